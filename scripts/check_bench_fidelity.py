#!/usr/bin/env python3
"""Check that ``trtpipe bench`` reports TTFT and ITL accurately, against a model with known timing.

Starts the real Triton (CPU, :class:`pipeline.triton.server.TritonServer`) on
``tests/data/timed_llm_repo`` — its ``tensorrt_llm`` model emits the first token 50 ms after a
request arrives and then one token every 10 ms (deadline-scheduled, a thread per request) — or
uses ``--url`` of a running one. Runs the bench (:func:`pipeline.stages.bench.run`, server
timestamps on) at each concurrency and prints, per load point (ms):

* bench TTFT/ITL next to the truth from the server's own timeline and the nominal 50/10 ms;
* the TTFT decomposition: request path, model, response path (see :mod:`pipeline.bench.fidelity`);
* the response-path floor of the server, measured first by a minimal reference client;
* PASS when |bench − truth| ≤ max(1 ms, 2 %) for average TTFT and ITL.

    .venv/bin/python scripts/check_bench_fidelity.py [--concurrency 1,16,64] [--osl 20] [--url HOST:PORT] [--json]

Exit status 0 when every load point passes, 1 otherwise.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import sys
import tempfile
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from pipeline.bench.exporters import BENCH_JSON  # noqa: E402
from pipeline.bench.fidelity import fidelity_report, reference_response_path  # noqa: E402
from pipeline.recipe.bench import BenchSpec  # noqa: E402
from pipeline.stages import bench  # noqa: E402

MODEL_REPO = REPO / "tests" / "data" / "timed_llm_repo"


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
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
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
