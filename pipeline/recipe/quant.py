"""``quantization`` section: ModelOpt PTQ format, KV-cache dtype and calibration data.

Names and defaults follow TensorRT-LLM 1.2.1 ``examples/quantization/quantize.py``
(``--qformat``, ``--kv_cache_dtype``, ``--calib_size``, ``--calib_max_seq_length``,
``--batch_size``, ``--awq_block_size``, ``--seed``).
"""

from __future__ import annotations

from typing import Literal

from pydantic import Field

from pipeline.recipe.base import StrictModel
from pipeline.recipe.bounds import INT32_MAX, MAX_SAMPLES, SEED_MAX
from pipeline.recipe.qformats import qformats_needing

QFormat = Literal["fp8", "int8_sq", "int4_awq", "w4a8_awq", "int8_wo", "int4_wo", "nvfp4", "full_prec"]
KvCacheDtype = Literal["fp8", "int8", "none"]

#: qformat → TensorRT-LLM QuantAlgo written in the checkpoint's quantization.quant_algo
#: (ModelOpt export mapping; TensorRT-LLM 1.2.1 quantization/mode.py names).
QUANT_ALGO: dict[str, str | None] = {
    "fp8": "FP8",
    "int8_sq": "W8A8_SQ_PER_CHANNEL",
    "int4_awq": "W4A16_AWQ",
    "w4a8_awq": "W4A8_AWQ",
    "int8_wo": "W8A16",
    "int4_wo": "W4A16_AWQ",  # ModelOpt's blockwise INT4 weight-only export writes W4A16_AWQ (no pre_quant_scale)
    "nvfp4": "NVFP4",
    "full_prec": None,
}
#: kv_cache_dtype → kv_cache_quant_algo.
KV_CACHE_QUANT_ALGO: dict[str, str | None] = {"fp8": "FP8", "int8": "INT8", "none": None}
#: qformats whose weights or activations are FP8 (need FP8 tensor cores: Ada, Hopper, Blackwell); the rule lives in
#: pipeline/data/qformat_rules.yaml (``needs: fp8``)
FP8_QFORMATS = qformats_needing("fp8")
AWQ_QFORMATS = frozenset({"int4_awq", "w4a8_awq"})
#: qformats quantized in groups of ``awq_block_size`` input channels (ModelOpt block quantizers).
BLOCK_QFORMATS = AWQ_QFORMATS | {"int4_wo"}


class CalibrationSpec(StrictModel):
    """Calibration data for PTQ."""

    dataset: str = Field(
        default="embedded",
        description=(
            "`embedded` (offline English prose shipped with trtpipe, see calib/README.md), a HF `datasets` "
            "name (`cnn_dailymail` — TensorRT-LLM's default —, `pile`; needs network), or a local "
            ".txt/.jsonl/.parquet file (relative to the recipe file)."
        ),
    )
    text_field: str | None = Field(
        default=None,
        description="Key/column holding the text in .jsonl/.parquet/HF data (default: `text`; `article` for cnn_dailymail).",
    )
    size: int = Field(default=512, ge=1, le=MAX_SAMPLES, description="Number of calibration samples (quantize.py --calib_size default 512).")
    max_seq_length: int = Field(
        default=512, ge=8, le=INT32_MAX,
        description="Tokens per calibration sample (quantize.py --calib_max_seq_length default 512; at most the model's max_position_embeddings).",
    )
    batch_size: int = Field(default=1, ge=1, le=MAX_SAMPLES, description="Calibration batch size (quantize.py --batch_size default 1; at most size).")
    seed: int = Field(default=1234, ge=0, le=SEED_MAX, description="Sampling seed in [0, 2^32) (quantize.py --seed default 1234).")
    eval_samples: int = Field(
        default=16, ge=1, le=MAX_SAMPLES, description="Held-out samples (never used for calibration) for the quality report."
    )


class QuantSpec(StrictModel):
    """Post-training quantization with ModelOpt."""

    qformat: QFormat = Field(default="full_prec", description="Weight/activation format (quantize.py --qformat, default full_prec).")
    kv_cache_dtype: KvCacheDtype = Field(default="none", description="KV-cache quantization (quantize.py --kv_cache_dtype, default none).")
    awq_block_size: int = Field(
        default=128, ge=16, le=4096, description="Group size of INT4 AWQ / W4A8 AWQ / INT4 weight-only (quantize.py --awq_block_size default 128; must divide the Linear input dims)."
    )
    calibration: CalibrationSpec = Field(default_factory=CalibrationSpec, description="Calibration data.")

    @property
    def quant_algo(self) -> str | None:
        """TensorRT-LLM ``QuantAlgo`` name for ``qformat`` (``None`` for full_prec)."""
        return QUANT_ALGO[self.qformat]

    @property
    def kv_cache_quant_algo(self) -> str | None:
        """TensorRT-LLM ``QuantAlgo`` name for ``kv_cache_dtype`` (``None`` for none)."""
        return KV_CACHE_QUANT_ALGO[self.kv_cache_dtype]
