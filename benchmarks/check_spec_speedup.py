#!/usr/bin/env python3
"""Predicted vs measured speed-up of speculative decoding (issue 48 item 2): per workload, two `trtpipe bench` runs of
the same deployment, without and with speculation (the CPU n-gram recipe, recipes/smollm2_135m_cpu_ngram.yaml, against
its plain twin recipes/smollm2_135m_cpu_llmapi.yaml), compared per concurrency with the planner's prediction from the
speculative run's own acceptance length and drafts per step (:func:`pipeline.plan.speculative.step_figures`) on the
measuring host's rates (`trtpipe plan measure-host`, ``--host``).

    flock /tmp/heavy.lock env TRTPIPE_HOST_FILE=/tmp/host.yaml .venv/bin/trtpipe plan measure-host
    .venv/bin/python benchmarks/check_spec_speedup.py --recipe recipes/smollm2_135m_cpu_ngram.yaml --host /tmp/host.yaml \\
        --pair repetitive RUN_PLAIN_REP RUN_NGRAM_REP --pair open RUN_PLAIN_OPEN RUN_NGRAM_OPEN \\
        [--write tests/data/ngram_speedup_cpu.json --machine '…' --load '…' --date 2026-11-28]

``--write`` stores the measured points and the host's rates in the form tests/test_plan_speculative.py reads; the
test recomputes the prediction from them (docs/speculative.md, "Predicted vs measured").
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path

import yaml

from pipeline.calibrate.measured import load_bench
from pipeline.plan import plan_recipe
from pipeline.plan.speculative import speculative_plan, step_figures
from pipeline.recipe import load_recipe

#: issue 48's bound on |predicted / measured − 1|
BOUND = 0.20


def _points(run: Path) -> dict[int, dict]:
    """The closed-loop load points of a bench run by concurrency."""
    return {int(p["concurrency"]): p for p in load_bench(run).get("load_points", [])
            if p.get("mode") == "concurrency" and "summary" in p}


def measured_points(workload: str, plain_run: Path, spec_run: Path) -> list[dict]:
    """One row per concurrency both runs have: mean ISL and OSL (tokens), both runs' output tok/s, and the speculative
    run's acceptance length and drafts per step over every generation step (:func:`step_figures`)."""
    plain, spec = _points(plain_run), _points(spec_run)
    rows = []
    for c in sorted(set(plain) & set(spec)):
        fig = step_figures(spec[c])
        if fig is None:
            continue
        m = spec[c]["summary"]["metrics"]
        s = spec[c]["summary"]["speculative"]
        rows.append({"workload": workload, "concurrency": c, "isl": round(m["input_sequence_length"]["avg"], 1),
                     "osl": round(m["output_sequence_length"]["avg"], 1),
                     "plain_tokens_per_s": round(plain[c]["summary"]["metrics"]["output_token_throughput"], 2),
                     "spec_tokens_per_s": round(m["output_token_throughput"], 2),
                     "acceptance_length": round(fig[0], 4), "drafts_per_step": None if fig[1] is None else round(fig[1], 4),
                     "acceptance_rate": round(s["acceptance_rate"], 4), "requests": s["requests"]})
    return rows


def predicted_speedup(recipe_path: Path, point: dict) -> float:
    """The planner's speed-up (E2E-based, :func:`speculative_plan`) for one measured point, on whatever host file
    ``TRTPIPE_HOST_FILE`` names (the measuring host's rates)."""
    recipe = load_recipe(recipe_path)
    isl, osl = max(1, round(point["isl"])), max(2, round(point["osl"]))
    plan = plan_recipe(recipe, scenarios=[(isl, osl)], concurrency=[point["concurrency"]], recipe_dir=recipe_path.resolve().parent,
                       acceptance=point["acceptance_length"])
    sp = speculative_plan(plan.speculative.draft, plan.step_cost, plan.efficiency, plan.scenarios[0].predicted_by_concurrency,
                          plan.geometry.num_hidden_layers, acceptance=point["acceptance_length"], on_gpu=False,
                          drafts_per_step=point["drafts_per_step"])
    return sp.points[0].speedup


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--recipe", type=Path, required=True, help="the speculative recipe")
    ap.add_argument("--host", type=Path, required=True, help="the measuring host's `trtpipe plan measure-host` file")
    ap.add_argument("--pair", nargs=3, action="append", metavar=("WORKLOAD", "PLAIN_RUN", "SPEC_RUN"), required=True)
    ap.add_argument("--write", type=Path, default=None, help="write the measured points here (tests/data/ngram_speedup_cpu.json)")
    ap.add_argument("--machine", default="", help="the machine, in words (with --write)")
    ap.add_argument("--load", default="", help="the machine's load during the runs (with --write)")
    ap.add_argument("--date", default="", help="the runs' date (with --write)")
    args = ap.parse_args(argv)
    os.environ["TRTPIPE_HOST_FILE"] = str(args.host.resolve())
    rows = [r for w, plain, spec in args.pair for r in measured_points(w, Path(plain), Path(spec))]
    if not rows:
        print("no common load point with an acceptance length (bench with --server-timestamps)", file=sys.stderr)
        return 2
    worst = 0.0
    for r in rows:
        pred = predicted_speedup(args.recipe, r)
        meas = r["spec_tokens_per_s"] / r["plain_tokens_per_s"]
        worst = max(worst, abs(pred / meas - 1))
        print(f"{r['workload']:>10} c{r['concurrency']}: ISL {r['isl']:.0f} OSL {r['osl']:.0f}, AL {r['acceptance_length']:.2f} "
              f"tok/step, {r['drafts_per_step']:.2f} drafts/step, measured ×{meas:.2f} ({r['plain_tokens_per_s']:.1f} → "
              f"{r['spec_tokens_per_s']:.1f} tok/s), predicted ×{pred:.2f} ({pred / meas - 1:+.0%})")
    if args.write:
        host = yaml.safe_load(args.host.read_text())
        doc = {"machine": args.machine, "load": args.load, "date": args.date, "recipe": str(args.recipe),
               "runs": {w: {"plain": plain, "spec": spec} for w, plain, spec in args.pair}, "host": host, "points": rows}
        args.write.write_text(json.dumps(doc, indent=2, ensure_ascii=False) + "\n")
        print(f"wrote {args.write}")
    print(f"worst |predicted / measured − 1|: {worst:.0%} (issue 48 bound: {BOUND:.0%})")
    return 0 if worst <= BOUND else 1


if __name__ == "__main__":
    sys.exit(main())
