"""``trtpipe eval``'s options are declared on the fields they set (issue #45 item 2, as ``trtpipe bench``'s:
tests/test_bench_options.py): each flag is one field with its :class:`~pipeline.recipe.bench.Flag`, the command's
flags, value types and help are those of the hand-written command they replace, and a value not given is the field's
(the recipe's ``eval`` section, else :class:`~pipeline.recipe.eval.EvalSpec`'s default). No server, no build."""

from __future__ import annotations

import dataclasses
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from pipeline.core.errors import UserError
from pipeline.eval import options
from pipeline.eval.options import EvalRun
from pipeline.eval.stage import EvalTarget
from pipeline.recipe import load_recipe
from pipeline.recipe.eval import EvalSpec

REPO = Path(__file__).resolve().parents[1]
CPU_RECIPE = REPO / "recipes" / "smollm2_135m_cpu_fp8.yaml"

#: every flag of the hand-written command (before #45) and its value type as --help showed it
OLD_FLAGS = {
    "--baseline": "<path>", "--baseline-recipe": "<path>", "--url": "<str>", "--task": "<str>", "--n": "<int>",
    "--rule": "<str>", "--reference": "<str>", "--max-output-tokens": "<int>", "--concurrency": "<int>",
    "--seed": "<int>", "--kld-max": "<float>", "--same-top1-min": "<float>", "--out": "<path>",
}


def _eval_command():
    import typer.main

    from pipeline.cli import app

    return typer.main.get_command(app).commands["eval"]  # type: ignore[attr-defined]


def _options(**given):
    """The command's options by field name as typer passes them: every declared one, ``None`` unless given."""
    return {name: None for name, _, _ in options.all_declared()} | given


def _fake_build(root: Path) -> Path:
    (root / "triton_repo" / "ensemble").mkdir(parents=True)
    (root / "triton_repo" / "ensemble" / "config.pbtxt").write_text('name: "ensemble"\n')
    shutil.copy(CPU_RECIPE, root / "recipe.yaml")
    return root


def test_the_command_keeps_every_flag_of_the_hand_written_one():
    import re

    trtpipe = str(Path(sys.executable).parent / "trtpipe")
    out = subprocess.run([trtpipe, "eval", "--help"], check=False, capture_output=True, text=True, timeout=60,
                         env={"COLUMNS": "200", "PATH": str(Path(sys.executable).parent)}).stdout
    shown = dict(re.findall(r"│ (--[a-z0-9-]+) +(<[^>]+>)", out))
    shown.pop("--help", None)
    assert shown == OLD_FLAGS
    assert "[BUILD_DIR | RECIPE]" in out


def test_every_flag_is_declared_on_a_field_with_its_help():
    """The command's options are exactly the declared ones: name, help and "not given" default from the field's Flag."""
    params = {p.name: p for p in _eval_command().params if p.name != "target"}
    decl = {name: flag for name, flag, _ in options.all_declared()}
    assert set(params) == set(decl) and {f.name for f in decl.values()} == set(OLD_FLAGS)
    for name, flag in decl.items():
        assert params[name].opts == [flag.name] and params[name].help == flag.help and params[name].default is None
    # each owner declares what it sets: the gate's knobs on the recipe section, --url on the candidate target
    assert {f.name for _, f, _ in options.declared(EvalTarget)} == {"--url"}
    assert {n for n, _, _ in options.declared(EvalSpec)} <= set(EvalSpec.model_fields)
    assert {n for n, _, _ in options.declared(EvalRun)} == {f.name for f in dataclasses.fields(EvalRun)}


def test_a_flag_not_given_is_the_fields_value_and_a_given_one_overrides_it(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    build = _fake_build(tmp_path / "b")
    recipe_eval = load_recipe(build / "recipe.yaml").eval
    r = options.resolve(build, _options())
    assert r.spec == recipe_eval and r.run == EvalRun() and r.candidate.url is None and r.baseline is None
    r = options.resolve(build, _options(n=5, rule="mlperf", kld_max=0.5, url="h:1", reference="llama3.1-8b",
                                        out=tmp_path / "o"))
    assert (r.spec.n, r.spec.rule, r.spec.kld_max) == (5, "mlperf", 0.5)
    assert r.spec.seed == recipe_eval.seed and r.spec.concurrency == recipe_eval.concurrency
    assert r.candidate.url == "h:1" and r.run.reference == "llama3.1-8b" and r.run.out == tmp_path / "o"
    # a build without a recipe starts from EvalSpec's own defaults
    (build / "recipe.yaml").unlink()
    other = _fake_build(tmp_path / "other")
    r = options.resolve(build, _options(baseline=other))
    assert r.spec == EvalSpec() and r.baseline is not None and r.baseline.layout.root == other


@pytest.mark.parametrize("given, message", [
    ({"baseline": Path("a"), "baseline_recipe": Path("b.yaml")}, "--baseline and --baseline-recipe exclude each other"),
    ({"reference": "gpt-5"}, "--reference 'gpt-5': known references are llama3.1-8b"),
    ({"n": 0}, "--n: "),
    ({"concurrency": 0}, "--concurrency: "),
    ({"same_top1_min": 200.0}, "--same-top1-min: "),
])
def test_a_bad_option_is_named_by_its_flag(tmp_path, monkeypatch, given, message):
    monkeypatch.chdir(tmp_path)
    build = _fake_build(tmp_path / "b")
    with pytest.raises(UserError) as e:
        options.resolve(build, _options(**given))
    assert str(e.value).startswith(message)
