"""Held-out errors of the planner's throughput models, and the ± band they set (issue 48, item 4).

A model judged on the table it was fitted on cannot show how it does elsewhere. Here each model is refitted with one
group of published points left out (scipy least squares, :func:`pipeline.plan.calibration.least_squares_fit`, the
same code as the shipped fit) and scored on that group only:

- the TensorRT engine path (``plan_calibration.yaml`` + the H200 column of ``plan_held_out.yaml``: TensorRT-LLM v0.17,
  Llama-3.1-8B TP1 on H100 / L40S / A100 / H200, 36 points): **each GPU** left out (fitted on the other three), and
  each ISL/OSL pair left out of the shipped fit's 27 points;
- the PyTorch backend (``plan_calibration_pytorch.yaml``: v1.0, H100 and H200, 8B TP1 / 70B TP1-TP2 / 405B TP8, 60
  points): **each model** (all its columns), **each TP degree** (1, 2, 8), **each GPU** and each ISL/OSL pair left out.

Per held-out group: n, median and max |error|, the signed bias (mean and median of predicted / published − 1), how many
points are over-predicted, and the RMS of ln(predicted / published). The band of an engine (``±N %``, 1 σ, what
``trtpipe plan`` prints next to a prediction before the uncalibrated-condition terms) is the largest held-out RMS ln
error of its groups — an error seen on data the fit had not seen, never the fit's own residuals. :func:`document`
builds ``pipeline/data/plan_generalisation.yaml`` (``benchmarks/plan_generalisation.py`` writes it, ``--check``
compares); :func:`pipeline.plan.model_inputs.held_out_band` reads the band from it.
"""

from __future__ import annotations

import math
import statistics
from importlib import resources

import yaml

from pipeline.plan import calibration as cal
from pipeline.plan import calibration_pytorch as calp
from pipeline.plan.model_inputs import GENERALISATION_FILE

#: when the shipped document was computed (benchmarks/plan_generalisation.py writes today's date)
HEADER = """\
# Held-out errors of the planner's throughput models and the ± band the CLI prints (pipeline/plan/generalisation.py).
# WRITTEN BY benchmarks/plan_generalisation.py — rerun it, do not edit. Error = predicted / published − 1 of a fit
# made WITHOUT the held-out group; bias = mean signed error (median_error: median); band = the largest held-out RMS
# of ln(predicted / published) over the engine's groups (1 sigma).
"""


def summarise(kind: str, held_out: str, results: list[cal.PointResult]) -> dict:
    """One held-out group's figures: ``kind`` (gpu, model, tp, isl_osl), ``held_out`` (its name), ``n``,
    ``median_abs_error``, ``max_abs_error``, ``bias`` (mean of predicted / published − 1), ``median_error``, ``over``
    (points predicted above the published figure), ``rms_log_error`` (ln units) and the per-point ``points``
    (label, ISL, OSL, published, predicted tok/s, error). Errors are fractions (0.05 = 5 %).

    Raises:
        ValueError: ``results`` is empty.
    """
    if not results:
        raise ValueError(f"held-out group {kind} {held_out} has no points")
    errs = [r.error for r in results]
    return {
        "kind": kind, "held_out": held_out, "n": len(results),
        "median_abs_error": round(statistics.median(abs(e) for e in errs), 4),
        "max_abs_error": round(max(abs(e) for e in errs), 4),
        "bias": round(statistics.fmean(errs), 4), "median_error": round(statistics.median(errs), 4),
        "over": sum(e > 0 for e in errs),
        "rms_log_error": round(math.sqrt(statistics.fmean(math.log(r.predicted / r.published) ** 2 for r in results)), 4),
        "points": [{"label": r.gpu, "isl": r.isl, "osl": r.osl, "published": r.published, "predicted": round(r.predicted, 1),
                    "error": round(r.error, 4)} for r in results],
    }


def tensorrt_points() -> list[cal.CalibrationPoint]:
    """The engine path's published points for the held-out tests: the fit's 27 (H100, L40S, A100) + the H200's 9."""
    return cal.points() + cal.held_out_points()


def held_out_tensorrt() -> list[dict]:
    """The engine path's held-out groups: each of the four GPUs left out of a fit on the other three (the H200 left
    out is the shipped fit), then each ISL/OSL pair left out of the shipped fit's 27 points."""
    sets = [summarise("gpu", g, rs) for g, (_, rs) in cal.leave_one_gpu_out(tensorrt_points()).items()]
    held = cal.leave_one_out(cal.points(), lambda p: (p.isl, p.osl), cal.fit, cal.evaluate)
    return sets + [summarise("isl_osl", f"{i}/{o}", rs) for (i, o), (_, rs) in held.items()]


