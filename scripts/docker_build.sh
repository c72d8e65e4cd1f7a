#!/usr/bin/env bash
# Build the GPU deploy image on the Triton container the release matrix names for trtpipe's TensorRT-LLM
# (pipeline/data/release_matrix.yaml; `trtpipe release` shows it). Needs a Docker engine and trtpipe's
# Python dependencies (scripts/setup.sh, or any Python with pydantic and PyYAML as $PYTHON); extra
# arguments go to `docker build` (e.g. -t myregistry/trtpipe:gpu).
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-$( [ -x .venv/bin/python ] && echo .venv/bin/python || echo python3 )}
IMAGE=$("$PY" -c 'import sys; sys.path.insert(0, "."); from pipeline.trtllm.release import default_release; print(default_release().image)')
TAG=${TAG:-trtpipe:gpu-$(echo "$IMAGE" | sed -E 's/.*:([0-9]+\.[0-9]+).*/\1/')}
echo "building $TAG on $IMAGE" >&2
exec docker build --build-arg "TRITON_IMAGE=$IMAGE" -t "$TAG" "$@" .
