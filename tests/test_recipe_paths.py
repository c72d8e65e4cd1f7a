"""A relative (or ``~``) ``model.source`` names the recipe's neighbour, never a same-named directory under the working
directory: ``trtpipe recipe validate``, ``trtpipe plan`` and ``trtpipe build --dry-run`` all resolve it with the one
rule (pipeline/core/recipe_paths.recipe_path), so a recipe copied elsewhere with its checkpoint plans and builds the
same from any directory (issue #45 item 2)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import yaml
from typer.testing import CliRunner

from pipeline.cli import app
from pipeline.core.recipe_paths import recipe_path

REPO = Path(__file__).resolve().parents[1]
runner = CliRunner()


def _llama(layers: int, hidden: int, max_pos: int = 4096) -> dict:
    """A config.json-only Llama checkpoint: enough for the planner's and the dry-run engine's geometry."""
    return {"architectures": ["LlamaForCausalLM"], "model_type": "llama", "num_hidden_layers": layers,
            "hidden_size": hidden, "num_attention_heads": 4, "num_key_value_heads": 2, "intermediate_size": 2 * hidden,
            "vocab_size": 256, "max_position_embeddings": max_pos, "torch_dtype": "float32", "rms_norm_eps": 1e-5,
            "rope_theta": 10000.0, "hidden_act": "silu", "tie_word_embeddings": False}


def _checkpoint(path: Path, cfg: dict) -> Path:
    path.mkdir(parents=True)
    (path / "config.json").write_text(json.dumps(cfg))
    return path


def _recipe(recipe_dir: Path, source: str, shipped: str = "smollm2_135m_cpu_fp8.yaml") -> Path:
    """A shipped recipe copied into ``recipe_dir`` with ``model.source: source``."""
    data = yaml.safe_load((REPO / "recipes" / shipped).read_text())
    data["model"]["source"] = source
    recipe_dir.mkdir(parents=True, exist_ok=True)
    path = recipe_dir / "copied.yaml"
    path.write_text(yaml.safe_dump(data, sort_keys=False))
    return path


def _plan_json(recipe: Path, *extra: str) -> dict:
    res = runner.invoke(app, ["plan", str(recipe), "--json", *extra])
    assert res.exit_code == 0, res.output
    return json.loads(res.stdout)


def _dry_build(recipe: Path, out: Path) -> dict:
    res = runner.invoke(app, ["build", str(recipe), "--dry-run", "--out", str(out)])
    assert res.exit_code == 0, res.output
    return json.loads((out / "engine" / "engine_config.json").read_text())


@pytest.mark.parametrize("spelling", ["models/tiny", "~/models/tiny"])
def test_validate_plan_and_dry_build_read_the_recipes_neighbour_not_the_working_directorys(spelling, tmp_path, monkeypatch):
    home, recipes, work = tmp_path / "home", tmp_path / "recipes", tmp_path / "work"
    monkeypatch.setenv("HOME", str(home))
    base = home if spelling.startswith("~") else recipes
    real = _checkpoint(base / "models" / "tiny", _llama(layers=2, hidden=64))
    # decoys: the same spelling under the working directory (a literal `~` folder too), a valid but different model
    _checkpoint(work / "models" / "tiny", _llama(layers=3, hidden=96))
    _checkpoint(work / "~" / "models" / "tiny", _llama(layers=3, hidden=96))
    _checkpoint(recipes / "~" / "models" / "tiny", _llama(layers=3, hidden=96))
    recipe = _recipe(recipes, spelling)
    monkeypatch.chdir(work)
    assert recipe_path(spelling, recipes).resolve() == real.resolve()

    res = runner.invoke(app, ["recipe", "validate", str(recipe)])
    assert res.exit_code == 0, res.output

    geo = _plan_json(recipe)["geometry"]
    assert (geo["num_hidden_layers"], geo["hidden_size"]) == (2, 64)

    cfg = _dry_build(recipe, tmp_path / "build")
    # the CPU engine's float32 K+V bytes per token: 2 (K, V) × layers × KV heads × head_dim (hidden / heads) × 4 B
    assert cfg["kv_cache"]["bytes_per_token"] == 2 * 2 * 2 * (64 // 4) * 4  # the decoy: 2 × 3 × 2 × 24 × 4
    manifest = json.loads((tmp_path / "build" / "quantize" / "manifest.json").read_text())
    assert manifest["source"] == {"spelling": spelling, "hf_dir": str(real.resolve())}
    script = (tmp_path / "build" / "quantize" / "quantize_command.sh").read_text()
    assert str(real.resolve()) in script and str(work) not in script and "/~/" not in script


def test_the_recipes_rules_check_the_neighbour_not_a_decoy_that_breaks_them(tmp_path, monkeypatch):
    """The recipe's own rules (build.max_seq_len against the model's max_position_embeddings) read the neighbour's
    config.json: a decoy under the working directory with a 128-token limit does not refuse the recipe."""
    recipes, work = tmp_path / "recipes", tmp_path / "work"
    _checkpoint(recipes / "models" / "tiny", _llama(layers=2, hidden=64))
    _checkpoint(work / "models" / "tiny", _llama(layers=2, hidden=64, max_pos=128))
    recipe = _recipe(recipes, "models/tiny")
    monkeypatch.chdir(work)
    for args in (["recipe", "validate", str(recipe)], ["plan", str(recipe)]):
        res = runner.invoke(app, args)
        assert res.exit_code == 0, res.output
    # and the decoy's limit is a rule that holds when the recipe names it
    _checkpoint(recipes / "short", _llama(layers=2, hidden=64, max_pos=128))
    res = runner.invoke(app, ["recipe", "validate", str(_recipe(recipes, "short"))])
    assert res.exit_code == 2 and "max_position_embeddings" in res.output and "128" in res.output, res.output


def _qwen2_vl(depth: int) -> dict:
    """A config.json-only Qwen2-VL checkpoint (the tiny one's geometry, pipeline/data/models.yaml
    ``embedded:tiny-qwen2-vl``) whose vision tower has ``depth`` blocks."""
    text = {"architectures": ["Qwen2VLForConditionalGeneration"], "model_type": "qwen2_vl", "num_hidden_layers": 30,
            "hidden_size": 576, "num_attention_heads": 9, "num_key_value_heads": 3, "head_dim": 64,
            "intermediate_size": 1536, "vocab_size": 49156, "max_position_embeddings": 8192, "torch_dtype": "float32",
            "rope_theta": 100000.0, "rope_scaling": {"type": "mrope", "mrope_section": [16, 8, 8]}}
    vision = {"depth": depth, "embed_dim": 32, "hidden_size": 576, "num_heads": 4, "mlp_ratio": 2, "in_channels": 3,
              "patch_size": 14, "spatial_merge_size": 2, "temporal_patch_size": 2, "hidden_act": "quick_gelu"}
    return {"architectures": ["Qwen2VLForConditionalGeneration"], "model_type": "qwen2_vl", "text_config": text,
            "vision_config": vision}


def test_the_plans_vision_tower_is_the_recipes_neighbours(tmp_path, monkeypatch):
    """A Qwen2-VL recipe with a relative model.source planned on a GPU from another directory counts the vision tower
    of the recipe's neighbour (pipeline/plan/vision_tokens.py), as when the recipe names it by absolute path."""
    recipes, work = tmp_path / "recipes", tmp_path / "work"
    real = _checkpoint(recipes / "models" / "vl", _qwen2_vl(depth=2))
    decoy = _checkpoint(work / "models" / "vl", _qwen2_vl(depth=6))
    recipe = _recipe(recipes, "models/vl", shipped="tiny_qwen2_vl_cpu_llmapi.yaml")
    monkeypatch.chdir(work)

    def tower(*extra: str) -> int:
        return _plan_json(recipe, "--gpu", "h200", *extra)["vision_tokens"]["tower_params"]

    named = tower("--set", f"model.source={real}")
    assert named != tower("--set", f"model.source={decoy}")  # the two towers differ: the check below can tell them apart
    assert tower() == named


