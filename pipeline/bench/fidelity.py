"""Bench accuracy against a model with known timing (``tests/data/timed_llm_repo``).

The timed model emits token ``i`` at ``arrival + 50 ms + i × 10 ms`` and, when asked
(``return_perf_metrics``), returns ``arrival_time_ns``, ``first_token_time_ns`` and
``last_token_time_ns`` (CLOCK_REALTIME ns, the clock every process on the machine shares).
The client converts its receipt times (``perf_counter_ns``) to that clock with the offset taken
at run start (``t0_epoch_ns``), so every request decomposes into

    request path   client send → model arrival   (gRPC + Triton queue + python-backend IPC)
    model          arrival → first token sent     (nominal 50 ms)
    response path  model send → client timestamp  (python-backend IPC + Triton + gRPC + client)

**Truth** per request is what the server actually did, as an ideal client would see it:
TTFT_truth = (model first-token send − client send) + the server's response-path floor, where the
floor is the median response path measured at concurrency 1 by :func:`reference_response_path` —
a minimal gRPC stream reader that shares no code with the bench (python-backend IPC + Triton +
gRPC, which every client sees). ITL_truth = (last − first token send) / (tokens − 1); the paths
cancel. The bench's **error** is its reported average minus the truth. A load point passes when
|error| ≤ max(1 ms, 2 % of the truth) for the average TTFT and ITL. The nominal 50/10 ms are
reported next to it: the gap is the server's own overhead and queueing on this machine (when the
response path grows far beyond the floor, the server is saturated).
"""

from __future__ import annotations

import time
from typing import Any

import numpy as np

NOMINAL_TTFT_MS = 50.0
NOMINAL_ITL_MS = 10.0
ABS_TOL_MS = 1.0
REL_TOL = 0.02


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
    import asyncio

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
