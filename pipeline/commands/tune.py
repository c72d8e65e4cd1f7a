"""``trtpipe tune TUNE.yaml``: sweep recipe knobs, measure each point, report the best certified configuration.

Examples::

    trtpipe tune tunes/smollm2_cpu.yaml                     # isolation + stacked on the CPU default
    trtpipe tune tunes/llama31_8b_h200.yaml --dry-run       # plan every point, print what would be built
    trtpipe tune tunes/x.yaml --mlflow-uri http://mlflow:5000
    trtpipe tune tunes/x.yaml --no-mlflow --out /tmp/t

The work is :mod:`pipeline.tune` (:func:`pipeline.tune.stage.run_sweep`); this module parses flags, shows one
progress display for the whole sweep and prints the result. Exit 0 with a result, 2 on a bad tune file
(nothing written), 130 on Ctrl-C (finished points stay and are reused by the next run).
"""

from __future__ import annotations

import time
from pathlib import Path
from typing import Annotated, Any

import typer

from pipeline.commands.common import console, err_console, handle_errors


def _dry_run_table(tune: Any, rows: list[dict[str, Any]]) -> Any:
    from rich.table import Table

    t = Table(title=f"trtpipe tune {tune.name} --dry-run: {len(rows)} distinct points (stacked/cumulative as if "
                    "every change were kept)", title_justify="left")
    concs = [(s.isl, s.osl, c) for s in tune.bench.scenarios for c in tune.bench.concurrency]
    for col in ("id", "point", "modes", "plan", "builds", "gate"):
        t.add_column(col, overflow="fold")
    for s in tune.bench.scenarios:
        t.add_column(f"predicted tok/s {s.isl}/{s.osl} at c=" + ",".join(map(str, tune.bench.concurrency)), overflow="fold")
    for r in rows:
        plan = "fits" if r["fits"] else f"SKIPPED: {r['reason']}"
        builds = " + ".join(r["rebuilds"]) or ("—" if not r["fits"] else "nothing (same build)")
        preds = [" / ".join(f"{r['predicted'][k]:.0f}" if k in r["predicted"] else "—" for k in concs if k[:2] == (s.isl, s.osl))
                 for s in tune.bench.scenarios]
        t.add_row(r["id"], r["label"], ",".join(r["modes"]), plan, builds, "eval" if r["gate"] else "—", *preds)
    return t


@handle_errors
def tune(
    tune_file: Annotated[Path, typer.Argument(metavar="TUNE.yaml", help="The sweep (see docs/tune.md; schema: tune.schema.json).")],
    out: Annotated[Path | None, typer.Option("--out", help="Run directory (default artifacts/tune/<tune name>).")] = None,
    dry_run: Annotated[bool, typer.Option("--dry-run", help="Plan every point and print what would be built; build nothing, write nothing.")] = False,
    mlflow_uri: Annotated[str | None, typer.Option("--mlflow-uri", help="MLflow tracking URI (default: SQLite in the run directory).")] = None,
    no_mlflow: Annotated[bool, typer.Option("--no-mlflow", help="Do not log to MLflow.")] = False,
) -> None:
    """Sweep knobs of a recipe (isolation / stacked / cumulative / grid), measure every point for real, gate
    accuracy, and write the tables, the Pareto front and the best configuration that meets the SLOs."""
    from pipeline.core import artifacts
    from pipeline.tune.spec import load_tune

    t = load_tune(tune_file)
    if dry_run:
        from pipeline.tune.stage import dry_run as plan_all

        rows = plan_all(t)
        con = console
        con.print(_dry_run_table(t, rows))
        skipped = [r for r in rows if not r["fits"]]
        con.print(f"{len(rows) - len(skipped)} point(s) would be built and measured, {len(skipped)} SKIPPED; "
                  f"{sum('quantize' in r['rebuilds'] for r in rows)} quantization(s), "
                  f"{sum('engine' in r['rebuilds'] for r in rows)} engine build(s)", highlight=False)
        return
    run_dir = out or artifacts.DEFAULT_ARTIFACTS_ROOT / "tune" / t.name
    _run(t, run_dir, mlflow_uri, no_mlflow)


