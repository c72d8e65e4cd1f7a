"""The quantize stage's typed result."""

from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import ClassVar

from pipeline.core.layout import HF_CKPT, TRTLLM_CKPT
from pipeline.core.results import StageResult


@dataclasses.dataclass(frozen=True)
class QuantizeResult(StageResult):
    """The quantize stage: ModelOpt checkpoints (``trtllm_ckpt/``, ``hf_ckpt/``) or, dry, the command."""

    STAGE: ClassVar[str] = "quantize"

    @property
    def trtllm_ckpt(self) -> Path:
        """The TensorRT-LLM checkpoint directory (exists only when built)."""
        return self.path / TRTLLM_CKPT

    @property
    def hf_ckpt(self) -> Path:
        """The unified HF checkpoint directory with the tokenizer (exists only when built)."""
        return self.path / HF_CKPT

    @property
    def quant_algo(self) -> str | None:
        """The exported ``quantization.quant_algo`` (``None`` = unquantized weights)."""
        return (self.manifest.get("exported") or {}).get("quant_algo")

    @property
    def kv_cache_quant_algo(self) -> str | None:
        """The exported ``quantization.kv_cache_quant_algo`` (``None`` = KV cache in the model dtype)."""
        return (self.manifest.get("exported") or {}).get("kv_cache_quant_algo")
