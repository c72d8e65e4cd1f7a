"""``pipeline.core.artifacts.write_atomic``: the one helper every small-file write that must never be seen half
written goes through (the last-build marker, ``serve.json``, a tune point, a build's recipe, eval output caches,
the file-hash memo)."""

from __future__ import annotations

from pathlib import Path

import pytest

from pipeline.core import artifacts


def test_writes_text_and_bytes_creating_parents_and_leaves_no_temp(tmp_path: Path):
    target = tmp_path / "a" / "b" / "state.json"
    assert artifacts.write_atomic(target, "{}\n") == target
    assert target.read_text() == "{}\n"
    artifacts.write_atomic(target, b"\x00\x01", fsync=True)
    assert target.read_bytes() == b"\x00\x01"
    assert sorted(p.name for p in target.parent.iterdir()) == ["state.json"]


def test_a_failed_write_leaves_the_old_content_and_no_temp(tmp_path: Path, monkeypatch: pytest.MonkeyPatch):
    target = tmp_path / "marker"
    artifacts.write_atomic(target, "old\n")

    def refuse(src, dst):  # noqa: ANN001 - os.replace's signature
        raise OSError("disk full")

    monkeypatch.setattr(artifacts.os, "replace", refuse)
    with pytest.raises(OSError, match="disk full"):
        artifacts.write_atomic(target, "new\n")
    assert target.read_text() == "old\n"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["marker"]


def test_last_build_marker_goes_through_it(tmp_path: Path):
    build = tmp_path / "b"
    build.mkdir()
    artifacts.record_last_build(build, tmp_path / "artifacts")
    assert artifacts.last_build(tmp_path / "artifacts") == build.resolve()
    assert sorted(p.name for p in (tmp_path / "artifacts").iterdir()) == [artifacts.LAST_BUILD_FILE]
