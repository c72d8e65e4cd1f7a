#!/usr/bin/env python3
"""Published (measured) TTFT and ITL at fixed concurrency against the planner's prediction.

Reads ``pipeline/data/plan_latency_published.yaml`` (AIConfigurator's silicon sample: Llama-3.1-8B TP1 on H100 SXM,
Llama-3.1-70B FP8 TP2/4/8 on H200; closed-loop concurrency 4–128; measured, not fit data) and predicts each row with
:func:`pipeline.plan.predict` from ``recipes/llama31_8b_h200_fp8_pytorch.yaml`` with the row's conditions as overrides:
model, GPU, tp (= num_gpus), qformat (FP8 → FP8 KV cache; full_prec → 16-bit KV), max_input_len = ISL and
max_seq_len = ISL + OSL rounded up to a KV block,
the bench scenario the row's. Everything else stays as the recipe has it (PyTorch backend, CUDA
graphs with padding, chunked prefill, KV fraction 0.95, GUARANTEED_NO_EVICT): the sample does not state them.

    .venv/bin/python benchmarks/check_latency.py              # per-row table + per-model summary
    .venv/bin/python benchmarks/check_latency.py --markdown   # the same as Markdown tables (docs/plan.md)

Error = predicted / published − 1. The 70B rows are the base Llama-3.1-70B; the planner's known geometry of
Llama-3.3-70B-Instruct is the same (80 layers, hidden 8192, 64 heads / 8 KV heads, intermediate 28672).
"""

from __future__ import annotations

import argparse
import math
import statistics
import sys
from importlib import resources
from pathlib import Path

import yaml

from pipeline.plan import predict
from pipeline.recipe import load_recipe

RECIPE = Path(__file__).resolve().parent.parent / "recipes" / "llama31_8b_h200_fp8_pytorch.yaml"
DATA = "data/plan_latency_published.yaml"
#: checkpoints whose geometry the planner knows under another id (same architecture and sizes)
SAME_GEOMETRY = {"meta-llama/Llama-3.1-70B": "meta-llama/Llama-3.3-70B-Instruct"}
TOKENS_PER_BLOCK = 32  # the recipe's


def rows() -> list[dict]:
    """The published rows, as in the YAML."""
    return yaml.safe_load(resources.files("pipeline").joinpath(DATA).read_text())


def overrides(row: dict) -> list[str]:
    """``KEY=VALUE`` overrides of the base recipe that reproduce a row's stated conditions."""
    fp8 = row["qformat"] == "fp8"
    seq = math.ceil((row["isl"] + row["osl"]) / TOKENS_PER_BLOCK) * TOKENS_PER_BLOCK
    return [
        f"model.source={SAME_GEOMETRY.get(row['model'], row['model'])}",
        f"target.gpu={row['gpu']}", f"target.num_gpus={row['tp']}", f"target.tp_size={row['tp']}",
        f"quantization.qformat={row['qformat']}", f"quantization.kv_cache_dtype={'fp8' if fp8 else 'none'}",
        f"build.max_input_len={row['isl']}", f"build.max_seq_len={seq}",
        f"bench.scenarios=[{{isl: {row['isl']}, osl: {row['osl']}}}]", f"bench.concurrency=[{row['concurrency']}]",
    ]


def compare() -> list[dict]:
    """Each row with its predicted TTFT / ITL (ms) and the errors (predicted / published − 1)."""
    out = []
    for row in rows():
        recipe = load_recipe(RECIPE, overrides(row))
        p = predict(recipe, row["isl"], row["osl"], row["concurrency"])
        out.append({**row, "pred_ttft_ms": p.ttft_ms, "pred_itl_ms": p.itl_ms,
                    "ttft_error": p.ttft_ms / row["ttft_ms"] - 1, "itl_error": p.itl_ms / row["itl_ms"] - 1})
    return out


def label(r: dict) -> str:
    return f"{r['model'].split('/')[-1]} TP{r['tp']} {r['gpu']}"


def summary(res: list[dict]) -> list[tuple[str, int, float, float, float, float]]:
    """Per model (all its TP degrees together, then per TP degree): rows, median and worst |error| of TTFT and ITL."""
    groups: dict[str, list[dict]] = {}
    for r in res:
        groups.setdefault(r["model"].split("/")[-1], []).append(r)
        groups.setdefault(label(r), []).append(r)
    out = []
    for name, rs in groups.items():
        t = [abs(r["ttft_error"]) for r in rs]
        i = [abs(r["itl_error"]) for r in rs]
        out.append((name, len(rs), statistics.median(t), max(t), statistics.median(i), max(i)))
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--markdown", action="store_true", help="print Markdown tables")
    args = ap.parse_args(argv)
    res = compare()
    if args.markdown:
        print("| model, GPU | ISL/OSL | concurrency | TTFT published ms | predicted | error | ITL published ms | predicted | error |")
        print("|---|---|---|---|---|---|---|---|---|")
        for r in res:
            print(f"| {label(r)} | {r['isl']}/{r['osl']} | {r['concurrency']} | {r['ttft_ms']:.1f} | {r['pred_ttft_ms']:.1f} | "
                  f"{r['ttft_error']:+.0%} | {r['itl_ms']:.2f} | {r['pred_itl_ms']:.2f} | {r['itl_error']:+.0%} |")
        print("\n| rows | n | TTFT median \\|error\\| | TTFT worst | ITL median \\|error\\| | ITL worst |\n|---|---|---|---|---|---|")
        for name, n, tm, tw, im, iw in summary(res):
            print(f"| {name} | {n} | {tm:.0%} | {tw:.0%} | {im:.0%} | {iw:.0%} |")
        return 0
    print(f"{'model, GPU':34s} {'ISL/OSL':>9s} {'conc':>4s} {'TTFT pub':>9s} {'pred':>8s} {'err':>6s} "
          f"{'ITL pub':>8s} {'pred':>7s} {'err':>6s}")
    for r in res:
        print(f"{label(r):34s} {r['isl']:>4d}/{r['osl']:<4d} {r['concurrency']:>4d} {r['ttft_ms']:>9.1f} {r['pred_ttft_ms']:>8.1f} "
              f"{r['ttft_error']:>+6.0%} {r['itl_ms']:>8.2f} {r['pred_itl_ms']:>7.2f} {r['itl_error']:>+6.0%}")
    print(f"\n{'rows':34s} {'n':>3s} {'TTFT med|e|':>12s} {'worst':>7s} {'ITL med|e|':>11s} {'worst':>7s}")
    for name, n, tm, tw, im, iw in summary(res):
        print(f"{name:34s} {n:>3d} {tm:>12.0%} {tw:>7.0%} {im:>11.0%} {iw:>7.0%}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
