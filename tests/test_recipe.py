"""Recipe schema: shipped recipes, one-line errors with file:line and field path, cross-field rules."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from pipeline.core.errors import RecipeError
from pipeline.recipe import Recipe, load_recipe, recipe_json_schema

REPO = Path(__file__).resolve().parents[1]
RECIPES = sorted((REPO / "recipes").glob("*.yaml"))
H200 = REPO / "recipes" / "llama31_8b_h200_fp8.yaml"
CPU = REPO / "recipes" / "smollm2_135m_cpu_fp8.yaml"


def test_the_required_recipes_are_shipped():
    names = {p.stem for p in RECIPES}
    assert {
        "llama31_8b_h200_fp8", "llama31_8b_h200_fp8_pytorch", "llama31_8b_a100_int8_sq", "mistral_7b_a100_int8_sq",
        "llama31_8b_l40s_int4_awq", "llama32_3b_rtx4090_int4_awq", "smollm2_135m_cpu_fp8", "smollm2_135m_cpu_int4_awq",
    } <= names


@pytest.mark.parametrize("path", RECIPES, ids=[p.stem for p in RECIPES])
def test_every_shipped_recipe_validates(path: Path):
    r = load_recipe(path)
    assert isinstance(r, Recipe)
    assert r.name == path.stem
    # the engine kind matches the target kind
    assert r.build.engine != ("tensorrt" if r.target.gpu == "cpu" else "cpu")  # pytorch runs on both (cpu: the LLM facade)


def write(tmp_path: Path, text: str, name: str = "r.yaml") -> Path:
    p = tmp_path / name
    p.write_text(text)
    return p


def mutate(tmp_path: Path, base: Path, old: str, new: str) -> Path:
    text = base.read_text()
    assert old in text, old
    return write(tmp_path, text.replace(old, new, 1), base.name)


def line_of(path: Path, needle: str) -> int:
    for i, line in enumerate(path.read_text().splitlines(), start=1):
        if needle in line:
            return i
    raise AssertionError(needle)


def test_bad_qformat_names_file_line_field_and_choices(tmp_path):
    p = mutate(tmp_path, H200, "qformat: fp8", "qformat: fp9")
    with pytest.raises(RecipeError) as ei:
        load_recipe(p)
    msg = str(ei.value)
    assert msg.startswith(f"{p}:{line_of(p, 'qformat: fp9')} quantization.qformat: 'fp9' is not one of fp8, int8_sq, int4_awq")
    assert "\n" not in msg


def test_unknown_key_is_rejected_with_its_path(tmp_path):
    p = mutate(tmp_path, H200, "  max_beam_width: 1", "  max_beam_widht: 1")
    with pytest.raises(RecipeError, match=rf"{p.name}:{line_of(p, 'max_beam_widht')} build.max_beam_widht: unknown key"):
        load_recipe(p)


def test_missing_required_field(tmp_path):
    p = write(tmp_path, "target: {gpu: h200}\nmodel: {dtype: auto}\n")
    with pytest.raises(RecipeError, match=r"r.yaml:2 model.source: required field is missing"):
        load_recipe(p)


def test_yaml_syntax_error_names_line(tmp_path):
    p = write(tmp_path, "model:\n  source: x\ntarget: [unclosed\n")
    with pytest.raises(RecipeError, match=r"r.yaml:\d+: not valid YAML"):
        load_recipe(p)


def test_missing_file(tmp_path):
    with pytest.raises(RecipeError, match="no such recipe file"):
        load_recipe(tmp_path / "nope.yaml")


@pytest.mark.parametrize(
    ("overrides", "field", "fragment"),
    [
        (["target.gpu=a100_80gb"], "quantization.qformat", "use int8_sq"),
        (["quantization.qformat=nvfp4"], "quantization.qformat", "needs a Blackwell GPU"),
        (["target.gpu=a100_40gb", "quantization.qformat=int8_sq"], "quantization.kv_cache_dtype", "use int8"),
        (["build.max_input_len=9000"], "build.max_input_len", "exceeds max_seq_len 8192"),
        (["target.tp_size=2"], "target.tp_size", "exceeds num_gpus 1"),
        (["target.gpu=h300"], "target.gpu", "not in the GPU catalog"),
        (["build.engine=cpu"], "build.engine", "does not run on target"),
        (["build.max_seq_len=200000"], "build.max_seq_len", "max_position_embeddings 131072"),
        (["bench.scenarios=[{isl: 5000, osl: 10}]"], "bench.scenarios.0.isl", "exceeds build.max_input_len"),
        (["build.max_num_tokens=512", "build.enable_chunked_prefill=false"], "build.max_num_tokens", "enable_chunked_prefill"),
        (["build.engine=pytorch"], "bench.model", "its only model is tensorrt_llm"),
    ],
)
def test_cross_field_rules(overrides, field, fragment):
    with pytest.raises(RecipeError) as ei:
        load_recipe(H200, overrides)
    msg = str(ei.value)
    assert f" {field}: " in msg and fragment in msg, msg
    assert msg.startswith(f"{H200}:")


def test_nvfp4_is_accepted_on_blackwell():
    r = load_recipe(H200, ["target.gpu=b200", "quantization.qformat=nvfp4"])
    assert r.quantization.quant_algo == "NVFP4"


def test_awq_block_size_must_divide_linear_input_dims():
    with pytest.raises(RecipeError, match=r"quantization.awq_block_size: 128 does not divide .*\[576\].*use 64"):
        load_recipe(CPU, ["quantization.qformat=int4_awq", "quantization.awq_block_size=128"])
    assert load_recipe(CPU, ["quantization.qformat=int4_awq", "quantization.awq_block_size=64"]).quantization.awq_block_size == 64


def test_tp_must_divide_heads():
    with pytest.raises(RecipeError, match="target.tp_size: 3 does not divide"):
        load_recipe(H200, ["target.num_gpus=8", "target.tp_size=3"])
    assert load_recipe(H200, ["target.num_gpus=8", "target.tp_size=8"]).target.world_size == 8


def test_overrides_are_validated_and_applied():
    r = load_recipe(H200, ["build.max_batch_size=64", "bench.concurrency=[1, 2]"])
    assert r.build.max_batch_size == 64 and r.bench.concurrency == [1, 2]
    with pytest.raises(RecipeError, match="expected KEY=VALUE"):
        load_recipe(H200, ["build.max_batch_size"])
    with pytest.raises(RecipeError, match="build.max_batch_size: 'many'"):
        load_recipe(H200, ["build.max_batch_size=many"])


def test_defaults_cite_tensorrt_llm_and_are_the_121_values():
    r = load_recipe(CPU)
    assert r.quantization.calibration.seed == 1234  # quantize.py --seed default
    b = type(r.build).model_fields
    assert b["max_batch_size"].default == 2048 and "2048" in b["max_batch_size"].description
    assert b["max_num_tokens"].default == 8192 and b["tokens_per_block"].default == 32


def test_schema_is_json_schema_with_every_section_and_matches_the_shipped_file():
    schema = recipe_json_schema()
    assert set(schema["properties"]) >= {"model", "target", "quantization", "build", "serving", "bench"}
    assert schema["additionalProperties"] is False
    shipped = json.loads((REPO / "recipe.schema.json").read_text())
    assert shipped == schema, "recipe.schema.json is stale: run `trtpipe recipe schema -o recipe.schema.json`"


def run_cli(*args: str, cwd: Path) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "pipeline.cli", *args], cwd=cwd, capture_output=True, text=True, timeout=120)


def test_cli_validate_bad_recipe_one_line_exit_2_nothing_written(tmp_path):
    p = mutate(tmp_path, H200, "qformat: fp8", "qformat: fp9")
    res = run_cli("recipe", "validate", str(p), cwd=tmp_path)
    assert res.returncode == 2
    assert "Traceback" not in res.stderr
    lines = [ln for ln in res.stderr.splitlines() if ln.strip()]
    assert len(lines) == 1 and "quantization.qformat: 'fp9' is not one of" in lines[0]
    res = run_cli("build", str(p), cwd=tmp_path)
    assert res.returncode == 2 and "Traceback" not in res.stderr + res.stdout
    assert not (tmp_path / "artifacts").exists()


def test_cli_validate_all_shipped(tmp_path):
    res = run_cli("recipe", "validate", *map(str, RECIPES), cwd=tmp_path)
    assert res.returncode == 0, res.stderr
    assert res.stdout.count("ok ") == len(RECIPES)


def test_cli_show_prints_resolved_recipe(tmp_path):
    res = run_cli("recipe", "show", str(CPU), "--set", "build.max_batch_size=8", cwd=tmp_path)
    assert res.returncode == 0, res.stderr
    data = yaml.safe_load(res.stdout)
    assert data["build"]["max_batch_size"] == 8
    assert data["build"]["plugins"]["context_fmha"] is True  # defaults are filled in


def test_recipe_reference_doc_is_current():
    from pipeline.recipe.reference import recipe_reference_markdown

    text = recipe_reference_markdown()
    assert "| `quantization.qformat` |" in text and "| `build.kv_cache_config.free_gpu_memory_fraction` |" in text
    assert (REPO / "docs" / "recipe-reference.md").read_text() == text, (
        "docs/recipe-reference.md is stale: run `trtpipe recipe reference -o docs/recipe-reference.md`"
    )
