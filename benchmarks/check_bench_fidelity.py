#!/usr/bin/env python3
"""How accurately does ``trtpipe bench`` report TTFT and ITL? Measured against a model with known timing.

Starts the real Triton (CPU, :class:`pipeline.triton.server.TritonServer`) on ``tests/data/timed_llm_repo`` — its
``tensorrt_llm`` model emits the first token 50 ms after a request arrives and then one token every 10 ms
(deadline-scheduled, a thread per request) — or uses ``--url`` of a running one. Runs the bench
(:func:`pipeline.bench.stage.run`, server timestamps on) at each concurrency and prints, per load point (ms):

* bench TTFT/ITL next to the truth from the server's own timeline and the nominal 50/10 ms;
* the TTFT decomposition: request path, model, response path;
* the response-path floor of the server, measured first by a minimal reference client;
* PASS when |bench − truth| ≤ max(1 ms, 2 %) for average TTFT and ITL.

    .venv/bin/python benchmarks/check_bench_fidelity.py [--concurrency 1,16,64] [--osl 20] [--url HOST:PORT] [--json]

Measured 2026-11-27 01:15–01:27 UTC on the 2-core CI host (main 6cf60e0 + the issue #33 restructure, under the
shared heavy-job lock, three runs, defaults: ISL 32, OSL 20, 3 × concurrency requests, ≥ 16), error = bench − truth:

    load  TTFT error, ms          TTFT truth, ms  ITL error, ms              ITL truth, ms  client CPU
    c1    −0.32 / +0.02 / −0.12   53              −0.001 / −0.003 / +0.007   10.0           6–7 %
    c16   −1.09 / −0.64 / +0.68   60–62           +0.080 / +0.090 / +0.054   10.0           34–38 %
    c64   +1.71 / +0.80 / +0.55   116–141         +0.041 / +0.135 / +0.158   11.9–14.7      51–61 %

every load point within max(1 ms, 2 %). The same 64-stream check as a CI test once measured +5.5 ms against a
2.9 ms tolerance (client at 0.41 of a core) and +21.2 ms another time, on busy moments of a shared host.

Exit status 0 when every load point passes, 1 otherwise. This is a measurement, not a test: the error at 64 streams
depends on how much CPU the machine has left for the server's response path (on the 2-core CI host the server, its
python stubs and the client share two cores), so it lives here; the test suite checks what cannot fail on a slow
moment (tests/test_bench_triton.py: the bench never reports less than the model's schedule, never a receipt before
the server's send, and its statistics are its own timestamps).

The timed model stamps ``arrival_time_ns``, ``first_token_time_ns`` and ``last_token_time_ns`` (CLOCK_REALTIME ns)
on its final response when asked (``return_perf_metrics``). The client converts its receipt times
(``perf_counter_ns``) to that clock with the offset taken at run start (``t0_epoch_ns``), so every request
decomposes into

    request path   client send → model arrival   (gRPC + Triton queue + python-backend IPC)
    model          arrival → first token sent     (nominal 50 ms)
    response path  model send → client timestamp  (python-backend IPC + Triton + gRPC + client)

**Truth** per request is what the server actually did, as an ideal client would see it: TTFT_truth = (model
first-token send − client send) + the server's response-path floor, where the floor is the median response path
measured at concurrency 1 by :func:`reference_response_path` — a minimal gRPC stream reader that shares no code with
the bench (python-backend IPC + Triton + gRPC, which every client sees). ITL_truth = (last − first token send) /
(tokens − 1); the paths cancel. The bench's **error** is its reported average minus the truth. The nominal 50/10 ms
are reported next to it: the gap is the server's own overhead and queueing on this machine (when the response path
grows far beyond the floor, the server is saturated).
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import numpy as np

from pipeline.bench import stage as bench
from pipeline.bench.exporters import BENCH_JSON
from pipeline.recipe.bench import BenchSpec

NOMINAL_TTFT_MS = 50.0
NOMINAL_ITL_MS = 10.0
ABS_TOL_MS = 1.0
REL_TOL = 0.02
MODEL_REPO = Path(__file__).resolve().parents[1] / "tests" / "data" / "timed_llm_repo"


def tolerance_ms(truth_ms: float) -> float:
    """Allowed |error| in ms: max(1 ms, 2 % of the truth)."""
    return max(ABS_TOL_MS, REL_TOL * abs(truth_ms))


async def _reference_once(url: str, model: str, isl: int, osl: int) -> float:
    import grpc
    from tritonclient.grpc import service_pb2, service_pb2_grpc

    req = service_pb2.ModelInferRequest(model_name=model)
    for name, arr in (("input_ids", np.arange(1000, 1000 + isl, dtype=np.int32).reshape(1, -1)),
                      ("input_lengths", np.array([[isl]], np.int32)), ("request_output_len", np.array([[osl]], np.int32)),
                      ("streaming", np.array([[True]])), ("return_perf_metrics", np.array([[True]]))):
        t = req.inputs.add()
        t.name, t.datatype = name, "BOOL" if arr.dtype == np.bool_ else "INT32"
        t.shape.extend(arr.shape)
        req.raw_input_contents.append(arr.tobytes())
    first_rx = path = None
    async with grpc.aio.insecure_channel(url) as ch:
        async for resp in service_pb2_grpc.GRPCInferenceServiceStub(ch).ModelStreamInfer(iter((req,)), timeout=30):
            first_rx = first_rx or time.time_ns()
            ir = resp.infer_response
            if ir.parameters["triton_final_response"].bool_param:  # then drain: the server ends the stream
                names = [o.name for o in ir.outputs]
                first_tx = int.from_bytes(ir.raw_output_contents[names.index("first_token_time_ns")][:8], "little")
                path = (first_rx - first_tx) / 1e6
    if path is None:
        raise RuntimeError("reference stream ended without a final response")
    return path


def reference_response_path(url: str, model: str = "tensorrt_llm", n: int = 20, isl: int = 32, osl: int = 2) -> float:
    """Median response path (model send → receipt, ms) of ``n`` sequential requests read by a
    minimal client (raw ``grpc.aio`` stream, timestamp on receipt, nothing else)."""

    async def run() -> list[float]:
        return [await _reference_once(url, model, isl, osl) for _ in range(n)]

    return float(np.median(asyncio.run(run())))


def fidelity_report(doc: dict[str, Any], response_floor_ms: float = 0.0) -> list[dict[str, Any]]:
    """One row per load point of a ``bench.json`` document run with ``--server-timestamps``.

    ``response_floor_ms`` is the server's response-path floor (:func:`reference_response_path`).
    Row fields (ms): ``bench_ttft``, ``truth_ttft``, ``ttft_error``, ``bench_itl``,
    ``truth_itl``, ``itl_error``, ``request_path``, ``model_ttft``, ``response_path``,
    ``nominal_ttft``/``nominal_itl``, ``pass``; plus ``load``, ``requests``, ``client_cpu_fraction``.

    Raises:
        ValueError: no request carries server timestamps (run without ``perf_metrics``).
    """
    off = doc["t0_epoch_ns"]
    rows = []
    for lp in doc["load_points"]:
        rs = [r for r in doc["requests"] if r["load"] == lp["load"] and r["scenario"] == lp["scenario"]
              and not r["warmup"] and r["error"] is None and r.get("server") and r["output_tokens"] >= 2]
        if not rs:
            raise ValueError(f"{lp['scenario']} {lp['load']}: no request with server timestamps")
        send = np.array([r["start_ns"] + off for r in rs], np.float64)
        first_rx = np.array([r["response_ns"][0] + off for r in rs], np.float64)
        arrival = np.array([r["server"]["arrival_time_ns"] for r in rs], np.float64)
        first_tx = np.array([r["server"]["first_token_time_ns"] for r in rs], np.float64)
        last_tx = np.array([r["server"]["last_token_time_ns"] for r in rs], np.float64)
        n = np.array([r["output_tokens"] for r in rs], np.float64)
        m = lp["summary"]["metrics"]
        truth_ttft = float(np.mean(first_tx - send)) / 1e6 + response_floor_ms
        truth_itl = float(np.sum(last_tx - first_tx) / np.sum(n - 1)) / 1e6
        bench_ttft, bench_itl = m["time_to_first_token"]["avg"], m["inter_token_latency"]["avg"]
        row = {
            "scenario": lp["scenario"], "load": lp["load"], "requests": len(rs),
            "client_cpu_fraction": lp.get("client_cpu_fraction"),
            "bench_ttft": bench_ttft, "truth_ttft": truth_ttft, "ttft_error": bench_ttft - truth_ttft,
            "bench_itl": bench_itl, "truth_itl": truth_itl, "itl_error": bench_itl - truth_itl,
            "request_path": float(np.mean(arrival - send)) / 1e6,
            "model_ttft": float(np.mean(first_tx - arrival)) / 1e6,
            "response_path": float(np.mean(first_rx - first_tx)) / 1e6,
            "response_floor": response_floor_ms, "nominal_ttft": NOMINAL_TTFT_MS, "nominal_itl": NOMINAL_ITL_MS,
            "bench_ttft_p50": m["time_to_first_token"]["p50"], "bench_itl_p50": m["inter_token_latency"]["p50"],
        }
        row["pass"] = abs(row["ttft_error"]) <= tolerance_ms(truth_ttft) and abs(row["itl_error"]) <= tolerance_ms(truth_itl)
        rows.append(row)
    return rows


def timed_repo(tmp: Path, first_token_ms: float, itl_ms: float) -> Path:
    """``tests/data/timed_llm_repo`` itself, or a copy whose ``tensorrt_llm`` has other timing (ms)."""
    if (first_token_ms, itl_ms) == (50.0, 10.0):
        return MODEL_REPO
    import re
    import shutil

    repo = tmp / "timed_llm_repo"
    shutil.copytree(MODEL_REPO, repo, ignore=shutil.ignore_patterns("__pycache__"))
    cfg = repo / "tensorrt_llm" / "config.pbtxt"
    text = cfg.read_text()
    for key, value in (("first_token_ms", first_token_ms), ("itl_ms", itl_ms)):
        text = re.sub(rf'(key: "{key}"\s*value: {{ string_value: )"[^"]*"', rf'\g<1>"{value:g}"', text)
    cfg.write_text(text)
    return repo


def check(url: str, concurrency: list[int], osl: int, isl: int, rounds: int, out: Path) -> list[dict]:
    """Bench the timed model at each concurrency (``rounds`` × concurrency requests, ≥ 16); fidelity rows."""
    floor = reference_response_path(url)
    rows = []
    for c in concurrency:  # one run per load point so each gets its own request count
        spec = BenchSpec(model="tensorrt_llm", scenarios=[{"isl": isl, "osl": osl}], concurrency=[c],
                         num_requests=max(rounds * c, 16), warmup_requests=min(c, 8), request_timeout_s=60,
                         server_timestamps=True, seed=c)
        bench.run(spec, bench.BenchTarget(url=url, out=out / f"c{c}"))
        rows += fidelity_report(json.loads((out / f"c{c}" / BENCH_JSON).read_text()), response_floor_ms=floor)
    return rows


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[1])
    ap.add_argument("--url", help="gRPC host:port of a running Triton serving tests/data/timed_llm_repo")
    ap.add_argument("--concurrency", default="1,16,64", help="comma-separated (default 1,16,64)")
    ap.add_argument("--isl", type=int, default=32, help="prompt tokens (default 32)")
    ap.add_argument("--osl", type=int, default=20, help="output tokens per request (default 20)")
    ap.add_argument("--rounds", type=int, default=3, help="requests per load point = rounds × concurrency (min 16)")
    ap.add_argument("--first-token-ms", type=float, default=50.0, help="timed model's first-token delay (default 50)")
    ap.add_argument("--itl-ms", type=float, default=10.0, help="timed model's token interval (default 10); "
                    "concurrency/itl_ms × 1000 responses/s must stay within what the server can send on this machine")
    ap.add_argument("--keep", type=Path, help="keep the run directories here")
    ap.add_argument("--json", action="store_true", help="print the rows as JSON")
    args = ap.parse_args(argv)
    conc = [int(c) for c in args.concurrency.split(",")]
    with contextlib.ExitStack() as stack:
        url = args.url
        if url is None:
            from pipeline.triton.server import TritonServer

            repo = timed_repo(Path(stack.enter_context(tempfile.TemporaryDirectory())), args.first_token_ms, args.itl_ms)
            srv = stack.enter_context(TritonServer(repo, http_port=None, grpc_port=None, metrics_port=None,
                                                   ready_timeout_s=90))
            url = srv.grpc_url
        out = args.keep or Path(stack.enter_context(tempfile.TemporaryDirectory()))
        rows = check(url, conc, args.osl, args.isl, args.rounds, out)
        for r in rows:
            r["nominal_ttft"], r["nominal_itl"] = args.first_token_ms, args.itl_ms
    if args.json:
        print(json.dumps(rows, indent=2))
    else:
        print(f"{'load':>5} {'TTFT bench':>10} {'truth':>7} {'err':>6} {'nominal':>7} | {'ITL bench':>9} {'truth':>7} "
              f"{'err':>6} {'nominal':>7} | {'req path':>8} {'model':>6} {'resp path':>9} | {'cpu':>4}  result")
        for r in rows:
            print(f"{r['load']:>5} {r['bench_ttft']:>10.2f} {r['truth_ttft']:>7.2f} {r['ttft_error']:>+6.2f} "
                  f"{r['nominal_ttft']:>7.1f} | {r['bench_itl']:>9.3f} {r['truth_itl']:>7.3f} {r['itl_error']:>+6.3f} "
                  f"{r['nominal_itl']:>7.1f} | {r['request_path']:>8.2f} {r['model_ttft']:>6.2f} {r['response_path']:>9.2f} | "
                  f"{r['client_cpu_fraction']:>4.0%}  {'PASS' if r['pass'] else 'FAIL'}")
        print(f"ms; truth = the server's own timeline + its response-path floor {rows[0]['response_floor']:.2f} ms "
              "(minimal reference client, concurrency 1); pass = |err| <= max(1 ms, 2 %) for TTFT and ITL averages")
    return 0 if all(r["pass"] for r in rows) else 1


if __name__ == "__main__":
    sys.exit(main())