def held_out_pytorch() -> list[dict]:
    """The PyTorch backend's held-out groups: each model (hub id: every GPU and TP degree it was run at), each TP
    degree, each GPU, each ISL/OSL pair — left out of a fit on the rest of the 60 points."""
    sets = [summarise("model", m.split("/")[-1], rs) for m, (_, rs) in calp.leave_one_model_out().items()]
    sets += [summarise("tp", f"tp{t}", rs) for t, (_, rs) in calp.leave_one_tp_out().items()]
    sets += [summarise("gpu", g, rs) for g, (_, rs) in calp.leave_one_gpu_out().items()]
    held = cal.leave_one_out(calp.points(), lambda p: (p.isl, p.osl), calp.fit, calp.evaluate)
    return sets + [summarise("isl_osl", f"{i}/{o}", rs) for (i, o), (_, rs) in held.items()]


def band(sets: list[dict]) -> tuple[float, str]:
    """``(band, from)``: the largest ``rms_log_error`` of ``sets`` and the group that sets it (``"kind held_out"``)."""
    worst = max(sets, key=lambda s: s["rms_log_error"])
    return worst["rms_log_error"], f"{worst['kind']} {worst['held_out']}"


def pooled(sets: list[dict], kind: str) -> dict:
    """All held-out points of one ``kind`` together: ``n``, median / max |error|, bias, ``over``."""
    errs = [p["error"] for s in sets if s["kind"] == kind for p in s["points"]]
    return {"n": len(errs), "median_abs_error": round(statistics.median(abs(e) for e in errs), 4),
            "max_abs_error": round(max(abs(e) for e in errs), 4), "bias": round(statistics.fmean(errs), 4),
            "over": sum(e > 0 for e in errs)}


def document(date: str) -> dict:
    """The ``plan_generalisation.yaml`` document computed today (``date``, ISO): per engine the table it is judged
    on, every held-out group (:func:`summarise`), the groups pooled per kind, and the ``band`` (:func:`band`).
    Deterministic (fixed-start least squares); about 40 refits, a few seconds."""
    out = {"date": date, "engines": {}}
    for engine, table, sets in (
        ("tensorrt", "TensorRT-LLM v0.17 engine path, Llama-3.1-8B TP1: H100 SXM, L40S, A100 80GB (FP16), H200 (36 points)",
         held_out_tensorrt()),
        ("pytorch", ("TensorRT-LLM v1.0 PyTorch backend: H100 SXM 8B TP1 / 70B TP2 / 405B TP8, H200 8B TP1 / 70B TP1 / "
                     "405B TP8 (60 points)"), held_out_pytorch()),
    ):
        b, src = band(sets)
        out["engines"][engine] = {"table": table, "band": b, "band_from": src,
                                  "pooled": {k: pooled(sets, k) for k in dict.fromkeys(s["kind"] for s in sets)},
                                  "sets": sets}
    return out


def dump(doc: dict) -> str:
    """``doc`` as the text of ``plan_generalisation.yaml``, header first."""
    return HEADER + yaml.safe_dump(doc, sort_keys=False, allow_unicode=True, width=120)


def shipped() -> dict:
    """The shipped ``plan_generalisation.yaml`` document."""
    return yaml.safe_load(resources.files("pipeline").joinpath(GENERALISATION_FILE).read_text())


def markdown(doc: dict) -> str:
    """The held-out tables of ``doc`` as Markdown (docs/plan.md "Held-out errors"): one row per group."""
    lines = []
    for engine, e in doc["engines"].items():
        lines += [f"**{engine}** — {e['table']}; computed {doc['date']}; band ±{e['band']:.1%} (from {e['band_from']})", "",
                  "| held out | n | median \\|error\\| | max \\|error\\| | bias (mean) | median error | over-predicted | RMS ln |",
                  "|---|---|---|---|---|---|---|---|"]
        for s in e["sets"]:
            lines.append(f"| {s['kind']} {s['held_out']} | {s['n']} | {s['median_abs_error']:.1%} | {s['max_abs_error']:.1%} | "
                         f"{s['bias']:+.1%} | {s['median_error']:+.1%} | {s['over']}/{s['n']} | {s['rms_log_error']:.3f} |")
        lines.append("")
    return "\n".join(lines)
