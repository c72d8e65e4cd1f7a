"""The CPU engine directory of a Qwen2-VL-family build (issue #47 item 5): the decoder for the CPU engine, the vision
tower for the LLM facade.

The PyTorch backend keeps the vision tower in PyTorch and out of quantization (modeling_qwen2vl.py@000a01de
``Qwen2VisionModelBase`` builds transformers' ``Qwen2VisionTransformerPretrainedModel``; "Re-setting QuantConfig to
exclude vision encoder weights from quantization load"; docs/reference/multimodal-vlm.md §3), so the engine
directory carries both halves of the quantized checkpoint (``<build>/quantize/hf_ckpt``):

- ``model.safetensors`` + ``config.json``: the language model, dequantized to ``build.cpu.dtype``, as a
  ``Qwen2ForCausalLM`` with the checkpoint's ``mrope_section`` (the CPU engine's M-RoPE, pipeline/cpu_runtime/mrope.py);
- ``vision/model.safetensors`` + ``vision/config.json``: the vision tower and merger (never quantized; names without
  ``visual.``) and the checkpoint's whole config (vision_config, image/vision token ids), which
  :class:`pipeline.cpu_runtime.multimodal.ImageInputs` loads;
- ``preprocessor_config.json``, tokenizer files, chat template: copied from hf_ckpt by the CPU builder;
- ``engine_config.json`` gains ``vision`` (:func:`vision_section`): the family, images per request, the processor's
  pixel bounds and the dtype the tower runs in here.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from pipeline.core.errors import StageError
from pipeline.cpu_runtime.multimodal import (
    VISION_DIR,
    decoder_config,
    split_tensor_name,
)


def vision_section(vision: Any, dtype: str) -> dict[str, Any]:
    """engine_config.json's ``vision`` for a recipe's Qwen2-VL-family section (``dtype``: the tower's dtype on the
    CPU, ``build.cpu.dtype``): ``family``, ``max_images_per_request``, ``patch_size``, ``merge_size``,
    ``min_pixels``, ``max_pixels``, ``image_tokens`` (one image at the recipe's size) and ``tower_dtype``."""
    return {"family": vision.family, "max_images_per_request": vision.max_images_per_request,
            "patch_size": vision.patch_size, "merge_size": vision.merge_size, "min_pixels": vision.min_pixels,
            "max_pixels": vision.max_pixels, "image_tokens": vision.image_tokens(), "tower_dtype": dtype}


def write_image_model(hf_ckpt: Path, out_dir: Path, dtype: str, cfg: dict[str, Any]) -> None:
    """Split the (quantized) Qwen2-VL checkpoint ``hf_ckpt`` into the engine's decoder and vision files (module
    docstring), dequantized/cast to ``dtype``; ``cfg``: its config.json without ``quantization_config``.

    Raises:
        StageError: a layout that cannot be dequantized, or a checkpoint without vision tower tensors.
    """
    import torch
    from safetensors.torch import save_file

    from pipeline.cpu_runtime.dequant import DequantError, iter_dequantized

    parts: dict[str, dict[str, Any]] = {"decoder": {}, "vision": {}}
    try:
        for name, t in iter_dequantized(hf_ckpt, getattr(torch, dtype)):
            part, new = split_tensor_name(name)
            parts[part][new] = t.contiguous()
    except (DequantError, FileNotFoundError) as e:
        raise StageError(f"cannot dequantize {hf_ckpt}: {e}") from e
    if not parts["vision"]:
        raise StageError(f"{hf_ckpt}: no vision tower tensors (visual.*) in a {cfg.get('model_type')} checkpoint")
    save_file(parts["decoder"], str(out_dir / "model.safetensors"), metadata={"format": "pt"})
    (out_dir / "config.json").write_text(json.dumps(decoder_config(cfg), indent=2) + "\n")
    (out_dir / VISION_DIR).mkdir(exist_ok=True)
    save_file(parts["vision"], str(out_dir / VISION_DIR / "model.safetensors"), metadata={"format": "pt"})
    (out_dir / VISION_DIR / "config.json").write_text(json.dumps(cfg, indent=2) + "\n")
