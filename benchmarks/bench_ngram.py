#!/usr/bin/env python3
"""N-gram speculative decoding on the CPU engine: throughput with vs without, on a repetitive and an open workload.

In one run, in this process: two :class:`~pipeline.cpu_runtime.engine.CpuEngine` instances on the same engine directory,
one plain and one with ``speculative_config`` ``{decoding_type: NGram, max_draft_len: V, max_matching_ngram_size: K}``
(pipeline/cpu_runtime/speculative.py). For each workload (``repetitive``: prompts whose answer copies from the prompt —
repeat a passage, rename a variable in code, reformat a list; ``open``: open-ended questions whose answer the prompt
does not contain) and each concurrency (closed loop: that many requests in flight), both engines serve the same
prompts, alternating plain/speculative ``--rounds`` times (this host's speed drifts; a fresh speculative engine each
round, so its public n-gram pool never holds an earlier round's output of the same prompts). Every request stops at the end
token or ``--osl`` tokens (greedy, so both engines must return identical tokens: checked, mismatches reported).

Reported per (workload, concurrency): output tokens/s of each (total generated tokens / wall time, means over rounds),
speed-up (speculative / plain), forward passes, and from the speculative engine's counters the acceptance rate
(accepted / drafted tokens) and the mean accepted length (AL: tokens per request-step that verified drafts, incl. the
target's own token; TensorRT-LLM's ``acceptanceLength``). ``--json PATH`` writes them (docs/speculative.json).

    PYTHONPATH=$PWD .venv/bin/python benchmarks/bench_ngram.py ENGINE_DIR [--concurrency 1,4] [--rounds 2] [--osl 128]

``--write-datasets DIR`` writes the two workloads as ``trtpipe bench --dataset`` JSONL instead (docs/speculative.md).

ENGINE_DIR: a CPU engine directory (``build.engine: cpu`` or ``pytorch`` on the cpu target, e.g.
``artifacts/smollm2_135m_cpu_ngram/engine``) of a chat model with a tokenizer. Run it on a quiet machine.
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
from typing import Any

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from pipeline.cpu_runtime.engine import CpuEngine

CODE = '''def moving_average(values, window):
    result = []
    total = 0.0
    for index, value in enumerate(values):
        total += value
        if index >= window:
            total -= values[index - window]
        if index + 1 >= window:
            result.append(total / window)
    return result
'''
CODE2 = '''class Counter:
    def __init__(self):
        self.counts = {}

    def add(self, item):
        self.counts[item] = self.counts.get(item, 0) + 1

    def most_common(self):
        return max(self.counts, key=self.counts.get)
'''
OPEN = [
    "Write a short story about a robot who learns to paint.",
    "Why is the sky blue? Explain it to a ten-year-old.",
    "Give me three tips for learning a new language.",
    "What are the pros and cons of working from home?",
    "Describe your ideal weekend in a few sentences.",
    "Invent a recipe for a new kind of sandwich.",
    "What would happen if the moon disappeared?",
    "Write a haiku about autumn and explain it.",
]


def repetitive_texts() -> list[str]:
    """Eight prompts whose answer copies from the prompt (passages of CPython's pydoc topics, PSF licence; code)."""
    topics = pydoc_data.topics.topics
    passages = [" ".join(topics[k].split()[:90]) for k in ("assert", "pass", "break", "continue")]
    return [
        f"Repeat the following text exactly, word for word:\n\n{passages[0]}",
        f"Repeat the following text exactly, word for word:\n\n{passages[1]}",
        f"Copy this paragraph and fix any typos, changing nothing else:\n\n{passages[2]}",
        f"Copy this paragraph and fix any typos, changing nothing else:\n\n{passages[3]}",
        f"Rewrite this Python code with the variable `total` renamed to `running_sum`. Output the full code.\n\n{CODE}",
        f"Add type hints to this Python code. Output the full code.\n\n{CODE}",
        f"Rewrite this Python class with the attribute `counts` renamed to `tally`. Output the full code.\n\n{CODE2}",
        ("Repeat this list exactly, one item per line: apple, banana, cherry, date, elderberry, fig, grape, honeydew, "
         "kiwi, lemon, mango, nectarine, orange, papaya, quince, raspberry."),
    ]


def chat_texts(engine_dir: Path, texts: list[str]) -> list[str]:
    """``texts`` as single-turn chat prompts (the model's chat template, generation prompt added)."""
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(engine_dir, local_files_only=True)
    return [tok.apply_chat_template([{"role": "user", "content": t}], add_generation_prompt=True, tokenize=False)
            for t in texts]


def encode(engine_dir: Path, texts: list[str]) -> list[list[int]]:
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(engine_dir, local_files_only=True)
    return [tok(c, add_special_tokens=False)["input_ids"] for c in chat_texts(engine_dir, texts)]


def write_datasets(engine_dir: Path, out: Path) -> None:
    """``out/ngram_repetitive.jsonl`` and ``out/ngram_open.jsonl``: the two workloads as ``trtpipe bench --dataset`` rows
    (``{"text": chat prompt}``)."""
    out.mkdir(parents=True, exist_ok=True)
    for name, texts in (("repetitive", repetitive_texts()), ("open", OPEN)):
        rows = [json.dumps({"text": t}) for t in chat_texts(engine_dir, texts)]
        (out / f"ngram_{name}.jsonl").write_text("\n".join(rows) + "\n")


def serve(engine: CpuEngine, prompts: list[list[int]], concurrency: int, osl: int, end_id: int) -> tuple[list[list[int]], float]:
    """Closed loop: ``concurrency`` requests in flight until every prompt was served; (outputs, wall seconds)."""
    outs: list[list[int]] = [[] for _ in prompts]
    left = list(range(len(prompts)))
    lock, all_done = threading.Lock(), threading.Event()
    pending = [len(prompts)]

    def submit(i: int) -> None:
        def on_tokens(toks: list[int], fin: bool) -> None:
            outs[i].extend(toks)
            if fin:
                with lock:
                    pending[0] -= 1
                    nxt = left.pop(0) if left else None
                    if pending[0] == 0:
                        all_done.set()
                if nxt is not None:
                    submit(nxt)
        engine.add_request(prompts[i], max_new_tokens=osl, end_id=end_id, on_tokens=on_tokens,
                           on_error=lambda m: print("error:", m, file=sys.stderr))

    t0 = time.perf_counter()
    with lock:
        first = [left.pop(0) for _ in range(min(concurrency, len(left)))]
    for i in first:
        submit(i)
    if not all_done.wait(1800):
        raise SystemExit("requests did not finish within 30 min")
    return outs, time.perf_counter() - t0


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("engine_dir", type=Path)
    ap.add_argument("--concurrency", default="1,4")
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--osl", type=int, default=128)
    ap.add_argument("--draft-len", type=int, default=5)
    ap.add_argument("--ngram", type=int, default=3)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--end-id", type=int, default=2, help="end token (SmolLM2 <|im_end|> = 2)")
    ap.add_argument("--json", type=Path)
    ap.add_argument("--write-datasets", type=Path, metavar="DIR", help="only write the workloads as bench JSONL into DIR")
    a = ap.parse_args()
    if a.write_datasets:
        write_datasets(a.engine_dir, a.write_datasets)
        return 0
    spec_cfg = {"decoding_type": "NGram", "max_draft_len": a.draft_len, "max_matching_ngram_size": a.ngram}
    loads = {"repetitive": encode(a.engine_dir, repetitive_texts()), "open": encode(a.engine_dir, OPEN)}
    conc = [int(c) for c in a.concurrency.split(",")]
    plain = CpuEngine(a.engine_dir, num_threads=a.threads)
    load0 = os.getloadavg()
    results: dict[str, Any] = {}
    try:
        serve(plain, loads["open"][:1], 1, 8, a.end_id)  # warm-up
        for name, prompts in loads.items():
            for c in conc:
                row: dict[str, Any] = {"plain_tok_s": [], "spec_tok_s": [], "mismatched_requests": 0}
                d = dict.fromkeys(("draft_tokens", "accepted_draft_tokens", "requests_with_drafts", "passes"), 0)
                p0 = plain.stats()["forward_passes"]
                for r in range(a.rounds):
                    # a fresh speculative engine per round: the public pool (never pruned, as upstream) would otherwise
                    # hold the previous round's outputs of these very prompts
                    spec = CpuEngine(a.engine_dir, num_threads=a.threads, speculative_config=spec_cfg)
                    try:
                        serve(spec, [[1, 2, 3]], 1, 4, a.end_id)  # warm-up (no pattern it learns repeats later)
                        s0 = spec.stats()
                        order = [("plain", plain), ("spec", spec)] if r % 2 == 0 else [("spec", spec), ("plain", plain)]
                        got = {}
                        for label, eng in order:
                            outs, wall = serve(eng, prompts, c, a.osl, a.end_id)
                            got[label] = outs
                            row[f"{label}_tok_s"].append(sum(map(len, outs)) / wall)
                        s1 = spec.stats()
                    finally:
                        spec.shutdown()
                    for k in ("draft_tokens", "accepted_draft_tokens", "requests_with_drafts"):
                        d[k] += s1["speculative"][k] - s0["speculative"][k]
                    d["passes"] += s1["forward_passes"] - s0["forward_passes"]
                    row["mismatched_requests"] += sum(x != y for x, y in zip(got["plain"], got["spec"]))
                    row["output_tokens"] = sum(map(len, got["plain"]))
                row.update({
                    "plain_tok_s": statistics.mean(row["plain_tok_s"]), "spec_tok_s": statistics.mean(row["spec_tok_s"]),
                    "plain_tok_s_rounds": row["plain_tok_s"], "spec_tok_s_rounds": row["spec_tok_s"],
                    "plain_forward_passes": (plain.stats()["forward_passes"] - p0) // a.rounds,
                    "spec_forward_passes": d["passes"] // a.rounds,
                    "acceptance_rate": d["accepted_draft_tokens"] / d["draft_tokens"] if d["draft_tokens"] else None,
                    "mean_accepted_length": ((d["accepted_draft_tokens"] + d["requests_with_drafts"]) / d["requests_with_drafts"]
                                             if d["requests_with_drafts"] else None),
                    "draft_tokens": d["draft_tokens"] // a.rounds,
                    "accepted_draft_tokens": d["accepted_draft_tokens"] // a.rounds,
                })
                row["speedup"] = row["spec_tok_s"] / row["plain_tok_s"]
                results.setdefault(name, {})[f"c{c}"] = row
                print(f"{name:10s} c{c}: plain {row['plain_tok_s']:6.1f} tok/s  ngram {row['spec_tok_s']:6.1f} tok/s  "
                      f"speed-up {row['speedup']:.2f}x  acceptance {row['acceptance_rate'] or 0:.2f}  "
                      f"AL {row['mean_accepted_length'] or 0:.2f}  passes {row['plain_forward_passes']}→{row['spec_forward_passes']}  "
                      f"mismatched {row['mismatched_requests']}", flush=True)
    finally:
        plain.shutdown()
    out = {
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "machine": f"{platform.machine()} {os.cpu_count()} cores ({platform.processor() or platform.platform()})",
        "load_average_before_after": [round(load0[0], 2), round(os.getloadavg()[0], 2)],
        "engine_dir": str(a.engine_dir), "engine": plain.runtime, "threads": a.threads,
        "speculative_config": spec_cfg, "osl": a.osl, "rounds": a.rounds, "requests_per_point": 8,
        "results": results,
    }
    if a.json:
        a.json.write_text(json.dumps(out, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
