"""``python -m pipeline.cpu_runtime.openai MODEL [trtllm-serve flags]``: trtpipe's CPU stand-in for trtllm-serve
(:mod:`pipeline.cpu_runtime.openai.cli`)."""

import sys

from pipeline.cpu_runtime.openai.cli import main

sys.exit(main())
