"""``trtpipe bench`` against the real Triton 2.51 (CPU, nvidia-pytriton) on ``tests/data/timed_llm_repo``.

The timed ``tensorrt_llm`` model emits its first token 50 ms after a request arrives and then
one every 10 ms (deadline-scheduled, a thread per request), and reports its own timeline; see
``tests/bench_fidelity.py`` for what the bench's timing must satisfy against it on any machine. No test here
asserts a duration: a slow moment can only make times longer, and every bound below is a lower bound that
physics guarantees (the accuracy figure is measured by ``benchmarks/check_bench_fidelity.py``).
"""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import psutil
import pytest
from bench_fidelity import violations
from support import free_port, free_ports

from pipeline.bench import stage as bench
from pipeline.bench.client import LLMAPI_OSL_WARNING
from pipeline.bench.results import check_outcome
from pipeline.bench.stage import BenchTarget
from pipeline.core.errors import StageError
from pipeline.recipe.bench import BenchSpec
from pipeline.triton.server import TritonServer

pytestmark = pytest.mark.triton

REPO = Path(__file__).resolve().parents[1]
TIMED_REPO = REPO / "tests" / "data" / "timed_llm_repo"
TRTPIPE = str(Path(sys.executable).parent / "trtpipe")


def _cli_env() -> dict[str, str]:
    """The CLI's environment: this checkout's ``pipeline`` first (the venv's editable install may be another)."""
    return {"COLUMNS": "250", "PATH": str(Path(sys.executable).parent), "PYTHONPATH": str(REPO)}


def _server(log: Path) -> TritonServer:
    http, grpc, metrics = free_ports(3)  # three separate free_port() calls can return the same port
    return TritonServer(TIMED_REPO, http_port=http, grpc_port=grpc, metrics_port=metrics, log_file=log, ready_timeout_s=90)


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    with _server(tmp_path_factory.mktemp("triton") / "server.log") as srv:
        yield srv


def _fidelity(server, c, out):
    spec = BenchSpec(model="tensorrt_llm", scenarios=[{"isl": 32, "osl": 20}], concurrency=[c], num_requests=max(3 * c, 16),
                     warmup_requests=min(c, 8), request_timeout_s=60, server_timestamps=True, seed=c)
    run = bench.run(spec, BenchTarget(url=server.grpc_url, out=out))
    check_outcome(run, run.run_dir)
    doc = json.loads((run.run_dir / "bench.json").read_text())
    assert {r["output_tokens"] for r in doc["requests"]} == {20}  # exact OSL, every request
    return doc


@pytest.mark.parametrize("concurrency", [1, 16])
def test_ttft_and_itl_are_the_clients_own_times_within_the_models_schedule(server, concurrency, tmp_path):
    """Deterministic: no receipt before the server's send, nothing shorter than the model's schedule, and the
    reported averages recomputed from the raw timestamps (see tests/bench_fidelity.py)."""
    doc = _fidelity(server, concurrency, tmp_path / "run")
    assert violations(doc) == []


@pytest.mark.slow
def test_ttft_and_itl_are_the_clients_own_times_at_64(server, tmp_path):
    """The same at 64 streams (6 400 responses/s asked of a CPU Triton: the server saturates on a busy 2-core
    machine, which lengthens times but breaks no rule). The accuracy figure at 64 is benchmarks/check_bench_fidelity.py's."""
    doc = _fidelity(server, 64, tmp_path / "run")
    assert violations(doc) == []


