"""The calibration room (issue #45 item 2): ``trtpipe plan measure-host`` and ``plan --against`` live in
``pipeline/calibrate/``, above the stages, so ``pipeline/plan/`` is a calculator that imports no stage, server or
bench; the served probe of measure-host is built by the build stage's ``run()``, not by a copy of its order."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
from structure import report

from pipeline.assemble import stage as build_stage
from pipeline.calibrate import host as host_mod
from pipeline.core import artifacts, hardware

ROOT = Path(__file__).resolve().parents[1]
#: what the planner may import: the shared layers, the recipe, and the CPU runtime's KV-slot rule
PLAN_MAY_IMPORT = {"pipeline", "pipeline.core", "pipeline.recipe", "pipeline.cpu_runtime"}


def test_plan_imports_nothing_that_builds_serves_or_benches():
    arrows = report([ROOT / "pipeline"])["folder_arrows"]
    assert set(arrows.get("pipeline.plan", [])) <= PLAN_MAY_IMPORT, arrows.get("pipeline.plan")
    # the room sits above: it reaches the build stage, the server and the bench, and the planner it measures
    assert {"pipeline.assemble", "pipeline.serve", "pipeline.bench", "pipeline.plan"} <= set(arrows["pipeline.calibrate"])


class _Stop(Exception):
    pass


def test_the_served_probe_is_built_by_the_build_stage(tmp_path, monkeypatch):
    """serving_cpu_per_token hands its probe recipe to pipeline.assemble.stage.run (here a stand-in that records the call,
    marks itself the last build as the real one does, and stops); the user's last build is left as it was, no
    artifacts/ folder is left in the working directory, and a broken host file does not stop the build's fit check."""
    calls = []
    broken = tmp_path / "cpu_host.yaml"
    broken.write_text("name: only a name\n")  # the host file being measured again is broken
    monkeypatch.setenv("TRTPIPE_HOST_FILE", str(broken))

    def fake_run(recipe, build_dir, *, recipe_dir, **kw):
        calls.append((recipe, Path(build_dir), Path(recipe_dir)))
        assert "shipped reference" in hardware.cpu_host().origin  # the build's fit check plans on the shipped host
        artifacts.record_last_build(Path(build_dir).parent)  # what a real full build does
        raise _Stop

    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr(build_stage, "run", fake_run)
    with pytest.raises(_Stop):
        host_mod.serving_cpu_per_token(0.0)
    (recipe, build_dir, recipe_dir), = calls
    assert recipe.build.engine == "cpu" and recipe.model.dtype == "float32" and recipe.bench.model == "ensemble"
    assert build_dir == recipe_dir / "build" and (Path(recipe.model.source) / "config.json").is_file() is False  # temp dir gone
    assert not (tmp_path / "artifacts").exists()
    assert os.environ["TRTPIPE_HOST_FILE"] == str(broken)
