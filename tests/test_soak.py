"""``trtpipe bench --soak`` (was scripts/soak.py), short: streams back to back against the timed test model, no failure,
every request exactly OSL, RSS sampled over time. The 10-minute figures in docs/measurements.md come from the same
command. The soak's library pieces (growth, report, the one-scenario rule) are checked without a server below."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from pipeline.bench.soak import SoakCounts, SoakReport, growth

REPO = Path(__file__).resolve().parents[1]
TRTPIPE = str(Path(sys.executable).parent / "trtpipe")


@pytest.mark.slow
@pytest.mark.triton
@pytest.mark.serial  # RSS growth and latency drift over time: alone on the host
@pytest.mark.timeout(300)
def test_short_soak_on_the_timed_model(tmp_path: Path):
    out = tmp_path / "soak"
    res = subprocess.run([TRTPIPE, "bench", "--soak", "0.4", "--serve", str(REPO / "tests" / "data" / "timed_llm_repo"),
                          "--model", "tensorrt_llm", "--concurrency", "32", "--soak-warmup", "0.15",
                          "--isl", "16", "--osl", "20", "--soak-sample", "1", "--out", str(out)],
                         capture_output=True, text=True, timeout=240, cwd=tmp_path)
    assert res.returncode == 0, res.stdout + res.stderr
    assert "→ PASS" in res.stdout, res.stdout
    report = json.loads((out / "soak.json").read_text())
    assert report["verdict"] == "PASS" and report["failed"] == 0 and report["short"] == report["long"] == 0
    # each of the 32 streams completes at least one request; none can beat the model's schedule (50 ms + 19 × 10 ms per
    # request), so at most 32 × (24 s / 0.24 s + 1) — bounds that no slow moment can break
    assert 32 <= report["completed"] == report["requests"] <= 32 * (24 / 0.24 + 1)
    assert report["output_tokens"] == 20 * report["completed"]
    assert len(report["rss_samples"]) >= 2 and all(s["server_bytes"] > 0 for s in report["rss_samples"])
    for key in ("server_rss_growth", "client_rss_growth"):  # measured when ≥ 3 samples fell after the warm-up
        assert report[key] is None or abs(report[key]) < 0.05, report[key]


def test_rss_growth_from_the_first_sample_after_warmup_to_the_tail():
    samples = [(t, 100 + t, 50) for t in range(0, 40, 2)]  # server grows 1 byte/s, client flat
    assert growth(samples, 10, 1) == pytest.approx(138 / 110 - 1)  # 15 samples from t = 10 s: the tail is the last one
    assert growth(samples, 10, 2) == 0.0
    assert growth(samples[:6], 10, 1) is None  # fewer than 3 samples after the warm-up: not measured


def test_soak_report_json_and_line():
    counts = SoakCounts(requests=10, completed=9, failed=1, short=0, long=0, output_tokens=180, errors={"timeout": 1})
    report = SoakReport("localhost:8001", "tensorrt_llm", 4, 0.5, 16, 20, 30.04, counts, [(0.0, 1, 2), (2.0, 3, 4)],
                        None, 0.01, "FAIL")
    doc = report.to_json()
    assert list(doc) == ["url", "model", "streams", "minutes", "isl", "osl", "wall_s", "requests", "completed", "failed",
                         "short", "long", "output_tokens", "errors", "aborted", "output_tokens_per_s", "server_rss_growth",
                         "client_rss_growth", "rss_samples", "verdict"]
    assert doc["wall_s"] == 30.0 and doc["output_tokens_per_s"] == pytest.approx(180 / 30.04)
    assert doc["rss_samples"][1] == {"t_s": 2.0, "server_bytes": 3, "client_bytes": 4}
    assert report.line().endswith("server n/a, client +1.0% → FAIL") and not report.passed


def test_soak_needs_one_scenario_and_one_concurrency(tmp_path):
    p = subprocess.run([TRTPIPE, "bench", "--soak", "1", "--url", "127.0.0.1:1", "--isl", "8", "--osl", "4",
                        "--concurrency", "1,2"], capture_output=True, text=True, timeout=60, cwd=tmp_path)
    assert p.returncode == 2 and "--soak runs one scenario at one concurrency" in p.stderr, p.stderr
    p = subprocess.run([TRTPIPE, "bench", "--serve", str(tmp_path), "--isl", "8", "--osl", "4"], capture_output=True,
                       text=True, timeout=60, cwd=tmp_path)
    assert p.returncode == 2 and "--serve and --server-pid go with --soak" in p.stderr, p.stderr
