"""Recipe writing (#44 item 8): defaults follow the engine path, local paths are checked where the recipe is
validated, every invalid field is shown, and a bad ``--set`` is blamed on the flag, not on the file."""

from __future__ import annotations

import re
from pathlib import Path

import pytest
import yaml
from typer.testing import CliRunner

from pipeline.cli import app
from pipeline.core.errors import RecipeError
from pipeline.recipe import load_recipe

REPO = Path(__file__).resolve().parents[1]
GPU_PYTORCH = REPO / "recipes/llama31_8b_h200_fp8_pytorch.yaml"
CPU_LLMAPI = REPO / "recipes/smollm2_135m_cpu_llmapi.yaml"
WIDE = {"COLUMNS": "400"}


def _write(tmp_path: Path, base: Path, edit) -> Path:
    data = yaml.safe_load(base.read_text())
    edit(data)
    out = tmp_path / base.name
    out.write_text(yaml.safe_dump(data, sort_keys=False))
    return out


@pytest.mark.parametrize("base,frontend", [(GPU_PYTORCH, "triton"), (GPU_PYTORCH, "trtllm-serve"),
                                           (CPU_LLMAPI, "triton"), (CPU_LLMAPI, "trtllm-serve")])
def test_a_pytorch_recipe_without_bench_model_benchmarks_its_only_model(tmp_path, base, frontend):
    def edit(d):
        d.get("bench", {}).pop("model", None)
        d.setdefault("serving", {})["frontend"] = frontend

    r = load_recipe(_write(tmp_path, base, edit))
    assert r.bench.model == "tensorrt_llm"  # the LLM-API repository's only model (recipe/schema.py's own rule)


def test_an_explicit_wrong_bench_model_on_pytorch_is_still_refused(tmp_path):
    f = _write(tmp_path, GPU_PYTORCH, lambda d: d["bench"].__setitem__("model", "ensemble"))
    with pytest.raises(RecipeError, match=r"bench\.model: 'ensemble' does not exist"):
        load_recipe(f)


def test_the_tensorrt_default_is_unchanged(tmp_path):
    f = _write(tmp_path, REPO / "recipes/llama31_8b_h200_fp8.yaml", lambda d: d.pop("bench", None))
    assert load_recipe(f).bench.model == "ensemble"


def _validate(*args: str):
    return CliRunner().invoke(app, ["recipe", "validate", *args], env=WIDE)


def test_validate_refuses_a_missing_local_model_source(tmp_path):
    f = _write(tmp_path, GPU_PYTORCH, lambda d: d["model"].__setitem__("source", "./checkpoints/llama-8b"))
    res = _validate(str(f))
    assert res.exit_code == 2, res.output
    line = res.output.strip()
    assert len(line.splitlines()) == 1 and re.match(rf"error: {re.escape(str(f))}:\d+ model\.source: ", line), line
    assert str(tmp_path / "checkpoints/llama-8b") in line  # resolved against the recipe's directory
    # the same relative path next to the recipe is accepted once it is a HF checkpoint directory
    (tmp_path / "checkpoints/llama-8b").mkdir(parents=True)
    assert _validate(str(f)).exit_code == 2  # a directory without config.json is not a checkpoint
    (tmp_path / "checkpoints/llama-8b/config.json").write_text("{}")
    res = _validate(str(f))
    assert res.exit_code == 0, res.output


def test_validate_refuses_a_missing_gguf_and_keeps_hub_ids(tmp_path):
    f = _write(tmp_path, GPU_PYTORCH, lambda d: d["model"].__setitem__("source", "/nonexistent/model.gguf"))
    assert _validate(str(f)).exit_code == 2
    assert _validate(str(GPU_PYTORCH)).exit_code == 0  # meta-llama/… is a hub id: not a local path


def test_validate_refuses_a_missing_calibration_file_and_accepts_it_once_there(tmp_path):
    def edit(d):
        d["quantization"]["calibration"]["dataset"] = "data/calib.jsonl"

    f = _write(tmp_path, CPU_LLMAPI, edit)
    res = _validate(str(f))
    assert res.exit_code == 2 and "quantization.calibration.dataset" in res.output, res.output
    assert str(tmp_path / "data/calib.jsonl") in res.output
    (tmp_path / "data").mkdir()
    (tmp_path / "data/calib.jsonl").write_text('{"text": "hello"}\n')
    res = _validate(str(f))
    assert res.exit_code == 0, res.output


