#!/usr/bin/env python3
"""Refit the planner's achievable-throughput model on the published TensorRT-LLM table and ship the result.

Reads ``pipeline/data/plan_calibration.yaml`` (NVIDIA's v0.17 Llama-3.1-8B TP1 max-load output tokens/s on
H100 / L40S / A100, nine ISL/OSL pairs), fits the free efficiency parameters
(:data:`pipeline.plan.calibration.FREE`: fractions of peak bandwidth, GEMM and attention compute, per-sequence
overhead) by least squares on ln(predicted / published), refits once per GPU without that GPU
(leave-one-GPU-out) and once per ISL/OSL pair without it, and writes ``pipeline/data/plan_efficiency.yaml``: the
parameters, the expected relative error, and every point's published vs predicted. The work is
:func:`pipeline.plan.calibration.calibrate`; this harness prints it and writes the file of the installed package.

    .venv/bin/python benchmarks/calibrate_plan.py            # refit, write the YAML, print the tables
    .venv/bin/python benchmarks/calibrate_plan.py --check    # refit and compare with the shipped file, write nothing
    .venv/bin/python benchmarks/calibrate_plan.py --markdown # also print the per-point table as Markdown (docs/plan.md)
    .venv/bin/python benchmarks/calibrate_plan.py --engine pytorch   # the PyTorch backend's model, on the v1.0 H100 + H200 table

The expected error (the ± band) is not written here: benchmarks/plan_generalisation.py computes it from held-out fits.

Deterministic: same table → same parameters (to the optimizer's tolerance).
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Callable
from pathlib import Path

import pipeline
from pipeline.plan import calibration as cal
from pipeline.plan import calibration_pytorch as calp

OUT = Path(pipeline.__file__).resolve().parent / cal.EFFICIENCY_FILE
OUT_PYTORCH = Path(pipeline.__file__).resolve().parent / calp.PYTORCH_EFFICIENCY_FILE
LABEL = {"h100_sxm": "H100 SXM FP8", "l40s": "L40S FP8", "a100_80gb": "A100 80GB FP16"}


def _print(data: dict, markdown: bool) -> None:
    summ, logo, lopo = data["fit"], data["leave_one_gpu_out"], data["leave_one_pair_out"]
    print("fitted:", data["fitted"], "fixed:", data["fixed"])
    print(f"fit: median |error| {summ['median_abs_error']:.1%}, worst {summ['worst_abs_error']:.1%}, "
          f"RMS log error {summ['rms_log_error']:.3f}")
    for g, v in logo.items():
        print(f"leave out {g:10s}: median |error| {v['median_abs_error']:.1%}, worst {v['worst_abs_error']:.1%}, "
              f"RMS log {v['rms_log_error']:.3f}  (params {v['params']})")
    print(f"leave out each ISL/OSL pair: median |error| {lopo['median_abs_error']:.1%}, worst "
          f"{lopo['worst_abs_error']:.1%}, RMS log {lopo['rms_log_error']:.3f}")
    pts = data["points"]

    def logo_error(r: dict) -> float:
        same = [(x["isl"], x["osl"]) for x in pts if x["gpu"] == r["gpu"]]
        return logo[r["gpu"]]["errors"][same.index((r["isl"], r["osl"]))]

    print(f"\n{'GPU':16s} {'ISL/OSL':>11s} {'published':>10s} {'predicted':>10s} {'error':>7s} {'LOGO':>7s} {'batch':>6s}")
    for r in pts:
        print(f"{LABEL[r['gpu']]:16s} {r['isl']:>5d}/{r['osl']:<5d} {r['published']:>10,.0f} {r['predicted']:>10,.0f} "
              f"{r['error']:>+7.1%} {logo_error(r):>+7.1%} {r['batch']:>6d}")
    if markdown:
        print("\n| GPU (format) | ISL/OSL | published tok/s | predicted tok/s | error | error, GPU left out | batch (limit) |")
        print("|---|---|---|---|---|---|---|")
        for r in pts:
            print(f"| {LABEL[r['gpu']]} | {r['isl']}/{r['osl']} | {r['published']:,.0f} | {r['predicted']:,.0f} | "
                  f"{r['error']:+.1%} | {logo_error(r):+.1%} | {r['batch']} ({r['limited_by'].replace('_', ' ')}) |")


def _print_held_out(data: dict) -> None:
    """The fitted parameters on the GPU the fit never sees (pipeline/data/plan_held_out.yaml: the H200 column)."""
    from statistics import median

    eff = cal.Efficiency(**data["fitted"], **data["fixed"], rel_error=0.0)
    res = cal.evaluate(eff, cal.held_out_points())
    summ = cal.summary(res)
    print(f"\nheld out (not fitted), {len(res)} points: median |error| {summ['median_abs_error']:.1%}, worst "
          f"{summ['worst_abs_error']:.1%}, median error {median(r.error for r in res):+.1%}")
    for r in res:
        print(f"  {r.gpu:8s} {r.isl:>5d}/{r.osl:<5d} published {r.published:>9,.0f} predicted {r.predicted:>9,.0f} "
              f"{r.error:+.1%}  batch {r.batch} ({r.limited_by})")
    for version, pts in cal.held_out_other_versions().items():
        res = cal.evaluate(eff, pts)
        by = {g: [r for r in res if r.gpu == g] for g in ("h200", "h100_sxm")}
        ratio = [(a.published / b.published) / (a.predicted / b.predicted) for a, b in zip(by["h200"], by["h100_sxm"])]
        print(f"v{version} table (not fitted): H200 median error {median(r.error for r in by['h200']):+.1%} "
              f"(worst {max((r.error for r in by['h200']), key=abs):+.1%}), H100 {median(r.error for r in by['h100_sxm']):+.1%}, "
              f"H200/H100 published over model {median(ratio):.3f}")


def _print_pytorch(data: dict, markdown: bool) -> None:
    summ = data["fit"]
    print("fitted:", data["fitted"], "fixed:", data["fixed"])
    print(f"fit ({len(data['points'])} points): median |error| {summ['median_abs_error']:.1%}, worst {summ['worst_abs_error']:.1%}, "
          f"RMS log error {summ['rms_log_error']:.3f}  (held-out errors and the ± band: benchmarks/plan_generalisation.py)")
    print("\n| model (FP8) | ISL/OSL | published tok/s | predicted tok/s | error | batch (limit) |")
    print("|---|---|---|---|---|---|")
    for r in data["points"]:
        print(f"| {calp.LABEL[r['model']]} | {r['isl']}/{r['osl']} | {r['published']:,.0f} | {r['predicted']:,.0f} | "
              f"{r['error']:+.1%} | {r['batch']} ({r['limited_by'].replace('_', ' ')}) |")


def check_or_write(data: dict, *, shipped: Callable[[], dict], drift: Callable[[dict, dict], dict], dump: Callable[[dict], str],
                   out: Path, check: bool, what: str = "parameters") -> int:
    """The end of every refit here (the engine path's, the PyTorch backend's, benchmarks/plan_generalisation.py's held-out
    bands): with ``check``, compare the fresh ``data`` with the shipped file (``drift(shipped(), data)``: what differs,
    empty when it reproduces), print the verdict and return 1 on a difference, 0 otherwise, writing nothing; without,
    write ``dump(data)`` to ``out`` and return 0."""
    if check:
        diff = drift(shipped(), data)
        print(f"shipped {what} reproduce" if not diff else f"shipped {what} differ: {diff}")
        return 1 if diff else 0
    out.write_text(dump(data))
    print(f"\nwrote {out}")
    return 0


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--engine", choices=["tensorrt", "pytorch"], default="tensorrt",
                    help="which model to fit: the engine path on the v0.17 table, or the PyTorch backend on the v1.0 H100 table")
    ap.add_argument("--check", action="store_true", help="refit and compare with the shipped file; write nothing")
    ap.add_argument("--markdown", action="store_true", help="print the per-point table as Markdown")
    ap.add_argument("--out", type=Path, default=None, help=f"where to write (default {OUT}, or {OUT_PYTORCH} with --engine pytorch)")
    args = ap.parse_args(argv)

    if args.engine == "pytorch":
        data = calp.calibrate()
        _print_pytorch(data, args.markdown)
        return check_or_write(data, shipped=calp.shipped, drift=cal.drift, dump=calp.dump, out=args.out or OUT_PYTORCH,
                              check=args.check)
    data = cal.calibrate()
    _print(data, args.markdown)
    _print_held_out(data)
    return check_or_write(data, shipped=cal.shipped, drift=cal.drift, dump=cal.dump, out=args.out or OUT, check=args.check)


if __name__ == "__main__":
    sys.exit(main())
