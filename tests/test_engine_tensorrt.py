"""Contract tests of the TensorRT-LLM engine path (``build.engine: tensorrt``) without a GPU.

The generated ``trtllm-build`` command is run through ``tests/fakes/fake_trtllm_build`` — a FAKE whose
argparse parser comes from the contract table (pipeline/data/trtllm_1.2.1_contract.yaml) and which applies
the real tool's checks and silent adjustments — for every shipped GPU recipe.
"""

from __future__ import annotations

import json
import os
import shlex
import subprocess
import sys
from pathlib import Path

import pytest

from pipeline.core.artifacts import read_manifest, sha256_file
from pipeline.core.errors import MissingToolError, StageError, UserError
from pipeline.core.layout import BuildLayout
from pipeline.engine import tensorrt as trt
from pipeline.quantize.result import QuantizeResult
from pipeline.recipe import load_recipe
from pipeline.trtllm import contract, runtime

REPO = Path(__file__).resolve().parents[1]
FAKES = REPO / "tests" / "fakes"
# vision recipes: the fake trtllm-build knows Llama/Mistral checkpoints only (no MLLaMAForCausalLM); their command is
# checked in tests/test_vision_stage.py
GPU_RECIPES = [p for p in sorted((REPO / "recipes").glob("*.yaml"))
               if load_recipe(p).build.engine == "tensorrt" and getattr(load_recipe(p).vision, "family", None) != "mllama"]
IDS = [p.stem for p in GPU_RECIPES]


def _path_with(bin_dir: Path) -> str:
    # the fakes' shebang is `env python3`: the venv's python (with pyyaml) must come first
    return os.pathsep.join([str(bin_dir), str(Path(sys.executable).parent), "/usr/bin", "/bin"])


@pytest.fixture
def fake_tools(tmp_path, monkeypatch):
    """PATH with the fake trtllm-build and fake nvidia-smi (one H200, SM 9.0)."""
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    (bin_dir / "trtllm-build").symlink_to(FAKES / "fake_trtllm_build")
    (bin_dir / "nvidia-smi").symlink_to(FAKES / "fake_nvidia_smi")
    monkeypatch.setenv("PATH", _path_with(bin_dir))
    monkeypatch.setenv("FAKE_GPUS", "NVIDIA H200:9.0")
    return bin_dir


@pytest.fixture
def no_tools(tmp_path, monkeypatch):
    """PATH without trtllm-build and nvidia-smi."""
    empty = tmp_path / "empty-bin"
    empty.mkdir()
    monkeypatch.setenv("PATH", _path_with(empty))


def quantized(tmp_path: Path, recipe, *, with_checkpoint: bool) -> QuantizeResult:
    """A quantize result; with a TensorRT-LLM checkpoint (config.json + placeholder rank files) if asked."""
    qdir = tmp_path / "quantize"
    qdir.mkdir(exist_ok=True)
    if with_checkpoint:
        ckpt = qdir / "trtllm_ckpt"
        ckpt.mkdir(exist_ok=True)
        cfg = contract.synthesize_checkpoint_config(recipe, _geometry(recipe))
        (ckpt / "config.json").write_text(json.dumps(cfg))
        for r in range(recipe.target.world_size):
            (ckpt / f"rank{r}.safetensors").write_bytes(b"placeholder weights")
    return QuantizeResult(qdir, {"cache_key": "q-key", "stage": "quantize", "status": "built"})


def _geometry(recipe):
    from pipeline.core.geometry import known_geometry

    return known_geometry(recipe.model.source)


def run_fake(argv: list[str], cwd: Path, env_extra: dict[str, str] | None = None) -> subprocess.CompletedProcess:
    env = {**os.environ, **(env_extra or {})}
    return subprocess.run(argv, cwd=cwd, capture_output=True, text=True, timeout=60, env=env)


# ------------------------------------------------------------------------------------ command vs table
@pytest.mark.parametrize("path", GPU_RECIPES, ids=IDS)
def test_command_uses_only_table_flags_each_once(path, tmp_path):
    recipe = load_recipe(path)
    argv = trt.plan(recipe, quantized(tmp_path, recipe, with_checkpoint=True))["argv"]
    flags = [a for a in argv if a.startswith("--")]
    assert set(flags) <= contract.build_flag_names(), set(flags) - contract.build_flag_names()
    assert len(flags) == len(set(flags))
    must = {"--checkpoint_dir", "--output_dir", "--max_batch_size", "--max_input_len", "--max_seq_len", "--max_num_tokens",
            "--max_beam_width", "--kv_cache_type", "--tokens_per_block", "--gpt_attention_plugin", "--gemm_plugin",
            "--context_fmha", "--remove_input_padding", "--use_paged_context_fmha", "--use_fp8_context_fmha",
            "--multiple_profiles", "--use_fused_mlp", "--reduce_fusion", "--norm_quant_fusion", "--workers", "--log_level"}
    assert must <= set(flags)
    assert ("--opt_num_tokens" in flags) == (recipe.build.opt_num_tokens is not None)


