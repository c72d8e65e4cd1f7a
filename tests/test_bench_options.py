"""``trtpipe bench``'s options are generated from the fields that declare them (no server): each knob is one field
with its :class:`~pipeline.recipe.bench.Flag`; the command's flags and help are those of the hand-written command they
replace; a build's recipe.yaml is read once per run."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated

import pytest
from pydantic import BaseModel, Field

from pipeline.bench import options
from pipeline.bench.target import BenchTarget, build_gpus, build_recipe
from pipeline.core.errors import UserError
from pipeline.core.layout import BuildLayout
from pipeline.recipe.bench import BenchSpec, Flag

REPO = Path(__file__).resolve().parents[1]

#: every flag of the command before the options were generated (issue #33) and its value type as --help shows it
OLD_FLAGS = {
    "--url": "<str>", "--api": "<str>", "--openai-endpoint": "<str>", "--model": "<str>", "--isl": "<int range>",
    "--osl": "<int range>", "--scenario": "<list[str]>", "--recipe": "<path>", "--concurrency": "<str>",
    "--request-rate": "<str>", "--arrival": "<str>", "--num-requests": "<int range>", "--duration": "<float range>",
    "--warmup": "<int range>", "--goodput": "<list[str]>", "--timeout": "<float range>", "--tokenizer": "<path>",
    "--dataset": "<path>", "--out": "<path>", "--seed": "<int>", "--server-timestamps": "<bool>",
    "--metrics-url": "<str>", "--allow-short": "<bool>",
}


def _bench_command():
    import typer.main

    from pipeline.cli import app

    return typer.main.get_command(app).commands["bench"]  # type: ignore[attr-defined]


def test_the_command_keeps_every_flag_of_the_hand_written_one():
    import re
    import subprocess
    import sys

    trtpipe = str(Path(sys.executable).parent / "trtpipe")
    out = subprocess.run([trtpipe, "bench", "--help"], capture_output=True, text=True, timeout=60,
                         env={"COLUMNS": "250", "PATH": str(Path(sys.executable).parent)}).stdout
    shown = dict(re.findall(r"│ (--[a-z-]+) +(<[^>]+>)", out))
    assert {flag: shown.get(flag) for flag in OLD_FLAGS} == OLD_FLAGS
    params = {p.opts[0]: p for p in _bench_command().params}
    assert params["--scenario"].multiple and params["--goodput"].multiple and params["--allow-short"].is_flag
    assert params["--api"].default == "grpc" and params["--openai-endpoint"].default is None
    assert (params["--num-requests"].min, params["--duration"].min, params["--warmup"].min) == (1, 0.1, 0)


def test_every_spec_flag_is_an_option_with_its_help():
    params = {p.name: p for p in _bench_command().params}
    for name, flag, _ in options.declared(BenchSpec) + options.declared(BenchTarget):
        assert params[name].opts == [flag.name] and params[name].help == flag.help


def test_a_new_knob_is_one_field():
    class Spec(BaseModel):
        window: Annotated[list[int], Flag("--window", "Windows, e.g. 1,2.", parse=lambda v, f: [int(x) for x in v.split(",")],
                                          clears={"other": None})] = Field(default_factory=list)
        other: int | None = None

    (param,) = options.parameters(Spec)
    assert param.name == "window" and param.default is None
    assert options.flag_names(Spec) == {"window": "--window"}
    assert options.overrides(Spec, {"window": "1,2"}) == {"other": None, "window": [1, 2]}
    assert options.overrides(Spec, {"window": None}) == {}


def test_overrides_parse_clear_and_exclude():
    got = options.overrides(BenchSpec, {"concurrency": "1,8", "goodput": ["ttft:200,itl:20"], "scenarios": ["8:4"],
                                        "allow_short": False, "seed": 3})
    assert got == {"request_rate": [], "concurrency": [1, 8], "goodput": {"ttft": 200.0, "itl": 20.0},
                   "scenarios": [{"isl": 8, "osl": 4}], "seed": 3}
    with pytest.raises(UserError, match="--concurrency and --request-rate exclude each other"):
        options.overrides(BenchSpec, {"concurrency": "1", "request_rate": "2"})
    with pytest.raises(UserError, match=r"--concurrency '1,0': values must be >= 1"):
        options.overrides(BenchSpec, {"concurrency": "1,0"})


def test_the_builds_recipe_is_read_once_per_run(tmp_path, monkeypatch):
    import pipeline.recipe.load as load

    build = tmp_path / "build"
    build.mkdir()
    layout = BuildLayout(build)
    layout.recipe_file.write_text((REPO / "recipes" / "smollm2_135m_cpu_fp8.yaml").read_text())
    calls = []
    real = load.load_recipe
    monkeypatch.setattr(load, "load_recipe", lambda path: calls.append(path) or real(path))
    from pipeline.bench import stage

    spec = stage.spec_for(None, layout)  # the command's spec …
    gpus = build_gpus(layout)  # … and the run's GPU count
    assert spec == build_recipe(layout).bench and gpus == 1 and len(calls) == 1
    layout.recipe_file.write_text(layout.recipe_file.read_text() + "\n# edited\n")  # a new version is read again
    build_gpus(layout)
    assert len(calls) == 2


def test_the_target_takes_the_builds_tokenizer_unless_given(tmp_path):
    build = tmp_path / "build"
    (build / "quantize" / "hf_ckpt").mkdir(parents=True)
    (build / "quantize" / "hf_ckpt" / "tokenizer_config.json").write_text("{}")
    assert BenchTarget(layout=BuildLayout(build)).tokenizer_dir() == build / "quantize" / "hf_ckpt"
    assert BenchTarget(layout=BuildLayout(build), tokenizer=tmp_path).tokenizer_dir() == tmp_path
    assert BenchTarget().tokenizer_dir() is None
    with pytest.raises(UserError, match="--tokenizer .*: no such directory"):
        BenchTarget(tokenizer=tmp_path / "nope").tokenizer_dir()


def test_openai_endpoint_defaults_to_chat_only_when_images_are_asked(tmp_path, monkeypatch):
    """/v1/completions takes no images (pipeline.bench.images): without ``--openai-endpoint`` an image workload goes to
    chat/completions, a text one to completions (exact-ISL prompt text); an explicit choice is kept."""
    monkeypatch.chdir(tmp_path)  # no last build here
    base = {p.name: p.default for p in _bench_command().params}
    base.update(api="openai", url="http://127.0.0.1:9/v1", isl=100, osl=64)
    img = {"image_width_mean": 448.0, "image_height_mean": 448.0}
    assert options.resolve(base)[1].openai_endpoint == "completions"
    assert options.resolve({**base, **img})[1].openai_endpoint == "chat"
    assert options.resolve({**base, **img, "openai_endpoint": "completions"})[1].openai_endpoint == "completions"
