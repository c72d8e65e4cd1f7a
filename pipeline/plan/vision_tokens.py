"""The planner's terms for a vision family whose images become decoder tokens (Qwen2-VL, Qwen2.5-VL; issue #47).

Where mllama's images go to a cross-attention pool (:mod:`pipeline.plan.vision`), a Qwen2-VL image is spliced into
the prompt as image tokens — one per 28×28 px after the processor's resize (:func:`pipeline.vision.geometry.
qwen2_vl_image_tokens`). So the planner treats a request as ``ISL + image tokens`` prompt tokens: they fill the KV
cache, the prefill step and ``max_input_len`` like text (`trtpipe plan` shows both numbers per scenario).

Memory: the vision tower (ViT + patch merger) runs in PyTorch inside the LLM-API backend on every rank in its own
dtype (bfloat16; never quantized), modeling_qwen2vl.py@000a01de ``Qwen2VisionModelBase`` ("Currently, copying
vision encoder on all devices"), so its weights join each GPU's runtime reserve. Its activations are not counted
(the multimodal quickstart lowers the KV fraction to 0.6 for them, examples/llm-api/quickstart_multimodal.py@000a01de).
Not modelled: the tower's FLOPs in the prefill time.
"""

from __future__ import annotations

from pydantic import BaseModel, Field

from pipeline.core.weights import DTYPE_BYTES
from pipeline.recipe.vision import QwenVLVision


class VisionTokens(BaseModel):
    """A token family's vision terms in a plan (tokens; parameters; bytes)."""

    family: str
    image_width: int = Field(description="Pixels; the recipe's vision.image_width.")
    image_height: int = Field(description="Pixels; the recipe's vision.image_height.")
    image_tokens_per_image: int = Field(description="Decoder tokens one image costs after the processor's resize.")
    images_per_request: int
    image_tokens_per_request: int = Field(description="Added to every scenario's ISL in the KV cache, prefill and limits.")
    tower_params: int | None = Field(description="Vision tower + merger parameters (None: vision_config unknown).")
    tower_bytes: int = Field(description="tower_params × encoder_dtype bytes, in each GPU's runtime reserve.")
    rule: str


def qwen2_5_vl_tower_params(vis: dict, text_hidden: int) -> int:
    """Parameters of transformers' ``Qwen2_5_VisionTransformerPretrainedModel`` for a Qwen2.5-VL ``vision_config``:
    a bias-free Conv3d patch embedding (3 × temporal × patch² → hidden), ``depth`` blocks of two RMSNorms, qkv and
    output projections with bias and a gated SiLU MLP (gate, up, down with bias), and the patch merger (RMSNorm, then
    ``Linear(hidden·merge² → hidden·merge²) → GELU → Linear(→ out_hidden_size)``, both with bias). ``text_hidden`` is
    used when ``out_hidden_size`` is absent."""
    h, i = vis["hidden_size"], vis["intermediate_size"]
    embed = vis.get("in_chans", vis.get("in_channels", 3)) * vis["temporal_patch_size"] * vis["patch_size"] ** 2 * h
    block = 2 * h + (h * 3 * h + 3 * h) + (h * h + h) + 2 * (h * i + i) + (i * h + h)
    m = h * vis["spatial_merge_size"] ** 2
    merger = h + (m * m + m) + (m * vis.get("out_hidden_size", text_hidden) + vis.get("out_hidden_size", text_hidden))
    return embed + vis["depth"] * block + merger


def qwen2_vl_tower_params(vis: dict, text_hidden: int) -> int:
    """Parameters of transformers' ``Qwen2VisionTransformerPretrainedModel`` (Qwen2-VL) for its ``vision_config``:
    the bias-free Conv3d patch embedding to ``embed_dim``, ``depth`` blocks of two LayerNorms (weight + bias), qkv and
    output projections with bias and a GELU MLP (``embed_dim → embed_dim·mlp_ratio → embed_dim``, bias), and the
    merger (LayerNorm, ``Linear(embed_dim·merge² → same) → GELU → Linear(→ hidden_size)``, bias). Qwen2-VL's
    ``vision_config.hidden_size`` is the merger's output (the text hidden); ``text_hidden`` when absent."""
    e = vis["embed_dim"]
    i = int(e * vis.get("mlp_ratio", 4))
    out = vis.get("hidden_size", text_hidden)
    embed = vis.get("in_chans", vis.get("in_channels", 3)) * vis["temporal_patch_size"] * vis["patch_size"] ** 2 * e
    block = 4 * e + (e * 3 * e + 3 * e) + (e * e + e) + (e * i + i) + (i * e + e)
    m = e * vis["spatial_merge_size"] ** 2
    return embed + vis["depth"] * block + 2 * e + (m * m + m) + (m * out + out)


_TOWER = {"qwen2_5_vl": qwen2_5_vl_tower_params, "qwen2_vl": qwen2_vl_tower_params}


def vision_tokens(recipe, geo, vision_geo: dict | None) -> VisionTokens | None:
    """The :class:`VisionTokens` of a recipe whose vision family splices image tokens (``None``: no vision section or a
    cross-attention family). The tower is counted when the source's ``vision_config`` is known (``vision_geo``:
    :func:`pipeline.recipe.vision.vision_geometry` of ``model.source`` — models.yaml or a local config.json, resolved
    once by the planner against the recipe's directory), else ``tower_params`` is None and ``tower_bytes`` 0."""
    v = recipe.vision
    if not isinstance(v, QwenVLVision):
        return None
    vis = (vision_geo or {}).get("vision_config")
    params = _TOWER[v.family](vis, geo.hidden_size) if vis else None
    per_image = v.image_tokens()
    return VisionTokens(
        family=v.family, image_width=v.image_width, image_height=v.image_height, image_tokens_per_image=per_image,
        images_per_request=v.max_images_per_request, image_tokens_per_request=per_image * v.max_images_per_request,
        tower_params=params, tower_bytes=(params or 0) * DTYPE_BYTES[v.encoder_dtype],
        rule=(f"one decoder token per {v.patch_size * v.merge_size}×{v.patch_size * v.merge_size} px after the resize to "
              f"multiples of {v.patch_size * v.merge_size} px within [{v.min_pixels}, {v.max_pixels}] px "
              "(transformers v4.57.3 image_processing_qwen2_vl.py:54-80, processing_qwen2_vl.py:157-162)"))
