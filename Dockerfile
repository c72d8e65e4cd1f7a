# syntax=docker/dockerfile:1
# trtpipe GPU deploy image: build (ModelOpt → trtllm-build → Triton repo) and serve on NVIDIA GPUs.
#
#   docker build -t trtpipe:gpu .
#   docker run --rm --init --gpus all --shm-size=2g -v $PWD/models:/models -e HF_TOKEN \
#       trtpipe:gpu build recipes/llama31_8b_h200_fp8.yaml
#   docker run --rm --init --gpus all --shm-size=2g -v $PWD/models:/models -p 8000-8002:8000-8002 \
#       trtpipe:gpu serve --host 0.0.0.0
# (docs/deploy-gpu.md has the details.)
#
# Base: the Triton release that ships TensorRT-LLM 1.2.1 (tritonserver + the tensorrtllm C++
# backend in /opt/tritonserver, tensorrt_llm + torch + transformers 4.57.3 in the system Python).
# An engine only runs on the TensorRT-LLM version that built it, so build AND serve in this image.
FROM nvcr.io/nvidia/tritonserver:25.12-trtllm-python-py3

ENV PIP_NO_CACHE_DIR=1 \
    PIP_DISABLE_PIP_VERSION_CHECK=1 \
    PYTHONUNBUFFERED=1

# Version conflict and how it is resolved:
#   TensorRT-LLM 1.2.1 pins nvidia-modelopt~=0.37 and transformers==4.57.3; trtpipe quantizes with
#   nvidia-modelopt 0.47 (recipe formats, unified HF export). Installing 0.47 system-wide would break
#   the container's tensorrt_llm, so trtpipe lives in its own venv created with
#   --system-site-packages: the venv SEES the container's torch (CUDA build), tensorrt, tensorrt_llm,
#   transformers 4.57.3 and numpy<2, and privately adds modelopt 0.47 (+ tritonclient, typer, …).
#   The TensorRT-LLM tools trtpipe calls (trtllm-build, the tensorrtllm backend) run with the system
#   interpreter and never see the venv's modelopt.
#   The constraints file freezes the container's own torch/transformers/numpy/tensorrt versions so
#   pip can never replace them (e.g. by a CPU torch from PyPI): a real conflict fails this build.
RUN python3 -m venv --system-site-packages /opt/trtpipe
RUN python3 - > /opt/trtpipe/container-constraints.txt <<'PY'
from importlib import metadata
for dist in ("torch", "transformers", "numpy", "tensorrt", "tensorrt_llm"):
    try:
        print(f"{dist}=={metadata.version(dist)}")
    except metadata.PackageNotFoundError:
        pass
PY

COPY . /opt/trtpipe/src
# Not editable, no extras: nvidia-pytriton ([cpu]) is the CPU server and is not wanted here.
RUN cat /opt/trtpipe/container-constraints.txt \
 && /opt/trtpipe/bin/pip install -c /opt/trtpipe/container-constraints.txt /opt/trtpipe/src \
 && /opt/trtpipe/bin/python -c "from importlib.metadata import version as v; \
print('trtpipe', v('trtpipe'), '| venv modelopt', v('nvidia-modelopt'), '| torch', v('torch'), \
'| transformers', v('transformers'), '| tensorrt_llm', v('tensorrt_llm'))" \
 && /opt/trtpipe/bin/trtpipe --version

# Working directory /workspace: the shipped recipes are at recipes/…; `artifacts` is /models, the
# volume to mount, so builds (artifacts/<recipe name>/), the last-build pointer, `serve --detach`
# state, the model download cache and trtpipe's cache all persist across containers.
ENV PATH=/opt/trtpipe/bin:$PATH \
    HF_HOME=/models/.hf_home \
    TRTPIPE_CACHE_DIR=/models/.trtpipe_cache
WORKDIR /workspace
RUN cp -r /opt/trtpipe/src/recipes /workspace/recipes \
 && cp /opt/trtpipe/src/recipe.schema.json /workspace/ \
 && mkdir -p /models \
 && ln -s /models /workspace/artifacts
VOLUME ["/models"]

# HTTP, gRPC, metrics (bind them with `trtpipe serve --host 0.0.0.0` to publish them).
EXPOSE 8000 8001 8002

# trtpipe handles SIGTERM (docker stop) itself: the server is stopped gracefully, then killed.
ENTRYPOINT ["/opt/trtpipe/bin/trtpipe"]
CMD ["--help"]
