"""``build.engine: tensorrt``: the exact ``trtllm-build`` command, its BuildConfig, and the engine manifest.

Stage directory (``<build>/engine/``)::

    trtllm_build.sh         the command, shell-quoted; runs from this directory (relative paths below)
    build_config.json       the BuildConfig dict incl. plugin_config (the form ``--build_config`` reads)
    checkpoint_config.json  only when no checkpoint exists: the PretrainedConfig the quantize stage's checkpoint will
                            have (synthesized); the command still reads ``--checkpoint_dir <quantize>/trtllm_ckpt``,
                            which ``quantize/quantize_command.sh`` writes (the dry-run chain; an engine built from
                            ``--model_config`` alone has no weights)
    config.json             engine config {"version", "pretrained_config", "build_config"} (when built)
    rank{N}.engine          one serialized TensorRT engine per rank (when built)
    build.log               trtllm-build's output (when built)
    timing.cache            --output_timing_cache (when built)
    manifest.json           status built | dry_run | not_built, versions, GPU, sha256 of every engine file

``--output_dir`` is the stage directory itself, so the stage directory is what the Triton ``tensorrt_llm``
model's ``gpt_model_path`` points at (the backend reads only ``config.json`` and ``rank{N}.engine``).

Every knob is passed explicitly (defaults moved between TensorRT-LLM versions). Knobs the tool would
silently override (:func:`pipeline.trtllm.contract.effective_plugins`) are passed with the value the engine
will really get, and listed under ``adjustments`` in the manifest. ``tensorrt_llm`` is never imported here:
versions come from package metadata, the engine's ``config.json`` and ``nvidia-smi``.
"""

from __future__ import annotations

import json
import shlex
import shutil
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

from pipeline.core.artifacts import (
    atomic_dir,
    base_manifest,
    library_versions,
    peak_rss_bytes,
    stable_hash,
    write_manifest,
)
from pipeline.core.errors import MissingToolError, StageError, UserError
from pipeline.core.geometry import geometry_from_config
from pipeline.core.layout import BuildLayout
from pipeline.engine.result import EngineResult
from pipeline.quantize.result import QuantizeResult
from pipeline.recipe import Recipe, derived
from pipeline.recipe.consumers import consumed
from pipeline.recipe.eval import needs_context_logits
from pipeline.recipe.serving_path import serving_path
from pipeline.recipe.vision import cross_attention
from pipeline.trtllm import contract
from pipeline.trtllm.runtime import (
    BUILD_CONFIG,
    BUILD_LOG,
    ENGINE_DIR,
    MODEL_CONFIG,
    SCRIPT,
    TIMING_CACHE,
    engine_file_hashes,
    runtime_facts,
)

TOOL = "trtllm-build"
#: the decoder architecture TensorRT-LLM's mllama checkpoint carries (convert_checkpoint.py@25b6cdd8 from_cli_args)
MLLAMA_ARCHITECTURE = "MLLaMAForCausalLM"
#: Seconds to wait for trtllm-build to exit after SIGTERM (Ctrl-C) before SIGKILL.
TERMINATE_GRACE_S = 10.0


# ----------------------------------------------------------------------------------------------- plan
def _checkpoint(recipe: Recipe, quantized: QuantizeResult) -> tuple[Path, dict[str, Any], bool]:
    """``(source, checkpoint config, synthesized?)``: the quantize stage's ``trtllm_ckpt`` or a synthesized config."""
    ckpt = quantized.trtllm_ckpt.resolve()
    if (ckpt / "config.json").is_file():
        try:
            cfg = json.loads((ckpt / "config.json").read_text())
        except ValueError as e:
            raise StageError(f"{ckpt / 'config.json'}: not valid JSON ({e})") from None
        problems = contract.checkpoint_config_problems(cfg, recipe)
        if problems:
            raise StageError(f"{ckpt / 'config.json'}: " + "; ".join(problems))
        return ckpt, cfg, False
    hf_cfg = quantized.hf_ckpt / "config.json"
    geo = geometry_from_config(hf_cfg) if hf_cfg.is_file() else quantized.source_geometry(recipe.model.source)
    if geo is None:
        raise UserError(
            f"model.source {recipe.model.source!r}: no TensorRT-LLM checkpoint at {ckpt} and the model geometry is "
            "unknown (not in pipeline/data/models.yaml), so no checkpoint config can be synthesized"
        )
    cfg = contract.synthesize_checkpoint_config(recipe, geo)
    if cross_attention(recipe.vision):  # mllama: convert_checkpoint.py / quantize.py write the decoder as MLLaMAForCausalLM
        cfg["architecture"] = MLLAMA_ARCHITECTURE  # (examples/models/core/mllama/convert_checkpoint.py@25b6cdd8)
    return Path(MODEL_CONFIG), cfg, True


