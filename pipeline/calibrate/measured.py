"""Predicted vs measured: compare :func:`pipeline.plan.predict` with ``trtpipe bench`` runs (``bench.json``).

:func:`compare_run` reads a run directory, takes its recipe (the one given, else the ``recipe.yaml`` of the build
directory the run recorded), and for each closed-loop load point (ISL/OSL × concurrency) returns the measured
output tokens/s, mean TTFT and mean ITL (ms) next to the prediction and its expected error;
:func:`comparison_table` formats them. ``trtpipe plan [RECIPE] --against RUN_DIR`` prints them; a sweep tool can
call :func:`compare_run` per point.
"""

from __future__ import annotations

import math
from pathlib import Path

from pydantic import BaseModel

from pipeline.bench.exporters import BENCH_JSON  # the run file name
from pipeline.core.errors import UserError
from pipeline.plan.achievable import Prediction


class PointComparison(BaseModel):
    """One closed-loop load point: measured (from bench.json) and predicted. Units: tokens/s and ms.

    ``error`` = predicted / measured − 1 of output tokens/s; ``within`` says whether the measurement lies
    inside the prediction's 1 σ band [value / (1 + e), value × (1 + e)]; ``ttft_error``, ``ttft_p99_error`` and
    ``itl_error`` the same ratio − 1 of mean TTFT, p99 TTFT and mean ITL (None where the run lacks the figure).
    """

    run_dir: str
    isl: int
    osl: int
    concurrency: int
    requests: int
    measured_output_tokens_per_s: float
    measured_ttft_ms: float | None
    measured_ttft_p99_ms: float | None = None
    measured_itl_ms: float | None
    predicted: Prediction
    error: float
    within: bool
    ttft_error: float | None = None
    ttft_p99_error: float | None = None
    itl_error: float | None = None

    def errors(self) -> dict[str, float]:
        """The relative errors this point has (predicted / measured − 1), by figure: ``tok/s``, ``TTFT``,
        ``TTFT p99``, ``ITL``."""
        named = {"tok/s": self.error, "TTFT": self.ttft_error, "TTFT p99": self.ttft_p99_error, "ITL": self.itl_error}
        return {k: v for k, v in named.items() if v is not None}


def _rel(pred: float | None, meas: float | None) -> float | None:
    """predicted / measured − 1, or None without both."""
    return None if pred is None or not meas else pred / meas - 1


def median_abs_errors(rows: list[PointComparison]) -> dict[str, float]:
    """Median |predicted / measured − 1| per figure over ``rows`` (``tok/s``, ``TTFT``, ``TTFT p99``, ``ITL``), and
    over all of them together (``all``)."""
    import statistics

    by: dict[str, list[float]] = {}
    for r in rows:
        for k, v in r.errors().items():
            by.setdefault(k, []).append(abs(v))
    out = {k: statistics.median(v) for k, v in by.items()}
    if by:
        out["all"] = statistics.median([x for v in by.values() for x in v])
    return out


def load_bench(run_dir: Path) -> dict:
    """The ``bench.json`` document of a run directory (:meth:`pipeline.bench.results.BenchResult.read`).

    Raises:
        UserError: it is missing, not JSON, or not a trtpipe bench document.
    """
    from pipeline.bench.results import BenchResult

    doc = BenchResult.read(run_dir)
    if not str(doc.get("schema", "")).startswith("trtpipe.bench/"):
        raise UserError(f"{run_dir}: schema {doc.get('schema')!r} is not a trtpipe bench document")
    return doc


def recipe_of_run(doc: dict) -> Path | None:
    """The recipe YAML a run was made against: the resolved recipe of the build the run recorded."""
    from pipeline.core.layout import BuildLayout

    build = (doc.get("config") or {}).get("build_dir") or ((doc.get("environment") or {}).get("build") or {}).get("dir")
    recipe = BuildLayout(Path(build)).recipe_file if build else None
    return recipe if recipe is not None and recipe.is_file() else None


