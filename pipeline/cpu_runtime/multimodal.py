"""Images into the CPU LLM facade (issue #47 items 3 and 5): upstream's multimodal prompt form, the checkpoint's image
processor, the vision tower in PyTorch, and the spliced embeddings + M-RoPE positions the CPU engine decodes.

What upstream does, and what this module restates for the Qwen2-VL family:

- **The prompt form.** ``LLM.generate_async`` takes a ``TextPrompt`` dict: ``{"prompt": str, "multi_modal_data":
  {"image": [PIL.Image, ...]}}`` (tensorrt_llm/inputs/data.py@092f84d40074:10-23 ``TextPrompt``: ``prompt``,
  ``multi_modal_data`` "raw multi-modal data to pass to the model"; its ``prompt_inputs`` passes a dict through).
  The prompt is the chat-templated text with one image placeholder per image (Qwen2-VL's
  ``<|vision_start|><|image_pad|><|vision_end|>``), as ``default_multimodal_input_loader`` builds it
  (examples/llm-api/quickstart_multimodal.py@000a01de, shared/reference/multimodal-vlm.md §3).
- **The input processor** (modeling_qwen2vl.py@000a01de ``Qwen2VLInputProcessorBase``): the checkpoint's processor
  turns the images into ``pixel_values`` + ``image_grid_thw`` and expands each ``<|image_pad|>`` to the image's token
  count; ``get_rope_index`` gives the M-RoPE positions (``mrope_config``).
- **The vision tower runs in PyTorch** (modeling_qwen2vl.py@000a01de ``Qwen2VisionModelBase``: transformers'
  ``Qwen2VisionTransformerPretrainedModel``; "Re-setting QuantConfig to exclude vision encoder weights from
  quantization load", so it stays in the model dtype whatever the decoder's format), and its output replaces the
  placeholder embeddings (``fuse_input_embeds``). Here: transformers' same module, float32, on the CPU, from the
  engine directory's ``vision/`` (written by the engine stage, pipeline/engine/cpu.py).

The engine directory's files for an image model (:data:`VISION_DIR`): ``vision/config.json`` (the checkpoint's full
``Qwen2VLConfig``: vision_config, image/vision token ids), ``vision/model.safetensors`` (the tower + merger, names
without the ``visual.`` prefix), and at the top ``preprocessor_config.json`` + tokenizer files + chat template.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

#: the engine directory's sub-directory with the vision tower (config.json + model.safetensors)
VISION_DIR = "vision"
#: checkpoint ``model_type`` values whose images are spliced tokens (the Qwen2-VL family)
IMAGE_TOKEN_MODEL_TYPES = ("qwen2_vl", "qwen2_5_vl")
#: the decoder's architecture in the engine directory's config.json (a Qwen2 decoder with M-RoPE)
DECODER_ARCHITECTURE = "Qwen2ForCausalLM"


def is_image_token_model(cfg: dict[str, Any]) -> bool:
    """Whether a checkpoint's config.json describes a Qwen2-VL-family model (images spliced as tokens)."""
    return cfg.get("model_type") in IMAGE_TOKEN_MODEL_TYPES and isinstance(cfg.get("vision_config"), dict)


def decoder_config(cfg: dict[str, Any]) -> dict[str, Any]:
    """The CPU engine's ``config.json`` for a Qwen2-VL-family checkpoint config: its ``text_config`` as a
    ``Qwen2ForCausalLM`` (``model_type`` qwen2; the ``mrope_section`` in ``rope_parameters``/``rope_scaling`` kept),
    with ``vocab_size`` and the special token ids the top-level config carries when the text config lacks them."""
    text = dict(cfg.get("text_config") or {k: v for k, v in cfg.items() if k != "vision_config"})
    for k in ("vocab_size", "bos_token_id", "eos_token_id", "pad_token_id", "tie_word_embeddings"):
        if text.get(k) is None and cfg.get(k) is not None:
            text[k] = cfg[k]
    text.update(architectures=[DECODER_ARCHITECTURE], model_type="qwen2")
    text.pop("quantization_config", None)
    return text


def split_tensor_name(name: str) -> tuple[str, str]:
    """``("decoder" | "vision", name in that file)`` for a Qwen2-VL checkpoint tensor: ``visual.*`` /
    ``model.visual.*`` go to the vision tower without the prefix; ``model.language_model.*`` (transformers ≥ 4.52
    module names) becomes ``model.*``; ``model.*`` and ``lm_head.*`` (what ``save_pretrained`` writes) pass through."""
    for pre in ("model.visual.", "visual."):
        if name.startswith(pre):
            return "vision", name[len(pre):]
    if name.startswith("model.language_model."):
        return "decoder", "model." + name[len("model.language_model."):]
    if name.startswith("language_model."):
        return "decoder", name[len("language_model."):]
    return "decoder", name