def max_encoder_input_len(recipe: Recipe) -> int | None:
    """``--max_encoder_input_len`` of a vision recipe: the vision section's derived value (images × max tiles ×
    ((tile / patch)² + 1) = 6404 at 560 px; :func:`pipeline.recipe.vision.derived_vision`, never recomputed here);
    ``None`` for a text recipe (the flag is left out)."""
    if not cross_attention(recipe.vision):
        return None
    from pipeline.recipe.vision import derived_vision

    return derived_vision(recipe.vision, recipe.build.max_batch_size).max_encoder_input_len


def resolve_max_seq_len(recipe: Recipe, ckpt_cfg: dict[str, Any]) -> int:
    """``build.max_seq_len``, or the checkpoint's ``max_position_embeddings`` when unset (tokens).

    Raises:
        UserError: unset and the model does not state max_position_embeddings, or max_input_len exceeds it.
    """
    b = recipe.build
    max_seq = derived.require_max_seq_len(b, ckpt_cfg.get("max_position_embeddings"))
    if b.opt_num_tokens is not None and b.plugins.multiple_profiles:
        raise UserError("build.opt_num_tokens: trtllm-build refuses it together with plugins.multiple_profiles: true")
    return max_seq


def build_command(recipe: Recipe, *, source: Path, from_model_config: bool, plugins: dict[str, Any], max_seq_len: int) -> list[str]:
    """The ``trtllm-build`` argv (program name first), every knob explicit, flag spellings of docs/reference/trtllm-1.2.1-contract.md §2.

    Paths inside the stage directory are relative: the command runs with the stage directory as cwd.
    ``plugins`` are the effective plugin values (:func:`contract.effective_plugins`).
    """
    b = recipe.build
    argv = [TOOL, "--model_config" if from_model_config else "--checkpoint_dir", str(source), "--output_dir", ENGINE_DIR]
    sizes = [("max_batch_size", b.max_batch_size), ("max_input_len", b.max_input_len), ("max_seq_len", max_seq_len),
             ("max_num_tokens", b.max_num_tokens), ("max_beam_width", b.max_beam_width)]
    if b.opt_num_tokens is not None:
        sizes.append(("opt_num_tokens", b.opt_num_tokens))
    if (enc := max_encoder_input_len(recipe)) is not None:  # the one cross-attention sizing flag for mllama
        sizes.append(("max_encoder_input_len", enc))  # (tensorrtllm_backend docs/multimodal.md@efb8a497:162-169)
    for name, value in sizes:
        argv += [f"--{name}", str(value)]
    argv += ["--kv_cache_type", b.kv_cache_type, "--tokens_per_block", str(b.tokens_per_block)]
    for name, value in plugins.items():
        argv += [f"--{name}", contract.plugin_cli_value(name, value)]
    argv += lora_flags(recipe)
    if needs_context_logits(recipe.eval):  # the kld gate reads context_logits (trtllm_1.2.1_contract.yaml: build flags)
        argv.append("--gather_context_logits")
    argv += ["--profiling_verbosity", "layer_names_only", "--output_timing_cache", TIMING_CACHE,
             "--workers", str(b.workers), "--log_level", "info"]
    return argv