# ---------------------------------------------------------------------------- full run with the fake
@pytest.mark.parametrize("path", GPU_RECIPES, ids=IDS)
def test_run_with_fake_builds_engine_matching_recipe(path, tmp_path, fake_tools):
    recipe = load_recipe(path)
    res = trt.run(recipe, BuildLayout(tmp_path), quantized=quantized(tmp_path, recipe, with_checkpoint=True))
    m = res.manifest
    assert m["status"] == "built" and m["engine_kind"] == "tensorrt"
    engine_dir = res.path / m["engine_dir"]
    cfg = json.loads((engine_dir / "config.json").read_text())
    bc, pc = cfg["build_config"], cfg["build_config"]["plugin_config"]
    b = recipe.build
    assert cfg["version"] == m["versions"]["tensorrt_llm"] == "1.2.1"
    assert (bc["max_batch_size"], bc["max_input_len"], bc["max_seq_len"], bc["max_num_tokens"], bc["max_beam_width"]) == (
        b.max_batch_size, b.max_input_len, b.max_seq_len, b.max_num_tokens, b.max_beam_width)
    assert bc["kv_cache_type"] == "PAGED" and pc["tokens_per_block"] == b.tokens_per_block
    adjusted = {a["knob"].split(".", 1)[1]: a["effective"] for a in m["adjustments"]}
    for knob, requested in b.plugins.model_dump().items():
        want = adjusted.get(knob, requested)
        got = pc[knob]
        assert got == contract.plugin_config_value(knob, contract.plugin_cli_value(knob, want)), knob
    assert cfg["pretrained_config"]["quantization"]["quant_algo"] == recipe.quantization.quant_algo
    assert cfg["pretrained_config"]["mapping"]["world_size"] == recipe.target.world_size
    # sha256 of every engine file, GPU facts, log
    assert set(m["engine_files"]) == {"config.json", *(f"rank{r}.engine" for r in range(recipe.target.world_size))}
    for rel, sha in m["engine_files"].items():
        assert sha256_file(engine_dir / rel) == sha
    assert m["gpu"] == {"name": "NVIDIA H200", "compute_capability": "9.0"}
    assert "Total time of building all engines" in (res.path / trt.BUILD_LOG).read_text()
    assert read_manifest(res.path) == json.loads(json.dumps(m, default=str))
    assert "tensorrt_llm" not in sys.modules


@pytest.mark.parametrize("path", GPU_RECIPES, ids=IDS)
def test_dry_run_script_reads_the_quantize_scripts_checkpoint(path, tmp_path, fake_tools):
    """#44 item 3: the dry-run script builds from ``--checkpoint_dir <quantize>/trtllm_ckpt`` (what
    quantize_command.sh writes), not ``--model_config`` (a config without weights); the predicted checkpoint config
    is kept in checkpoint_config.json. Once a checkpoint with that config is there, the fake builds from it."""
    recipe = load_recipe(path)
    q = quantized(tmp_path, recipe, with_checkpoint=False)
    res = trt.run(recipe, BuildLayout(tmp_path), quantized=q, dry_run=True)
    assert res.manifest["status"] == "dry_run"
    assert res.manifest["command"][1:3] == ["--checkpoint_dir", str(q.trtllm_ckpt.resolve())]
    ckpt_cfg = json.loads((res.path / trt.MODEL_CONFIG).read_text())
    assert set(ckpt_cfg["quantization"]) <= set(contract.contract()["quant_config"]["fields"])
    assert contract.checkpoint_config_problems(ckpt_cfg, recipe) == []
    q.trtllm_ckpt.mkdir(parents=True)  # what quantize_command.sh leaves there (config; the fake reads no weights)
    (q.trtllm_ckpt / "config.json").write_text(json.dumps(ckpt_cfg))
    for r in range(recipe.target.world_size):
        (q.trtllm_ckpt / f"rank{r}.safetensors").write_bytes(b"placeholder weights")
    out = run_fake(["bash", str(res.path / trt.SCRIPT)], cwd=tmp_path)
    assert out.returncode == 0, out.stderr
    assert (res.path / "rank0.engine").read_bytes().startswith(b"FAKE TensorRT engine")


