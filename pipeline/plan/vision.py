"""The planner's vision-language terms (issue #46 item 7, recipe level): what a ``vision`` section adds to GPU memory
and how it splits the KV pool. mllama (Llama 3.2 Vision) on the TensorRT engine path.

Memory on GPU 0 (the most loaded rank; the vision engine is one TensorRT engine, not split by tensor parallelism,
and Triton's ``multimodal_encoders`` model runs it on GPU 0):

- vision encoder + projector weights in ``vision.encoder_dtype`` (bfloat16: never quantized — ModelOpt quantizes
  only the language model of a VLM, TensorRT-Model-Optimizer examples/llm_ptq/hf_ptq.py@5a4242fa:348-368, 646-651;
  the mllama README keeps the visual engine in BF16 for an FP8 decoder, docs/reference/multimodal-vlm.md §1).
  Parameters: :func:`mllama_vision_params` (transformers' ``MllamaVisionModel`` layout; the test counts the real
  module on the meta device) + the projector ``Linear(vision_output_dim → text hidden, bias)``;
- the multimodal CUDA memory pool, ``--multimodal_gpu0_cuda_mem_pool_bytes`` (tensorrtllm_backend
  docs/multimodal.md@efb8a497:235, 241).

Both are added to the runtime reserve, so ``free`` (what ``free_gpu_memory_fraction`` applies to) shrinks.

The KV pool (``free × free_gpu_memory_fraction``) is split by ``cross_kv_cache_fraction`` f (docs/multimodal.md@
efb8a497:230, "cross_kv_cache_fraction splits the paged KV pool between self- and cross-attention"):
self-attention tokens = blocks(free × fraction × (1 − f)) × tokens_per_block — the capacity the rest of the plan
(concurrency, throughput) uses — and cross-attention tokens = blocks(free × fraction × f) × tokens_per_block, each
request with an image holding ``max_encoder_input_len`` of them (6404 at 560 px, :mod:`pipeline.vision.geometry`).
Bytes per token of both pools: :meth:`ModelGeometry.kv_bytes_per_token` over all ``num_hidden_layers`` [inference:
TensorRT-LLM sizes its paged pools per decoder layer; counting every layer for both pools is the upper bound on
bytes, so capacities are lower bounds].

Throughput (issue #46 item 7, :func:`vision_step_terms`, added to the step model's :class:`StepCost`): each request
with N images (``vision.max_images_per_request``) costs, once, the vision encoder over its N × max_tiles tiles
(:func:`mllama_vision_gflops_per_image`, on GPU 0 at the encoder dtype's peak × η_gemm: the encoder engine is not split
by tp and the decoder's ranks wait for it) and the cross-attention K/V projections of its E = N × tiles × (patches + 1)
encoder tokens in every cross-attention layer; every token (prompt or decode) attends over E in each cross-attention
layer (4·E·H·d FLOPs, with the GEMMs); every decoding sequence reads its E cross K/V tokens per cross-attention layer
each step (memory-bound, as self-attention's KV). Not counted: the vision engine's activations at its max batch
(TensorRT workspace).
"""

from __future__ import annotations

from pydantic import BaseModel

from pipeline.core.weights import DTYPE_BYTES
from pipeline.recipe.vision import (
    VisionSpec,
    cross_attention,
    derived_vision,
)


class VisionMemory(BaseModel):
    """The vision terms of a GPU memory plan (bytes; tokens; GFLOP) and of the throughput model (per request with
    ``images_per_request`` images: its encoder tokens and the cross-attention layers they feed; the step model's terms
    are in the plan's ``step_cost``: ``cross_kv_bytes_per_seq``, ``prompt_extra_flops``)."""

    family: str
    encoder_params: int
    projector_params: int
    encoder_dtype: str
    encoder_bytes: int
    multimodal_pool_bytes: int
    gpu0_reserve_bytes: int
    max_encoder_input_len: int
    vision_max_batch_size: int
    cross_kv_cache_fraction: float
    cross_kv_token_bytes: int
    cross_kv_tokens: int
    cross_kv_pool_bytes: int
    image_requests_in_cross_pool: int
    encoder_gflops_per_image: float
    formula: str
    images_per_request: int = 0
    encoder_tokens_per_request: int = 0
    cross_attention_layers: int = 0


