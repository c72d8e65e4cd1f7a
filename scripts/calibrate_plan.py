#!/usr/bin/env python3
"""Refit the planner's achievable-throughput model on the published TensorRT-LLM table and ship the result.

Reads ``pipeline/data/plan_calibration.yaml`` (NVIDIA's v0.17 Llama-3.1-8B TP1 max-load output tokens/s on
H100 / L40S / A100, nine ISL/OSL pairs), fits the free efficiency parameters
(:data:`pipeline.plan.calibration.FREE`: fractions of peak bandwidth, GEMM and attention compute, per-sequence
overhead) by least squares on ln(predicted / published), refits once per GPU without that GPU
(leave-one-GPU-out), and writes ``pipeline/data/plan_efficiency.yaml``: the parameters, the expected
relative error (the largest RMS log error of the leave-one-GPU-out and leave-one-ISL/OSL-pair-out refits), and
every point's published vs predicted.

    .venv/bin/python scripts/calibrate_plan.py            # refit, write the YAML, print the tables
    .venv/bin/python scripts/calibrate_plan.py --check    # refit and compare with the shipped file, write nothing
    .venv/bin/python scripts/calibrate_plan.py --markdown # also print the per-point table as Markdown (docs/plan.md)

Deterministic: same table → same parameters (to the optimizer's tolerance).
"""

from __future__ import annotations

import argparse
import math
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

import yaml  # noqa: E402

from pipeline.plan import calibration as cal  # noqa: E402

OUT = REPO / "pipeline" / "data" / "plan_efficiency.yaml"
LABEL = {"h100_sxm": "H100 SXM FP8", "l40s": "L40S FP8", "a100_80gb": "A100 80GB FP16"}

HEADER = """\
# Fitted efficiency parameters of the achievable-throughput model (pipeline/plan/achievable.py).
# WRITTEN BY scripts/calibrate_plan.py from pipeline/data/plan_calibration.yaml — rerun it, do not edit.
#
# fitted (least squares on ln(predicted / published), 27 points):
#   bw_frac          achieved fraction of peak DRAM bandwidth streaming weights, activations, logits and KV
#   gemm_frac        achieved fraction of the dense tensor-core peak of the GEMM dtype
#   attn_frac        achieved fraction of the dense tensor-core peak in prefill attention (ceiling 0.75 = FA3)
#   seq_overhead_us  time per sequence per step outside the GEMM/attention roofline (runtime, sampling)
# fixed (not identifiable from max-load points, whose steps last 20-300 ms):
#   step_overhead_ms 0.5 ± 0.5 ms per step: ~32 layers x ~10 kernels x ~1.5 us launch each
# rel_error: the largest RMS of ln(predicted / published) when a GPU (or an ISL/OSL pair) is left out of the
#   fit and predicted — the error seen on data the fit had not seen; predictions add terms for uncalibrated
#   conditions (pipeline/plan/predict.py).
"""


def _round(d: dict, n: int = 4) -> dict:
    return {k: round(v, n) if isinstance(v, float) else v for k, v in d.items()}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--check", action="store_true", help="refit and compare with the shipped file; write nothing")
    ap.add_argument("--markdown", action="store_true", help="print the per-point table as Markdown")
    args = ap.parse_args(argv)

    eff = cal.fit()
    results = cal.evaluate(eff)
    summ = cal.summary(results)
    logo = cal.leave_one_gpu_out()
    logo_out = {}
    for g, (e, rs) in logo.items():
        logo_out[g] = {"params": _round({k: getattr(e, k) for k in cal.FREE}), **_round(cal.summary(rs)),
                       "errors": [round(r.error, 4) for r in rs]}
    lopo = cal.leave_one_pair_out()
    lopo_summ = cal.summary(lopo)
    rel_error = max(max(v["rms_log_error"] for v in logo_out.values()), lopo_summ["rms_log_error"])
    data = {
        "source": f"fit of scripts/calibrate_plan.py on {cal._raw()['source']}",
        "fitted": _round({k: getattr(eff, k) for k in cal.FREE}),
        "fixed": {k: v for k, v in cal.FIXED.items()},
        "rel_error": round(rel_error, 4),
        "fit": _round(summ),
        "leave_one_gpu_out": logo_out,
        "leave_one_pair_out": _round(lopo_summ),
        "points": [{"gpu": r.gpu, "isl": r.isl, "osl": r.osl, "published": r.published, "predicted": round(r.predicted, 1),
                    "error": round(r.error, 4), "batch": r.batch, "limited_by": r.limited_by} for r in results],
    }

    print("fitted:", data["fitted"], "fixed:", data["fixed"])
    print(f"fit: median |error| {summ['median_abs_error']:.1%}, worst {summ['worst_abs_error']:.1%}, "
          f"RMS log error {summ['rms_log_error']:.3f}")
    for g, v in logo_out.items():
        print(f"leave out {g:10s}: median |error| {v['median_abs_error']:.1%}, worst {v['worst_abs_error']:.1%}, "
              f"RMS log {v['rms_log_error']:.3f}  (params {v['params']})")
    print(f"leave out each ISL/OSL pair: median |error| {lopo_summ['median_abs_error']:.1%}, worst "
          f"{lopo_summ['worst_abs_error']:.1%}, RMS log {lopo_summ['rms_log_error']:.3f}")
    print(f"expected relative error (1 sigma): {rel_error:.1%}")
    print(f"\n{'GPU':16s} {'ISL/OSL':>11s} {'published':>10s} {'predicted':>10s} {'error':>7s} {'LOGO':>7s} {'batch':>6s}")
    for r in results:
        lo = logo_out[r.gpu]["errors"][[(x.isl, x.osl) for x in results if x.gpu == r.gpu].index((r.isl, r.osl))]
        print(f"{LABEL[r.gpu]:16s} {r.isl:>5d}/{r.osl:<5d} {r.published:>10,.0f} {r.predicted:>10,.0f} {r.error:>+7.1%} {lo:>+7.1%} {r.batch:>6d}")
    if args.markdown:
        print("\n| GPU (format) | ISL/OSL | published tok/s | predicted tok/s | error | error, GPU left out | batch (limit) |")
        print("|---|---|---|---|---|---|---|")
        for r in results:
            i = [(x.isl, x.osl) for x in results if x.gpu == r.gpu].index((r.isl, r.osl))
            print(f"| {LABEL[r.gpu]} | {r.isl}/{r.osl} | {r.published:,.0f} | {r.predicted:,.0f} | {r.error:+.1%} | "
                  f"{logo_out[r.gpu]['errors'][i]:+.1%} | {r.batch} ({r.limited_by.replace('_', ' ')}) |")

    if args.check:
        shipped = yaml.safe_load(OUT.read_text())
        drift = {k: (shipped["fitted"][k], data["fitted"][k]) for k in data["fitted"]
                 if not math.isclose(shipped["fitted"][k], data["fitted"][k], rel_tol=1e-3, abs_tol=1e-3)}
        print("shipped parameters reproduce" if not drift else f"shipped parameters differ: {drift}")
        return 1 if drift else 0
    OUT.write_text(HEADER + yaml.safe_dump(data, sort_keys=False, allow_unicode=True, width=120))
    print(f"\nwrote {OUT.relative_to(REPO)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
