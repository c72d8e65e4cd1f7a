"""trtpipe's CPU inference engine, used inside Triton by the ``tensorrt_llm`` python model.

- :mod:`.engine`: :class:`CpuEngine`, in-flight batching on a paged KV cache (transformers'
  continuous batching) with TensorRT-LLM request semantics (``min_tokens``, ``end_id``).
- :mod:`.dequant`: ModelOpt unified HF checkpoint → plain weights carrying the quantization error.

``from pipeline.cpu_runtime import CpuEngine`` imports torch/transformers on first use only.
"""

from __future__ import annotations

from typing import Any

__all__ = ["CpuEngine"]


def __getattr__(name: str) -> Any:
    if name == "CpuEngine":
        from pipeline.cpu_runtime.engine import CpuEngine

        return CpuEngine
    raise AttributeError(name)
