"""The TensorRT-LLM LLM API as trtpipe writes it: ``tensorrt_llm.LLM(**kwargs)`` for a recipe.

Shared by the engine stage (``build.engine: pytorch``, :mod:`pipeline.engine.pytorch`), the Triton repository
stage (the ``llmapi`` model's ``model.yaml``) and ``trtpipe deploy``. Names are checked against the contract
table (``pipeline/data/trtllm_1.2.1_contract.yaml``, section ``llm_api``).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from pipeline.core.geometry import geometry_for_source, geometry_from_config
from pipeline.recipe import Recipe, derived
from pipeline.trtllm import contract

#: Recipe knobs with no PyTorch-backend equivalent (TensorRT engine build only).
TRT_ONLY_KNOBS = ("build.plugins", "build.kv_cache_type", "build.workers", "build.opt_num_tokens")


def _max_seq_len(recipe: Recipe, hf_ckpt_dir: Path) -> int:
    """:func:`pipeline.recipe.derived.require_max_seq_len` with the model's max_position_embeddings
    (HF config.json, else the known-model table)."""
    cfg = Path(hf_ckpt_dir) / "config.json"
    geo = geometry_from_config(cfg) if cfg.is_file() else geometry_for_source(recipe.model.source)
    return derived.require_max_seq_len(recipe.build, geo.max_position_embeddings if geo is not None else None)


def llm_api_kwargs(recipe: Recipe, hf_ckpt_dir: Path) -> dict[str, Any]:
    """The ``tensorrt_llm.LLM(**kwargs)`` arguments for ``recipe`` (TensorRT-LLM 1.2.1 LLM-API names).

    Args:
        recipe: the recipe (``build``, ``target``, ``model``, ``quantization.kv_cache_dtype``).
        hf_ckpt_dir: the unified HF checkpoint ModelOpt exported (model weights + tokenizer); used as
            ``model`` and ``tokenizer`` verbatim (make it absolute for a server started elsewhere).

    Returns:
        A JSON-able dict: ``model``, ``tokenizer``, ``backend`` ("pytorch"), ``dtype``, ``trust_remote_code``,
        ``tensor_parallel_size``, ``pipeline_parallel_size``, ``max_batch_size``, ``max_input_len``,
        ``max_seq_len`` (resolved, tokens), ``max_beam_width``, ``max_num_tokens``, ``kv_cache_config``
        {free_gpu_memory_fraction, enable_block_reuse, max_tokens, max_attention_window, host_cache_size,
        tokens_per_block, dtype ("fp8" for an FP8 KV cache, else "auto" = from the checkpoint)},
        ``scheduler_config`` {capacity_scheduler_policy, context_chunking_policy}, ``enable_chunked_prefill``.
        Every key is a name of the contract table's ``llm_api`` section.

    Raises:
        UserError: max_seq_len is unset and cannot be derived from the model.
    """
    b, kv, t = recipe.build, recipe.build.kv_cache_config, recipe.target
    kwargs = {
        "model": str(hf_ckpt_dir),
        "tokenizer": str(hf_ckpt_dir),
        "backend": "pytorch",
        "dtype": recipe.model.dtype,
        "trust_remote_code": recipe.model.trust_remote_code,
        "tensor_parallel_size": t.tp_size,
        "pipeline_parallel_size": t.pp_size,
        "max_batch_size": b.max_batch_size,
        "max_input_len": b.max_input_len,
        "max_seq_len": _max_seq_len(recipe, hf_ckpt_dir),
        "max_beam_width": b.max_beam_width,
        "max_num_tokens": b.max_num_tokens,
        "kv_cache_config": {
            "free_gpu_memory_fraction": kv.free_gpu_memory_fraction,
            "enable_block_reuse": kv.enable_block_reuse,
            "max_tokens": kv.max_tokens,
            # LLM-API max_attention_window is a per-layer list (repeated across layers).
            "max_attention_window": [kv.max_attention_window] if kv.max_attention_window else None,
            "host_cache_size": kv.host_cache_size,
            "tokens_per_block": b.tokens_per_block,
            "dtype": "fp8" if recipe.quantization.kv_cache_dtype == "fp8" else "auto",
        },
        "scheduler_config": {
            "capacity_scheduler_policy": b.scheduler_config.capacity_scheduler_policy,
            "context_chunking_policy": b.scheduler_config.context_chunking_policy,
        },
        "enable_chunked_prefill": b.enable_chunked_prefill,
    }
    return kwargs


def kwargs_problems(kwargs: dict[str, Any]) -> list[str]:
    """Keys of ``kwargs`` that are not LLM-API names of the contract table (empty = all known)."""
    api = contract.contract()["llm_api"]
    out = [f"LLM() has no argument {k!r}" for k in kwargs if k not in api["llm_kwargs"]]
    out += [f"KvCacheConfig has no field {k!r}" for k in kwargs.get("kv_cache_config", {}) if k not in api["kv_cache_config_fields"]]
    out += [f"SchedulerConfig has no field {k!r}" for k in kwargs.get("scheduler_config", {}) if k not in api["scheduler_config_fields"]]
    return out