def test_a_pytorch_dry_build_takes_max_seq_len_from_the_recipes_neighbour(tmp_path, monkeypatch):
    """``build.max_seq_len`` unset: the LLM-API engine's dry run reads max_position_embeddings from the checkpoint the
    quantize stage resolved against the recipe's directory (no hf_ckpt yet), not from the working directory's."""
    recipes, work = tmp_path / "recipes", tmp_path / "work"
    _checkpoint(recipes / "models" / "tiny", _llama(layers=2, hidden=64, max_pos=8192))
    _checkpoint(work / "models" / "tiny", _llama(layers=2, hidden=64, max_pos=16384))
    recipe = _recipe(recipes, "models/tiny", shipped="llama31_8b_h200_fp8_pytorch.yaml")
    data = yaml.safe_load(recipe.read_text())
    del data["build"]["max_seq_len"]
    recipe.write_text(yaml.safe_dump(data, sort_keys=False))
    monkeypatch.chdir(work)
    res = runner.invoke(app, ["build", str(recipe), "--dry-run", "--out", str(tmp_path / "build")])
    assert res.exit_code == 0, res.output
    kwargs = yaml.safe_load((tmp_path / "build" / "engine" / "llm_api_config.yaml").read_text())
    assert kwargs["max_seq_len"] == 8192
