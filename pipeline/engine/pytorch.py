"""``build.engine: pytorch``: no engine build; the ``LLM()`` arguments of TensorRT-LLM's PyTorch backend.

Stage directory (``<build>/engine/``)::

    llm_api_config.yaml   LLM() keyword arguments (LLM-API names, docs/reference/trtllm-1.2.1-contract.md §8–9); the Triton ``llmapi``
                          model's ``model.yaml`` is generated from these by :mod:`pipeline.stages.triton_repo`
    llm_api_config.json   the same, as JSON
    manifest.json         engine_kind pytorch, status built | dry_run, the kwargs and their hash

The PyTorch backend loads the unified HF checkpoint (``<quantize>/hf_ckpt``) at server start; there is
nothing to compile, so nothing here needs a GPU. Knobs that only exist for TensorRT engines
(``build.plugins``, ``kv_cache_type``, ``workers``, ``opt_num_tokens``) are listed as ``ignored_knobs``.
"""

from __future__ import annotations

import json
import time
from pathlib import Path
from typing import Any

import yaml

from pipeline.artifacts import atomic_dir, base_manifest, library_versions, peak_rss_bytes, stable_hash, write_manifest
from pipeline.engine import contract
from pipeline.errors import StageError
from pipeline.layout import BuildLayout
from pipeline.models import geometry_for_source, geometry_from_config
from pipeline.recipe import Recipe, derived
from pipeline.recipe.consumers import consumed
from pipeline.stages.results import EngineResult, QuantizeResult

CONFIG_YAML = "llm_api_config.yaml"
CONFIG_JSON = "llm_api_config.json"
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


def _ignored(recipe: Recipe) -> list[str]:
    """TRT-only knobs that differ from their defaults (so the user learns they have no effect here)."""
    fresh = type(recipe.build)()
    out = []
    for knob in TRT_ONLY_KNOBS:
        name = knob.split(".", 1)[1]
        if getattr(recipe.build, name) != getattr(fresh, name):
            out.append(f"{knob} (TensorRT engine build only; no effect on the PyTorch backend)")
    return out


def run(recipe: Recipe, layout: BuildLayout, *, quantized: QuantizeResult, force: bool = False, dry_run: bool = False) -> EngineResult:
    """Write the LLM-API configuration of ``recipe`` into ``layout.engine`` (files in the module docstring).

    Reused when the cache key (recipe sections, upstream cache key, kwargs) matches, unless ``force``.

    Raises:
        UserError: max_seq_len cannot be resolved.
        StageError: not a dry run and the quantize stage left no ``hf_ckpt/config.json``.
    """
    t0 = time.monotonic()
    out_dir = layout.engine
    hf_ckpt = quantized.hf_ckpt.resolve()
    present = (hf_ckpt / "config.json").is_file()
    if not present and not dry_run:
        raise StageError(f"{hf_ckpt}: no unified HF checkpoint (config.json) from the quantize stage")
    kwargs = llm_api_kwargs(recipe, hf_ckpt)
    problems = kwargs_problems(kwargs)
    if problems:  # a programming error: the table and this module disagree
        raise StageError("LLM-API config: " + "; ".join(problems))
    status = "built" if present else "dry_run"
    fields = consumed(recipe, "engine", "runtime")  # the LLM() arguments hold the KV/scheduler knobs too
    key = stable_hash({"recipe": fields,
                       "quantize": quantized.cache_key, "kwargs": kwargs, "status": status,
                       "pins": contract.pins()})
    if not force:
        hit = EngineResult.load(out_dir, key)
        if hit:
            return hit
    manifest = base_manifest(
        EngineResult.STAGE, key, engine_kind="pytorch", status=status, consumed=fields, llm_api_config=CONFIG_YAML, llm_api_kwargs=kwargs,
        llm_api_kwargs_sha256=stable_hash(kwargs), checkpoint={"path": str(hf_ckpt), "present": present},
        world_size=recipe.target.world_size, ignored_knobs=_ignored(recipe), pins=contract.pins(),
        inputs={"quantize_cache_key": quantized.cache_key}, max_seq_len=kwargs["max_seq_len"], versions=library_versions(),
    )
    with atomic_dir(out_dir) as tmp:
        (tmp / CONFIG_YAML).write_text(yaml.safe_dump(kwargs, sort_keys=False))
        (tmp / CONFIG_JSON).write_text(json.dumps(kwargs, indent=2) + "\n")
        manifest["timings_s"] = {"total": round(time.monotonic() - t0, 3)}
        manifest["peak_rss_bytes"] = peak_rss_bytes()
        write_manifest(tmp, manifest)
    return EngineResult.from_manifest(out_dir, manifest)
