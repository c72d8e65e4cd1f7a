"""One point of a sweep, for real: plan → build → serve → bench × repeats → eval gate → stop → ``point.json``.

Run directory of a tune (``artifacts/tune/<name>/``)::

    points/<id>/point.json      the finished point (written last, atomically: temp file + rename)
    points/<id>/build/          its build directory (quantize/engine stages hard-linked from an earlier point
                                whose stage inputs are identical, then reused by build.run's content keys)
    points/<id>/bench-<r>/      bench run of repeat r (bench.json, AIPerf exports, plots)
    points/<id>/eval/           accuracy gate run (eval.json, samples.jsonl) when the numerics changed
    baseline/                   the full-precision baseline build of the gate (built once, outputs cached)

A point whose ``point.json`` exists is reused as is (resume). A point the planner says cannot fit is written
as ``SKIPPED`` with the planner's reason, without building anything. A point whose build, server or bench fails
is reported ``FAILED`` and not written (a rerun tries it again).
"""

from __future__ import annotations

import json
import shutil
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from pipeline.assemble.seed import seed_build
from pipeline.core import artifacts
from pipeline.core.errors import TrtpipeError
from pipeline.core.layout import BuildLayout
from pipeline.tune.points import (
    Point,
    is_full_precision,
    numerics_changed,
    plan_point,
)

POINT_JSON = "point.json"
#: gate verdicts that make a point eligible to be the best (besides PASS)
GATE_NOT_NEEDED = "not needed (same numerics as the base)"
GATE_REFERENCE = "not needed (full precision: the gate's reference)"


def point_dir(out: Path, point_id: str) -> Path:
    """``out/points/<id>``."""
    return Path(out) / "points" / point_id


def read_point(out: Path, point_id: str) -> dict[str, Any] | None:
    """The finished point's document, or ``None``."""
    f = point_dir(out, point_id) / POINT_JSON
    try:
        return json.loads(f.read_text())
    except (OSError, ValueError):
        return None


def donors(out: Path) -> list[Path]:
    """Build directories a point may be seeded from: the tune's that finished (the baseline included), then the
    user's builds under ``artifacts/`` (:func:`pipeline.assemble.seed.local_builds`: the last build first), so the base
    point reuses the quantize stage of the recipe the user already built instead of calibrating again."""
    from pipeline.assemble.seed import local_builds

    own = [p for p in [*sorted((Path(out) / "points").glob("*/build")), Path(out) / "baseline"] if (p / "recipe.yaml").is_file()]
    seen = {p.resolve() for p in own}
    return [*own, *(p for p in local_builds() if p.resolve() not in seen)]


def build_point(recipe: Any, build_dir: Path, recipe_dir: Path, out: Path, status: Callable[[str], None]) -> Any:
    """Seed then build (``pipeline.assemble.stage.run``); the user's last build stays recorded as it was. ``status``
    gets a line per seeded stage and per finished stage (built or reused)."""
    from pipeline.assemble import stage as build

    seeded = seed_build(build_dir, recipe, donors(out))
    for stage, donor in seeded.items():
        status(f"{stage}: linked in from {donor} (reused if its content key matches)")
    with artifacts.last_build_kept():  # a tune's point builds are not "the last build" of `trtpipe serve` / `bench`
        return build.run(recipe, build_dir, recipe_dir=recipe_dir, warn=status,
                         on_stage=lambda name, res, _: status(f"{name}: {'reused' if res.cached else 'built'}"))


def baseline_layout(tune: Any, out: Path, status: Callable[[str], None]) -> BuildLayout:
    """The gate's full-precision baseline of the base recipe, built (or reused) into ``out/baseline``."""
    from pipeline.eval.stage import baseline_recipe

    return build_point(baseline_recipe(tune.base, tune.recipe_dir), Path(out) / "baseline", tune.recipe_dir, out, status).layout