@pytest.mark.parametrize("path", GPU_RECIPES, ids=IDS)
def test_predicted_adjustments_agree_with_fake(path, tmp_path, fake_tools):
    """Give the fake the recipe's REQUESTED plugin values: its engine must hold our predicted effective values."""
    recipe = load_recipe(path)
    p = trt.plan(recipe, quantized(tmp_path, recipe, with_checkpoint=True))
    requested = recipe.build.plugins.model_dump()
    argv = trt.build_command(recipe, source=Path(p["argv"][2]), from_model_config=False, plugins=requested,
                             max_seq_len=p["max_seq_len"])
    out = run_fake(argv, cwd=tmp_path)
    assert out.returncode == 0, out.stderr
    pc = json.loads((tmp_path / "config.json").read_text())["build_config"]["plugin_config"]
    for knob, value in p["plugins"].items():
        if knob != "use_fused_mlp":  # commands/build.py changes it in kwargs only, not in plugin_config
            assert pc[knob] == contract.plugin_config_value(knob, contract.plugin_cli_value(knob, value)), knob


def test_build_config_json_is_accepted_by_fake(tmp_path, fake_tools):
    recipe = load_recipe(GPU_RECIPES[0])
    res = trt.run(recipe, BuildLayout(tmp_path), quantized=quantized(tmp_path, recipe, with_checkpoint=False), dry_run=True)
    bc = json.loads((res.path / trt.BUILD_CONFIG).read_text())
    assert set(contract.contract()["build_config"]["required_keys"]) <= set(bc)
    tb = contract.contract()["trtllm_build"]
    assert set(bc["plugin_config"]) == {f["name"] for f in tb["plugin_flags"]} | set(tb["plugin_json_only"])
    out = run_fake(["trtllm-build", "--model_config", trt.MODEL_CONFIG, "--build_config", trt.BUILD_CONFIG,
                    "--output_dir", "from_json"], cwd=res.path)
    assert out.returncode == 0, out.stderr
    engine_bc = json.loads((res.path / "from_json" / "config.json").read_text())["build_config"]
    assert engine_bc["max_batch_size"] == recipe.build.max_batch_size
    assert engine_bc["plugin_config"]["use_paged_context_fmha"] == bc["plugin_config"]["use_paged_context_fmha"]


# --------------------------------------------------------------------------- the fake rejects bad input
@pytest.mark.parametrize("inject, code, needle", [
    (["--max_batch_sizes", "8"], 2, "unrecognized arguments"),
    (["--context_fmha", "yes"], 2, "invalid choice"),
    (["--kv_cache_type", "pagd"], 2, "invalid choice"),
    (["--max_seq_len", "8k"], 2, "invalid int value"),
    (["--opt_num_tokens", "256"], 1, "multiple_profiles is enabled"),
])
def test_fake_rejects_bad_knobs(inject, code, needle, tmp_path, fake_tools):
    recipe = load_recipe(next(p for p in GPU_RECIPES if "h200_fp8" in p.stem))
    argv = trt.plan(recipe, quantized(tmp_path, recipe, with_checkpoint=True))["argv"]
    out = run_fake(argv + inject, cwd=tmp_path)
    assert out.returncode == code and needle in out.stderr, out.stderr


def test_fake_rejects_unknown_quant_key_and_missing_source(tmp_path, fake_tools):
    cfg = {"architecture": "LlamaForCausalLM", "dtype": "bfloat16", "hidden_size": 64, "num_hidden_layers": 2,
           "num_attention_heads": 4, "quantization": {"quant_algo": "FP8", "kv_cache_dtype": "fp8"}}
    (tmp_path / "c.json").write_text(json.dumps(cfg))
    out = run_fake(["trtllm-build", "--model_config", "c.json"], cwd=tmp_path)
    assert out.returncode == 1 and "unexpected keyword argument 'kv_cache_dtype'" in out.stderr
    out = run_fake(["trtllm-build", "--max_batch_size", "8"], cwd=tmp_path)
    assert out.returncode == 1 and "AttributeError" in out.stderr


# --------------------------------------------------------------------------------- run() behaviour
def test_missing_tool_writes_command_then_raises(tmp_path, no_tools):
    recipe = load_recipe(GPU_RECIPES[0])
    out_dir = tmp_path / "engine"
    with pytest.raises(MissingToolError, match="trtllm-build is not on PATH") as e:
        trt.run(recipe, BuildLayout(tmp_path), quantized=quantized(tmp_path, recipe, with_checkpoint=True))
    assert e.value.exit_code == 3
    assert (out_dir / trt.SCRIPT).is_file() and (out_dir / trt.BUILD_CONFIG).is_file()
    m = read_manifest(out_dir)
    assert m["status"] == "not_built" and m["command"][1] == "--checkpoint_dir"
    assert shlex.split((out_dir / trt.SCRIPT).read_text().splitlines()[-1]) == m["command"]


