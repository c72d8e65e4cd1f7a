"""The sweep: run the modes of a tune over its points, decide stacked steps, and summarise every point.

* ``isolation``: the base, then each knob value alone on the base; speedup vs the base.
* ``stacked``: the knob values in order, each on top of the changes kept so far; a change is kept only when
  it helps — the speedup over the current configuration lies above 1 (its interval's lower end; with 1 repeat
  the point estimate), the point meets the SLOs, and its gate passed (or was not needed).
* ``cumulative``: the same sequence keeping every change that could run (the harness's stacked table); each
  step is VALID when it meets the SLOs, INVALID otherwise.
* ``grid``: every combination of one value per knob.

Points are keyed by their resolved recipe, so the same configuration asked for by two modes is measured once.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from pathlib import Path
from typing import Any

from pipeline.tune import analysis as an
from pipeline.tune.measure import GATE_NOT_NEEDED, GATE_REFERENCE, measure
from pipeline.tune.points import Point, grid_points, isolation_points, make_point, steps
from pipeline.tune.spec import Tune


def summarize(doc: dict[str, Any], tune: Tune) -> dict[str, Any]:
    """Add the sweep's view of a point document: ``values`` (objective per repeat), ``value`` (mean or None),
    ``at`` (the load point that gave it), ``valid`` (every repeat met the SLOs), ``violations``, ``eligible``
    (valid and gate PASS or not needed), latency percentiles at ``at`` (means over repeats), and
    ``operating`` (per load point: output tok/s per GPU and tok/s per user, means over repeats)."""
    obj = tune.spec.objective
    if doc.get("status") != "DONE":
        return doc | {"values": [], "value": None, "valid": False, "eligible": False, "at": None, "operating": []}
    values, ats = [], []
    for rep in doc["repeats"]:
        v, at = an.objective(rep["load_points"], obj.metric, obj.slo)
        values.append(v)
        ats.append(at)
    valid = all(v is not None for v in values)
    at = max({a for a in ats if a}, key=ats.count) if any(ats) else None
    lat: dict[str, float] = {}
    per_load: dict[str, list[dict[str, float]]] = {}
    for rep in doc["repeats"]:
        for lp in rep["load_points"]:
            per_load.setdefault(f"{lp['scenario']}/{lp['load']}", []).append(lp["metrics"])
    if at is not None:
        for k in ("time_to_first_token.p50", "time_to_first_token.p99", "inter_token_latency.p50",
                  "inter_token_latency.p99", "output_token_throughput_per_user.avg"):
            xs = [m[k] for m in per_load.get(at, []) if k in m]
            if xs:
                lat[k] = an.mean(xs)
    operating = []
    for key, ms in per_load.items():
        x = [m.get("output_token_throughput_per_user.avg") for m in ms]
        y = [m.get("output_token_throughput_per_gpu") for m in ms]
        if all(v is not None for v in x + y):
            operating.append({"load": key, "per_user": an.mean(x), "per_gpu": an.mean(y),
                              "meets_slo": all(not an.meets(m, obj.slo) for m in ms)})
    violations = sorted({b for rep in doc["repeats"] for lp in rep["load_points"] for b in an.meets(lp["metrics"], obj.slo)})
    gate = (doc.get("gate") or {}).get("verdict")
    eligible = valid and gate in ("PASS", GATE_NOT_NEEDED, GATE_REFERENCE)
    return doc | {"values": [v for v in values if v is not None] if valid else [], "value": an.mean(values) if valid else None,
                  "at": at, "valid": valid, "eligible": eligible, "latency": lat, "operating": operating,
                  "violations": violations}


@dataclasses.dataclass
class Row:
    """One line of a mode's table: the point, its step label and the mode's verdict on it."""

    point_id: str
    change: str
    speedup: an.Speedup | None = None        # vs the base
    vs_previous: an.Speedup | None = None    # stacked/cumulative: vs the configuration before this step
    kept: bool | None = None                 # stacked/cumulative
    note: str = ""


@dataclasses.dataclass
class SweepResult:
    """Every point (id → summarised document), each mode's rows, the base id and the decision."""

    points: dict[str, dict[str, Any]]
    modes: dict[str, list[Row]]
    base_id: str
    decision: an.Decision | None = None
    recipes: dict[str, Any] = dataclasses.field(default_factory=dict)


def planned_total(tune: Tune) -> int:
    """How many point evaluations the modes ask for (repeated ids included): the progress total."""
    n = 0
    for m in tune.spec.modes:
        n += len(isolation_points(tune)) if m == "isolation" else len(grid_points(tune)) if m == "grid" else 1 + len(steps(tune))
    return n


