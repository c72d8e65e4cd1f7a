"""``build.engine: pytorch``: no engine build; the ``LLM()`` arguments of TensorRT-LLM's PyTorch backend.

Stage directory (``<build>/engine/``)::

    llm_api_config.yaml   LLM() keyword arguments (LLM-API names, docs/reference/trtllm-1.2.1-contract.md §8–9); the Triton ``llmapi``
                          model's ``model.yaml`` is generated from these by :mod:`pipeline.triton_repo.stage`
    llm_api_config.json   the same, as JSON
    trtllm_serve_options.yaml  serving.frontend: trtllm-serve only: the --extra_llm_api_options YAML (the kwargs
                          without those given as flags, :mod:`pipeline.trtllm.trtllm_serve`)
    trtllm_serve.json     serving.frontend: trtllm-serve only: {"argv": the command line (host/port defaults;
                          ``trtpipe serve`` sets its own), "options": the YAML's path}
    manifest.json         engine_kind pytorch, status built | dry_run, frontend, the kwargs and their hash

The PyTorch backend loads the unified HF checkpoint (``<quantize>/hf_ckpt``) at server start; there is
nothing to compile, so nothing here needs a GPU. Knobs that only exist for TensorRT engines are refused by recipe
validation (:mod:`pipeline.recipe.knobs`); the kwargs are held to the LLM-API contract
(:func:`pipeline.trtllm.llmapi.check_kwargs`) before anything is written.
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
from pipeline.recipe.serving_path import serving_path
from pipeline.trtllm import contract, trtllm_serve
from pipeline.trtllm.llmapi import check_kwargs, llm_api_kwargs

CONFIG_YAML = "llm_api_config.yaml"
CONFIG_JSON = "llm_api_config.json"
SERVE_OPTIONS = "trtllm_serve_options.yaml"
SERVE_COMMAND = "trtllm_serve.json"


def run(recipe: Recipe, layout: BuildLayout, *, quantized: QuantizeResult, force: bool = False, dry_run: bool = False) -> EngineResult:
    """Write the LLM-API configuration of ``recipe`` into ``layout.engine`` (files in the module docstring).

    Reused when the cache key (recipe sections, upstream cache key, kwargs) matches, unless ``force``.

    Raises:
        UserError: max_seq_len cannot be resolved.
        StageError: not a dry run and the quantize stage left no ``hf_ckpt/config.json``; the kwargs (or the
            trtllm-serve command) break the LLM-API contract (nothing is written).
    """
    t0 = time.monotonic()
    out_dir = layout.engine
    hf_ckpt = quantized.hf_ckpt.resolve()
    present = (hf_ckpt / "config.json").is_file()
    if not present and not dry_run:
        raise StageError(f"{hf_ckpt}: no unified HF checkpoint (config.json) from the quantize stage")
    kwargs = llm_api_kwargs(recipe, hf_ckpt, draft_dir=None if dry_run else _draft_dir(recipe),  # a dry run: the geometry
                            source_geometry=quantized.source_geometry(recipe.model.source))  # of the resolved source
    problems = check_kwargs(kwargs, "pytorch")
    frontend, path = recipe.serving.frontend, serving_path(recipe)
    serve_cmd = trtllm_serve.argv(kwargs, str((out_dir / SERVE_OPTIONS).resolve())) if path.trtllm_serve else None
    problems += trtllm_serve.argv_problems(serve_cmd) if serve_cmd else []
    if problems:
        raise StageError(f"{out_dir / CONFIG_YAML}: breaks the TensorRT-LLM 1.2.1 LLM-API contract: {problems[0]}"
                         + (f" (+{len(problems) - 1} more)" if len(problems) > 1 else ""))
    status = "built" if present else "dry_run"
    fields = consumed(recipe, "engine", "runtime")  # the LLM() arguments hold the KV/scheduler knobs too
    serve_key = [serve_cmd, trtllm_serve.extra_options(kwargs)] if serve_cmd else None  # the YAML is derived
    key = stable_hash({"recipe": fields,
                       "quantize": quantized.cache_key, "kwargs": kwargs, "status": status, "serve": serve_key,
                       "pins": contract.pins()})
    if not force:
        hit = EngineResult.load(out_dir, key)
        if hit:
            return hit
    manifest = base_manifest(
        EngineResult.STAGE, key, engine_kind="pytorch", serving_path=path.key, status=status, consumed=fields, llm_api_config=CONFIG_YAML, llm_api_kwargs=kwargs,
        llm_api_kwargs_sha256=stable_hash(kwargs), checkpoint={"path": str(hf_ckpt), "present": present},
        world_size=recipe.target.world_size, frontend=frontend, trtllm_serve=serve_cmd, pins=contract.pins(),
        inputs={"quantize_cache_key": quantized.cache_key}, max_seq_len=kwargs["max_seq_len"], versions=library_versions(),
    )
    with atomic_dir(out_dir) as tmp:
        (tmp / CONFIG_YAML).write_text(yaml.safe_dump(kwargs, sort_keys=False))
        (tmp / CONFIG_JSON).write_text(json.dumps(kwargs, indent=2) + "\n")
        if serve_cmd:
            (tmp / SERVE_OPTIONS).write_text(yaml.safe_dump(trtllm_serve.extra_options(kwargs), sort_keys=False))
            (tmp / SERVE_COMMAND).write_text(json.dumps({"argv": serve_cmd, "options": serve_cmd[-1]}, indent=2) + "\n")
        manifest["timings_s"] = {"total": round(time.monotonic() - t0, 3)}
        manifest["peak_rss_bytes"] = peak_rss_bytes()
        write_manifest(tmp, manifest)
    return EngineResult.from_manifest(out_dir, manifest)


def _draft_dir(recipe: Recipe) -> str | None:
    """The local directory of the recipe's draft model (EAGLE-3 head or DraftTarget draft), fetched like
    ``model.source`` (a local directory as is, a HF id from the local HF cache or one download); ``None`` without one.

    Raises:
        UserError: the draft cannot be found (one line naming ``build.pytorch.speculative_config.speculative_model_dir``).
    """
    from pathlib import Path

    from pipeline.core.errors import UserError
    from pipeline.quantize.sources import resolve_source
    from pipeline.recipe import ModelSpec
    from pipeline.recipe.speculative import FIELD, draft_source

    draft = draft_source(recipe.build.pytorch.speculative_config)
    if not draft:
        return None
    try:
        return str(resolve_source(ModelSpec(source=draft), Path.cwd()).hf_dir)
    except UserError as e:
        raise UserError(f"{FIELD}.speculative_model_dir: {str(e).removeprefix('model.source ')}") from None