def measure(point: Point, tune: Any, out: Path, *, on_stage: Callable[[str], None] = lambda s: None,
            status: Callable[[str], None] = lambda s: None) -> dict[str, Any]:
    """The finished document of ``point`` (reused from ``point.json`` when there), else measured now.

    Returns the point document: ``status`` DONE | SKIPPED | FAILED, ``reason``, ``plan``, ``stages`` (built or
    reused per build stage), ``repeats`` (load points with AIPerf-named metrics per repeat), ``gate``,
    ``timings_s``. Ctrl-C propagates after the server is stopped; nothing of the point is then written.
    """
    from pipeline.recipe import dump_recipe

    done = read_point(out, point.id)
    if done is not None:
        done["reused"] = True
        return done
    pdir = point_dir(out, point.id)
    doc: dict[str, Any] = {
        "id": point.id, "label": point.label,
        "changes": [{"field": c.field, "value": c.value, "also": dict(c.also), "label": c.label} for c in point.changes],
        "numerics_changed": numerics_changed(point.recipe, tune.base), "started_at": artifacts.utc_now(),
    }
    t0 = time.monotonic()
    on_stage("plan")
    plan = plan_point(point.recipe, tune.bench, tune.recipe_dir)
    doc["plan"] = {"fits": plan.fits, "reason": plan.reason, "warnings": list(plan.warnings),
                   "predicted": [{"isl": i, "osl": o, "concurrency": c, "output_token_throughput": v}
                                 for (i, o, c), v in plan.predicted.items()]}
    if not plan.fits:
        doc.update(status="SKIPPED", reason=plan.reason, timings_s={"total": round(time.monotonic() - t0, 3)})
        artifacts.write_atomic(pdir / POINT_JSON, json.dumps(doc, indent=2, default=str) + "\n")
        (pdir / "recipe.yaml").write_text(dump_recipe(point.recipe))
        return doc
    timings: dict[str, float] = {}
    try:
        _measure(point, tune, out, pdir, doc, timings, on_stage, status)
    except TrtpipeError as e:
        doc.update(status="FAILED", reason=str(e).splitlines()[0] if str(e) else type(e).__name__)
        return doc
    timings["total"] = round(time.monotonic() - t0, 3)
    doc.update(status="DONE", reason="", timings_s=timings, finished_at=artifacts.utc_now())
    (pdir / "recipe.yaml").write_text(dump_recipe(point.recipe))
    artifacts.write_atomic(pdir / POINT_JSON, json.dumps(doc, indent=2, default=str) + "\n")
    return doc


def _measure(point: Point, tune: Any, out: Path, pdir: Path, doc: dict[str, Any], timings: dict[str, float],
             on_stage: Callable[[str], None], status: Callable[[str], None]) -> None:
    from pipeline.bench import stage as bench
    from pipeline.bench.results import check_outcome
    from pipeline.eval import stage as ev
    from pipeline.serve import stage as serve
    from pipeline.tune.analysis import load_points

    t = time.monotonic()
    on_stage("build")
    res = build_point(point.recipe, pdir / "build", tune.recipe_dir, out, status)
    timings["build"] = round(time.monotonic() - t, 3)
    doc["stages"] = {s: ("reused" if r.cached else "built") for s, r in res.stages.items()}
    doc["build_changes"] = res.changes
    gpus = point.recipe.target.tp_size * point.recipe.target.pp_size
    gate_needed = doc["numerics_changed"] and not is_full_precision(point.recipe)
    base_layout = None
    if gate_needed:
        t = time.monotonic()
        on_stage("baseline build")
        base_layout = baseline_layout(tune, out, status)
        timings["baseline_build"] = round(time.monotonic() - t, 3)
    t = time.monotonic()
    on_stage("serve")
    opts = serve.ServeOptions(http_port=None, grpc_port=None, metrics_port=None)
    with serve.run(res.layout, opts) as handle:
        timings["serve_ready"] = round(time.monotonic() - t, 3)
        repeats = []
        for r in range(1, tune.spec.repeats + 1):
            on_stage(f"bench {r}/{tune.spec.repeats}")
            t = time.monotonic()
            run_dir = pdir / f"bench-{r}"
            shutil.rmtree(run_dir, ignore_errors=True)
            result = bench.run(tune.bench, bench.BenchTarget(url=handle.grpc_url, layout=res.layout, out=run_dir,
                                                              metrics_url=handle.metrics_url,
                                                              server_pid=getattr(handle.server, "pid", None)))
            check_outcome(result)
            doc_b = {"load_points": [p.to_json() for p in result.load_points]}
            repeats.append({"bench_dir": str(run_dir), "load_points": load_points(doc_b, gpus)})
            timings[f"bench_{r}"] = round(time.monotonic() - t, 3)
        doc["repeats"] = repeats
        if gate_needed:
            on_stage("eval gate")
            t = time.monotonic()
            shutil.rmtree(pdir / "eval", ignore_errors=True)
            e = ev.run(tune.gate, ev.EvalTarget(layout=res.layout, url=handle.grpc_url),
                       ev.EvalTarget(layout=base_layout), recipe=point.recipe, recipe_dir=tune.recipe_dir,
                       out=pdir / "eval", on_status=status)
            timings["eval"] = round(time.monotonic() - t, 3)
            doc["gate"] = {"verdict": e.verdict, "rule": e.rule.rule, "n": e.n, "task": e.task,
                           "reasons": list(e.rule.reasons), "eval_dir": str(pdir / "eval"), "means": e.means}
        else:
            doc["gate"] = {"verdict": GATE_REFERENCE if is_full_precision(point.recipe) else GATE_NOT_NEEDED}
