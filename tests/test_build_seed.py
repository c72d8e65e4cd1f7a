"""``trtpipe build --out NEW`` of a variant reuses another build's quantize stage through hard links
(pipeline/assemble/seed.py), on the real CPU default built once per session (``cpu_build``)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from pipeline.assemble.seed import local_builds, seed_build
from pipeline.core import artifacts
from pipeline.recipe import load_recipe

TRTPIPE = str(Path(sys.executable).parent / "trtpipe")
REPO = Path(__file__).resolve().parents[1]
CPU_RECIPE = REPO / "recipes" / "smollm2_135m_cpu_fp8.yaml"


def _files(stage: Path) -> dict[str, os.stat_result]:
    return {str(p.relative_to(stage)): p.stat() for p in stage.rglob("*") if p.is_file()}


def test_a_variant_build_hard_links_the_quantize_stage_of_an_earlier_build(cpu_build: Path, tmp_path: Path):
    # a working directory of its own (its artifacts/.last_build changes), the session build linked into its root
    (tmp_path / "artifacts").mkdir()
    (tmp_path / "artifacts" / "base").symlink_to(cpu_build, target_is_directory=True)
    out = tmp_path / "artifacts" / "variant"
    res = subprocess.run([TRTPIPE, "build", str(CPU_RECIPE), "--set", "build.max_batch_size=8", "--out", str(out)],
                         cwd=tmp_path, capture_output=True, text=True, timeout=600, env={**os.environ, "COLUMNS": "200"})
    assert res.returncode == 0, res.stdout[-3000:] + res.stderr[-3000:]
    assert "quantize" in res.stdout and "reused (inputs unchanged)" in res.stdout
    assert "quantize hard-linked from artifacts/base (same inputs)" in res.stdout
    donor, mine = _files(cpu_build / "quantize"), _files(out / "quantize")
    assert mine.keys() == donor.keys() and mine
    assert all(mine[k].st_ino == donor[k].st_ino for k in mine)  # the same files, not copies
    assert artifacts.read_manifest(out / "quantize")["cache_key"] == artifacts.read_manifest(cpu_build / "quantize")["cache_key"]
    # the engine consumed the new max_batch_size: rebuilt, not taken over
    assert artifacts.read_manifest(out / "engine")["cache_key"] != artifacts.read_manifest(cpu_build / "engine")["cache_key"]
    assert artifacts.last_build(tmp_path / "artifacts").resolve() == out.resolve()
    assert [p.resolve() for p in local_builds(tmp_path / "artifacts")] == [out.resolve(), cpu_build.resolve()]


def test_a_recipe_whose_quantize_inputs_differ_seeds_nothing(cpu_build: Path, tmp_path: Path):
    other = load_recipe(CPU_RECIPE, ["quantization.calibration.size=32"])
    assert seed_build(tmp_path / "b", other, [cpu_build]) == {}
    assert not (tmp_path / "b").exists()
    same = load_recipe(CPU_RECIPE, ["build.max_batch_size=8"])  # the same quantize inputs, another engine
    seeded = seed_build(tmp_path / "c", same, [cpu_build])
    assert seeded == {"quantize": cpu_build}
    # the engine of the same-checkpoint donor is linked in (not reported): its key will not match, the CPU builder
    # keeps its weight files
    assert (tmp_path / "c" / "engine" / artifacts.MANIFEST).is_file()
    # a build stopped after quantize (--stage quantize) gets no engine
    assert seed_build(tmp_path / "d", same, [cpu_build], until="quantize") == {"quantize": cpu_build}
    assert not (tmp_path / "d" / "engine").exists()


def test_a_failed_first_build_removes_what_it_linked_in(cpu_build: Path, tmp_path: Path, monkeypatch):
    from pipeline.assemble import stage as build
    from pipeline.engine import stage as engine

    def engine_fails(*args, **kwargs):
        raise RuntimeError("engine stage failed")

    monkeypatch.setattr(engine, "run", engine_fails)  # the stage after the seeded quantize fails
    recipe = load_recipe(CPU_RECIPE, ["build.max_batch_size=8"])
    with pytest.raises(RuntimeError, match="engine stage failed"):
        build.run(recipe, tmp_path / "new" / "b", recipe_dir=CPU_RECIPE.parent, donors=[cpu_build])
    assert not (tmp_path / "new").exists()  # nothing behind, not even the links
    assert (cpu_build / "quantize" / artifacts.MANIFEST).is_file() and (cpu_build / "engine" / artifacts.MANIFEST).is_file()


def test_seeding_removes_the_temp_dirs_a_killed_build_left(cpu_build: Path, tmp_path: Path):
    """#44: a killed tune left ``.quantize.tmp-*``; its point's stages were then seeded (never rewritten), so no
    writer removed it. Seeding now removes the temp dirs of dead processes (a live writer's are kept)."""
    gone = subprocess.Popen([sys.executable, "-c", ""])
    gone.wait()
    b = tmp_path / "b"
    stale = [b / f".quantize.tmp-{gone.pid}-1", b / f".engine.old-{gone.pid}-2", b / f".engine.seed-{gone.pid}"]
    live = b / f".engine.tmp-{os.getpid()}-3"
    for d in [*stale, live]:
        (d / "x").mkdir(parents=True)
    assert seed_build(b, load_recipe(CPU_RECIPE), [cpu_build]) == {"quantize": cpu_build, "engine": cpu_build}
    assert not any(d.exists() for d in stale) and live.is_dir()


def test_a_tune_point_is_seeded_from_the_users_build_under_artifacts(cpu_build: Path, tmp_path: Path, monkeypatch):
    """#44: tune's base point re-ran ModelOpt although ``artifacts/`` held the same recipe's quantize stage."""
    from pipeline.tune.measure import donors

    monkeypatch.chdir(cpu_build.parent.parent)  # the working directory of the user's build (artifacts/ in it)
    out = tmp_path / "tune"
    assert cpu_build.resolve() in [d.resolve() for d in donors(out)]
    build = out / "points" / "base" / "build"
    assert seed_build(build, load_recipe(CPU_RECIPE), donors(out)) == {"quantize": cpu_build, "engine": cpu_build}
    assert artifacts.read_manifest(build / "quantize")["cache_key"] == artifacts.read_manifest(cpu_build / "quantize")["cache_key"]