def _vision_module(cfg: dict[str, Any]) -> Any:
    """transformers' vision tower for the family of ``cfg`` (a full checkpoint config), randomly initialised."""
    if cfg.get("model_type") == "qwen2_5_vl":
        from transformers import Qwen2_5_VLConfig as Config
        from transformers.models.qwen2_5_vl.modeling_qwen2_5_vl import (
            Qwen2_5_VisionTransformerPretrainedModel as Tower,
        )
    else:
        from transformers import Qwen2VLConfig as Config
        from transformers.models.qwen2_vl.modeling_qwen2_vl import (
            Qwen2VisionTransformerPretrainedModel as Tower,
        )
    full = {k: v for k, v in cfg.items() if k not in ("architectures", "quantization_config", "transformers_version")}
    return Tower._from_config(Config(**full).vision_config)


@dataclass
class ImagePrompt:
    """A multimodal prompt made ready for the engine.

    Attributes:
        token_ids: the prompt's token ids with each image placeholder expanded to its image tokens.
        multimodal: :class:`pipeline.cpu_runtime.mrope.PromptMultimodal` (embedding rows + M-RoPE positions).
        image_tokens: tokens per image, in prompt order (the rule of
            :func:`pipeline.vision.geometry.qwen2_vl_image_tokens` on each image's size).
    """

    token_ids: list[int]
    multimodal: Any
    image_tokens: list[int]


