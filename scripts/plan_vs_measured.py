#!/usr/bin/env python3
"""Predicted vs measured: ``trtpipe plan``'s achievable-throughput model against ``trtpipe bench`` runs.

For each run directory (``bench.json``) and each closed-loop load point (default concurrency 1, 4, 16), prints
measured output tokens/s, mean TTFT and ITL next to :func:`pipeline.plan.predict` for the run's recipe (the
``recipe.yaml`` of the build the run recorded, or ``--recipe``), the relative error of the prediction and
whether the measurement falls inside its expected error band.

    .venv/bin/python scripts/plan_vs_measured.py artifacts/bench/20261123-120000 [more run dirs]
    .venv/bin/python scripts/plan_vs_measured.py RUN --recipe recipes/smollm2_135m_cpu_fp8.yaml --concurrency 1,4,16
    .venv/bin/python scripts/plan_vs_measured.py RUN --json      # the comparisons as JSON (PointComparison)
    .venv/bin/python scripts/plan_vs_measured.py RUN --markdown  # a Markdown table (docs)

Exit 0 when every point was compared, 2 on a user mistake (no bench.json, no recipe, no matching point).
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from pipeline.errors import UserError  # noqa: E402
from pipeline.plan.measured import compare_run  # noqa: E402


def _f(x: float | None, nd: int = 1) -> str:
    return "—" if x is None else f"{x:,.{nd}f}"


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("runs", nargs="+", type=Path, help="bench run directories (each holding bench.json)")
    ap.add_argument("--recipe", type=Path, help="recipe YAML (default: the recipe.yaml of the build each run recorded)")
    ap.add_argument("--concurrency", default="1,4,16", help="load points to compare, e.g. 1,4,16 ('all' for every one)")
    ap.add_argument("--gpu", help="predict on this catalog GPU (or cpu) instead of the recipe's target")
    fmt = ap.add_mutually_exclusive_group()
    fmt.add_argument("--json", action="store_true", help="print the comparisons as JSON")
    fmt.add_argument("--markdown", action="store_true", help="print a Markdown table")
    args = ap.parse_args(argv)
    try:
        conc = None if args.concurrency == "all" else [int(c) for c in args.concurrency.split(",") if c.strip()]
    except ValueError:
        print(f"error: --concurrency {args.concurrency!r}: expected comma-separated integers, e.g. 1,4,16", file=sys.stderr)
        return 2
    try:
        rows = [r for run in args.runs for r in compare_run(run, args.recipe, conc, gpu=args.gpu)]
    except UserError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2

    if args.json:
        print(json.dumps([r.model_dump(mode="json") for r in rows], indent=2))
        return 0
    head = ["run", "ISL/OSL", "conc.", "measured tok/s", "predicted tok/s", "error", "in band", "TTFT ms meas/pred",
            "ITL ms meas/pred"]
    table = []
    for r in rows:
        p = r.predicted
        table.append([Path(r.run_dir).name, f"{r.isl}/{r.osl}", str(r.concurrency), _f(r.measured_output_tokens_per_s),
                      f"{p.output_tokens_per_s:,.1f} ±{p.rel_error:.0%}", f"{r.error:+.0%}", "yes" if r.within else "no",
                      f"{_f(r.measured_ttft_ms, 0)} / {_f(p.ttft_ms, 0)}", f"{_f(r.measured_itl_ms)} / {_f(p.itl_ms)}"])
    if args.markdown:
        print("| " + " | ".join(head) + " |")
        print("|" + "---|" * len(head))
        for t in table:
            print("| " + " | ".join(t) + " |")
    else:
        widths = [max(len(h), *(len(t[i]) for t in table)) for i, h in enumerate(head)]
        print("  ".join(h.ljust(w) for h, w in zip(head, widths)))
        for t in table:
            print("  ".join(c.rjust(w) if i >= 2 else c.ljust(w) for i, (c, w) in enumerate(zip(t, widths))))
    return 0


if __name__ == "__main__":
    sys.exit(main())
