#!/usr/bin/env python3
"""How many streamed responses per second can the bench client absorb on one core?

Runs the real bench client (:func:`pipeline.bench.stage.run`) against the ``fast_streamer``
model of ``tests/data/timed_llm_repo`` — a decoupled python model that sends one token per
response as fast as the backend can — on a real Triton (started here on CPU with
:class:`pipeline.triton.server.TritonServer`, or ``--url`` of a running one serving that repository).

For each concurrency it prints responses/s received, the client's CPU time over wall time
(``time.process_time``, all threads) and their ratio: **responses per client CPU-second**, the
most the client can absorb on one fully used core. The server shares the machine, so the
received rate is usually server-bound; the per-CPU-second figure is the client's ceiling.

    .venv/bin/python benchmarks/bench_client_ceiling.py [--concurrency 1,4,16] [--osl 2000] [--url HOST:PORT]
"""

from __future__ import annotations

import argparse
import contextlib
import json
import sys
import tempfile
from pathlib import Path

from pipeline.bench import stage as bench
from pipeline.recipe.bench import BenchSpec

MODEL_REPO = Path(__file__).resolve().parents[1] / "tests" / "data" / "timed_llm_repo"


def measure(url: str, concurrency: list[int], osl: int, requests: int, out: Path) -> list[dict]:
    """Run the bench on ``fast_streamer``; one result dict per concurrency (rates per s)."""
    spec = BenchSpec(model="fast_streamer", scenarios=[{"isl": 8, "osl": osl}], concurrency=concurrency,
                     num_requests=requests, warmup_requests=1, request_timeout_s=120)
    run = bench.run(spec, bench.BenchTarget(url=url, out=out))
    rows = []
    for p in run.load_points:
        responses = sum(len(r.response_ns) for r in p.records(run.records) if not r.warmup)
        rows.append({
            "concurrency": p.concurrency,
            "responses": responses,
            "wall_s": p.wall_s,
            "responses_per_s": responses / p.wall_s,
            "client_cpu_fraction": p.client_cpu_fraction,
            "responses_per_client_cpu_s": responses / p.client_cpu_s if p.client_cpu_s else float("nan"),
            "failed": p.summary.counts.failed if p.summary else 0,
        })
    return rows


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--url", help="gRPC host:port of a running Triton serving tests/data/timed_llm_repo")
    ap.add_argument("--concurrency", default="1,4,16", help="comma-separated (default 1,4,16)")
    ap.add_argument("--osl", type=int, default=2000, help="tokens (= responses) per request (default 2000)")
    ap.add_argument("--requests", type=int, default=4, help="measured requests per concurrency (default 4)")
    ap.add_argument("--json", action="store_true", help="print JSON instead of a table")
    args = ap.parse_args(argv)
    conc = [int(c) for c in args.concurrency.split(",")]
    with contextlib.ExitStack() as stack:
        url = args.url
        if url is None:
            from pipeline.triton.server import TritonServer

            srv = stack.enter_context(TritonServer(MODEL_REPO, http_port=None, grpc_port=None, metrics_port=None,
                                                   ready_timeout_s=90))
            url = srv.grpc_url
        out = Path(stack.enter_context(tempfile.TemporaryDirectory())) / "run"
        rows = measure(url, conc, args.osl, max(args.requests, 1), out)
    if args.json:
        print(json.dumps(rows, indent=2))
    else:
        print(f"{'conc':>5} {'responses/s':>12} {'client CPU':>11} {'responses/CPU-s':>16} {'failed':>7}")
        for r in rows:
            print(f"{r['concurrency']:>5} {r['responses_per_s']:>12,.0f} {r['client_cpu_fraction']:>10.0%} "
                  f"{r['responses_per_client_cpu_s']:>16,.0f} {r['failed']:>7}")
        best = max(r["responses_per_client_cpu_s"] for r in rows)
        print(f"client ceiling ≈ {best:,.0f} responses/s on one core")
    return 0 if all(r["failed"] == 0 for r in rows) else 1


if __name__ == "__main__":
    sys.exit(main())
