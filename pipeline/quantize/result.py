"""The quantize stage's typed result."""

from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import ClassVar

from pipeline.core.geometry import ModelGeometry, geometry_for_source, known_geometry
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

    @property
    def source_dir(self) -> Path | None:
        """The HF checkpoint directory the stage read ``model.source`` from (the manifest's ``source.hf_dir``): when
        built, the resolved source's; in a dry run, ``model.source`` resolved against the recipe's directory
        (:func:`pipeline.core.recipe_paths.recipe_path`) when that is a local directory. ``None`` otherwise (a hub
        id, ``embedded:``, a GGUF file in a dry run)."""
        hf_dir = (self.manifest.get("source") or {}).get("hf_dir")
        return Path(hf_dir) if hf_dir else None

    def source_geometry(self, source: str) -> ModelGeometry | None:
        """The geometry of ``source`` (the recipe's ``model.source``) as the planner finds it: the known-model table,
        else the ``config.json`` of :attr:`source_dir`; never a path relative to the working directory. ``None``
        when neither knows it."""
        d = self.source_dir
        return known_geometry(source) or (geometry_for_source(str(d)) if d is not None else None)
