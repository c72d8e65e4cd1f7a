#!/usr/bin/env python3
"""Soak a running deployment: N concurrent streams for M minutes, then a verdict.

    python scripts/soak.py --url 127.0.0.1:8001 --model ensemble --tokenizer artifacts/x/triton_repo/preprocessing/tokenizer \\
        --streams 32 --minutes 10 --isl 100 --osl 64 --server-pid $(jq .pid artifacts/serve.json) --json out.json
    python scripts/soak.py --repo tests/data/timed_llm_repo --model tensorrt_llm --streams 256 --minutes 10 --osl 20

With ``--repo`` (or a build directory) the script starts the server itself (pipeline.stages.serve.run, free
ports). Each of the N streams sends requests back to back with the bench's own client
(pipeline.bench.client: exact ISL, OSL forced with min_tokens), keeps no per-request history (only counters),
and every ``--sample-s`` seconds records the server's RSS (its process tree: tritonserver + python stubs) and
this process's RSS. Verdict (exit 0 / 1): no failed request, every request exactly OSL tokens, and RSS growth
after warm-up (the first ``--warmup-minutes``) below ``--max-growth`` (default 5 %) for both.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import sys
import threading
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from pipeline.bench import client as bclient  # noqa: E402
from pipeline.bench.prompts import load_tokenizer, text_prompts, token_prompts  # noqa: E402
from pipeline.bench.records import RequestRecord  # noqa: E402


def _rss(pid: int) -> int:
    from pipeline.triton.process import tree_rss

    return tree_rss(pid)


class Sampler(threading.Thread):
    """Samples (elapsed s, server RSS, client RSS) every ``period`` seconds."""

    def __init__(self, server_pid: int | None, period: float) -> None:
        super().__init__(daemon=True)
        import psutil

        self.server_pid, self.period, self.me = server_pid, period, psutil.Process()
        self.samples: list[tuple[float, int, int]] = []
        self.done = threading.Event()
        self.t0 = time.monotonic()

    def run(self) -> None:
        while not self.done.is_set():
            server = _rss(self.server_pid) if self.server_pid else 0
            self.samples.append((time.monotonic() - self.t0, server, self.me.memory_info().rss))
            self.done.wait(self.period)


async def soak(url: str, model: str, streams: int, seconds: float, isl: int, osl: int, tokenizer_dir: Path | None,
               timeout_s: float) -> dict:
    info = await bclient.preflight(url, model)
    tok = load_tokenizer(tokenizer_dir) if tokenizer_dir else None
    n = min(512, streams * 2)
    prompts = text_prompts(n, isl, seed=0, tokenizer=tok) if info.takes_text else token_prompts(n, isl, seed=0, tokenizer=tok)
    requests = [bclient.build_request(info, p, osl, request_id="", ignore_eos=True) for p in prompts]
    client = bclient.StreamClient(url, info, timeout_s=timeout_s, max_streams=streams)
    counts = {"requests": 0, "completed": 0, "failed": 0, "short": 0, "long": 0, "output_tokens": 0}
    errors: dict[str, int] = {}
    deadline = time.monotonic() + seconds

    aborted: list[str] = []

    async def worker(w: int) -> None:
        i = w
        while time.monotonic() < deadline and not aborted:
            k = i % len(requests)
            rec = RequestRecord(f"{isl}:{osl}", f"c{streams}", i, False, prompts[k].num_tokens, osl)
            await client.stream(bclient.with_request_id(requests[k], f"soak-{i}"), rec)
            counts["requests"] += 1
            if rec.error:
                counts["failed"] += 1
                errors[rec.error[:120]] = errors.get(rec.error[:120], 0) + 1
                if rec.error.startswith("UNAVAILABLE") and not aborted:  # the server went away: stop, report
                    aborted.append(f"server unreachable after {time.monotonic() - (deadline - seconds):.0f} s: {rec.error[:200]}")
            else:
                got = sum(t for t in rec.response_tokens if t > 0)
                if got == 0 and tok is not None and rec.response_text:
                    got = len(tok.encode(b"".join(rec.response_text).decode("utf-8", "replace"), add_special_tokens=False))
                counts["completed"] += 1
                counts["output_tokens"] += got
                counts["short"] += got < osl
                counts["long"] += got > osl
            i += streams

    try:
        await asyncio.gather(*(worker(w) for w in range(streams)))
    finally:
        await client.close()
    return {"counts": counts, "errors": errors, "aborted": aborted[0] if aborted else None}


def growth(samples: list[tuple[float, int, int]], after_s: float, column: int) -> float | None:
    """Relative RSS growth from the first sample after warm-up to the mean of the last 10 % of samples."""
    post = [s[column] for s in samples if s[0] >= after_s and s[column] > 0]
    if len(post) < 3:
        return None
    tail = post[-max(1, len(post) // 10):]
    return (sum(tail) / len(tail)) / post[0] - 1.0


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--url", help="gRPC host:port of a running deployment (or use --repo)")
    ap.add_argument("--repo", type=Path, help="a build directory or model repository to serve for the soak")
    ap.add_argument("--server-pid", type=int, help="PID of the running server (for its RSS; default: the one started)")
    ap.add_argument("--model", default="ensemble")
    ap.add_argument("--tokenizer", type=Path, help="tokenizer dir (text models; default: the build's)")
    ap.add_argument("--streams", type=int, default=32)
    ap.add_argument("--minutes", type=float, default=10.0)
    ap.add_argument("--warmup-minutes", type=float, default=1.0)
    ap.add_argument("--isl", type=int, default=100)
    ap.add_argument("--osl", type=int, default=64)
    ap.add_argument("--timeout", type=float, default=600.0, help="per-request timeout (s)")
    ap.add_argument("--sample-s", type=float, default=5.0)
    ap.add_argument("--max-growth", type=float, default=0.05)
    ap.add_argument("--json", type=Path, help="write the report here")
    args = ap.parse_args(argv)
    if (args.url is None) == (args.repo is None):
        ap.error("give exactly one of --url and --repo")
    handle = None
    try:
        if args.repo is not None:
            from pipeline.layout import BuildLayout
            from pipeline.stages import serve

            target = BuildLayout(args.repo) if BuildLayout(args.repo).is_build() else args.repo
            handle = serve.run(target, serve.ServeOptions(http_port=None, grpc_port=None, metrics_port=None,
                                                          ready_timeout_s=300))
            url, pid = handle.grpc_url, handle.server.pid
            tokenizer = args.tokenizer or (handle.layout.tokenizer_dir() if handle.layout else None)
        else:
            url, pid, tokenizer = args.url, args.server_pid, args.tokenizer
        sampler = Sampler(pid, args.sample_s)
        sampler.start()
        t0 = time.monotonic()
        result = asyncio.run(soak(url, args.model, args.streams, args.minutes * 60, args.isl, args.osl, tokenizer,
                                  args.timeout))
        wall = time.monotonic() - t0
        sampler.done.set()
        sampler.join()
    finally:
        if handle is not None:
            handle.stop()
    c = result["counts"]
    report = {
        "url": url, "model": args.model, "streams": args.streams, "minutes": args.minutes, "isl": args.isl,
        "osl": args.osl, "wall_s": round(wall, 1), **c, "errors": result["errors"], "aborted": result["aborted"],
        "output_tokens_per_s": c["output_tokens"] / wall if wall else 0.0,
        "server_rss_growth": growth(sampler.samples, args.warmup_minutes * 60, 1),
        "client_rss_growth": growth(sampler.samples, args.warmup_minutes * 60, 2),
        "rss_samples": [{"t_s": round(t, 1), "server_bytes": s, "client_bytes": cl} for t, s, cl in sampler.samples],
    }
    ok = (result["aborted"] is None and c["failed"] == 0 and c["short"] == 0 and c["long"] == 0 and c["completed"] > 0
          and all(g is None or g < args.max_growth for g in (report["server_rss_growth"], report["client_rss_growth"])))
    report["verdict"] = "PASS" if ok else "FAIL"
    if args.json:
        args.json.write_text(json.dumps(report, indent=2) + "\n")

    def pct(g: float | None) -> str:
        return "n/a" if g is None else f"{g:+.1%}"

    print(f"soak {args.streams} streams × {args.minutes:g} min on {args.model} ({url}): {c['requests']} requests, "
          f"{c['completed']} completed, {c['failed']} failed, {c['short']} short, {c['long']} long; "
          f"{report['output_tokens_per_s']:.1f} output tok/s; RSS growth after warm-up: server "
          f"{pct(report['server_rss_growth'])}, client {pct(report['client_rss_growth'])} → {report['verdict']}"
          + (f" ({result['aborted']})" if result["aborted"] else ""))
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
