"""``build.engine: pytorch``: no engine build; the ``LLM()`` arguments of TensorRT-LLM's PyTorch backend.

Stage directory (``<build>/engine/``)::

    llm_api_config.yaml   LLM() keyword arguments (LLM-API names, docs/reference/trtllm-1.2.1-contract.md §8–9); the Triton ``llmapi``
                          model's ``model.yaml`` is generated from these by :mod:`pipeline.triton_repo.stage`
    llm_api_config.json   the same, as JSON
    manifest.json         engine_kind pytorch, status built | dry_run, the kwargs and their hash

The PyTorch backend loads the unified HF checkpoint (``<quantize>/hf_ckpt``) at server start; there is
nothing to compile, so nothing here needs a GPU. Knobs that only exist for TensorRT engines
(``build.plugins``, ``kv_cache_type``, ``workers``, ``opt_num_tokens``) are listed as ``ignored_knobs``.
"""

from __future__ import annotations

import json
import time

import yaml

from pipeline.core.artifacts import (
    atomic_dir,
    base_manifest,
    library_versions,
    peak_rss_bytes,
    stable_hash,
    write_manifest,
)
from pipeline.core.errors import StageError
from pipeline.core.layout import BuildLayout
from pipeline.engine.result import EngineResult
from pipeline.quantize.result import QuantizeResult
from pipeline.recipe import Recipe
from pipeline.recipe.consumers import consumed
from pipeline.trtllm import contract
from pipeline.trtllm.llmapi import TRT_ONLY_KNOBS, kwargs_problems, llm_api_kwargs

CONFIG_YAML = "llm_api_config.yaml"
CONFIG_JSON = "llm_api_config.json"
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