def test_every_invalid_field_is_shown(tmp_path):
    def edit(d):
        d["quantization"]["qformat"] = "fp9"
        d["build"]["max_batch_size"] = "many"
        d["serving"]["no_such_key"] = 1

    f = _write(tmp_path, CPU_LLMAPI, edit)
    with pytest.raises(RecipeError) as e:
        load_recipe(f)
    msg = str(e.value)
    assert "more)" not in msg and "\n" not in msg
    for field in ("quantization.qformat", "build.max_batch_size", "serving.no_such_key"):
        assert re.search(rf"{re.escape(str(f))}:\d+ {re.escape(field)}: ", msg), (field, msg)


def test_a_bad_set_is_blamed_on_the_flag_not_the_file(tmp_path):
    with pytest.raises(RecipeError) as e:
        load_recipe(CPU_LLMAPI, ["build.max_batch_size=bad"])
    msg = str(e.value)
    assert msg.startswith(f"{CPU_LLMAPI}: --set build.max_batch_size=bad build.max_batch_size: "), msg
    lines = [i + 1 for i, ln in enumerate(CPU_LLMAPI.read_text().splitlines()) if "max_batch_size" in ln]
    assert not any(f":{n} " in msg for n in lines), msg  # no line of the file: the file did not say 'bad'
    # a field the file got wrong is still blamed on its line
    f = _write(tmp_path, CPU_LLMAPI, lambda d: d["quantization"].__setitem__("qformat", "fp9"))
    with pytest.raises(RecipeError, match=rf"^{re.escape(str(f))}:\d+ quantization\.qformat: "):
        load_recipe(f, ["build.max_batch_size=16"])


# ------------------------------------------------------------------ the recipe reference (#44 item 10)
def _reference_rows() -> list[list[str]]:
    from pipeline.recipe.reference import recipe_reference_markdown

    rows = []
    for ln in recipe_reference_markdown().splitlines():
        if ln.startswith("| `"):
            rows.append([c.strip() for c in re.split(r"(?<!\\)\|", ln)[1:-1]])
    return rows


def test_reference_types_are_yaml_types_not_python_internals():
    rows = _reference_rows()
    assert len(rows) > 100
    for key, kind, _default, _desc in rows:
        assert not re.search(r"typing\.|FieldInfo|pipeline\.|<class|annotation=", kind), (key, kind)
    kinds = {r[0]: r[1] for r in rows}
    assert kinds["`bench.concurrency`"].startswith("list[int ≥ 1")  # the item's bound, as the schema says
    assert "≥ 1" in kinds["`build.max_batch_size`"]


def test_reference_has_a_field_table_per_speculative_decoding_type():
    from pipeline.recipe.reference import recipe_reference_markdown
    from pipeline.recipe.speculative import SpeculativeSpec

    text = recipe_reference_markdown()
    import typing

    variants = typing.get_args(typing.get_args(SpeculativeSpec)[0])
    for model in variants:
        tag = typing.get_args(model.model_fields["decoding_type"].annotation)[0]
        assert f"## `build.pytorch.speculative_config (decoding_type: {tag})`" in text, tag
        table = text.split(f"(decoding_type: {tag})`")[1].split("\n## ")[0]
        for field in model.model_fields:
            assert f"| `build.pytorch.speculative_config.{field}` |" in table, (tag, field)


def test_reference_says_trtllm_serve_runs_on_the_cpu_target_too():
    rows = {r[0]: r for r in _reference_rows()}
    desc = rows["`serving.frontend`"][3]
    assert "GPU target only" not in desc and "cpu" in desc.lower()
    # and it does: a CPU recipe with trtllm-serve validates (the stand-in serves it: tests/test_trtllm_serve_cpu.py)
    assert load_recipe(CPU_LLMAPI, ["serving.frontend=trtllm-serve"]).serving.frontend == "trtllm-serve"


# ------------------------------------------------------------------ an ambiguous GPU alias is said (#44, misc)
def test_an_ambiguous_gpu_alias_is_named_in_one_line(tmp_path):
    from pipeline.core.hardware import alias_note, catalog

    res = _validate(str(REPO / "recipes/llama33_70b_h100_fp8_tp2.yaml"), "--set", "target.gpu=H100")
    assert res.exit_code == 0, res.output
    notes = [ln for ln in res.output.splitlines() if ln.startswith("note:")]
    assert len(notes) == 1 and "h100_sxm" in notes[0] and "h100_pcie" in notes[0], res.output
    assert alias_note("h100_sxm") is None and alias_note("h200-sxm") is None  # a key; an alias of the only h200
    assert {"h100_sxm", "h100_pcie"} <= set(catalog())