def _run(t: Any, run_dir: Path, mlflow_uri: str | None, no_mlflow: bool) -> None:
    from rich.progress import (
        BarColumn,
        MofNCompleteColumn,
        Progress,
        TextColumn,
        TimeElapsedColumn,
        TimeRemainingColumn,
    )

    from pipeline.recipe import dump_recipe
    from pipeline.recipe.consumers import flatten
    from pipeline.tune import report
    from pipeline.tune.stage import planned_total, run_sweep

    tracker = None
    if not no_mlflow:
        from pipeline.tune.tracking import Tracker

        params = {f"tune.{k}": v for k, v in flatten(t.spec.model_dump(mode="json")).items()}
        tracker = Tracker(run_dir, t.name, mlflow_uri, params)
    run_dir.mkdir(parents=True, exist_ok=True)
    (run_dir / "tune.yaml").write_text(t.path.read_text())
    (run_dir / "base_recipe.yaml").write_text(dump_recipe(t.base))
    t0 = time.monotonic()
    progress = Progress(TextColumn("[bold]tune[/] {task.description}"), BarColumn(), MofNCompleteColumn(),
                        TimeElapsedColumn(), TextColumn("ETA"), TimeRemainingColumn(), console=err_console,
                        disable=not err_console.is_terminal, transient=False)
    def status(s: str) -> None:  # on a terminal and piped alike
        progress.console.print(f"  {s}", highlight=False)
    with progress:
        task = progress.add_task("starting", total=planned_total(t))

        def on_point(p: Any, stage: str) -> None:
            progress.update(task, description=f"{p.label} [{p.id}]: {stage}")
            if not err_console.is_terminal:  # no live bar when piped: a line per stage, so no stage is silent
                status(f"{p.label} [{p.id}]: {stage} ({time.monotonic() - t0:.0f} s into the tune)")

        def on_done(p: Any, d: dict[str, Any]) -> None:
            progress.advance(task)
            v = d.get("value")
            line = (f"{d['label']}: {d['status']}" + (f" {v:.1f} tok/s" if v is not None else "")
                    + (f" ({d.get('reason')})" if d["status"] != "DONE" else "")
                    + (f", gate {d['gate']['verdict']}" if d.get("gate") else "") + (" (reused)" if d.get("reused") else ""))
            progress.console.print(f"  {line}", highlight=False)  # one line per point, also when piped
            if tracker is not None:
                from pipeline.tune.analysis import speedup

                base = res_points.get("base")
                s = speedup(d["values"], base["values"]) if base else None
                tracker.log_point(d, p.recipe, None if s is None else s.value)
            if not p.changes:
                res_points["base"] = d

        res_points: dict[str, Any] = {}
        res = run_sweep(t, run_dir, on_point=on_point, on_done=on_done, status=status)
    wall = time.monotonic() - t0
    files = report.write(res, t, run_dir, wall_s=wall)
    if tracker is not None:
        tracker.finish(files, res.decision.best if res.decision else None)
    dec = res.decision
    done = sum(d["status"] == "DONE" for d in res.points.values())
    skipped = sum(d["status"] == "SKIPPED" for d in res.points.values())
    failed = [d for d in res.points.values() if d["status"] == "FAILED"]
    console.print(f"{len(res.points)} point(s): {done} measured, {skipped} SKIPPED, {len(failed)} FAILED; "
                  f"{wall / 60:.1f} min", highlight=False)
    if dec is not None and dec.best is not None:
        best = res.points[dec.best]["label"]
        head = f"tie between {best} and {res.points[dec.runner_up]['label']}" if dec.tie else f"best: {best}"
        console.print(f"{head} — {dec.reason}", highlight=False)
        console.print(f"best recipe: {files.get('best')}", highlight=False)
    else:
        console.print(f"no best configuration: {dec.reason if dec else ''}", highlight=False)
    console.print(f"report: {files['report']}" + (f"; MLflow: {tracker.uri}" if tracker else ""), highlight=False)
