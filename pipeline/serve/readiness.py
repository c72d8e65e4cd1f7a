"""How long ``trtpipe serve`` waits for a server to be ready when ``--timeout`` is not given: one rule, by serving
path and model size.

    wait = floor(path) + weight GiB × SECONDS_PER_GIB

* ``floor``: :data:`GPU_FLOOR_S` (600 s) for a GPU build, either engine kind. For ``build.engine: pytorch`` that is
  upstream's own wait for ``trtllm-serve``: its test harness gives the server ``MAX_SERVER_START_WAIT_S = 600``
  seconds to answer ``GET /health`` (NVIDIA/TensorRT-LLM tests/unittest/llmapi/apps/openai_server.py@0c1ee82a446c:17)
  while the LLM loads the checkpoint, sets up the KV cache and captures its CUDA graphs. trtpipe applies the same
  floor to the Triton ``llmapi`` model (the same ``LLM()`` start behind Triton) and to a TensorRT engine with TP/PP
  ranks under ``mpirun`` (no upstream figure for Triton's start; trtpipe's choice). :data:`CPU_FLOOR_S` (120 s, the
  wait before #45) for trtpipe's CPU engine, whose small models load in seconds here, and for a bare model
  repository that names no GPU backend.
* the size term: the bytes the server reads at start (the build's recorded served files:
  :func:`pipeline.serve.compat.served_files`; a TensorRT engine's ``rank*.engine``, the PyTorch path's HF checkpoint,
  the CPU engine's weights) at :data:`SECONDS_PER_GIB` (10 s per GiB, about 100 MiB/s: a cold read from a network
  volume; trtpipe's assumption, not a measurement). A 70B FP8 checkpoint (~70 GiB) gets 600 + 700 s. A later copy
  of upstream's harness raises its own wait to 7200 s "for LLM models weight loading" (search-index copy of the same
  file, its commit not returned), so the wait upstream needs grows with the model.

The wait is an upper bound: a server that is ready returns at once, so a generous bound only delays the report of a
server that hangs. ``trtpipe serve --timeout S`` (``ServeOptions.ready_timeout_s``) replaces the rule.
"""

from __future__ import annotations

import re
from pathlib import Path

from pipeline.engine.result import EngineResult
from pipeline.recipe.serving_path import path_of_engine
from pipeline.serve.compat import ServeTarget, served_files

GPU_FLOOR_S = 600.0
CPU_FLOOR_S = 120.0
SECONDS_PER_GIB = 10.0
#: a model repository served by the GPU image (TensorRT-LLM's C++ backend or its python ``llmapi`` model)
_GPU_BACKEND = re.compile(r'^\s*backend\s*:\s*"tensorrtllm"|key\s*:\s*"llm_runtime"\s*value\s*\{\s*string_value\s*:\s*"tensorrt_llm"', re.MULTILINE)


def default_ready_timeout_s(target: ServeTarget) -> tuple[float, str]:
    """The readiness wait for ``target`` in seconds, and the reason in words (e.g. ``"GPU build, 15.0 GiB of
    weights"``). Never raises: files that cannot be read count as 0 bytes."""
    gpu = _is_gpu(target)
    size = _weight_bytes(target) / 2**30
    floor = GPU_FLOOR_S if gpu else CPU_FLOOR_S
    return round(floor + size * SECONDS_PER_GIB), f"{'GPU' if gpu else 'CPU'} build, {size:.1f} GiB of weights"


def ready_timeout_s(target: ServeTarget, given: float | None) -> float:
    """``given`` (``--timeout``) when set, else :func:`default_ready_timeout_s`."""
    return float(given) if given is not None else default_ready_timeout_s(target)[0]


def _is_gpu(target: ServeTarget) -> bool:
    engine = EngineResult.load(target.layout.engine) if target.layout is not None else None
    path = path_of_engine(engine.manifest) if engine is not None else None
    if path is not None:
        return path.target == "gpu"
    return any(_GPU_BACKEND.search(p.read_text(errors="replace")) for p in target.repo.glob("*/config.pbtxt"))


def _weight_bytes(target: ServeTarget) -> int:
    if target.layout is None:
        return 0
    total = 0
    for root, files in served_files(target.layout):
        for rel in files:
            try:
                total += (Path(root) / rel).stat().st_size
            except OSError:
                continue
    return total
