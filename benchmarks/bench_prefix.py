#!/usr/bin/env python3
"""Prompt-prefix KV block reuse on the CPU engine: time to first token with vs without, on prompts sharing a prefix.

In one run, in this process: a plain :class:`~pipeline.cpu_runtime.engine.CpuEngine` and one with ``block_reuse``
(``kv_cache_config.enable_block_reuse`` in ``tokens_per_block`` blocks, pipeline/cpu_runtime/prefix.py) on the same
engine directory serve the same requests, alternating ``--rounds`` times: ``--requests`` chat prompts that share one
long system prompt (CPython's pydoc topics, PSF licence) and differ in the question, one first token each
(``max_new_tokens`` 1, so the request's time is its prefill: TTFT), ``--concurrency`` in flight. Reports mean and
median TTFT of each, their ratio, and the reusing engine's ``cacheHitRate`` and cached-token share
(``kvCacheStats``); ``--json PATH`` writes them.

    PYTHONPATH=$PWD .venv/bin/python benchmarks/bench_prefix.py ENGINE_DIR [--concurrency 1,4] [--rounds 2]
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import pydoc_data.topics
import statistics
import sys
import threading
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from pipeline.cpu_runtime.engine import CpuEngine

QUESTIONS = ["What does assert do?", "When is pass useful?", "Summarise the text in one sentence.",
             "Give an example.", "What is the main point?", "Is this about loops?", "Name one keyword mentioned.",
             "Explain it to a beginner.", "What happens on failure?", "Who would read this?",
             "Translate the first sentence to French.", "List two facts from the text."]


def prompts(engine_dir: Path, n: int, prefix_words: int) -> list[list[int]]:
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(engine_dir, local_files_only=True)
    topics = pydoc_data.topics.topics
    system = "Answer questions about this text.\n\n" + " ".join((topics["assert"] + topics["pass"]).split()[:prefix_words])
    chats = [tok.apply_chat_template([{"role": "system", "content": system}, {"role": "user", "content": QUESTIONS[i % 12]}],
                                     add_generation_prompt=True, tokenize=False) for i in range(n)]
    return [tok(c, add_special_tokens=False)["input_ids"] for c in chats]


def ttfts(engine: CpuEngine, ps: list[list[int]], concurrency: int) -> list[float]:
    """Closed loop, ``concurrency`` in flight, one token each: each request's submit → first token (s)."""
    out: list[float] = [0.0] * len(ps)
    left, lock, done = list(range(len(ps))), threading.Lock(), threading.Event()
    pending = [len(ps)]

    def submit(i: int) -> None:
        t0 = time.perf_counter()

        def on_tokens(toks: list[int], fin: bool) -> None:
            if fin:
                out[i] = time.perf_counter() - t0
                with lock:
                    pending[0] -= 1
                    nxt = left.pop(0) if left else None
                    if pending[0] == 0:
                        done.set()
                if nxt is not None:
                    submit(nxt)
        engine.add_request(ps[i], max_new_tokens=1, on_tokens=on_tokens)

    with lock:
        first = [left.pop(0) for _ in range(min(concurrency, len(left)))]
    for i in first:
        submit(i)
    if not done.wait(1800):
        raise SystemExit("requests did not finish within 30 min")
    return out


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("engine_dir", type=Path)
    ap.add_argument("--concurrency", default="1,4")
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--requests", type=int, default=12)
    ap.add_argument("--prefix-words", type=int, default=300)
    ap.add_argument("--tokens-per-block", type=int, default=32)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--json", type=Path)
    a = ap.parse_args()
    ps = prompts(a.engine_dir, a.requests, a.prefix_words)
    plain = CpuEngine(a.engine_dir, num_threads=a.threads)
    reuse = CpuEngine(a.engine_dir, num_threads=a.threads, block_reuse=a.tokens_per_block)
    load0 = os.getloadavg()
    results = {}
    try:
        for eng in (plain, reuse):
            ttfts(eng, [[1, 2, 3]], 1)  # warm-up (shares nothing with the prompts)
        for c in (int(x) for x in a.concurrency.split(",")):
            got: dict[str, list[float]] = {"plain": [], "reuse": []}
            s0 = reuse.iteration_stats()["kvCacheStats"]
            for r in range(a.rounds):
                for label, eng in ([("plain", plain), ("reuse", reuse)] if r % 2 == 0 else [("reuse", reuse), ("plain", plain)]):
                    got[label] += ttfts(eng, ps, c)
            s1 = reuse.iteration_stats()["kvCacheStats"]
            reused, missed = s1["reusedBlocks"] - s0["reusedBlocks"], s1["missedBlocks"] - s0["missedBlocks"]
            row = {f"{k}_ttft_ms_{f.__name__}": 1e3 * f(v) for k, v in got.items() for f in (statistics.mean, statistics.median)}
            row.update({"ttft_ratio_mean": row["reuse_ttft_ms_mean"] / row["plain_ttft_ms_mean"],
                        "cache_hit_rate": reused / (reused + missed) if reused + missed else 0.0,
                        "cached_token_share": (s1["cachedTokens"] - s0["cachedTokens"]) / (a.rounds * sum(map(len, ps)))})
            results[f"c{c}"] = row
            print(f"c{c}: TTFT mean plain {row['plain_ttft_ms_mean']:.1f} ms, reuse {row['reuse_ttft_ms_mean']:.1f} ms "
                  f"({row['ttft_ratio_mean']:.2f}x); hit rate {row['cache_hit_rate']:.2f}, cached tokens "
                  f"{100 * row['cached_token_share']:.0f} %", flush=True)
    finally:
        plain.shutdown()
        reuse.shutdown()
    out = {"date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
           "machine": f"{platform.machine()} {os.cpu_count()} cores", "load_average_before_after":
           [round(load0[0], 2), round(os.getloadavg()[0], 2)], "threads": a.threads, "requests": a.requests,
           "prompt_tokens": [len(p) for p in ps], "tokens_per_block": a.tokens_per_block, "rounds": a.rounds,
           "results": results}
    if a.json:
        a.json.write_text(json.dumps(out, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