def test_short_requests_fail_a_forced_osl_run_unless_allowed(server, tmp_path):
    """tensorrt_llm_short stops at 5 tokens although min_tokens = OSL = 8 was sent."""
    spec = BenchSpec(model="tensorrt_llm_short", scenarios=[{"isl": 16, "osl": 8}], concurrency=[2], num_requests=6, warmup_requests=1)
    run = bench.run(spec, BenchTarget(url=server.grpc_url, out=tmp_path / "run"))
    out = run.run_dir
    with pytest.raises(StageError) as e:
        check_outcome(run, out)
    msg = str(e.value)
    assert "\n" not in msg and msg.startswith("6 request(s) stopped short of the forced OSL") and "3 token(s) short" in msg
    assert "16:8 c2 #1: 5/8 (−3)" in msg and "--allow-short" in msg
    counts = run.load_points[0].summary.counts
    assert counts.short == 6 and counts.completed == 6 and counts.output_tokens == 30
    assert any("fewer than OSL" in w for w in run.warnings)
    row = next(csv_row for csv_row in (out / "summary.csv").read_text().splitlines()[1:])
    assert ",6,6,0,6," in row  # requests, completed, failed, short
    # the server's sequence_length agrees with the counted output_ids: short, but no count mismatch
    check = run.load_points[0].summary.osl_check
    assert check.methods == ["client", "server"] and check.mismatch == 0 and check.mismatch_pct == 0.0

    allowed = bench.run(spec.model_copy(update={"allow_short": True}), BenchTarget(url=server.grpc_url, out=tmp_path / "ok"))
    check_outcome(allowed, allowed.run_dir)  # accepted: short stays a warning
    assert allowed.load_points[0].summary.counts.short == 6


def test_cli_short_run_exits_1_with_one_line_and_allow_short_exits_0(server, tmp_path):
    args = [TRTPIPE, "bench", "--url", server.grpc_url, "--model", "tensorrt_llm_short", "--scenario", "16:8",
            "--concurrency", "2", "--num-requests", "4", "--warmup", "0"]
    env = _cli_env()
    p = subprocess.run([*args, "--out", str(tmp_path / "a")], capture_output=True, text=True, timeout=120, cwd=tmp_path, env=env)
    assert p.returncode == 1, p.stderr
    err = [line for line in p.stderr.splitlines() if "stopped short" in line]
    assert len(err) == 1 and "5/8 (−3)" in err[0], p.stderr
    p = subprocess.run([*args, "--allow-short", "--out", str(tmp_path / "b")], capture_output=True, text=True, timeout=120,
                       cwd=tmp_path, env=env)
    assert p.returncode == 0, p.stderr


def _smollm2_tokenizer() -> Path:
    from pipeline.quantize.sources import embedded_smollm2_dir

    return embedded_smollm2_dir()


def test_text_interface_exact_isl_and_counted_osl(server, tmp_path):
    tok = _smollm2_tokenizer()
    spec = BenchSpec(model="ensemble", scenarios=[{"isl": 40, "osl": 6}], concurrency=[4], num_requests=8, warmup_requests=0, goodput={"ttft": 1000, "itl": 100})
    run = bench.run(spec, BenchTarget(url=server.grpc_url, tokenizer=tok, out=tmp_path / "run"))
    out = run.run_dir
    check_outcome(run, out)
    s = run.load_points[0].summary
    assert s.metrics["input_sequence_length"]["min"] == s.metrics["input_sequence_length"]["max"] == 40
    assert s.counts.output_tokens == 48 and s.counts.short == 0 and s.counts.good == 8
    # OSL two ways: the server's num_output_tokens and re-tokenizing the returned text (" a" × 6)
    assert s.osl_check.methods == ["client", "retokenized"] and s.osl_check.mismatch == 0
    doc = json.loads((out / "bench.json").read_text())
    assert {r["text_tokens"] for r in doc["requests"]} == {6}


def test_llmapi_test_model_declares_upstreams_tensors():
    """llmapi_echo stands for upstream's llmapi model: trtpipe's template less trtpipe's own extensions."""
    from pipeline.triton.model_config import load_model_config
    from pipeline.triton_repo.render import render_model_config
    from pipeline.trtllm.triton_contract import (
        LLMAPI_EXTRA_INPUTS,
        LLMAPI_EXTRA_OUTPUTS,
    )

    ours_only = {*LLMAPI_EXTRA_INPUTS["tensorrt_llm"], *LLMAPI_EXTRA_OUTPUTS["tensorrt_llm"]}

    def tensors(cfg):
        return [[(t.name, t.data_type, list(t.dims), getattr(t, "optional", None)) for t in ts if t.name not in ours_only]
                for ts in (cfg.input, cfg.output)]

    ours = render_model_config("llmapi_tensorrt_llm", max_batch_size=0, decoupled=True, llm_runtime="tensorrt_llm")
    test_model = load_model_config(TIMED_REPO / "llmapi_echo")
    assert not ours_only & {t.name for t in (*test_model.input, *test_model.output)}
    assert tensors(test_model) == tensors(ours)
    assert test_model.max_batch_size == ours.max_batch_size == 0 and test_model.model_transaction_policy.decoupled