def mllama_vision_params(vis: dict) -> int:
    """Parameters of transformers' ``MllamaVisionModel`` (no projector) for a ``vision_config`` dict.

    patch conv C·p²·H + class token H + gated position embedding (1 + N·H + A·T·N·H) + pre/post tile embeddings
    2·(A·T·H + 1) + two LayerNorms 4·H + (layers + global layers) × (4·H² + 2·H·I + I + H + 4·H) + 2 gates per
    global layer; N = (image_size / patch)² + 1 vectors per tile, T = max_num_tiles, A = max_aspect_ratio_id + 1.
    Llama 3.2 Vision (560/14, H 1280, I 5120, 32 + 8 layers, 4 tiles, A 9): 863,567,379.
    """
    h, i, t = vis["hidden_size"], vis["intermediate_size"], vis["max_num_tiles"]
    n = (vis["image_size"] // vis["patch_size"]) ** 2 + 1
    a = vis.get("max_aspect_ratio_id", 8) + 1
    layer = 4 * h * h + 2 * h * i + i + h + 4 * h
    return (vis.get("num_channels", 3) * vis["patch_size"] ** 2 * h + h + 1 + n * h + a * t * n * h + 2 * (a * t * h + 1)
            + 4 * h + (vis["num_hidden_layers"] + vis["num_global_layers"]) * layer + 2 * vis["num_global_layers"])


def mllama_vision_gflops_per_image(vis: dict, text_hidden: int) -> float:
    """Forward GFLOP of one image (all ``max_num_tiles`` tiles; the processor always pads to them): 2 × Linear
    params × T·N tokens per layer + attention 4·(T·N)²·H per layer (the encoders attend over all tiles of an
    image) + the projector 2 × vision_output_dim × text_hidden × T·N."""
    h, i, t = vis["hidden_size"], vis["intermediate_size"], vis["max_num_tiles"]
    tokens = t * ((vis["image_size"] // vis["patch_size"]) ** 2 + 1)
    layers = vis["num_hidden_layers"] + vis["num_global_layers"]
    flops = layers * (2 * (4 * h * h + 2 * h * i) * tokens + 4 * tokens * tokens * h)
    return (flops + 2 * vis["vision_output_dim"] * text_hidden * tokens) / 1e9


def vision_reserve(recipe, geo, vision_geo: dict | None) -> tuple[VisionMemory, int] | None:
    """``(partial VisionMemory, bytes to add to GPU 0's reserve)`` for a recipe with a ``vision`` section whose
    vision geometry ``vision_geo`` is known (:func:`pipeline.recipe.vision.vision_geometry` of ``model.source``,
    resolved once by the planner against the recipe's directory); ``None`` otherwise. The cross-KV figures are
    filled in by :func:`split_kv_pool`."""
    v = recipe.vision
    if not isinstance(v, VisionSpec):  # no section, or a token family (pipeline/plan/vision_tokens.py)
        return None
    g = vision_geo
    if g is None or not g.get("vision_config"):
        return None
    vis = g["vision_config"]
    enc = mllama_vision_params(vis)
    proj = vis["vision_output_dim"] * geo.hidden_size + geo.hidden_size
    enc_bytes = (enc + proj) * DTYPE_BYTES[v.encoder_dtype]
    d = derived_vision(v, recipe.build.max_batch_size)
    reserve = enc_bytes + v.multimodal_gpu0_cuda_mem_pool_bytes
    return VisionMemory(
        family=v.family, encoder_params=enc, projector_params=proj, encoder_dtype=v.encoder_dtype, encoder_bytes=enc_bytes,
        multimodal_pool_bytes=v.multimodal_gpu0_cuda_mem_pool_bytes, gpu0_reserve_bytes=reserve,
        max_encoder_input_len=d.max_encoder_input_len, vision_max_batch_size=d.max_batch_size,
        cross_kv_cache_fraction=v.cross_kv_cache_fraction, cross_kv_token_bytes=0, cross_kv_tokens=0,
        cross_kv_pool_bytes=0, image_requests_in_cross_pool=0, images_per_request=v.max_images_per_request,
        encoder_tokens_per_request=d.max_encoder_input_len, cross_attention_layers=len(g.get("cross_attention_layers") or []),
        encoder_gflops_per_image=round(mllama_vision_gflops_per_image(vis, geo.hidden_size), 1),
        formula="self KV tokens = blocks(free × free_gpu_memory_fraction × (1 − cross_kv_cache_fraction)) × "
                "tokens_per_block; cross KV tokens = blocks(free × free_gpu_memory_fraction × cross_kv_cache_fraction) × "
                "tokens_per_block; image requests = floor(cross blocks / ceil(max_encoder_input_len / tokens_per_block)) "
                "(tensorrtllm_backend docs/multimodal.md@efb8a497:230)"), reserve


def split_kv_pool(vm: VisionMemory, *, free: int, fraction: float, kv_token_bytes: int, tokens_per_block: int) -> VisionMemory:
    """``vm`` with the cross-attention pool filled in: tokens = blocks(free × fraction × f) × tokens_per_block at
    ``kv_token_bytes`` each, and the image requests it holds at once (each ``max_encoder_input_len`` tokens,
    rounded up to whole blocks)."""
    block = tokens_per_block * kv_token_bytes
    blocks = int(max(free, 0) * fraction * vm.cross_kv_cache_fraction // block)
    per_request = -(-vm.max_encoder_input_len // tokens_per_block)
    return vm.model_copy(update={
        "cross_kv_token_bytes": kv_token_bytes, "cross_kv_tokens": blocks * tokens_per_block,
        "cross_kv_pool_bytes": blocks * block, "image_requests_in_cross_pool": blocks // per_request})


def vision_step_terms(recipe, geo, vision_geo: dict | None, *, tp_size: int, kv_bytes: int, encoder_peak_flops: float) -> dict:
    """The :class:`~pipeline.plan.step.StepCost` fields a vision recipe adds (empty dict: not a vision recipe or its
    vision geometry ``vision_geo`` is unknown: :func:`vision_reserve`), per GPU at tensor parallelism ``tp_size`` with
    ``kv_bytes`` per K/V element:

    - ``cross_kv_bytes_per_seq`` = E × C × 2 × max(1, K / tp) × head_dim × kv_bytes (C cross-attention layers, E encoder
      tokens per request = N × tiles × ((tile / patch)² + 1));
    - ``prompt_extra_flops`` = N × encoder FLOPs per image (whole, GPU 0) + C × 2 × E × hidden × 2·K·head_dim / tp (the
      cross K/V projections), at ``prompt_extra_flops_rate`` = ``encoder_peak_flops`` (FLOP/s of the encoder dtype);
    - ``cross_attn_flops_per_token`` = C × 4 × E × H × head_dim / tp (each token's cross-attention; the caller adds it
      to the Linear FLOPs per token).
    """
    v = recipe.vision
    g = vision_geo if cross_attention(v) else None  # a token family: vision_tokens.py
    if g is None or not g.get("vision_config"):
        return {}
    n = v.max_images_per_request
    e = derived_vision(v, recipe.build.max_batch_size).max_encoder_input_len  # N images' encoder tokens
    c = len(g.get("cross_attention_layers") or [])
    kd = max(1, geo.num_key_value_heads // tp_size) * geo.head_dim
    enc = n * mllama_vision_gflops_per_image(g["vision_config"], geo.hidden_size) * 1e9
    proj = c * 2 * e * geo.hidden_size * 2 * geo.num_key_value_heads * geo.head_dim / tp_size
    return {"cross_kv_bytes_per_seq": float(e * c * 2 * kd * kv_bytes), "prompt_extra_flops": enc + proj,
            "prompt_extra_flops_rate": encoder_peak_flops,
            "cross_attn_flops_per_token": c * 4 * e * geo.num_attention_heads * geo.head_dim / tp_size,
            "images_per_request": n, "encoder_tokens_per_request": e, "cross_attention_layers": c}