class ImageInputs:
    """The image half of a Qwen2-VL-family CPU engine directory: its image processor and vision tower.

    Args:
        engine_dir: a CPU engine directory with :data:`VISION_DIR` and ``preprocessor_config.json``.

    Raises:
        FileNotFoundError: the directory has no vision tower or no image processor.
    """

    def __init__(self, engine_dir: Path):
        import torch
        from safetensors.torch import load_file

        from pipeline.vision.tiny_qwen2_vl import load_image_processor

        d = Path(engine_dir)
        for f in (d / VISION_DIR / "config.json", d / VISION_DIR / "model.safetensors", d / "preprocessor_config.json"):
            if not f.is_file():
                raise FileNotFoundError(f"{f}: the engine directory has no vision tower / image processor")
        self.config = json.loads((d / VISION_DIR / "config.json").read_text())
        self.image_token_id = int(self.config["image_token_id"])
        self.vision_start_token_id = int(self.config["vision_start_token_id"])
        self.merge_size = int(self.config["vision_config"].get("spatial_merge_size", 2))
        self.processor = load_image_processor(d)
        self.tower = _vision_module(self.config).to(torch.float32).eval()
        self.tower.load_state_dict({k: v.float() for k, v in load_file(str(d / VISION_DIR / "model.safetensors")).items()},
                                   strict=True)

    def embed(self, images: list[Any]) -> tuple[Any, list[list[int]]]:
        """``(embeddings float32 [Σ image tokens, hidden], image_grid_thw per image)`` of RGB PIL ``images``."""
        import torch

        px = self.processor(images=images, return_tensors="pt")
        grid = px["image_grid_thw"]
        with torch.no_grad():
            out = self.tower(px["pixel_values"].to(torch.float32), grid_thw=grid)
        feats = out.pooler_output if hasattr(out, "pooler_output") else out  # transformers 5.x / 4.57
        return feats.float(), grid.tolist()

    def prepare(self, token_ids: list[int], images: list[Any]) -> ImagePrompt:
        """Expand the placeholders of ``token_ids`` (one ``<|image_pad|>`` per image) and compute the image rows'
        embeddings and the prompt's M-RoPE positions.

        Raises:
            ValueError: the number of placeholders differs from the number of images (one line).
        """
        import torch

        from pipeline.cpu_runtime.mrope import PromptMultimodal, qwen2_vl_rope_index
        from pipeline.vision.tiny_qwen2_vl import expand_image_pads

        n_slots = sum(1 for t in token_ids if t == self.image_token_id)
        if n_slots != len(images):
            raise ValueError(f"the prompt has {n_slots} image placeholders for {len(images)} images "
                             "(one <|vision_start|><|image_pad|><|vision_end|> per image: apply the chat template)")
        feats, grids = self.embed(images)
        ids = expand_image_pads(list(token_ids), grids, self.image_token_id, self.merge_size)
        per_image = [int(t) * int(h) * int(w) // (self.merge_size ** 2) for t, h, w in grids]
        pos, delta = qwen2_vl_rope_index(ids, grids, image_token_id=self.image_token_id,
                                         vision_start_token_id=self.vision_start_token_id,
                                         spatial_merge_size=self.merge_size)
        rows = torch.tensor([i for i, t in enumerate(ids) if t == self.image_token_id], dtype=torch.int64)
        return ImagePrompt(ids, PromptMultimodal(rows=rows, embeds=feats, positions=pos, delta=delta), per_image)


def as_rgb(image: Any) -> Any:
    """A ``multi_modal_data`` image as an RGB PIL image (upstream ``load_image`` converts a PIL image to RGB,
    tensorrt_llm/inputs/utils.py@00a8667c4547:67-73). Raises ValueError for anything that is not a PIL image."""
    from PIL import Image

    if not isinstance(image, Image.Image):
        raise ValueError(f"multi_modal_data image: a PIL.Image is expected, got {type(image).__name__}")  # noqa: TRY004 (the client's 400)
    return image.convert("RGB") if image.mode != "RGB" else image


def parse_prompt(inputs: Any) -> tuple[Any, list[Any]]:
    """Split the facade's ``inputs`` into ``(prompt: str | list[int], images)``: a string or token ids as they are,
    or upstream's ``TextPrompt`` / ``TokensPrompt`` dict (``prompt`` / ``prompt_token_ids`` and an optional
    ``multi_modal_data``, of which the ``image`` modality is read: one image or a list).

    Raises:
        ValueError: a dict without ``prompt``/``prompt_token_ids``, or a modality other than ``image``.
    """
    if not isinstance(inputs, dict):
        return inputs, []
    prompt = inputs.get("prompt")
    if prompt is None:
        prompt = inputs.get("prompt_token_ids")
    if prompt is None:
        raise ValueError("inputs: a prompt dict needs 'prompt' or 'prompt_token_ids'")
    data = inputs.get("multi_modal_data") or {}
    other = sorted(set(data) - {"image"})
    if other:
        raise ValueError(f"multi_modal_data: modality {other[0]!r} is not served by the CPU engine (image only)")
    images = data.get("image") or []
    images = list(images) if isinstance(images, (list, tuple)) else [images]
    return prompt, [as_rgb(i) for i in images]


def image_inputs(engine_dir: Path, engine_cfg: dict[str, Any]) -> ImageInputs | None:
    """The facade's :class:`ImageInputs` when ``engine_config.json`` has a ``vision`` section (an image build),
    else ``None`` (a text-only build: a request with images is refused)."""
    return ImageInputs(Path(engine_dir)) if engine_cfg.get("vision") else None


def encode_request(inputs: Any, tokenizer: Any, images_in: ImageInputs | None, *, add_special_tokens: bool,
                   max_images: int | None, model_dir: Path) -> tuple[str | None, list[int], Any, int]:
    """``(prompt text or None, token ids, PromptMultimodal or None, image tokens)`` of one facade request.

    ``inputs``: a prompt string (encoded with ``add_special_tokens``), token ids, or a ``TextPrompt`` /
    ``TokensPrompt`` dict (:func:`parse_prompt`) whose images go through ``images_in``.

    Raises:
        ValueError (one line, the client's fault): images for a text-only build, more than ``max_images``, a
        placeholder count that differs from the images, a string prompt without a tokenizer.
    """
    prompt, images = parse_prompt(inputs)
    if isinstance(prompt, str):
        if tokenizer is None:
            raise ValueError(f"{model_dir}: no tokenizer.json to encode a text prompt")
        text, ids = prompt, tokenizer.encode(prompt, add_special_tokens=add_special_tokens)
    else:
        text, ids = None, [int(t) for t in prompt]
    if not images:
        return text, ids, None, 0
    if images_in is None:
        raise ValueError(f"{len(images)} images sent to a text-only model ({model_dir} has no vision tower)")
    if max_images is not None and len(images) > max_images:
        raise ValueError(f"{len(images)} images in one request: this build takes at most {max_images} "
                         "(vision.max_images_per_request)")
    ready = images_in.prepare(ids, images)
    return text, ready.token_ids, ready.multimodal, sum(ready.image_tokens)