def test_llmapi_interface_counts_cumulative_text_and_reports_short(server, tmp_path):
    """The LLM-API model streams the whole text so far (pieces of 1, 1, 4, 2, 2 SmolLM2 tokens)."""
    status: list[str] = []
    spec = BenchSpec(model="llmapi_echo", scenarios=[{"isl": 24, "osl": 16}, {"isl": 24, "osl": 10}], concurrency=[2], num_requests=4, warmup_requests=1)
    run = bench.run(spec, BenchTarget(url=server.grpc_url, tokenizer=_smollm2_tokenizer(), out=tmp_path / "run"), on_status=status.append)
    out = run.run_dir
    check_outcome(run, out)  # every request accepted by the model (Triton checks names/dtypes/shapes)
    assert run.info.interface == "llmapi"
    assert [s for s in status if s.startswith("warning:")] == ["warning: " + LLMAPI_OSL_WARNING]
    assert all(r.response_tokens == [1, 1, 4, 2, 2] and r.error is None for r in run.records), run.records[0]
    short, full = (p.summary for p in run.load_points)
    assert short.counts.output_tokens == 40 and short.counts.short == 4 and short.counts.failed == 0
    assert full.counts.output_tokens == 40 and full.counts.short == 0 and full.counts.completed == 4
    assert short.metrics["input_sequence_length"]["min"] == short.metrics["input_sequence_length"]["max"] == 24
    assert any("4 request(s) came back with fewer than OSL" in w for w in run.warnings)
    doc = json.loads((out / "bench.json").read_text())
    notes = [n for n in doc["status"]["notes"] if not n.startswith("device telemetry:")]  # + the telemetry source (#49)
    assert notes == [LLMAPI_OSL_WARNING] and doc["environment"]["model"]["interface"] == "llmapi"


def test_request_timeout_fails_requests_and_closes_streams(server, tmp_path):
    spec = BenchSpec(model="tensorrt_llm", scenarios=[{"isl": 8, "osl": 50}], concurrency=[4], num_requests=4, warmup_requests=0, request_timeout_s=0.2)
    run = bench.run(spec, BenchTarget(url=server.grpc_url, out=tmp_path / "run"))
    out = run.run_dir
    assert run.load_points[0].summary.counts.failed == 4
    assert all(r.error == "timeout after 0.2 s" for r in run.records)
    with pytest.raises(StageError, match="4 request\\(s\\) failed"):
        check_outcome(run, out)


