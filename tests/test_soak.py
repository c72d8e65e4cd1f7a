"""The soak script (scripts/soak.py), short: streams back to back against the timed test model, no failure,
every request exactly OSL, RSS sampled over time. The 10-minute figures in the README come from the same script."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]


@pytest.mark.slow
@pytest.mark.triton
@pytest.mark.timeout(300)
def test_short_soak_on_the_timed_model(tmp_path: Path):
    out = tmp_path / "soak.json"
    res = subprocess.run([sys.executable, str(REPO / "scripts" / "soak.py"), "--repo", str(REPO / "tests" / "data" / "timed_llm_repo"),
                          "--model", "tensorrt_llm", "--streams", "32", "--minutes", "0.75", "--warmup-minutes", "0.25",
                          "--isl", "16", "--osl", "20", "--sample-s", "2", "--json", str(out)],
                         capture_output=True, text=True, timeout=240)
    assert res.returncode == 0, res.stdout + res.stderr
    report = json.loads(out.read_text())
    assert report["verdict"] == "PASS" and report["failed"] == 0 and report["short"] == report["long"] == 0
    # 32 streams, first token after 50 ms then one every 10 ms: ~0.24 s per request of 20 tokens
    assert report["completed"] > 32 * 45 / 0.5
    assert len(report["rss_samples"]) >= 15 and all(s["server_bytes"] > 0 for s in report["rss_samples"])
    assert abs(report["server_rss_growth"]) < 0.05 and abs(report["client_rss_growth"]) < 0.05
