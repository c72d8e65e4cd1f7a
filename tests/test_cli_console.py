"""Piped output (#44 item 7): off a TTY every command prints through one console setting, wide and unwrapped, so
``recipe validate`` keeps one line per file and ``plan`` tables keep whole numbers (rich alone wraps at 80)."""

from __future__ import annotations

import re
import shutil
from pathlib import Path

from typer.testing import CliRunner

from pipeline.cli import app

REPO = Path(__file__).resolve().parents[1]
NO_COLUMNS = {"COLUMNS": None, "LINES": None}  # CliRunner's stdout is not a TTY; no $COLUMNS: rich's default applies


def test_validate_prints_one_line_per_file_when_piped(tmp_path):
    deep = tmp_path / "a_directory_with_a_rather_long_name" / "another_level_of_the_team_recipe_tree"
    deep.mkdir(parents=True)
    files = []
    for name in ("llama31_8b_h200_fp8.yaml", "llama33_70b_h100_fp8_tp2.yaml", "llama31_8b_h200_fp8_pytorch.yaml"):
        files.append(deep / name)
        shutil.copy(REPO / "recipes" / name, files[-1])
    res = CliRunner().invoke(app, ["recipe", "validate", *map(str, files)], env=NO_COLUMNS)
    assert res.exit_code == 0, res.output
    lines = res.output.strip().splitlines()
    assert len(lines) == len(files), res.output
    for f, line in zip(files, lines):
        assert line.startswith(f"ok {f}:") and "kv_cache_dtype" in line, line


def test_plan_tables_keep_whole_cells_when_piped():
    res = CliRunner().invoke(app, ["plan", str(REPO / "recipes/llama33_70b_h100_fp8_tp2.yaml"), "--isl", "100",
                                   "--osl", "2000", "--gpu", "h100_sxm", "--gpu", "h200"], env=NO_COLUMNS)
    assert res.exit_code == 0, res.output
    assert "…" not in res.output, res.output  # rich's mark of a cut cell
    for gpu in ("h100_sxm", "h200"):
        row = [ln for ln in res.output.splitlines() if ln.lstrip().startswith(gpu + " ")]
        assert len(row) == 1, res.output
        assert "100/2000" in row[0] and re.search(r"[\d,]+ ±\d+%", row[0]), f"a cell is cut: {row[0]!r}"


def test_error_lines_are_one_line_when_piped(tmp_path):
    bad = tmp_path / ("x" * 60) / "recipe_with_a_long_name_that_goes_past_eighty_columns.yaml"
    bad.parent.mkdir()
    bad.write_text((REPO / "recipes/llama31_8b_h200_fp8.yaml").read_text().replace("qformat: fp8", "qformat: fp9"))
    res = CliRunner().invoke(app, ["recipe", "validate", str(bad)], env=NO_COLUMNS)
    assert res.exit_code == 2
    out = [ln for ln in res.output.splitlines() if ln.strip()]
    assert len(out) == 1 and out[0].startswith(f"error: {bad}:") and "quantization.qformat" in out[0], res.output


def test_usage_errors_use_the_same_error_prefix_as_every_other_error():
    """#44 misc: click's usage errors came as a box titled 'Error', trtpipe's own as 'error: …'; one style now."""
    for args in (["recipe", "validate", "--bogus"], ["plan", "--gpu"], ["serve", "--grpc-port", "x"]):
        res = CliRunner().invoke(app, args, env=NO_COLUMNS)
        assert res.exit_code == 2, res.output
        errors = [ln for ln in res.output.splitlines() if "rror" in ln]
        assert len(errors) == 1 and errors[0].startswith("error: "), res.output
        assert "╭" not in res.output and "Error" not in res.output, res.output


def test_a_console_made_while_columns_is_set_follows_the_environment_it_prints_in(monkeypatch):
    """The commands' console is made at import; rich alone fixes the $COLUMNS of that moment as its width (a test
    worker started with COLUMNS=80 cut every later table at 80 whatever the caller set)."""
    import io

    from pipeline.core.console import OFF_TTY_WIDTH, make_console

    monkeypatch.setenv("COLUMNS", "80")
    console = make_console(file=io.StringIO())
    monkeypatch.delenv("COLUMNS")
    assert console.width == OFF_TTY_WIDTH
    monkeypatch.setenv("COLUMNS", "200")
    assert console.width == 200