def test_cli_run_writes_table_json_csv_and_plots(server, tmp_path):
    out = tmp_path / "run"
    p = subprocess.run([TRTPIPE, "bench", "--url", server.grpc_url, "--model", "tensorrt_llm", "--scenario", "16:8",
                        "--scenario", "8:4", "--concurrency", "1,4", "--num-requests", "8", "--warmup", "1",
                        "--goodput", "ttft:200,itl:20", "--out", str(out)],
                       capture_output=True, text=True, timeout=120, cwd=tmp_path,
                       env=_cli_env())
    assert p.returncode == 0, p.stderr
    assert "ISL:OSL 16:8" in p.stdout and "ISL:OSL 8:4" in p.stdout and "goodput" in p.stdout
    rows = (out / "summary.csv").read_text().splitlines()
    assert len(rows) == 1 + 4
    assert len(list((out / "plots").glob("*.png"))) == 5  # + telemetry.png (#49)
    doc = json.loads((out / "bench.json").read_text())
    assert doc["environment"]["triton_server"]["version"] == "2.51.0"
    # telemetry (#49): no NVML here; the fake server (this test's child process) found by its listening port
    tel = doc["load_points"][0]["telemetry"]
    assert tel["source"] == "process" and tel["samples"] >= 2 and tel["interval_s"] == 0.5
    pid = int(tel["devices"][0]["name"].removeprefix("server process tree (pid ").rstrip(")"))
    assert pid in {os.getpid(), *(c.pid for c in psutil.Process().children(recursive=True))}
    assert tel["overall"]["rss"]["peak"] > 10 and tel["overall"]["cpu_util"]["mean"] >= 0
    assert any(n.startswith("device telemetry: NVML unavailable") for n in doc["status"]["notes"])
    header = rows[0].split(",")
    assert "telemetry_source" in header and "rss_mib_peak" in header and rows[1].split(",")[header.index("telemetry_source")] == "process"
    assert len([r for r in doc["requests"] if not r["warmup"]]) == 32
    # AIPerf's per-request export: one MetricRecordInfo per measured request (aiperf@db4f6397 record_models.py)
    lines = [json.loads(x) for x in (out / "profile_export.jsonl").read_text().splitlines()]
    assert len(lines) == 32 and all(set(x) == {"metadata", "metrics", "error"} and x["error"] is None for x in lines)
    rec = next(x for x in lines if x["metadata"]["scenario"] == "16:8")
    assert rec["metrics"]["output_sequence_length"] == {"value": 8, "unit": "tokens"}
    assert len(rec["metrics"]["inter_chunk_latency"]["value"]) == 7  # 8 one-token responses → 7 gaps
    m = rec["metrics"]  # ITL = (E2E − TTFT) / (OSL − 1); E2E no shorter than the model's 50 ms + 7 × 10 ms
    assert m["inter_token_latency"]["value"] == pytest.approx((m["request_latency"]["value"] - m["time_to_first_token"]["value"]) / 7)
    assert m["time_to_first_token"]["value"] >= 50.0 and m["request_latency"]["value"] >= 120.0
    meta = rec["metadata"]
    assert meta["request_start_ns"] < meta["request_ack_ns"] < meta["request_end_ns"] and meta["benchmark_phase"] == "profiling"
    # aggregated AIPerf files per load point (4 here), none at the top
    aggs = sorted(p.parent.name for p in (out / "aiperf").glob("*/profile_export_aiperf.json"))
    assert aggs == ["16x8_c1", "16x8_c4", "8x4_c1", "8x4_c4"] and not (out / "profile_export_aiperf.json").exists()
    agg = json.loads((out / "aiperf" / "8x4_c4" / "profile_export_aiperf.json").read_text())
    assert agg["output_sequence_length"]["avg"] == 4 and agg["request_count"] == {"unit": "requests", "avg": 8}
    assert set(agg["time_to_first_token"]) == {"unit", "avg", "min", "max", "p1", "p5", "p10", "p25", "p50", "p75", "p90",
                                               "p95", "p99", "std"}
    head = (out / "aiperf" / "8x4_c4" / "profile_export_aiperf.csv").read_text().splitlines()[0]
    assert head == "Metric,avg,min,max,p1,p5,p10,p25,p50,p75,p90,p95,p99,std"
    # vLLM-style block and the definitions table in bench.json
    v = doc["load_points"][0]["vllm"]
    assert v["completed"] == 8 and v["total_output_tokens"] == 64 and v["max_concurrency"] == 1
    assert v["mean_itl_ms"] == doc["load_points"][0]["summary"]["metrics"]["inter_chunk_latency"]["avg"]
    assert doc["definitions"]["inter_chunk_latency"]["vllm"] == "ITL"
    assert doc["definitions"]["inter_token_latency"]["aiperf"] == "inter_token_latency"


def test_cli_text_model_without_tokenizer_is_one_clear_error(server, tmp_path):
    # cwd without artifacts/.last_build: the default model `ensemble` takes text and no tokenizer is known
    p = subprocess.run([TRTPIPE, "bench", "--url", server.grpc_url, "--isl", "8", "--osl", "4", "--out", str(tmp_path / "r")],
                       capture_output=True, text=True, timeout=120, cwd=tmp_path)
    assert p.returncode == 2, p.stderr
    assert "model 'ensemble' takes text" in p.stderr and "--tokenizer" in p.stderr
    assert len([ln for ln in p.stderr.splitlines() if "error" in ln]) == 1 and not (tmp_path / "r").exists()


