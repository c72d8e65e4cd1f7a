#!/usr/bin/env python3
"""Predicted vs measured speed-up of speculative decoding (issue 48 item 2): two `trtpipe bench` runs of the same
deployment, without and with speculation (e.g. the CPU n-gram recipe, recipes/smollm2_135m_cpu_ngram.yaml from
wip/ngram), compared per concurrency with the planner's prediction from the speculative run's own acceptance length
and drafts per step (:func:`pipeline.plan.speculative.speculative_plan`).

    .venv/bin/python benchmarks/check_spec_speedup.py --recipe recipes/smollm2_135m_cpu_ngram.yaml \\
        --plain artifacts/bench/RUN_PLAIN --spec artifacts/bench/RUN_NGRAM [--write tests/data/ngram_speedup_cpu.json]

``--write`` stores the measured points in the form tests/test_plan_speculative.py reads (the 20 % check then runs).
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from pipeline.plan import plan_recipe
from pipeline.plan.measured import load_bench
from pipeline.plan.speculative import point_speculation, speculative_plan
from pipeline.recipe import load_recipe


def _points(run: Path) -> dict[tuple[int, int, int], dict]:
    out = {}
    for p in load_bench(run).get("load_points", []):
        if p.get("mode") == "concurrency" and "summary" in p:
            out[(int(p["isl"]), int(p["osl"]), int(p["concurrency"]))] = p
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--recipe", type=Path, required=True, help="the speculative recipe")
    ap.add_argument("--plain", type=Path, required=True, help="bench run without speculation")
    ap.add_argument("--spec", type=Path, required=True, help="bench run with speculation")
    ap.add_argument("--write", type=Path, default=None, help="write the measured points here (tests/data/ngram_speedup_cpu.json)")
    args = ap.parse_args(argv)
    plain, spec = _points(args.plain), _points(args.spec)
    recipe = load_recipe(args.recipe)
    rows, worst = [], 0.0
    for key in sorted(set(plain) & set(spec)):
        isl, osl, c = key
        s = point_speculation(spec[key])
        if not s.get("acceptance_length"):
            continue
        steps = s.get("requests_with_drafts") or s.get("spec_steps")
        drafts = float(s["draft_tokens"]) / float(steps) if s.get("draft_tokens") and steps else None
        p_tps = plain[key]["summary"]["metrics"]["output_token_throughput"]
        s_tps = spec[key]["summary"]["metrics"]["output_token_throughput"]
        plan = plan_recipe(recipe, scenarios=[(isl, osl)], concurrency=[c], recipe_dir=args.recipe.resolve().parent,
                           acceptance=float(s["acceptance_length"]))
        pred = speculative_plan(plan.speculative.draft, plan.step_cost, plan.efficiency, plan.scenarios[0].predicted_by_concurrency,
                                plan.geometry.num_hidden_layers, acceptance=float(s["acceptance_length"]),
                                on_gpu=plan.target != "host", drafts_per_step=drafts).points[0].speedup
        meas = s_tps / p_tps
        worst = max(worst, abs(pred / meas - 1))
        print(f"{isl}/{osl} c={c}: AL {s['acceptance_length']:.2f}, drafts/step {drafts}, measured ×{meas:.2f} "
              f"({p_tps:.1f} → {s_tps:.1f} tok/s), predicted ×{pred:.2f} ({pred / meas - 1:+.0%})")
        rows.append({"isl": isl, "osl": osl, "concurrency": c, "plain_tokens_per_s": p_tps, "spec_tokens_per_s": s_tps,
                     "acceptance_length": float(s["acceptance_length"]), "drafts_per_step": drafts})
    if not rows:
        print("no common load point with an acceptance length", file=sys.stderr)
        return 2
    if args.write:
        args.write.write_text(json.dumps({"plain": str(args.plain), "spec": str(args.spec), "points": rows}, indent=2) + "\n")
        print(f"wrote {args.write}")
    print(f"worst |predicted / measured − 1|: {worst:.0%} (issue 48 bound: 20 %)")
    return 0 if worst <= 0.20 else 1


if __name__ == "__main__":
    sys.exit(main())
