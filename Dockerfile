# syntax=docker/dockerfile:1
# trtpipe GPU deploy image: build (ModelOpt → trtllm-build → Triton repo) and serve on NVIDIA GPUs.
#
# The base image comes from the release matrix (pipeline/data/release_matrix.yaml), never from this file:
#
#   docker build --build-arg TRITON_IMAGE=$(trtpipe release --image) -t trtpipe:gpu .
#   # or: scripts/docker_build.sh   (the same, for a fresh clone without trtpipe installed)
#   docker run --rm --init --gpus all --shm-size=2g -v $PWD/models:/models -e HF_TOKEN \
#       trtpipe:gpu build recipes/llama31_8b_h200_fp8.yaml
#   docker run --rm --init --gpus all --shm-size=2g -v $PWD/models:/models -p 8000-8002:8000-8002 \
#       -e TRTPIPE_ADMIN_KEY trtpipe:gpu serve --host 0.0.0.0   # off loopback the admin APIs need the key
# (docs/deploy-gpu.md has the details.)
#
# An engine only runs on the TensorRT-LLM version that built it, so build AND serve in this image.
ARG TRITON_IMAGE
FROM ${TRITON_IMAGE}
ARG TRITON_IMAGE

ENV PIP_NO_CACHE_DIR=1 \
    PIP_DISABLE_PIP_VERSION_CHECK=1 \
    PIP_BREAK_SYSTEM_PACKAGES=1 \
    PYTHONUNBUFFERED=1

# How trtpipe is installed without moving anything the image pins:
#   * into the image's OWN Python environment: `python3` is whatever the image puts first on PATH — the venv
#     /opt/venv-tritonserver from 26.03 on (torch, tensorrt_llm, modelopt, transformers live there), the system
#     interpreter before. A separate venv would not see a parent venv's packages.
#   * every package the image already has is frozen into a constraints file first, so pip may only ADD
#     packages (typer, rich, …); a requirement that would replace one (e.g. torch from PyPI, or a newer
#     transformers/ModelOpt) fails this build instead of silently breaking tensorrt_llm. trtpipe accepts what
#     TensorRT-LLM pins (nvidia-modelopt 0.37.x, transformers 4.57.3: pyproject ranges).
#   * afterwards `trtpipe release --check-image` fails the build when the installed TensorRT-LLM, torch,
#     transformers or ModelOpt differ from the matrix entry of TRITON_IMAGE, or any frozen package moved.
RUN test -n "${TRITON_IMAGE}" || (echo "build with --build-arg TRITON_IMAGE=\$(trtpipe release --image)" >&2; exit 1) \
 && mkdir -p /opt/trtpipe \
 && python3 -m pip list --format=freeze > /opt/trtpipe/image-constraints.txt

COPY . /opt/trtpipe/src
# Not editable, no extras: nvidia-pytriton ([cpu]) is the CPU server and is not wanted here.
RUN python3 -m pip install -c /opt/trtpipe/image-constraints.txt /opt/trtpipe/src \
 && trtpipe release --check-image "${TRITON_IMAGE}" --unchanged-since /opt/trtpipe/image-constraints.txt \
 && trtpipe --version

# Working directory /workspace: the shipped recipes are at recipes/…; `artifacts` is /models, the
# volume to mount, so builds (artifacts/<recipe name>/), the last-build pointer, `serve --detach`
# state, the model download cache and trtpipe's cache all persist across containers.
ENV HF_HOME=/models/.hf_home \
    TRTPIPE_CACHE_DIR=/models/.trtpipe_cache
WORKDIR /workspace
RUN cp -r /opt/trtpipe/src/recipes /workspace/recipes \
 && cp /opt/trtpipe/src/recipe.schema.json /workspace/ \
 && mkdir -p /models \
 && ln -s /models /workspace/artifacts
VOLUME ["/models"]

# HTTP, gRPC, metrics (bind them with `trtpipe serve --host 0.0.0.0 --admin-key KEY` to publish them).
EXPOSE 8000 8001 8002

# trtpipe handles SIGTERM (docker stop) itself: the server is stopped gracefully, then killed.
ENTRYPOINT ["trtpipe"]
CMD ["--help"]
