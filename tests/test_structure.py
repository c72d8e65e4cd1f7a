"""The package's shape (issue #33): no import circle between modules or between folders, no module over 450
lines, CLI command modules ≤ 150 lines, no Python under scripts/, stages in their own folders.

The import graph is read from the source with ``tests/structure.py`` (``ast``: module-level and function-level
imports alike), so a lazy import inside a function still counts; the module-circle check counts the imports inside
``if TYPE_CHECKING:`` blocks too (issue #45: "no import circle (TYPE_CHECKING included)").
"""

from __future__ import annotations

from pathlib import Path

import pytest
from structure import _cycles, folder_of, report

ROOT = Path(__file__).resolve().parents[1]
MAX_MODULE_LINES = 450
MAX_COMMAND_LINES = 150
#: the pipeline's stages in order, each a folder with its run() in stage.py
STAGES = ("quantize", "engine", "triton_repo", "assemble", "serve", "bench", "eval", "tune", "deploy")


@pytest.fixture(scope="module")
def shape() -> dict:
    return report([ROOT / "pipeline"])


def test_no_import_cycle_between_modules(shape):
    assert shape["import_cycles"] == []


def test_no_import_cycle_between_modules_counting_type_checking_imports(shape):
    """A circle kept alive by an ``if TYPE_CHECKING:`` import is a circle too (deploy/spec ↔ deploy/trtllm_serve was one)."""
    assert shape["import_cycles_typing"] == []


def test_no_import_cycle_between_folders(shape):
    assert shape["folder_cycles"] == []


def test_shared_layers_import_no_stage(shape):
    """core and trtllm sit below every stage: nothing they import is a stage, the CLI or the planner."""
    below = {"pipeline.core": {"pipeline", "pipeline.core"},
             "pipeline.trtllm": {"pipeline", "pipeline.core", "pipeline.trtllm", "pipeline.recipe", "pipeline.triton"}}
    for folder, allowed in below.items():
        assert set(shape["folder_arrows"].get(folder, [])) <= allowed, folder


def test_no_module_over_the_limit(shape):
    big = {n: lines for n, lines in shape["module_lines"].items() if lines > MAX_MODULE_LINES}
    assert big == {}


def test_cli_command_modules_are_thin(shape):
    fat = {n: lines for n, lines in shape["module_lines"].items()
           if n.startswith("pipeline.commands.") and lines > MAX_COMMAND_LINES}
    assert fat == {}


def test_scripts_holds_shell_entry_points_only():
    assert sorted(p.name for p in (ROOT / "scripts").glob("*.py")) == []


def test_every_stage_has_one_home():
    for stage in STAGES:
        assert (ROOT / "pipeline" / stage / "stage.py").is_file(), stage
    assert not (ROOT / "pipeline" / "stages").exists()


def test_the_type_checking_count_sees_what_the_run_time_count_skips(tmp_path):
    """Two real modules, one importing the other at run time and the other importing it back for typing only: a circle
    for ``import_cycles_typing``, none for ``import_cycles``."""
    pkg = tmp_path / "pkg"
    pkg.mkdir()
    (pkg / "__init__.py").write_text("")
    (pkg / "a.py").write_text("from pkg import b\n")
    (pkg / "b.py").write_text("from typing import TYPE_CHECKING\n\nif TYPE_CHECKING:\n    from pkg.a import X\n")
    r = report([pkg])
    assert r["import_cycles"] == [] and r["import_cycles_typing"] == [["pkg.a", "pkg.b"]]


def test_the_checks_catch_a_cycle():
    """The cycle finder is not vacuous: a two-module circle and the folders it spans are found."""
    graph = {"pipeline.a.x": {"pipeline.b.y"}, "pipeline.b.y": {"pipeline.a.x"}, "pipeline.c.z": set()}
    assert _cycles(graph) == [["pipeline.a.x", "pipeline.b.y"]]
    assert folder_of("pipeline.engine.tensorrt") == "pipeline.engine" and folder_of("pipeline.cli") == "pipeline.cli"
