#!/usr/bin/env python3
"""Held-out errors of the planner's throughput models and the ± band ``trtpipe plan`` prints (issue 48, item 4).

Refits each model with one group of published points left out and predicts that group
(:mod:`pipeline.plan.generalisation`): the engine path on TensorRT-LLM v0.17's Llama-3.1-8B table with each of its four
GPUs left out (H100, L40S, A100, H200) and each ISL/OSL pair; the PyTorch backend on v1.0's H100 + H200 table with each
model, each TP degree, each GPU and each ISL/OSL pair left out. Writes ``pipeline/data/plan_generalisation.yaml`` (the
tables and each engine's band = the largest held-out RMS ln error) and prints the Markdown tables of docs/plan.md.

    .venv/bin/python benchmarks/plan_generalisation.py           # recompute, write the YAML, print the tables
    .venv/bin/python benchmarks/plan_generalisation.py --check   # recompute and compare with the shipped file

Run it after benchmarks/calibrate_plan.py (the held-out fits use the same code, not the shipped parameters).
"""

from __future__ import annotations

import argparse
import datetime
import math
import sys
from pathlib import Path

from calibrate_plan import check_or_write

import pipeline
from pipeline.plan import generalisation as gen

OUT = Path(pipeline.__file__).resolve().parent / gen.GENERALISATION_FILE


def band_drift(old: dict, new: dict) -> dict:
    """``{engine: (shipped band, recomputed band)}`` for each engine whose band moved by more than 0.002."""
    return {e: (old["engines"][e]["band"], v["band"]) for e, v in new["engines"].items()
            if not math.isclose(old["engines"][e]["band"], v["band"], abs_tol=2e-3)}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--check", action="store_true", help="recompute and compare with the shipped file; write nothing")
    ap.add_argument("--out", type=Path, default=OUT)
    args = ap.parse_args(argv)
    doc = gen.document(datetime.date.today().isoformat())
    print(gen.markdown(doc))
    return check_or_write(doc, shipped=gen.shipped, drift=band_drift, dump=gen.dump, out=args.out, check=args.check,
                          what="bands")


if __name__ == "__main__":
    sys.exit(main())
