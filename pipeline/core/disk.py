"""What a build stage writes to disk, estimated before it writes (bytes), from the planner's weight formula
(:func:`pipeline.core.weights.weight_bytes`).

The stages pass these to :func:`pipeline.core.artifacts.atomic_dir`, which refuses to start a stage when less is
free under its directory, naming the directory and the space needed: a 70B checkpoint export is hundreds of GB, and
a disk that fills halfway through costs the calibration that came before. The estimates count the weights only;
configs and tokenizer files are small and not counted, so a disk that fills in the last few MB still fails while
writing, with the same one line. ``None``: no estimate (the geometry is unreadable), no up-front check.
"""

from __future__ import annotations

from pathlib import Path

from pipeline.core.geometry import ModelGeometry, geometry_from_config
from pipeline.core.weights import DTYPE_BYTES, weight_bytes


def _geometry(config_json: Path) -> ModelGeometry | None:
    try:
        return geometry_from_config(config_json)
    except (OSError, KeyError, ValueError):
        return None


def quantize_bytes(config_json: Path, qformat: str, export_dtype: str, *, awq_block_size: int = 128,
                   tp_size: int = 1, pp_size: int = 1) -> int | None:
    """The quantize stage's two exports of the model of ``config_json`` (its HF ``config.json``) in ``qformat``:
    the TensorRT-LLM checkpoint (an lm_head of its own, split over tp × pp ranks; 16-bit) plus the unified HF
    checkpoint (a tied lm_head shared), with unquantized tensors in ``export_dtype``. SmolLM2-135M FP8 from
    float32: 419 MiB estimated, 422 MiB written (the tokenizer files are the difference)."""
    geo = _geometry(config_json)
    if geo is None:
        return None
    dtype_b = DTYPE_BYTES.get(export_dtype, 2)
    # ModelOpt's TensorRT-LLM export writes float16 when asked for float32 (the quantize manifest's trtllm_dtype)
    trt = weight_bytes(geo, qformat, min(dtype_b, 2), awq_block_size=awq_block_size, tp_size=tp_size,
                       pp_size=pp_size, lm_head_copy=True)
    hf = weight_bytes(geo, qformat, dtype_b, awq_block_size=awq_block_size, lm_head_copy=False)
    return trt.total_bytes + hf.total_bytes


def cpu_engine_bytes(config_json: Path, dtype: str) -> int | None:
    """The CPU engine's ``model.safetensors``: every weight dequantized to ``dtype`` (build.cpu.dtype), a tied lm_head
    stored once. SmolLM2-135M in float32: 513 MiB estimated, 517 MiB written (with the tokenizer)."""
    geo = _geometry(config_json)
    if geo is None:
        return None
    return weight_bytes(geo, "full_prec", DTYPE_BYTES.get(dtype, 4), lm_head_copy=False).total_bytes
