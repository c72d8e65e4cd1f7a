"""`trtpipe build --dry-run` on every GPU recipe: the fake trtllm-build accepts the command, and every
generated config.pbtxt parses into tritonclient's ModelConfig with no placeholder left."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from pipeline.assemble.stage import run as run_build
from pipeline.recipe import load_recipe
from pipeline.triton.model_config import load_model_config

REPO = Path(__file__).resolve().parents[1]
FAKES = REPO / "tests" / "fakes"
# vision recipes (issue #46) plan but do not build yet: tests/test_recipe_vision.py checks the refusal
GPU_RECIPES = [p for p in sorted((REPO / "recipes").glob("*.yaml")) if load_recipe(p).target.gpu != "cpu" and getattr(load_recipe(p).vision, "family", None) != "mllama"]


@pytest.mark.parametrize("path", GPU_RECIPES, ids=[p.stem for p in GPU_RECIPES])
def test_dry_run_build_of_every_gpu_recipe(path: Path, tmp_path: Path):
    recipe = load_recipe(path)
    warnings: list[str] = []
    result = run_build(recipe, tmp_path / "build", recipe_dir=path.parent, dry_run=True, warn=warnings.append)
    assert set(result.stages) == {"quantize", "engine", "triton_repo"}
    assert not warnings, warnings  # shipped recipes fit their GPU without planner warnings
    build = result.build_dir
    assert (build / "quantize" / "quantize_command.sh").is_file()
    engine = build / "engine"
    if recipe.build.engine == "tensorrt":
        # run the generated script with the FAKE trtllm-build first on PATH
        bin_dir = tmp_path / "bin"
        bin_dir.mkdir()
        (bin_dir / "trtllm-build").symlink_to(FAKES / "fake_trtllm_build")
        env = dict(os.environ, PATH=os.pathsep.join([str(bin_dir), str(Path(sys.executable).parent), "/usr/bin", "/bin"]))
        # the chain (#44 item 3): the script reads the checkpoint quantize_command.sh writes; stand in its config
        ckpt = build / "quantize" / "trtllm_ckpt"
        ckpt.mkdir()
        (ckpt / "config.json").write_text((engine / "checkpoint_config.json").read_text())
        for r in range(recipe.target.world_size):
            (ckpt / f"rank{r}.safetensors").write_bytes(b"placeholder weights")
        res = subprocess.run(["bash", str(engine / "trtllm_build.sh")], env=env, capture_output=True, text=True, timeout=60)
        assert res.returncode == 0, res.stderr
        built = json.loads((engine / "config.json").read_text())
        assert built["version"] == "1.2.1"
        bc = built["build_config"]
        assert bc["max_batch_size"] == recipe.build.max_batch_size
        assert bc["max_num_tokens"] == recipe.build.max_num_tokens
        assert bc["max_seq_len"] == recipe.build.max_seq_len
        assert bc["plugin_config"]["tokens_per_block"] == recipe.build.tokens_per_block
        assert sorted(p.name for p in engine.glob("rank*.engine")) == [f"rank{r}.engine" for r in range(recipe.target.world_size)]
    else:
        assert (engine / "llm_api_config.yaml").is_file()
    repo = build / "triton_repo"
    configs = sorted(repo.glob("*/config.pbtxt"))
    assert configs
    for cfg_path in configs:
        text = cfg_path.read_text()
        assert "${" not in text and "{{" not in text, cfg_path
        cfg = load_model_config(cfg_path)
        assert cfg.name == cfg_path.parent.name
    names = {p.parent.name for p in configs}
    if recipe.build.engine == "tensorrt":
        assert names == {"ensemble", "preprocessing", "tensorrt_llm", "postprocessing", "tensorrt_llm_bls"}
        trt = load_model_config(repo / "tensorrt_llm" / "config.pbtxt")
        assert trt.backend == "tensorrtllm"
        assert trt.model_transaction_policy.decoupled is recipe.serving.decoupled_mode
        params = {k: v.string_value for k, v in trt.parameters.items()}
        assert params["gpt_model_path"] == str(engine.resolve())
        assert float(params["kv_cache_free_gpu_mem_fraction"]) == recipe.build.kv_cache_config.free_gpu_memory_fraction
    else:
        assert names == {"tensorrt_llm"}


def test_dry_run_is_reused_when_unchanged_and_rebuilt_with_force(tmp_path: Path):
    path = REPO / "recipes" / "llama31_8b_h200_fp8.yaml"
    recipe = load_recipe(path)
    first = run_build(recipe, tmp_path / "b", recipe_dir=path.parent, dry_run=True)
    assert not any(r.cached for r in first.stages.values())
    again = run_build(recipe, tmp_path / "b", recipe_dir=path.parent, dry_run=True)
    assert all(r.cached for r in again.stages.values())
    changed = run_build(load_recipe(path, ["build.max_batch_size=512"]), tmp_path / "b", recipe_dir=path.parent, dry_run=True)
    assert changed.stages["quantize"].cached and not changed.stages["engine"].cached
    forced = run_build(recipe, tmp_path / "b", recipe_dir=path.parent, dry_run=True, force=True)
    assert not any(r.cached for r in forced.stages.values())


def test_build_refuses_a_recipe_that_cannot_fit(tmp_path: Path):
    from pipeline.core.errors import UserError

    path = REPO / "recipes" / "llama31_8b_h200_fp8.yaml"
    recipe = load_recipe(path, ["target.gpu=l4", "quantization.qformat=full_prec", "quantization.kv_cache_dtype=none",
                                "model.dtype=float32"])
    with pytest.raises(UserError, match="does not fit"):
        run_build(recipe, tmp_path / "b", recipe_dir=path.parent, dry_run=True)
    assert not (tmp_path / "b").exists()  # nothing written


def test_a_failing_first_build_leaves_nothing(tmp_path: Path):
    from pipeline.core.errors import UserError

    path = REPO / "recipes" / "smollm2_135m_cpu_fp8.yaml"
    recipe = load_recipe(path, ["model.source=/nonexistent/checkpoint"])
    with pytest.raises(UserError, match="/nonexistent/checkpoint"):
        run_build(recipe, tmp_path / "artifacts" / "x", recipe_dir=path.parent)
    assert list(tmp_path.iterdir()) == []
