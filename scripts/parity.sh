#!/usr/bin/env bash
# Container parity: run the quantize + export + geometry checks with the versions the Triton container of the
# release matrix ships for TensorRT-LLM 1.2.1 (nvidia-modelopt 0.37.x, transformers 4.57.3; `trtpipe release`),
# in a second venv (.venv-parity, made by scripts/setup.sh), beside the development versions of .venv.
# torch is the local CPU build 2.13.0 (the container's NGC torch cannot come from PyPI). Extra arguments go to pytest;
# `scripts/parity.sh --setup-only` only makes the venv.
set -euo pipefail
cd "$(dirname "$0")/.."
# the versions come from the release matrix, read with the development venv (scripts/setup.sh ran first)
PINS=$(.venv/bin/python -c 'from pipeline.trtllm.release import default_release as d; r = d(); print(f"nvidia-modelopt=={r.nvidia_modelopt} transformers=={r.transformers}")')
export TRTPIPE_VENV=${TRTPIPE_PARITY_VENV:-.venv-parity}
TRTPIPE_EXTRAS=test TRTPIPE_PINS="$PINS" bash scripts/setup.sh
# `--setup-only`: make the venv and stop (.ci/run makes it in the background while the slow tier runs)
if [ "${1:-}" = "--setup-only" ]; then exit 0; fi
# its own cache: the embedded SmolLM2 conversion is made by this transformers major
export TRTPIPE_CACHE_DIR=${TRTPIPE_PARITY_CACHE_DIR:-$PWD/.trtpipe-cache-parity}
exec "$TRTPIPE_VENV/bin/python" -m pytest -p no:cacheprovider tests/test_export_geometry.py tests/test_quantize.py tests/test_checkpoint_portability.py "$@"