def test_cli_request_rate_mode(server, tmp_path):
    out = tmp_path / "run"
    p = subprocess.run([TRTPIPE, "bench", "--url", server.grpc_url, "--model", "tensorrt_llm", "--isl", "8", "--osl", "4",
                        "--request-rate", "20", "--arrival", "constant", "--num-requests", "10", "--warmup", "0",
                        "--out", str(out)], capture_output=True, text=True, timeout=120, cwd=tmp_path)
    assert p.returncode == 0, p.stderr
    doc = json.loads((out / "bench.json").read_text())
    starts = [r["start_ns"] for r in sorted(doc["requests"], key=lambda r: r["index"])]
    assert len(starts) == 10  # request k is due k × 50 ms after the phase starts (after the run's t0): never earlier
    assert all(t >= k * 50_000_000 - 1_000 for k, t in enumerate(starts)), starts
    assert doc["load_points"][0]["request_rate"] == 20.0


def _bench_proc(url: str, out: Path) -> subprocess.Popen:
    return subprocess.Popen([TRTPIPE, "bench", "--url", url, "--model", "tensorrt_llm", "--isl", "8", "--osl", "300",
                             "--concurrency", "4", "--num-requests", "12", "--warmup", "0", "--out", str(out)],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, cwd=out.parent)


def _wait_for_load(proc: subprocess.Popen, timeout_s: float = 90.0) -> list[str]:
    """Block until the bench has started sending load (its preflight line is on stderr), then ~1 s more.

    Returns the list that a reader thread keeps filling with the rest of stderr; stdout is drained too,
    so ``proc.wait()`` (not ``communicate()``) must be used afterwards.
    """
    lines: list[str] = []
    started = threading.Event()

    def read_err() -> None:
        for line in proc.stderr:
            lines.append(line)
            if "interface, Triton" in line:
                started.set()

    threading.Thread(target=read_err, daemon=True).start()
    threading.Thread(target=proc.stdout.read, daemon=True).start()
    assert started.wait(timeout_s), f"bench did not start: {''.join(lines)}"
    time.sleep(1.0)  # ~1 s into 3 s requests
    assert proc.poll() is None, "".join(lines)
    return lines


def test_server_dying_mid_run_writes_partial_results_and_exits_1(tmp_path):
    out = tmp_path / "run"
    with _server(tmp_path / "server.log") as srv:
        proc = _bench_proc(srv.grpc_url, out)
        err_lines = _wait_for_load(proc)
        srv.stop(grace_s=0)  # SIGKILL: the server dies
    proc.wait(timeout=60)
    time.sleep(0.2)  # let the reader thread take the last lines
    stderr = "".join(err_lines)
    assert proc.returncode == 1, stderr
    assert "server became unreachable" in stderr
    doc = json.loads((out / "bench.json").read_text())
    assert doc["status"]["aborted"] and not doc["status"]["complete"]
    assert doc["load_points"][0]["summary"]["counts"]["failed"] >= 4


@pytest.mark.parametrize("sig", [signal.SIGINT, signal.SIGTERM])  # Ctrl-C; `kill` / `timeout` (#44: kept nothing)
def test_ctrl_c_stops_cleanly_writes_results_and_releases_the_server(tmp_path, sig):
    out = tmp_path / "run"
    with _server(tmp_path / "server.log") as srv:
        proc = _bench_proc(srv.grpc_url, out)
        err_lines = _wait_for_load(proc)
        proc.send_signal(sig)
        proc.wait(timeout=30)
        time.sleep(0.2)
        stderr = "".join(err_lines)
        rc = srv.stop()  # the streams were closed: nothing in flight when the server is asked to stop
    assert proc.returncode == 130, stderr
    doc = json.loads((out / "bench.json").read_text())
    assert doc["status"]["interrupted"] and doc["load_points"][0]["summary"]["counts"]["requests"] >= 4
    assert not doc["status"]["complete"] and any(f"interrupted ({sig.name})" in w for w in doc["status"]["warnings"])
    log = (tmp_path / "server.log").read_text()
    assert rc == 0 and re.search(r"Timeout \d+: Found 0 model versions that have in-flight inferences", log), log[-2000:]
    assert not re.search(r"Found [1-9]\d* model versions that have in-flight inferences", log), log[-2000:]


