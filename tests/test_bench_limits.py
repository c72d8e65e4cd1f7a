"""The bench refuses, before sending anything, a scenario the served build cannot run; a run whose every request
failed claims no results (no plots, no tables); the shipped CPU default runs the README's ``--isl 100 --osl 2000``.

Issue #44 item 1: on fc84aa0 ``trtpipe bench --isl 100 --osl 2000`` against the CPU default (max_seq_len 1024) sent
18 requests that all failed, exited 1 and wrote plots of the failures."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

from support import free_port

from pipeline.bench.exporters import write_run
from pipeline.bench.records import RequestRecord
from pipeline.bench.results import BenchResult, LoadPoint
from pipeline.bench.run import summarize_run
from pipeline.recipe.bench import BenchSpec

TRTPIPE = str(Path(sys.executable).parent / "trtpipe")
REPO = Path(__file__).resolve().parents[1]


def _trtpipe(*args: str, cwd: Path) -> subprocess.CompletedProcess:
    return subprocess.run([TRTPIPE, *args], cwd=cwd, capture_output=True, text=True, timeout=120, check=False,
                          env={**os.environ, "COLUMNS": "200"})


def test_the_readme_scenario_fits_the_cpu_default_and_a_longer_one_is_refused_before_any_request(cpu_build, tmp_path):
    work = cpu_build.parent.parent  # the build's working directory: artifacts/.last_build points at it
    engine = json.loads((cpu_build / "engine" / "manifest.json").read_text())
    max_seq, max_in = engine["max_seq_len"], engine["engine_config"]["max_input_len"]
    assert max_seq >= 100 + 2000  # the README's own command fits the shipped default
    plan = _trtpipe("plan", str(REPO / "recipes" / "smollm2_135m_cpu_fp8.yaml"), "--isl", "100", "--osl", "2000", cwd=work)
    assert plan.returncode == 0, plan.stdout[-2000:] + plan.stderr

    url = f"127.0.0.1:{free_port()}"  # nothing listens: a refusal here was decided before the server was asked
    cases = {  # (isl, osl) → what the one line must name
        (100, max_seq - 100 + 1): ["max_seq_len", str(max_seq), f"--osl to ≤ {max_seq - 100}",
                                   f"build.max_seq_len={max_seq + 1}"],
        (max_in + 1, 10): ["max_input_len", str(max_in), f"--isl to ≤ {max_in}"],
    }
    for (isl, osl), names in cases.items():
        out = tmp_path / f"run-{isl}-{osl}"
        p = _trtpipe("bench", "--url", url, "--isl", str(isl), "--osl", str(osl), "--out", str(out), cwd=work)
        lines = [ln for ln in p.stderr.splitlines() if ln.strip()]
        assert p.returncode == 2 and len(lines) == 1, p.stdout + p.stderr
        assert all(n in lines[0] for n in names) and "manifest.json" in lines[0], lines[0]
        assert not out.exists()
    # the README's scenario passes the check and gets as far as the (absent) server
    p = _trtpipe("bench", "--url", url, "--isl", "100", "--osl", "2000", "--out", str(tmp_path / "ok"), cwd=work)
    assert p.returncode == 2 and "not reachable" in p.stderr and "max_seq_len" not in p.stderr, p.stderr


def _all_failed_run() -> BenchResult:
    spec = BenchSpec(model="ensemble", scenarios=[{"isl": 100, "osl": 2000}], concurrency=[1, 8])
    run = BenchResult(spec, started_at="now", t0_ns=0)
    for c in (1, 8):
        for i in range(4):
            r = RequestRecord("100:2000", f"c{c}", i, i == 0, 100, 2000, start_ns=i * 1000)
            r.error, r.end_ns = "[StatusCode.INVALID_ARGUMENT] prompt + max_new_tokens exceeds max_seq_len", i * 1000 + 5
            run.records.append(r)
        run.load_points.append(LoadPoint("100:2000", 100, 2000, "concurrency", f"c{c}", concurrency=c, requests_sent=3))
    summarize_run(run)
    return run


def test_a_run_where_every_request_failed_writes_no_plots_and_says_so(tmp_path):
    from pipeline.bench.results import check_outcome
    from pipeline.core.errors import StageError

    run = _all_failed_run()
    run.run_dir = write_run(tmp_path / "run", run)
    assert (run.run_dir / "bench.json").is_file()  # the requests and their errors are kept
    assert not (run.run_dir / "plots").exists()
    assert any("no plots" in w for w in run.warnings)
    try:
        check_outcome(run)
    except StageError as e:
        assert "6 request(s) failed — every measured one, no results" in str(e)
    else:
        raise AssertionError("an all-failed run must not pass")
