"""Which stage consumes each recipe field: what each stage's cache key hashes.

TensorRT-LLM splits its knobs into what ``trtllm-build`` bakes into the engine (``BuildConfig`` /
``PluginConfig``: sizes, KV-cache type and block size, plugins; docs/reference/trtllm-1.2.1-contract.md §2-§3)
and what the runtime reads when the engine is loaded (``KvCacheConfig``, ``SchedulerConfig``, chunked context:
§8-§9, the Triton ``tensorrt_llm`` parameters in the model repository). A runtime knob must therefore never
rebuild an engine — tens of minutes on a GPU for a value that only goes into ``config.pbtxt``.

:data:`CONSUMERS` maps a dotted field (or section) to its stage; the longest matching prefix wins.
:func:`consumed` is the part of a recipe a stage hashes, flattened (``{"build.max_batch_size": 2048, …}``),
and :func:`changed` names the fields that differ between two of them (``trtpipe build`` prints them).
"""

from __future__ import annotations

from typing import Any

#: field path (prefix) → consuming stage: quantize | engine (every engine kind) | engine_cpu (the CPU engine only) |
#: runtime (the model repository) | bench | eval | plan (checked before building, produces nothing) | deploy |
#: none (labels)
CONSUMERS: dict[str, str] = {
    "name": "none",
    "description": "none",
    "model": "quantize",
    "target.gpu": "engine",          # engine kernels and plugin adjustments follow the GPU's SM
    "target.mig": "engine",          # a MIG slice has fewer SMs: its engine is built (tactics timed) on the slice
    "target.tp_size": "quantize",    # the checkpoint is sharded per rank (export mapping)
    "target.pp_size": "quantize",
    "target.ep_size": "runtime",     # LLM-API moe_expert_parallel_size, read when the LLM loads
    "target.num_gpus": "plan",
    "target.gpus_per_node": "deploy",
    "target.tensorrt_llm": "plan",   # checked against the release's engine paths; builds use the pinned container
    "quantization": "quantize",
    "build.engine": "engine",
    "build.max_batch_size": "engine",
    "build.max_input_len": "engine",
    "build.max_seq_len": "engine",
    "build.max_num_tokens": "engine",
    "build.opt_num_tokens": "engine",
    "build.max_beam_width": "engine",
    "build.kv_cache_type": "engine",
    "build.tokens_per_block": "engine",
    "build.workers": "engine",
    "build.plugins": "engine",
    "build.cpu": "engine_cpu",      # only the CPU engine reads it
    "build.kv_cache_config": "runtime",
    "build.scheduler_config": "runtime",
    "build.enable_chunked_prefill": "runtime",
    "build.pytorch": "runtime",     # TorchLlmArgs read when the LLM loads (llm_api_config.yaml → model.yaml): no engine
    "build.guided_decoding_backend": "runtime",  # read at model load (Triton parameters / LLM() / the CPU model)
    "build.allow_kv_oversubscription": "plan",
    "build.lora": "engine",         # trtllm-build's LoRA flags; the CPU engine directory's copies of the adapters
    "build.lora.max_loras": "runtime",  # LLM-API LoraConfig, read when the LLM loads
    "build.lora.max_cpu_loras": "runtime",
    "build.lora.cache_gpu_memory_fraction": "runtime",  # the C++ backend's lora_cache_* parameters
    "build.lora.cache_host_memory_bytes": "runtime",
    "build.lora.cache_optimal_adapter_size": "runtime",
    "build.lora.cache_max_adapter_size": "runtime",
    "serving": "runtime",
    "bench": "bench",
    "eval": "eval",
    # the vision section (pipeline/recipe/vision.py). Its absence (a text recipe: the leaf "vision" = None) is hashed by
    # no stage, so text recipes keep their cache keys; each field is classified below.
    "vision": "plan",
    "vision.family": "engine",                  # the vision engine and the decoder's cross-attention shapes
    "vision.tile_size": "engine",
    "vision.patch_size": "engine",
    "vision.max_tiles": "engine",
    "vision.max_images_per_request": "engine",  # → max_encoder_input_len (trtllm-build) and the vision batch
    "vision.encoder_dtype": "engine",
    "vision.max_batch_size": "engine",
    "vision.max_encoder_input_len": "engine",
    "vision.encoder_input_features_data_type": "runtime",  # Triton parameters / launch flag (docs/multimodal.md)
    "vision.cross_kv_cache_fraction": "runtime",
    "vision.multimodal_gpu0_cuda_mem_pool_bytes": "runtime",
}


def flatten(data: Any, prefix: str = "") -> dict[str, Any]:
    """``{"a.b": 1}`` for ``{"a": {"b": 1}}`` (lists are leaves)."""
    if isinstance(data, dict) and data:
        out: dict[str, Any] = {}
        for k, v in data.items():
            out.update(flatten(v, f"{prefix}.{k}" if prefix else str(k)))
        return out
    return {prefix: data}


def stage_of(path: str) -> str:
    """The stage that consumes field ``path`` (longest matching prefix of :data:`CONSUMERS`).

    Raises:
        KeyError: no entry covers the path (a new recipe field must be classified here).
    """
    parts = path.split(".")
    for n in range(len(parts), 0, -1):
        stage = CONSUMERS.get(".".join(parts[:n]))
        if stage is not None:
            return stage
    raise KeyError(f"recipe field {path!r} is not classified in pipeline/recipe/consumers.py")


def consumed(recipe: Any, *stages: str) -> dict[str, Any]:
    """The flattened fields of ``recipe`` that ``stages`` consume (JSON values), sorted by path."""
    flat = flatten(recipe.model_dump(mode="json"))
    return {k: flat[k] for k in sorted(flat) if stage_of(k) in stages}


def changed(old: dict[str, Any] | None, new: dict[str, Any]) -> list[str]:
    """``["build.max_batch_size 2048 → 512", …]``: fields whose value differs (added/removed included)."""
    if old is None:
        return []
    return [f"{k} {old.get(k, '—')!r} → {new.get(k, '—')!r}" for k in sorted(set(old) | set(new)) if old.get(k) != new.get(k)]
