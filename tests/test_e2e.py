"""The main job end to end on the embedded CPU default, as a user runs it (README quickstart):

    trtpipe build recipes/smollm2_135m_cpu_fp8.yaml   (the session fixture ``cpu_build``)
    trtpipe serve --detach                             (the last build, real Triton)
    trtpipe bench --isl 100 --osl N --concurrency …    (real gRPC streaming through ``ensemble``)
    trtpipe serve --stop

Every command runs as a subprocess from the build's working directory, so the defaults
(``artifacts/.last_build``, the build's tokenizer and bench model) are the ones a user gets.
Smaller OSL and request counts than the quickstart keep the default test run short.
"""

from __future__ import annotations

import csv
import json
import os
import subprocess
import sys
from pathlib import Path

import psutil
import pytest

from pipeline.triton_server import free_port

TRTPIPE = str(Path(sys.executable).parent / "trtpipe")
ISL, OSL = 100, 48


def trtpipe(*args: str, cwd: Path, timeout: float = 600) -> subprocess.CompletedProcess:
    return subprocess.run([TRTPIPE, *args], cwd=cwd, capture_output=True, text=True, timeout=timeout,
                          env={**os.environ, "COLUMNS": "200"})


@pytest.mark.triton
def test_build_serve_bench_stop_on_the_cpu_default(cpu_build: Path, tmp_path: Path):
    work = cpu_build.parent.parent  # the directory the build ran in (holds artifacts/)
    manifests = {s: json.loads((cpu_build / s / "manifest.json").read_text()) for s in ("quantize", "engine", "triton_repo")}
    # the quantization is real and not a no-op
    q = manifests["quantize"]
    assert q["exported"]["quant_algo"] == "FP8" and q["quality"]["kl_mean_nats"] > 0
    assert 0.5 < q["quality"]["top1_agreement"] < 1.0
    assert manifests["engine"]["engine_kind"] == "cpu"

    # a rebuild of the unchanged recipe reuses every stage
    again = trtpipe("build", str(Path(__file__).resolve().parents[1] / "recipes" / "smollm2_135m_cpu_fp8.yaml"),
                    "--out", str(cpu_build), cwd=work)
    assert again.returncode == 0, again.stderr
    assert again.stdout.count("reused (inputs") == 3, again.stdout

    http, grpc, metrics = free_port(), free_port(), free_port()
    up = trtpipe("serve", "--detach", "--http-port", str(http), "--grpc-port", str(grpc), "--metrics-port", str(metrics),
                 cwd=work)
    assert up.returncode == 0, up.stdout + up.stderr
    assert "ready in" in up.stdout
    pid = json.loads((work / "artifacts" / "serve.json").read_text())["pid"]
    try:
        out = tmp_path / "run"
        bench = trtpipe("bench", "--url", f"127.0.0.1:{grpc}", "--isl", str(ISL), "--osl", str(OSL),
                        "--concurrency", "1,4", "--num-requests", "4", "--warmup", "1", "--out", str(out), cwd=work)
        assert bench.returncode == 0, bench.stdout + bench.stderr
        assert f"ISL:OSL {ISL}:{OSL}" in bench.stdout and "c4" in bench.stdout
        doc = json.loads((out / "bench.json").read_text())
        assert doc["config"]["model"] == "ensemble"  # the build's recipe default
        measured = [r for r in doc["requests"] if not r["warmup"]]
        assert len(measured) == 8
        # exact ISL and exact OSL for every request
        assert {r["input_tokens"] for r in measured} == {ISL}
        assert {r["output_tokens"] for r in measured} == {OSL}
        rows = list(csv.DictReader((out / "summary.csv").open()))
        assert [int(r["concurrency"]) for r in rows] == [1, 4]
        assert all(int(r["completed"]) == 4 and int(r["short"]) == 0 for r in rows)
        assert len(list((out / "plots").glob("*.png"))) == 4
        # in-flight batching: 4 concurrent requests give more output tokens/s than 1
        tput = {p["load"]: p["summary"]["metrics"]["output_token_throughput"] for p in doc["load_points"]}
        assert tput["c4"] > 1.3 * tput["c1"], tput
    finally:
        down = trtpipe("serve", "--stop", cwd=work, timeout=120)
    assert down.returncode == 0, down.stderr
    assert not psutil.pid_exists(pid) or psutil.Process(pid).status() == psutil.STATUS_ZOMBIE
    assert not (work / "artifacts" / "serve.json").exists()
