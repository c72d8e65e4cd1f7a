"""The main job end to end on the embedded CPU default:

    trtpipe build recipes/smollm2_135m_cpu_fp8.yaml   (the session fixture ``cpu_build``, a CLI subprocess;
                                                       rebuilt here to check every stage is reused)
    pipeline.serve.stage.run(build)                   (real Triton, free ports)
    pipeline.bench.stage.run(spec, target)            (real gRPC streaming through ``ensemble``)

serve and bench are called as stage functions, as a sweep calls them (the CLI shells over them are tested
in test_serve.py and test_bench_triton.py). Smaller OSL and request counts than the quickstart keep the
default test run short.
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
from support import free_ports

from pipeline.bench import stage as bench
from pipeline.bench.results import check_outcome
from pipeline.core.layout import BuildLayout
from pipeline.serve import stage as serve

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

    # serve and bench through the stage functions (what `trtpipe serve` / `trtpipe bench` and a sweep call)
    layout = BuildLayout(cpu_build)
    options = serve.ServeOptions(http_port=None, grpc_port=None, metrics_port=None, ready_timeout_s=240)
    stale = [layout.server_log(30000 + i) for i in range(serve.SERVER_LOGS_KEPT)]  # earlier free-port servers' logs
    for i, p in enumerate(stale):
        p.write_text("old\n")
        os.utime(p, (1_000_000 + i, 1_000_000 + i))
    with serve.run(layout, options) as handle:
        pid = handle.server.pid
        logs = layout.server_logs()  # the new server's log is kept, the oldest goes
        assert handle.server.log_file in logs and len(logs) <= serve.SERVER_LOGS_KEPT and not stale[0].exists()
        assert {m["name"] for m in handle.models()} >= {"ensemble", "tensorrt_llm"}
        spec = bench.with_overrides(bench.spec_for(None, layout), {
            "scenarios": [{"isl": ISL, "osl": OSL}], "concurrency": [1, 4], "num_requests": 4, "warmup_requests": 1})
        out = tmp_path / "run"
        result = bench.run(spec, bench.BenchTarget(url=handle.grpc_url, layout=layout, out=out))
        check_outcome(result)
        assert result.run_dir == out
        doc = json.loads((out / "bench.json").read_text())
        assert doc["config"]["model"] == "ensemble"  # the build's recipe default
        assert doc["environment"]["build"]["dir"] == str(cpu_build)
        measured = [r for r in doc["requests"] if not r["warmup"]]
        assert len(measured) == 8
        # exact ISL and exact OSL for every request
        assert {r["input_tokens"] for r in measured} == {ISL}
        assert {r["output_tokens"] for r in measured} == {OSL}
        rows = list(csv.DictReader((out / "summary.csv").open()))
        assert [int(r["concurrency"]) for r in rows] == [1, 4]
        assert all(int(r["completed"]) == 4 and int(r["short"]) == 0 for r in rows)
        assert len(list((out / "plots").glob("*.png"))) == 5  # 4 latency/throughput plots + the server's telemetry
        # in-flight batching: at c4 the four streams interleave, every request's first token arriving before any
        # request of the load point has finished (served one after another, each would start after the last ended).
        # An order of events, not a speed: the throughput gain is measured by benchmarks/bench_cpu.py
        c4 = [r for r in measured if r["load"] == "c4"]
        first = [next(t for t, n in zip(r["response_ns"], r["response_tokens"]) if n != 0) for r in c4]
        assert len(c4) == 4 and max(first) < min(r["end_ns"] for r in c4), (first, [r["end_ns"] for r in c4])
    assert handle.server.proc.returncode is not None  # stopped on leaving the block
    assert not psutil.pid_exists(pid) or psutil.Process(pid).status() == psutil.STATUS_ZOMBIE


@pytest.mark.triton
def test_cli_serve_detach_bench_stop_on_the_cpu_default(cpu_build: Path, tmp_path: Path):
    """The same job as a user types it, from the build's working directory: the defaults
    (``artifacts/.last_build``, the build's tokenizer and bench model) are the ones a user gets."""
    work = cpu_build.parent.parent  # the directory the build ran in (holds artifacts/)
    http, grpc, metrics = free_ports(3)
    up = trtpipe("serve", "--detach", "--http-port", str(http), "--grpc-port", str(grpc), "--metrics-port", str(metrics),
                 cwd=work)
    assert up.returncode == 0, up.stdout + up.stderr
    assert "ready in" in up.stdout
    pid = json.loads((work / "artifacts" / "serve.json").read_text())["pid"]
    try:
        out = tmp_path / "run"
        run = trtpipe("bench", "--url", f"127.0.0.1:{grpc}", "--isl", str(ISL), "--osl", "16",
                      "--concurrency", "4", "--num-requests", "4", "--warmup", "0", "--out", str(out), cwd=work)
        assert run.returncode == 0, run.stdout + run.stderr
        assert f"ISL:OSL {ISL}:16" in run.stdout and "c4" in run.stdout
        doc = json.loads((out / "bench.json").read_text())
        assert doc["config"]["model"] == "ensemble"  # the build's recipe default
        assert {r["output_tokens"] for r in doc["requests"]} == {16}
    finally:
        down = trtpipe("serve", "--stop", cwd=work, timeout=120)
    assert down.returncode == 0, down.stderr
    assert not psutil.pid_exists(pid) or psutil.Process(pid).status() == psutil.STATUS_ZOMBIE
    assert not (work / "artifacts" / "serve.json").exists()
