"""Each stage's cache key hashes exactly what it consumes (pipeline/recipe/consumers.py).

A fake ``trtllm-build`` (tests/fakes, its rules from the TensorRT-LLM contract table) counts its invocations:
changing a runtime-only knob (KV cache, scheduler, chunked context, serving) must rebuild only the model
repository; changing a build knob must rebuild the engine.
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

import pytest

from pipeline.core.layout import BuildLayout
from pipeline.engine import tensorrt as trt
from pipeline.quantize.result import QuantizeResult
from pipeline.recipe import load_recipe
from pipeline.recipe.consumers import consumed, flatten, stage_of
from pipeline.triton_repo import stage as triton_repo
from pipeline.trtllm import contract

REPO = Path(__file__).resolve().parents[1]
FAKES = REPO / "tests" / "fakes"
RECIPE = REPO / "recipes" / "llama31_8b_h200_fp8.yaml"

#: one changed value per runtime-only field of the recipe (a new runtime field must be added here)
RUNTIME_OVERRIDES = {
    "build.enable_chunked_prefill": "false",
    "build.kv_cache_config.enable_block_reuse": "false",
    "build.kv_cache_config.free_gpu_memory_fraction": "0.5",
    "build.kv_cache_config.host_cache_size": "1073741824",
    "build.kv_cache_config.max_attention_window": "4096",
    "build.kv_cache_config.max_tokens": "65536",
    "build.scheduler_config.capacity_scheduler_policy": "MAX_UTILIZATION",
    "build.scheduler_config.context_chunking_policy": "FIRST_COME_FIRST_SERVED",
    "serving.accumulate_tokens": "false",
    "serving.add_special_tokens": "false",
    "serving.bls_instance_count": "2",
    "serving.cancellation_check_period_ms": "50",
    "serving.exclude_input_in_output": "false",
    "serving.max_queue_delay_microseconds": "100",
    "serving.max_queue_size": "64",
    "serving.postprocessing_instance_count": "1",
    "serving.preprocessing_instance_count": "2",
    "serving.skip_special_tokens": "false",
    "serving.stats_check_period_ms": "50",
    "serving.triton_max_batch_size": "64",
}
#: fields with a single allowed value or changed elsewhere (no other value to try)
RUNTIME_FIXED = {"serving.batching_strategy", "serving.decoupled_mode",
                 # a TensorRT recipe must keep this at its default (the serving-path table refuses trtllm-serve)
                 "serving.frontend",
                 # MoE: refused on a TensorRT recipe and on a dense model (pipeline/recipe/moe.py); the PyTorch
                 # backend's knobs (build.pytorch.*) are not fields of a TensorRT build at all (TensorrtBuild)
                 "target.ep_size",
                 # needs the model's real tokenizer (the xgrammar tokenizer-info file the stage writes), which the
                 # placeholder checkpoint here has not: the CPU default exercises it (tests/test_guided.py)
                 "build.guided_decoding_backend"}
#: one change (one or more overrides) per build-time field of a TensorRT engine recipe
BUILD_OVERRIDES = {
    "build.max_batch_size": ["build.max_batch_size=512"],
    "build.max_input_len": ["build.max_input_len=2048"],
    "build.max_seq_len": ["build.max_seq_len=6144"],
    "build.max_num_tokens": ["build.max_num_tokens=4096"],
    "build.opt_num_tokens": ["build.opt_num_tokens=1024", "build.plugins.multiple_profiles=false"],
    "build.max_beam_width": ["build.max_beam_width=2"],
    "build.tokens_per_block": ["build.tokens_per_block=64"],
    "build.plugins.context_fmha": ["build.plugins.context_fmha=false", "build.plugins.use_paged_context_fmha=false",
                                   "build.plugins.use_fp8_context_fmha=false", "build.enable_chunked_prefill=false",
                                   "build.kv_cache_config.enable_block_reuse=false"],
    "build.plugins.gemm_plugin": ["build.plugins.gemm_plugin=auto"],
    "build.plugins.gpt_attention_plugin": ["build.plugins.gpt_attention_plugin=float16"],
    "build.plugins.multiple_profiles": ["build.plugins.multiple_profiles=false"],
    "build.plugins.norm_quant_fusion": ["build.plugins.norm_quant_fusion=true"],
    "build.plugins.reduce_fusion": ["build.plugins.reduce_fusion=true"],
    "build.plugins.remove_input_padding": ["build.plugins.remove_input_padding=false"],
    "build.plugins.use_fp8_context_fmha": ["build.plugins.use_fp8_context_fmha=false"],
    "build.plugins.use_fused_mlp": ["build.plugins.use_fused_mlp=false"],
    "build.plugins.use_paged_context_fmha": ["build.plugins.use_paged_context_fmha=false", "build.enable_chunked_prefill=false",
                                             "build.kv_cache_config.enable_block_reuse=false"],
    "target.gpu": ["target.gpu=h100_sxm"],
}
#: build-time fields with no other value to try on this recipe: the engine kind (another builder), the only KV
#: cache type that supports in-flight batching, workers (needs tp × pp > 1, another quantized checkpoint), LoRA
#: (needs real adapter directories matching the model: tests/test_lora.py builds with peft adapters)
BUILD_FIXED = {"build.engine", "build.kv_cache_type", "build.workers", "build.lora",
               "target.mig"}  # a MIG slice of a GPU: the fake trtllm-build path has none to vary (tests/test_mig.py)


@pytest.fixture
def counted(tmp_path, monkeypatch):
    """PATH with a trtllm-build that appends a line to a file per invocation, then runs the fake."""
    bin_dir, log = tmp_path / "bin", tmp_path / "invocations"
    bin_dir.mkdir()
    (bin_dir / "trtllm-build").write_text(f'#!/bin/sh\necho "$@" >> {log}\nexec {sys.executable} {FAKES / "fake_trtllm_build"} "$@"\n')
    (bin_dir / "trtllm-build").chmod(0o755)
    (bin_dir / "nvidia-smi").symlink_to(FAKES / "fake_nvidia_smi")
    monkeypatch.setenv("PATH", os.pathsep.join([str(bin_dir), str(Path(sys.executable).parent), "/usr/bin", "/bin"]))
    monkeypatch.setenv("FAKE_GPUS", "NVIDIA H200:9.0")
    return lambda: len(log.read_text().splitlines()) if log.exists() else 0


def _quantized(root: Path, recipe) -> QuantizeResult:
    from pipeline.core.geometry import known_geometry

    layout = BuildLayout(root)
    layout.trtllm_ckpt.mkdir(parents=True)
    cfg = contract.synthesize_checkpoint_config(recipe, known_geometry(recipe.model.source))
    (layout.trtllm_ckpt / "config.json").write_text(json.dumps(cfg))
    (layout.trtllm_ckpt / "rank0.safetensors").write_bytes(b"placeholder weights")
    layout.hf_ckpt.mkdir(parents=True)
    for name in ("tokenizer.json", "tokenizer_config.json"):
        (layout.hf_ckpt / name).write_text("{}")
    return QuantizeResult(layout.quantize, {"stage": "quantize", "cache_key": "q", "status": "built"})


def _build(recipe, layout: BuildLayout, q: QuantizeResult):
    engine = trt.run(recipe, layout, quantized=q)
    repo = triton_repo.run(recipe, layout, quantized=q, engine=engine)
    return engine, repo


def test_every_runtime_and_build_field_of_the_recipe_is_exercised():
    recipe = load_recipe(RECIPE)
    assert set(consumed(recipe, "runtime")) == set(RUNTIME_OVERRIDES) | RUNTIME_FIXED
    assert set(consumed(recipe, "engine")) == set(BUILD_OVERRIDES) | BUILD_FIXED


def test_every_recipe_field_is_classified():
    paths = sorted((REPO / "recipes").glob("*.yaml"))
    assert len(paths) >= 13  # the shipped recipes, the speculative / MoE / TP / NVFP4 ones included
    for path in paths:
        for field in flatten(load_recipe(path).model_dump(mode="json")):
            stage_of(field)  # raises KeyError for an unclassified field


def test_runtime_knobs_rebuild_only_the_repository(tmp_path, counted):
    base = load_recipe(RECIPE)
    layout = BuildLayout(tmp_path / "b")
    q = _quantized(layout.root, base)
    engine, repo = _build(base, layout, q)
    assert counted() == 1 and engine.built
    for field, value in RUNTIME_OVERRIDES.items():
        recipe = load_recipe(RECIPE, [f"{field}={value}"])
        engine2, repo2 = _build(recipe, layout, q)
        assert engine2.cached and engine2.cache_key == engine.cache_key, field
        assert not repo2.cached, field
        _build(base, layout, q)  # back to the base repository
    assert counted() == 1  # trtllm-build ran once in all


@pytest.mark.parametrize("field,overrides", sorted(BUILD_OVERRIDES.items()))
def test_build_knobs_rebuild_the_engine(tmp_path, counted, field: str, overrides: list[str]):
    base = load_recipe(RECIPE)
    layout = BuildLayout(tmp_path / "b")
    q = _quantized(layout.root, base)
    _build(base, layout, q)
    assert stage_of(field) == "engine"
    engine, repo = _build(load_recipe(RECIPE, overrides), layout, q)
    assert not engine.cached and not repo.cached and counted() == 2


def test_cpu_engine_settings_are_not_fields_of_a_tensorrt_build():
    """``build.cpu`` belongs to the CPU engine's build type (and PyTorch's on a CPU target): on a TensorRT recipe it is
    refused by type, one line naming the field, so it can neither rebuild nor silently ride along."""
    from pipeline.core.errors import RecipeError

    with pytest.raises(RecipeError, match=r"build\.cpu: .*build\.engine is 'tensorrt'") as e:
        load_recipe(RECIPE, ["build.cpu.num_threads=2"])
    assert "\n" not in str(e.value)


def test_build_says_which_fields_changed(tmp_path):
    from pipeline.assemble.stage import run

    r = load_recipe(RECIPE)
    run(r, tmp_path / "b", recipe_dir=RECIPE.parent, dry_run=True, warn=lambda m: None)
    again = run(load_recipe(RECIPE, ["build.max_batch_size=512", "serving.max_queue_size=8"]), tmp_path / "b",
                recipe_dir=RECIPE.parent, dry_run=True, warn=lambda m: None)
    assert again.stages["quantize"].cached and again.changes["quantize"] == []
    assert again.changes["engine"] == ["build.max_batch_size 2048 → 512"]
    assert again.changes["triton_repo"] == ["serving.max_queue_size 0 → 8"]


def test_last_build_kept_restores_or_removes_the_marker(tmp_path: Path) -> None:
    """Builds inside ``last_build_kept`` (tune points, eval baselines, peer scripts) leave `trtpipe serve`'s default
    as it was: the previous marker comes back, also after an error; with no marker before, none after."""
    from pipeline.core import artifacts

    mine = tmp_path / "mine"
    mine.mkdir()
    artifacts.record_last_build(mine, tmp_path)
    with pytest.raises(RuntimeError):
        with artifacts.last_build_kept(tmp_path):
            artifacts.record_last_build(tmp_path, tmp_path)
            raise RuntimeError("build failed")
    assert artifacts.last_build(tmp_path) == mine.resolve()
    (tmp_path / artifacts.LAST_BUILD_FILE).unlink()
    with artifacts.last_build_kept(tmp_path):
        artifacts.record_last_build(mine, tmp_path)
    assert artifacts.last_build(tmp_path) is None and not list(tmp_path.glob(".last_build*"))