def lora_flags(recipe: Recipe) -> list[str]:
    """trtllm-build's LoRA flags for ``build.lora`` (none without it; pipeline/data/trtllm_1.2.1_contract.yaml):
    ``--lora_plugin auto`` (the checkpoint dtype, as ``TrtLlmArgs.validate_build_config_remaining`` sets it for
    ``enable_lora``, llm_args.py@c292b9f997d6), ``--lora_dir`` every adapter (the first supplies the configuration),
    ``--lora_ckpt_source hf``, ``--max_lora_rank`` and ``--lora_target_modules`` in TensorRT-LLM's module names
    (:data:`pipeline.core.lora.TRTLLM_MODULES`; default: the modules the adapters target)."""
    from pipeline.core.lora import TRTLLM_MODULES, AdapterError, read_adapter_config
    from pipeline.recipe.lora import target_modules

    spec = recipe.build.lora
    if spec is None:
        return []
    try:
        mods = target_modules(spec, [] if spec.target_modules is not None else
                              [read_adapter_config(Path(a.path)).target_modules for a in spec.adapters])
    except AdapterError as e:
        raise UserError(f"build.lora.adapters: {e}") from None
    return ["--lora_plugin", "auto", "--lora_dir", *[a.path for a in spec.adapters], "--lora_ckpt_source", "hf",
            "--max_lora_rank", str(spec.max_lora_rank), "--lora_target_modules", *[TRTLLM_MODULES[m] for m in mods]]


def build_config_dict(recipe: Recipe, *, plugins: dict[str, Any], max_seq_len: int, dtype: str) -> dict[str, Any]:
    """The BuildConfig dict (docs/reference/trtllm-1.2.1-contract.md §3) incl. the full ``plugin_config``, as ``--build_config`` reads it."""
    c = contract.contract()["build_config"]
    b = recipe.build
    cfg = dict(c["fields"])
    cfg.update(max_input_len=b.max_input_len, max_seq_len=max_seq_len, max_batch_size=b.max_batch_size,
               max_beam_width=b.max_beam_width, max_num_tokens=b.max_num_tokens, opt_num_tokens=b.opt_num_tokens,
               kv_cache_type=c["kv_cache_type_names"][b.kv_cache_type], output_timing_cache=TIMING_CACHE,
               gather_context_logits=needs_context_logits(recipe.eval))
    if (enc := max_encoder_input_len(recipe)) is not None:
        cfg["max_encoder_input_len"] = enc
    plugin_config = contract.plugin_defaults()
    plugin_config.update({k: contract.plugin_config_value(k, contract.plugin_cli_value(k, v)) for k, v in plugins.items()})
    plugin_config.update(tokens_per_block=b.tokens_per_block, dtype=dtype, paged_kv_cache=b.kv_cache_type == "paged")
    if b.lora is not None:
        plugin_config["lora_plugin"] = "auto"
    cfg["plugin_config"] = plugin_config
    return cfg


def plan(recipe: Recipe, quantized: QuantizeResult) -> dict[str, Any]:
    """Everything the build needs, computed without side effects.

    Returns a dict: ``argv``, ``build_config``, ``checkpoint_config``, ``synthesized`` (bool), ``max_seq_len``,
    ``plugins`` (effective), ``adjustments``, ``world_size``. Raises UserError/StageError for unusable inputs.
    """
    source, ckpt_cfg, synthesized = _checkpoint(recipe, quantized)
    max_seq = resolve_max_seq_len(recipe, ckpt_cfg)
    gpu = recipe.gpu
    plugins, adjustments = contract.effective_plugins(
        recipe, architecture=ckpt_cfg["architecture"], sm=contract.compute_capability_sm(gpu.compute_capability if gpu else None)
    )
    if synthesized:  # no checkpoint yet (dry run): the command reads the one quantize_command.sh writes there
        source = quantized.trtllm_ckpt.resolve()
    return {
        "plugins": plugins,
        "argv": build_command(recipe, source=source, from_model_config=False, plugins=plugins, max_seq_len=max_seq),
        "build_config": build_config_dict(recipe, plugins=plugins, max_seq_len=max_seq, dtype=ckpt_cfg["dtype"]),
        "checkpoint_config": ckpt_cfg,
        "synthesized": synthesized,
        "max_seq_len": max_seq,
        "adjustments": adjustments,
        "world_size": recipe.target.world_size,
    }