def test_server_metrics_deltas_from_triton_prometheus(server, tmp_path):
    """Triton's /metrics scraped before and after the measured phase: its request count is the bench's."""
    spec = BenchSpec(model="tensorrt_llm", scenarios=[{"isl": 16, "osl": 8}], concurrency=[1, 4], num_requests=12, warmup_requests=2)
    run = bench.run(spec, BenchTarget(url=server.grpc_url, out=tmp_path / "run", metrics_url=server.metrics_url))
    check_outcome(run, run.run_dir)
    for point in run.load_points:
        sm = point.server_metrics
        assert sm["url"] == server.metrics_url
        assert sm["counters"]["request_success"] == 12 and sm["counters"].get("request_failure", 0) == 0, sm
        # deltas per request, ms (their size is the machine's: only their sign is asserted)
        assert sm["queue_ms_per_request"] >= 0 and sm["compute_infer_ms_per_request"] >= 0, sm
        assert sm["trt_llm"] == {}  # no TensorRT-LLM backend on the CPU Triton
    doc = json.loads((run.run_dir / "bench.json").read_text())
    assert doc["load_points"][1]["server_metrics"]["counters"]["request_success"] == 12


def test_unreachable_metrics_url_is_a_note_not_a_failure(server, tmp_path):
    spec = BenchSpec(model="tensorrt_llm", scenarios=[{"isl": 8, "osl": 4}], concurrency=[1], num_requests=2, warmup_requests=0)
    bad = f"http://127.0.0.1:{free_port()}/metrics"
    run = bench.run(spec, BenchTarget(url=server.grpc_url, out=tmp_path / "run", metrics_url=bad))
    check_outcome(run, run.run_dir)
    assert run.load_points[0].server_metrics is None
    assert any(n.startswith(f"server metrics not scraped: {bad}") for n in run.notes)


@pytest.mark.parametrize(("model", "isl", "osl"), [("ensemble", 40, 6), ("tensorrt_llm", 16, 8)])
def test_triton_http_and_grpc_bench_the_same_deployment_identically(server, tmp_path, model, isl, osl):
    """``--api triton-http`` (generate_stream, SSE) and gRPC send the same inputs: same counts, exact OSL."""
    spec = BenchSpec(model=model, scenarios=[{"isl": isl, "osl": osl}], concurrency=[4], num_requests=8, warmup_requests=1, seed=3)
    runs = {}
    for api, url in (("grpc", server.grpc_url), ("triton-http", f"http://{server.http_url}")):
        run = bench.run(spec, BenchTarget(url=url, api=api, tokenizer=_smollm2_tokenizer(), out=tmp_path / api))
        check_outcome(run)
        s = run.load_points[0].summary
        assert s.counts.completed == 8 and s.counts.short == 0 and s.counts.output_tokens == 8 * osl
        assert s.osl_check.mismatch == 0 and s.metrics["input_sequence_length"]["min"] == isl
        runs[api] = sorted((r.index, r.input_tokens, tuple(sorted(r.osl_counts.items()))) for r in run.records if not r.warmup)
    assert runs["grpc"] == runs["triton-http"]
    assert all(dict(c)["client"] == osl and len(c) == 2 for _, _, c in runs["grpc"])  # client + server/retokenized


def test_triton_http_preflight_errors_are_one_line(server, tmp_path):
    from pipeline.core.errors import UserError

    spec = BenchSpec(model="nope", scenarios=[{"isl": 8, "osl": 2}], concurrency=[1], num_requests=1)
    with pytest.raises(UserError, match=r"model 'nope' is not ready on http://"):
        bench.run(spec, BenchTarget(url=f"http://{server.http_url}", api="triton-http", out=tmp_path / "a"))