def test_dry_run_without_tool_returns_and_resolves_max_seq_len(tmp_path, no_tools):
    recipe = load_recipe(GPU_RECIPES[0], ["build.max_seq_len=null"])
    res = trt.run(recipe, BuildLayout(tmp_path), quantized=quantized(tmp_path, recipe, with_checkpoint=False), dry_run=True)
    argv = res.manifest["command"]
    assert argv[argv.index("--max_seq_len") + 1] == str(_geometry(recipe).max_position_embeddings)
    assert json.loads((res.path / trt.BUILD_CONFIG).read_text())["max_seq_len"] == _geometry(recipe).max_position_embeddings


def test_real_build_without_checkpoint_is_refused(tmp_path, fake_tools):
    recipe = load_recipe(GPU_RECIPES[0])
    with pytest.raises(UserError, match="no TensorRT-LLM checkpoint"):
        trt.run(recipe, BuildLayout(tmp_path), quantized=quantized(tmp_path, recipe, with_checkpoint=False))


def test_failed_build_raises_and_keeps_log(tmp_path, fake_tools, monkeypatch):
    monkeypatch.setenv("FAKE_TRTLLM_BUILD_FAIL", "1")
    recipe = load_recipe(GPU_RECIPES[0])
    with pytest.raises(StageError, match="exited with status 1"):
        trt.run(recipe, BuildLayout(tmp_path), quantized=quantized(tmp_path, recipe, with_checkpoint=True))
    assert not (tmp_path / "engine").exists()
    assert "FAKE_TRTLLM_BUILD_FAIL" in (tmp_path / "engine.build-failed.log").read_text()


def test_cache_reuse_and_force(tmp_path, fake_tools):
    recipe = load_recipe(GPU_RECIPES[0])
    q = quantized(tmp_path, recipe, with_checkpoint=True)
    first = trt.run(recipe, BuildLayout(tmp_path), quantized=q)
    again = trt.run(recipe, BuildLayout(tmp_path), quantized=q)
    assert again.cached and again.manifest["cache_key"] == first.manifest["cache_key"]
    assert not trt.run(recipe, BuildLayout(tmp_path), quantized=q, force=True).cached
    other = load_recipe(GPU_RECIPES[0], ["build.max_batch_size=64"])
    assert not trt.run(other, BuildLayout(tmp_path), quantized=q).cached


# ------------------------------------------------------------------------------ serve-time checks
def test_check_engine_compatible(tmp_path, fake_tools):
    recipe = load_recipe(GPU_RECIPES[0])
    res = trt.run(recipe, BuildLayout(tmp_path), quantized=quantized(tmp_path, recipe, with_checkpoint=True))
    m = res.manifest
    ok = {"tensorrt_llm": "1.2.1", "tensorrt": m["versions"]["tensorrt"], "gpus": [{"name": "NVIDIA H200", "compute_capability": "9.0"}]}
    assert runtime.check_engine_compatible(m, ok, stage_dir=res.path) == []
    assert any("TensorRT-LLM 1.2.1, this runtime has 1.3.0" in s for s in runtime.check_engine_compatible(m, {**ok, "tensorrt_llm": "1.3.0"}))
    assert any("TensorRT-LLM is not installed" in s for s in runtime.check_engine_compatible(m, {**ok, "tensorrt_llm": None}))
    a100 = {**ok, "gpus": [{"name": "NVIDIA A100-SXM4-80GB", "compute_capability": "8.0"}]}
    assert any("compute capability 8.0" in s for s in runtime.check_engine_compatible(m, a100))
    assert any("no NVIDIA GPU" in s for s in runtime.check_engine_compatible(m, {**ok, "gpus": []}))
    engine = res.path / "rank0.engine"
    engine.write_bytes(engine.read_bytes() + b"x")
    assert any("changed on disk" in s for s in runtime.check_engine_compatible(m, ok, stage_dir=res.path))
    engine.unlink()
    assert any("missing" in s for s in runtime.check_engine_compatible(m, ok, stage_dir=res.path))
    assert "not built" in runtime.check_engine_compatible({**m, "status": "dry_run"}, ok)[0]


def test_runtime_facts(tmp_path, monkeypatch, fake_tools):
    monkeypatch.setenv("FAKE_GPUS", "NVIDIA H100 80GB HBM3:9.0;NVIDIA H100 80GB HBM3:9.0")
    facts = runtime.runtime_facts()
    assert facts["gpus"] == [{"name": "NVIDIA H100 80GB HBM3", "compute_capability": "9.0"}] * 2
    assert facts["tensorrt_llm"] is None  # not installed on this CPU machine
    assert "tensorrt_llm" not in sys.modules


def test_runtime_facts_without_gpu(no_tools):
    assert runtime.runtime_facts()["gpus"] == []