def compare_run(run_dir: Path, recipe_path: Path | None = None, concurrency: list[int] | None = None,
                *, gpu: str | None = None, overrides: list[str] | None = None) -> list[PointComparison]:
    """Measured vs predicted for every closed-loop load point of ``run_dir`` (only ``concurrency`` values when
    given), in the order of the run. ``gpu``: predict on this catalog GPU (or ``cpu``) instead of the recipe's
    target; ``overrides``: ``KEY=VALUE`` recipe overrides (:func:`pipeline.recipe.load_recipe`).

    Raises:
        UserError: no bench.json, no recipe (pass one), a recipe that cannot be predicted, no matching point.
    """
    from pipeline.plan.planner import predict
    from pipeline.recipe import load_recipe

    doc = load_bench(run_dir)
    path = recipe_path or recipe_of_run(doc)
    if path is None:
        raise UserError(f"{run_dir}: the run recorded no build directory with a recipe.yaml: pass the recipe (trtpipe plan RECIPE --against RUN_DIR)")
    recipe = load_recipe(Path(path), overrides)
    out = []
    for p in doc.get("load_points", []):
        if p.get("mode") != "concurrency" or "summary" not in p:
            continue
        c = int(p["concurrency"])
        if concurrency and c not in concurrency:
            continue
        s = p["summary"]
        m = s["metrics"]
        tps = m.get("output_token_throughput")
        if not tps:
            continue
        pred = predict(recipe, int(p["isl"]), int(p["osl"]), c, gpu=gpu, recipe_dir=Path(path).resolve().parent)
        e = pred.rel_error
        ttft, itl = m.get("time_to_first_token") or {}, m.get("inter_token_latency") or {}
        out.append(PointComparison(
            run_dir=str(run_dir), isl=int(p["isl"]), osl=int(p["osl"]), concurrency=c, requests=s["counts"]["completed"],
            measured_output_tokens_per_s=tps, measured_ttft_ms=ttft.get("avg"), measured_ttft_p99_ms=ttft.get("p99"),
            measured_itl_ms=itl.get("avg"), predicted=pred,
            error=pred.output_tokens_per_s / tps - 1, within=abs(math.log(pred.output_tokens_per_s / tps)) <= math.log1p(e),
            ttft_error=_rel(pred.ttft_ms, ttft.get("avg")), ttft_p99_error=_rel(pred.ttft_p99_ms, ttft.get("p99")),
            itl_error=_rel(pred.itl_ms, itl.get("avg")),
        ))
    if not out:
        want = f" at concurrency {','.join(map(str, concurrency))}" if concurrency else ""
        raise UserError(f"{run_dir}: no completed closed-loop load point{want} in {BENCH_JSON}")
    return out


def _f(x: float | None, nd: int = 1) -> str:
    return "—" if x is None else f"{x:,.{nd}f}"


def comparison_table(rows: list[PointComparison], *, markdown: bool = False) -> str:
    """``rows`` as a plain-text table (or a Markdown one): run, ISL/OSL, concurrency, measured and predicted
    output tokens/s (± expected error), the error, whether the measurement is in the band, TTFT (mean, p99) and ITL
    (ms) measured / predicted with their errors; then the median |error| per figure and over all of them."""
    head = ["run", "ISL/OSL", "conc.", "measured tok/s", "predicted tok/s", "error", "in band", "TTFT ms meas/pred",
            "TTFT p99 meas/pred", "ITL ms meas/pred"]

    def err(x: float | None) -> str:
        return "" if x is None else f" ({x:+.0%})"

    table = []
    for r in rows:
        p = r.predicted
        table.append([Path(r.run_dir).name, f"{r.isl}/{r.osl}", str(r.concurrency), _f(r.measured_output_tokens_per_s),
                      f"{p.output_tokens_per_s:,.1f} ±{p.rel_error:.0%}", f"{r.error:+.0%}", "yes" if r.within else "no",
                      f"{_f(r.measured_ttft_ms, 0)} / {_f(p.ttft_ms, 0)}{err(r.ttft_error)}",
                      f"{_f(r.measured_ttft_p99_ms, 0)} / {_f(p.ttft_p99_ms, 0)}{err(r.ttft_p99_error)}",
                      f"{_f(r.measured_itl_ms)} / {_f(p.itl_ms)}{err(r.itl_error)}"])
    med = median_abs_errors(rows)
    foot = "median |error|: " + ", ".join(f"{k} {v:.0%}" for k, v in med.items())
    if markdown:
        return "\n".join(["| " + " | ".join(head) + " |", "|" + "---|" * len(head)] + ["| " + " | ".join(t) + " |" for t in table]
                         + ["", foot])
    widths = [max(len(h), *(len(t[i]) for t in table)) for i, h in enumerate(head)]
    lines = ["  ".join(h.ljust(w) for h, w in zip(head, widths))]
    lines += ["  ".join(c.rjust(w) if i >= 2 else c.ljust(w) for i, (c, w) in enumerate(zip(t, widths))) for t in table]
    return "\n".join(lines + [foot])
