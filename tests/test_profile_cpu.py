"""``trtpipe profile`` on the CPU default, for real: build (session fixture) → ``serve --detach`` → ``profile`` prints
the CPU engine's step timeline over one load point and writes profile.json / profile.png."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from support import free_ports

TRTPIPE = str(Path(sys.executable).parent / "trtpipe")
ISL, OSL, N = 24, 8, 4


def _cli(*args: str, cwd: Path, timeout: float = 600) -> subprocess.CompletedProcess:
    return subprocess.run([TRTPIPE, *args], cwd=cwd, capture_output=True, text=True, timeout=timeout, check=False,
                          env={**os.environ, "COLUMNS": "200"})


@pytest.mark.triton
def test_profile_of_the_served_cpu_default(cpu_build: Path, tmp_path: Path):
    work = cpu_build.parent.parent
    http, grpc, metrics = free_ports(3)
    up = _cli("serve", "--detach", "--http-port", str(http), "--grpc-port", str(grpc), "--metrics-port", str(metrics),
              cwd=work)
    assert up.returncode == 0, up.stdout + up.stderr
    try:
        out = tmp_path / "prof"
        r = _cli("profile", "--url", f"127.0.0.1:{grpc}", "--concurrency", "2", "--isl", str(ISL), "--osl", str(OSL),
                 "--num-requests", str(N), "--warmup", "0", "--out", str(out), cwd=work)
    finally:
        _cli("serve", "--stop", cwd=work, timeout=120)
    assert r.returncode == 0, r.stdout + r.stderr
    assert "active %" in r.stdout and "generation step" in r.stdout
    doc = json.loads((out / "profile.json").read_text())
    assert doc["source"] == "cpu-engine-steps" and doc["input"] == f"http://127.0.0.1:{metrics}/metrics"
    cats = {c["name"]: c for c in doc["categories"]}
    # every step is one of the three kinds; the gauges refresh every 100 ms, so a window end may miss the last ones
    assert doc["count"] == sum(cats[k]["count"] for k in ("context", "generation", "mixed")) > 0
    assert 0 < doc["tokens"]["context"] <= N * ISL and 0 < doc["tokens"]["generation"] <= N * OSL
    assert cats["generation"]["count"] >= 1 and 0 < doc["active_pct"] <= 100
    assert doc["busy_s"] <= doc["window_s"] and cats["forward pass (in steps)"]["time_s"] <= doc["busy_s"]
    assert (out / "profile.png").stat().st_size > 0 and Path(doc["bench_run"], "bench.json").is_file()