def run_sweep(tune: Tune, out: Path, *, on_point: Callable[[Point, str], None] = lambda p, s: None,
              on_done: Callable[[Point, dict[str, Any]], None] = lambda p, d: None,
              status: Callable[[str], None] = lambda s: None) -> SweepResult:
    """Run every mode; ``on_point(point, stage)`` reports progress, ``on_done(point, doc)`` each finished point
    (reused ones included). Ctrl-C propagates; finished points stay on disk."""
    res = SweepResult({}, {}, "")

    def get(p: Point, report: bool = True) -> dict[str, Any]:
        if p.id not in res.points:
            doc = measure(p, tune, out, on_stage=lambda s: on_point(p, s), status=status)
            res.points[p.id] = summarize(doc, tune)
            res.recipes[p.id] = p.recipe
            if doc["status"] == "FAILED":
                status(f"{p.label}: FAILED: {doc['reason']}")
        if report:  # every mode lists the base: it is reported there, not here
            on_done(p, res.points[p.id])
        return res.points[p.id]

    base = make_point(tune, ())
    res.base_id = base.id
    b = get(base, report=False)
    for mode in tune.spec.modes:
        rows: list[Row] = []
        if mode in ("isolation", "grid"):
            pts = isolation_points(tune) if mode == "isolation" else grid_points(tune)
            for p in pts:
                d = get(p)
                rows.append(Row(p.id, p.label, an.speedup(d["values"], b["values"])))
        else:
            current, cur_doc = base, b
            rows.append(Row(base.id, "base", an.speedup(b["values"], b["values"]), kept=True))
            for ch in steps(tune):
                p = make_point(tune, (*current.changes, ch))
                d = get(p)
                s_prev = an.speedup(d["values"], cur_doc["values"])
                if d["status"] != "DONE":
                    keep, note = False, f"{d['status']}: {d.get('reason', '')}"
                elif mode == "cumulative":
                    keep, note = True, "VALID" if d["valid"] else "INVALID: " + "; ".join(d.get("violations", [])[:2])
                elif not d["eligible"]:
                    keep = False
                    note = ("INVALID: " + "; ".join(d.get("violations", [])[:2])) if not d["valid"] else \
                        f"gate {d['gate']['verdict']}"
                elif cur_doc["value"] is None:
                    keep, note = True, "first configuration meeting the SLOs"
                else:
                    keep = s_prev is not None and s_prev.better
                    note = "helps" if keep else "does not help"
                rows.append(Row(p.id, ch.label, an.speedup(d["values"], b["values"]), s_prev, keep, note))
                if keep:
                    current, cur_doc = p, d
        res.modes[mode] = rows
    res.decision = an.decide({k: d["values"] for k, d in res.points.items() if d["eligible"]})
    return res


def dry_run(tune: Tune) -> list[dict[str, Any]]:
    """What the sweep would do, without building: per planned point (stacked/cumulative as if every change were
    kept) its modes, changes, the stages it would build given the points before it, the planner's verdict and
    predicted output tok/s per scenario × concurrency."""
    from pipeline.tune.points import numerics_changed, plan_point, rebuilds

    order: dict[str, tuple[Point, list[str]]] = {}
    plans: dict[str, Any] = {}

    def plan(p: Point) -> Any:
        if p.id not in plans:
            plans[p.id] = plan_point(p.recipe, tune.bench, tune.recipe_dir)
        return plans[p.id]

    for mode in tune.spec.modes:
        if mode in ("isolation", "grid"):
            pts = isolation_points(tune) if mode == "isolation" else grid_points(tune)
        else:  # every change that fits is kept (a SKIPPED one cannot be, as in the real run)
            pts, cur = [make_point(tune, ())], ()
            for ch in steps(tune):
                p = make_point(tune, (*cur, ch))
                pts.append(p)
                if plan(p).fits:
                    cur = p.changes
        for p in pts:
            order.setdefault(p.id, (p, []))[1].append(mode)
    rows, built = [], []
    for p, modes in order.values():
        pl = plan(p)
        rows.append({"id": p.id, "label": p.label, "modes": modes, "fits": pl.fits, "reason": pl.reason,
                     "rebuilds": rebuilds(p.recipe, built) if pl.fits else [],
                     "gate": numerics_changed(p.recipe, tune.base), "predicted": pl.predicted})
        if pl.fits:
            built.append(p.recipe)
    return rows