def script_text(argv: list[str]) -> str:
    """``trtllm_build.sh``: bash that cds to its own directory and runs ``argv`` (shell-quoted)."""
    ckpt = argv[argv.index("--checkpoint_dir") + 1] if "--checkpoint_dir" in argv else None
    lines = ["#!/usr/bin/env bash", "# Generated by trtpipe: the exact trtllm-build command of this engine (TensorRT-LLM 1.2.1).",
             *([(f"# The chain: reads {ckpt} (written by ../quantize/quantize_command.sh); writes this directory "
                 "(config.json, rank*.engine), which ../triton_repo/tensorrt_llm/config.pbtxt names.")] if ckpt else []),
             "set -euo pipefail", 'cd "$(dirname "$0")"', shlex.join(argv)]
    return "\n".join(lines) + "\n"


# ---------------------------------------------------------------------------------------------- run
def _run_tool(tool: str, argv: list[str], cwd: Path, failed_log: Path) -> None:
    """Run ``tool argv[1:]`` in ``cwd``, streaming output to ``cwd/build.log`` and stderr; raise on failure."""
    log_path = cwd / BUILD_LOG
    tail: list[str] = []
    with open(log_path, "w") as log:
        log.write(f"$ {shlex.join([tool, *argv[1:]])}\n")
        log.flush()
        proc = subprocess.Popen([tool, *argv[1:]], cwd=cwd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, bufsize=1)
        try:
            assert proc.stdout is not None
            for line in proc.stdout:
                log.write(line)
                sys.stderr.write(f"[trtllm-build] {line}")
                tail = (tail + [line.rstrip()])[-20:]
            rc = proc.wait()
        except BaseException:
            proc.terminate()
            try:
                proc.wait(timeout=TERMINATE_GRACE_S)
            except subprocess.TimeoutExpired:
                proc.kill()
            raise
    if rc != 0:
        shutil.copyfile(log_path, failed_log)
        last = "\n".join(tail[-10:])
        raise StageError(f"trtllm-build exited with status {rc}; full log: {failed_log}\n{last}")


def _engine_config(engine_dir: Path, world_size: int) -> dict[str, Any]:
    """The built engine's ``config.json``; StageError when it or a ``rank{N}.engine`` is missing."""
    try:
        cfg = json.loads((engine_dir / "config.json").read_text())
    except (OSError, ValueError) as e:
        raise StageError(f"trtllm-build succeeded but {engine_dir / 'config.json'} is unreadable ({e})") from None
    missing = [f"rank{r}.engine" for r in range(world_size) if not (engine_dir / f"rank{r}.engine").is_file()]
    if missing:
        raise StageError(f"trtllm-build succeeded but {engine_dir} lacks {', '.join(missing)}")
    return cfg


def _write_plan(tmp: Path, p: dict[str, Any]) -> None:
    (tmp / BUILD_CONFIG).write_text(json.dumps(p["build_config"], indent=2, sort_keys=True) + "\n")
    if p["synthesized"]:
        (tmp / MODEL_CONFIG).write_text(json.dumps(p["checkpoint_config"], indent=2, sort_keys=True) + "\n")
    script = tmp / SCRIPT
    script.write_text(script_text(p["argv"]))
    script.chmod(0o755)


