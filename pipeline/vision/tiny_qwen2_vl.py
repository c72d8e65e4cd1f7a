"""A tiny Qwen2-VL (``Qwen2VLForConditionalGeneration``) built on this machine: no download, seeded.

The **text decoder is SmolLM2-135M-Instruct grafted** into the Qwen2 layout, not random: Llama and Qwen2 decoders are
the same computation when Qwen2's q/k/v biases are zero, and with an ``mrope_section`` that sums to head_dim / 2
(here [16, 8, 8] of 64) M-RoPE reduces to ordinary 1-D RoPE for text positions (all three position rows equal), so
the text answers stay SmolLM2's real ones and the tokenizer and chat template are real too. Only the **vision tower
is random** (``torch.manual_seed``): 2 blocks of width 32, 14 px patches merged 2×2, its merger projecting to the
decoder's 576. The image tokens therefore carry no meaning, but their count, placement and M-RoPE positions are the
real family's (the point of the CPU path: plumbing and token accounting, exercised for real).

Four special tokens are appended to SmolLM2's vocabulary, spelled as Qwen2-VL spells them
(``<|vision_start|>``, ``<|vision_end|>``, ``<|image_pad|>``, ``<|video_pad|>``); their embedding rows are the mean of
SmolLM2's (the image-pad rows are replaced by vision features anyway). The chat template is SmolLM2's ChatML with
Qwen2-VL's image placeholder ``<|vision_start|><|image_pad|><|vision_end|>`` for an image content part; image
processor is built from parameters (torch-free ``Qwen2VLImageProcessorPil`` on transformers 5.x) and
:func:`expand_image_pads` expands each ``<|image_pad|>`` to the image's token count as ``Qwen2VLProcessor`` does.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

#: Qwen2-VL's special tokens, appended to SmolLM2's 49152-token vocabulary in this order
SPECIAL_TOKENS = ("<|vision_start|>", "<|vision_end|>", "<|image_pad|>", "<|video_pad|>")
#: M-RoPE sections (temporal, height, width) in rotary pairs; sum = SmolLM2's head_dim 64 / 2
MROPE_SECTION = [16, 8, 8]
#: random vision tower: width 32, 2 blocks, 14 px patches, 2×2 merge (one decoder token per 28×28 px)
TINY_VISION: dict[str, Any] = {"depth": 2, "embed_dim": 32, "num_heads": 4, "mlp_ratio": 2, "patch_size": 14,
                               "spatial_merge_size": 2, "temporal_patch_size": 2, "in_channels": 3}
#: the processor's pixel bounds: 56×56 up to 448×448 (at most 256 image tokens an image; larger images resize down)
MIN_PIXELS = 56 * 56
MAX_PIXELS = 448 * 448

CHAT_TEMPLATE = (
    "{% for message in messages %}"
    "{% if loop.first and message['role'] != 'system' %}<|im_start|>system\n"
    "You are a helpful AI assistant named SmolLM, trained by Hugging Face<|im_end|>\n{% endif %}"
    "<|im_start|>{{ message['role'] }}\n"
    "{% if message['content'] is string %}{{ message['content'] }}"
    "{% else %}{% for part in message['content'] %}"
    "{% if part['type'] in ('image', 'image_url') %}<|vision_start|><|image_pad|><|vision_end|>"
    "{% elif part['type'] == 'text' %}{{ part['text'] }}{% endif %}"
    "{% endfor %}{% endif %}<|im_end|>\n"
    "{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)


def image_processor_class() -> type:
    """transformers' Qwen2-VL image processor that runs without torchvision: ``Qwen2VLImageProcessorPil`` in
    transformers 5.x, ``Qwen2VLImageProcessor`` in 4.57 (TensorRT-LLM 1.2.1's pin, where it is numpy/PIL)."""
    try:
        from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import (
            Qwen2VLImageProcessorPil,
        )

        return Qwen2VLImageProcessorPil
    except ImportError:  # transformers 4.x
        from transformers import Qwen2VLImageProcessor

        return Qwen2VLImageProcessor


def image_processor(min_pixels: int = MIN_PIXELS, max_pixels: int = MAX_PIXELS) -> Any:
    """A Qwen2-VL image processor built from parameters (14 px patches, 2×2 merge, temporal patch 2; images resized
    to multiples of 28 px within ``[min_pixels, max_pixels]``). Output for ``images=[img, …]``: ``pixel_values``
    float32 [Σ patches, 3·2·14·14] and ``image_grid_thw`` int64 [images, 3]."""
    kw = {"patch_size": 14, "merge_size": 2, "temporal_patch_size": 2, "min_pixels": min_pixels, "max_pixels": max_pixels}
    try:
        return image_processor_class()(**kw, size={"shortest_edge": min_pixels, "longest_edge": max_pixels})
    except (TypeError, ValueError):
        return image_processor_class()(**kw)


def load_image_processor(model_dir: Path) -> Any:
    """The Qwen2-VL image processor saved in ``model_dir/preprocessor_config.json``, loaded with
    :func:`image_processor_class` (``AutoImageProcessor`` needs torchvision on transformers 5.x)."""
    return image_processor_class().from_pretrained(str(model_dir))


def build_tiny_qwen2_vl(out_dir: Path, seed: int = 0, *, decoder_dir: Path) -> Path:
    """Write a tiny Qwen2-VL HF checkpoint to ``out_dir``: ``config.json`` (``Qwen2VLForConditionalGeneration``),
    ``model.safetensors`` (float32), tokenizer files, ``chat_template.jinja`` and the image processor's
    ``preprocessor_config.json`` — loadable by ``AutoTokenizer``, :func:`load_image_processor` and
    ``Qwen2VLForConditionalGeneration.from_pretrained``. No ``processor_config.json``: transformers 5.x's
    ``Qwen2VLProcessor`` needs torchvision for its video processor, so placeholders expand by
    :func:`expand_image_pads`.

    Args:
        out_dir: destination directory (created; existing files overwritten).
        seed: ``torch.manual_seed`` for the random vision tower (the decoder is SmolLM2's).
        decoder_dir: the SmolLM2-135M-Instruct HF checkpoint to graft
            (:func:`pipeline.quantize.sources.embedded_smollm2_dir`; passed in so this module does not import the
            quantize package, which resolves ``embedded:tiny-qwen2-vl`` through it).

    Returns:
        ``out_dir``.

    Raises:
        RuntimeError: ``decoder_dir`` is not a Llama checkpoint whose tensors fill the Qwen2 decoder.
    """
    import torch
    from transformers import (
        AutoModelForCausalLM,
        AutoTokenizer,
        Qwen2VLConfig,
        Qwen2VLForConditionalGeneration,
    )

    src = Path(decoder_dir)
    lm = AutoModelForCausalLM.from_pretrained(src, dtype=torch.float32)
    tok = AutoTokenizer.from_pretrained(src)
    base_vocab = len(tok)
    tok.add_special_tokens({"additional_special_tokens": list(SPECIAL_TOKENS)})
    ids = {t: tok.convert_tokens_to_ids(t) for t in SPECIAL_TOKENS}
    vocab = len(tok)
    lc = lm.config
    theta = float((getattr(lc, "rope_parameters", None) or {}).get("rope_theta") or getattr(lc, "rope_theta", 1e4))
    text = {"vocab_size": vocab, "hidden_size": lc.hidden_size, "intermediate_size": lc.intermediate_size,
                "num_hidden_layers": lc.num_hidden_layers, "num_attention_heads": lc.num_attention_heads,
                "num_key_value_heads": lc.num_key_value_heads, "max_position_embeddings": lc.max_position_embeddings,
                "rms_norm_eps": lc.rms_norm_eps, "tie_word_embeddings": False, "rope_theta": theta,
                "rope_scaling": {"type": "mrope", "mrope_section": MROPE_SECTION},
                "bos_token_id": lc.bos_token_id, "eos_token_id": lc.eos_token_id, "pad_token_id": lc.pad_token_id}
    cfg = Qwen2VLConfig(text_config=text, vision_config={**TINY_VISION, "hidden_size": lc.hidden_size},
                        image_token_id=ids["<|image_pad|>"], video_token_id=ids["<|video_pad|>"],
                        vision_start_token_id=ids["<|vision_start|>"], vision_end_token_id=ids["<|vision_end|>"],
                        bos_token_id=lc.bos_token_id, eos_token_id=lc.eos_token_id, tie_word_embeddings=False)
    torch.manual_seed(seed)
    model = Qwen2VLForConditionalGeneration(cfg).eval()
    src_sd = lm.state_dict()
    emb = src_sd["model.embed_tokens.weight"]
    grown = torch.cat([emb, emb.mean(0, keepdim=True).expand(vocab - base_vocab, -1)])
    new_sd: dict[str, torch.Tensor] = {}
    for k, v in model.state_dict().items():
        if not k.startswith("model.language_model.") and k != "lm_head.weight":
            continue
        name = k.replace("model.language_model.", "model.")
        if k == "lm_head.weight" or name == "model.embed_tokens.weight":
            new_sd[k] = grown.clone()
        elif name in src_sd:
            new_sd[k] = src_sd[name]
        elif k.endswith(("q_proj.bias", "k_proj.bias", "v_proj.bias")):
            new_sd[k] = torch.zeros_like(v)  # Llama has no q/k/v bias: zero makes Qwen2's attention Llama's
        else:
            raise RuntimeError(f"tiny Qwen2-VL graft: no SmolLM2 tensor for {k}")
    missing = model.load_state_dict(new_sd, strict=False)
    assert not missing.unexpected_keys, missing.unexpected_keys
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(out_dir)
    tok.chat_template = CHAT_TEMPLATE
    tok.save_pretrained(out_dir)
    image_processor().save_pretrained(out_dir)  # preprocessor_config.json
    (out_dir / "chat_template.jinja").write_text(CHAT_TEMPLATE)
    tcfg = json.loads((out_dir / "tokenizer_config.json").read_text())
    tcfg["chat_template"] = CHAT_TEMPLATE
    (out_dir / "tokenizer_config.json").write_text(json.dumps(tcfg, indent=2))
    return out_dir


def expand_image_pads(ids: list[int], grids: list[list[int]], image_token_id: int, merge_size: int = 2) -> list[int]:
    """Token ids with the k-th ``<|image_pad|>`` repeated ``t·h·w / merge²`` times for image k's ``grid = [t, h, w]``
    (what ``Qwen2VLProcessor`` does to the text; done here because that class needs torchvision for its video half).

    Raises:
        ValueError: the number of ``<|image_pad|>`` placeholders differs from the number of images.
    """
    slots = [i for i, t in enumerate(ids) if t == image_token_id]
    if len(slots) != len(grids):
        raise ValueError(f"{len(slots)} image placeholders for {len(grids)} images")
    out: list[int] = []
    it = iter(grids)
    for t in ids:
        if t == image_token_id:
            g = next(it)
            out.extend([image_token_id] * (int(g[0]) * int(g[1]) * int(g[2]) // (merge_size * merge_size)))
        else:
            out.append(t)
    return out
