"""A build killed (SIGKILL: no cleanup runs) while any stage is writing leaves no half-written stage, and the
next build completes, reusing the stages that finished. Real CPU build of the shipped default; the kill lands while
the stage's temp directory exists (``.<stage>.tmp-<pid>-*``, renamed into place only when the stage is complete:
pipeline.core.artifacts.atomic_dir). After the kill during quantize, the quantize stage the session's build of the
same recipe finished (``cpu_build``: the same content key) is hard-linked in rather than calibrated again, as
``trtpipe build`` seeds a stage from another build (pipeline/assemble/seed.py)."""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from pipeline.core import artifacts
from pipeline.core.layout import STAGES, BuildLayout

REPO = Path(__file__).resolve().parents[1]
TRTPIPE = str(Path(sys.executable).parent / "trtpipe")
RECIPE = REPO / "recipes" / "smollm2_135m_cpu_fp8.yaml"


def _build(out: Path, cwd: Path) -> subprocess.Popen:
    argv = [TRTPIPE, "build", str(RECIPE), "--out", str(out)]
    return subprocess.Popen(argv, cwd=cwd, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True,
                            env={**os.environ, "TRTPIPE_NUM_THREADS": "1"})


def _kill_while_writing(out: Path, cwd: Path, stage: str, timeout_s: float = 600) -> None:
    proc = _build(out, cwd)
    deadline = time.monotonic() + timeout_s
    try:
        while time.monotonic() < deadline:
            if list(out.glob(f".{stage}.tmp-*")):
                os.kill(proc.pid, signal.SIGKILL)
                proc.wait(10)
                return
            assert proc.poll() is None, f"the build ended before {stage} was written: {proc.stderr.read()[-2000:]}"
            time.sleep(0.005)
        raise AssertionError(f"no {stage} temp dir within {timeout_s} s")
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait(10)


def _complete(layout: BuildLayout, stage: str) -> bool:
    """The stage directory exists with a manifest, and every file the manifest lists has its hash."""
    from pipeline.core.artifacts import file_hashes, read_manifest

    m = read_manifest(layout.stage_dir(stage))
    if m is None:
        return False
    files = m.get("files") or {}
    return not files or all(file_hashes(layout.stage_dir(stage)).get(k) == v for k, v in files.items())


@pytest.mark.slow
@pytest.mark.timeout(1800)
def test_sigkill_during_each_stage_then_a_clean_rebuild(tmp_path: Path, cpu_build: Path):
    out = tmp_path / "artifacts" / "b"
    layout = BuildLayout(out)
    for i, stage in enumerate(STAGES):
        _kill_while_writing(out, tmp_path, stage)
        assert not layout.stage_dir(stage).exists(), f"{stage}: a half-written stage was left in place"
        for done in STAGES[:i]:
            assert _complete(layout, done), f"{done} should have completed before {stage} was killed"
        assert list(out.glob(f".{stage}.tmp-*")), "SIGKILL skips the cleanup: the temp dir stays until the next run"
        if stage == "quantize":  # the finished stage of the same inputs, as seed_build links it in
            shutil.copytree(cpu_build / stage, layout.stage_dir(stage), copy_function=os.link)
    proc = _build(out, tmp_path)
    assert proc.wait(900) == 0, proc.stderr.read()[-3000:]
    assert all(_complete(layout, s) for s in STAGES)
    quantize = artifacts.read_manifest(layout.stage_dir("quantize"))
    assert quantize["cache_key"] == artifacts.read_manifest(cpu_build / "quantize")["cache_key"]  # reused, not redone
    assert not list(out.glob(".*.tmp-*")), "the rebuild removed the dead runs' temp dirs"
    manifests = {s: json.loads((layout.stage_dir(s) / "manifest.json").read_text()) for s in STAGES}
    assert manifests["triton_repo"]["inputs"]["engine"] == manifests["engine"]["cache_key"]