def run(recipe: Recipe, layout: BuildLayout, *, quantized: QuantizeResult, force: bool = False, dry_run: bool = False) -> EngineResult:
    """Build the TensorRT-LLM engine of ``recipe`` into ``layout.engine`` (files in the module docstring).

    Reuses ``out_dir`` when its cache key matches and it was built (or, for a dry run, dry-run).

    Raises:
        UserError: unusable recipe values, or a real build requested without a quantized checkpoint.
        StageError: bad checkpoint config, trtllm-build failed (log kept next to ``out_dir``) or left no engine.
        MissingToolError: ``trtllm-build`` is not on PATH; ``out_dir`` then holds the command,
            build_config.json and a manifest with status ``not_built``.
    """
    t0 = time.monotonic()
    out_dir = layout.engine
    p = plan(recipe, quantized)
    fields = consumed(recipe, "engine")  # build-time knobs only: runtime ones go to the model repository
    key = stable_hash({
        "recipe": fields, "quantize": quantized.cache_key, "checkpoint_config": p["checkpoint_config"],
        "argv": p["argv"], "build_config": p["build_config"], "pins": contract.pins(),
    })
    if not force:
        hit = EngineResult.load(out_dir, key)
        if hit and (hit.built or (dry_run and hit.status == "dry_run")):
            return hit
    tool = shutil.which(TOOL)
    if p["synthesized"] and tool and not dry_run:
        raise UserError(f"{quantized.trtllm_ckpt}: no TensorRT-LLM checkpoint; run the quantize stage "
                        "first (an engine from --model_config alone would have no weights)")
    status = "dry_run" if dry_run else ("built" if tool else "not_built")
    manifest = base_manifest(
        EngineResult.STAGE, key, engine_kind="tensorrt", serving_path=serving_path(recipe).key, status=status, consumed=fields, engine_dir=ENGINE_DIR, world_size=p["world_size"],
        tp_size=recipe.target.tp_size, pp_size=recipe.target.pp_size, max_seq_len=p["max_seq_len"],
        command=p["argv"], script=SCRIPT, build_config=BUILD_CONFIG, build_config_sha256=stable_hash(p["build_config"]),
        checkpoint={"source": "synthesized" if p["synthesized"] else "quantize", "path": p["argv"][2],
                    "config_sha256": stable_hash(p["checkpoint_config"])},
        adjustments=p["adjustments"], effective_plugins=p["plugins"],
        pins=contract.pins(), inputs={"quantize_cache_key": quantized.cache_key},
        target_gpu={"key": recipe.target.gpu, "compute_capability": recipe.gpu.compute_capability if recipe.gpu else None},
        versions=library_versions(),
    )
    for a in p["adjustments"]:
        sys.stderr.write(f"trtpipe: {a['knob']} {a['requested']} -> {a['effective']}: {a['reason']}\n")
    # the engine holds the checkpoint's weights: its rank files' size is what the build needs free
    need = sum(f.stat().st_size for f in quantized.trtllm_ckpt.glob("rank*.safetensors")) if status == "built" else None
    with atomic_dir(out_dir, need_bytes=need) as tmp:
        _write_plan(tmp, p)
        if status == "built":
            assert tool is not None
            _run_tool(tool, p["argv"], tmp, failed_log=out_dir.parent / f"{out_dir.name}.build-failed.log")
            engine_cfg = _engine_config(tmp / ENGINE_DIR, p["world_size"])
            facts = runtime_facts()
            manifest["versions"].update(tensorrt_llm=engine_cfg.get("version"), tensorrt=facts["tensorrt"])
            manifest["gpus"] = facts["gpus"]
            manifest["gpu"] = facts["gpus"][0] if facts["gpus"] else {"name": None, "compute_capability": None}
            manifest["engine_files"] = engine_file_hashes(tmp / ENGINE_DIR)
            if engine_cfg.get("version") != contract.pins()["tensorrt_llm"]:
                manifest["notes"] = [f"built with TensorRT-LLM {engine_cfg.get('version')}, trtpipe pins "
                                     f"{contract.pins()['tensorrt_llm']}"]
        manifest["timings_s"] = {"total": round(time.monotonic() - t0, 3)}
        manifest["peak_rss_bytes"] = peak_rss_bytes()
        write_manifest(tmp, manifest)
    if status == "not_built":
        raise MissingToolError(
            f"{TOOL} is not on PATH (TensorRT-LLM {contract.pins()['tensorrt_llm']} is GPU-only); the exact command is in "
            f"{out_dir / SCRIPT} and {out_dir / BUILD_CONFIG}: run it in {contract.pins()['triton_container']}"
        )
    return EngineResult.from_manifest(out_dir, manifest)
