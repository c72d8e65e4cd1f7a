"""A tiny random mllama (Llama 3.2 Vision shape), built from a config on this machine: no download, seeded.

The layout is Llama 3.2 Vision's — a tiled ViT (local layers, then gated global layers, intermediate-layer
features concatenated into ``vision_output_dim``), a Linear projector to the text hidden size, and a Llama decoder
with gated cross-attention layers — at sizes that build, save and run in seconds on a CPU. The sizes follow the
spirit of transformers' own test config (tests/models/mllama/test_modeling_mllama.py@01d13949: text hidden 32,
2 layers; vision hidden 16, 2 layers, ``intermediate_layers_indices [0]``) with a 56 px tile of 14 px patches, so the
encoder length rule has real patches to count: (56/14)² + 1 = 17 vectors per tile, 4 tiles, 68 per image.

The weights are random (``torch.manual_seed``): the checkpoint exercises shapes and plumbing (export, parity,
repository, serving), not answers. The image processor is constructed from parameters (tile size, max tiles) and
saved beside the weights as ``preprocessor_config.json``, as a hub checkpoint ships it.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from pipeline.core.errors import UserError

#: vision tower: 56 px tiles of 14 px patches (17 vectors a tile), hidden 16, 1 local + 1 global layer;
#: vision_output_dim = hidden × (len(intermediate_layers_indices) + 1) as in Llama 3.2 Vision (1280 × 6 = 7680)
TINY_VISION: dict[str, Any] = {
    "image_size": 56, "patch_size": 14, "max_num_tiles": 4, "num_channels": 3,
    "hidden_size": 16, "attention_heads": 2, "intermediate_size": 32,
    "num_hidden_layers": 1, "num_global_layers": 1, "intermediate_layers_indices": [0], "vision_output_dim": 32,
}
#: text decoder: Llama with a gated cross-attention layer at index 1 of 2; vocabulary 128 (+ the image token 127)
TINY_TEXT: dict[str, Any] = {
    "vocab_size": 128, "hidden_size": 32, "num_hidden_layers": 2, "cross_attention_layers": [1],
    "num_attention_heads": 4, "num_key_value_heads": 2, "intermediate_size": 64, "max_position_embeddings": 256,
    "rope_theta": 500000.0, "rope_scaling": {"rope_type": "default"},
    "bos_token_id": 1, "eos_token_id": 2, "pad_token_id": 0,
}
TINY_IMAGE_TOKEN = 127


def tiny_mllama_config(vision: dict[str, Any] | None = None, text: dict[str, Any] | None = None) -> Any:
    """A ``transformers.MllamaConfig`` of :data:`TINY_VISION` / :data:`TINY_TEXT` with ``vision`` / ``text`` keys
    overriding theirs (e.g. ``vision={"image_size": 560}`` for a 560 px tile geometry at tiny width).

    Returns:
        ``MllamaConfig`` (float32 weights when a model is built from it).
    """
    from transformers import MllamaConfig

    return MllamaConfig(vision_config={**TINY_VISION, **(vision or {})}, text_config={**TINY_TEXT, **(text or {})},
                        image_token_index=TINY_IMAGE_TOKEN)


def image_processor_class() -> type:
    """transformers' mllama image processor that runs without torchvision: ``MllamaImageProcessorPil`` in
    transformers 5.x (its ``MllamaImageProcessor`` needs torchvision there), ``MllamaImageProcessor`` in 4.57 (the
    TensorRT-LLM 1.2.1 pin, where it is the numpy/PIL one)."""
    try:
        from transformers.models.mllama.image_processing_pil_mllama import (
            MllamaImageProcessorPil,
        )

        return MllamaImageProcessorPil
    except ImportError:  # transformers 4.x
        from transformers import MllamaImageProcessor

        return MllamaImageProcessor


def image_processor(tile_size: int, max_tiles: int) -> Any:
    """An mllama image processor built from parameters (no ``from_pretrained``): square ``tile_size`` px tiles,
    up to ``max_tiles`` per image, the class's defaults for everything else (bilinear resize, rescale 1/255,
    normalisation, RGB conversion, padding to ``max_tiles``).

    Its output for ``images=[[img], …]`` (one image per sample): ``pixel_values`` float32
    [B, 1, max_tiles, 3, tile, tile], ``aspect_ratio_ids`` int64 [B, 1], ``aspect_ratio_mask`` int64 [B, 1, max_tiles].

    Raises:
        UserError: ``tile_size`` or ``max_tiles`` not a positive integer.
    """
    for name, v in (("vision.tile_size", tile_size), ("vision.max_tiles", max_tiles)):
        if isinstance(v, bool) or not isinstance(v, int) or v <= 0:
            raise UserError(f"{name}: {v!r} is not a positive integer")
    return image_processor_class()(size={"height": tile_size, "width": tile_size}, max_image_tiles=max_tiles)


def build_tiny_mllama(out_dir: Path, *, seed: int = 0, vision: dict[str, Any] | None = None,
                      text: dict[str, Any] | None = None) -> Path:
    """Build a random ``MllamaForConditionalGeneration`` from :func:`tiny_mllama_config` and save it as an HF
    checkpoint directory: ``config.json``, ``model.safetensors`` (float32), ``preprocessor_config.json``.

    Args:
        out_dir: the directory to write (created; files in it are overwritten).
        seed: ``torch.manual_seed`` before the weights are drawn: the same seed gives the same tensors.
        vision, text: config overrides (see :func:`tiny_mllama_config`).

    Returns:
        ``out_dir``.
    """
    import torch
    from transformers import MllamaForConditionalGeneration

    cfg = tiny_mllama_config(vision, text)
    torch.manual_seed(seed)
    model = MllamaForConditionalGeneration(cfg).eval()
    out_dir.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(out_dir)
    vc = cfg.vision_config
    image_processor(vc.image_size, vc.max_num_tiles).save_pretrained(out_dir)
    return out_dir


def load_mllama(ckpt_dir: Path) -> Any:
    """Load an mllama checkpoint directory in float32 on the CPU, in eval mode (``MllamaForConditionalGeneration``).

    Raises:
        UserError: ``ckpt_dir`` has no ``config.json`` or is not an mllama checkpoint (``model_type`` other than
            ``mllama``).
    """
    import json

    import torch
    from transformers import MllamaForConditionalGeneration

    cfg_path = ckpt_dir / "config.json"
    if not cfg_path.is_file():
        raise UserError(f"{ckpt_dir}: no config.json (not a Hugging Face checkpoint directory)")
    model_type = json.loads(cfg_path.read_text()).get("model_type")
    if model_type != "mllama":
        raise UserError(f"{cfg_path}: model_type is {model_type!r}, the vision family mllama needs 'mllama'")
    return MllamaForConditionalGeneration.from_pretrained(ckpt_dir, dtype=torch.float32).eval()
