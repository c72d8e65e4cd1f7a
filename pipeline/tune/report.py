"""Results of a sweep: the mode tables, the accuracy table, the Pareto front (table + PNG), the best recipe and
``report.md`` — all written into the tune's run directory from a :class:`~pipeline.tune.stage.SweepResult`.

Files: ``report.md``, ``results.json`` (every point, summarised), ``pareto.png``, ``best_recipe.yaml`` (only
when a configuration met the SLOs and passed the gate or needed none; the recipe is the point's resolved
recipe, named ``<tune>-best``).
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from pipeline.tune import analysis as an
from pipeline.tune.stage import SweepResult

REPORT_MD, RESULTS_JSON, PARETO_PNG, BEST_RECIPE = "report.md", "results.json", "pareto.png", "best_recipe.yaml"


def _f(x: float | None, fmt: str = ".1f") -> str:
    return "—" if x is None else format(x, fmt)


def point_cells(d: dict[str, Any]) -> list[str]:
    """tok/s (mean ± spread over repeats), at, TTFT p50/p99, ITL p50/p99 (ms) of a summarised point."""
    if d["status"] != "DONE":
        return [f"{d['status']}: {d.get('reason', '')}", "", "", "", "", ""]
    lat = d.get("latency", {})
    vals = d["values"]
    v = "INVALID" if d["value"] is None else f"{d['value']:.1f}" + (f" ± {(max(vals) - min(vals)) / 2:.1f}" if len(vals) > 1 else "")
    return [v, d.get("at") or "—", _f(lat.get("time_to_first_token.p50"), ".0f"), _f(lat.get("time_to_first_token.p99"), ".0f"),
            _f(lat.get("inter_token_latency.p50"), ".1f"), _f(lat.get("inter_token_latency.p99"), ".1f")]


def gate_cell(d: dict[str, Any]) -> str:
    """The gate verdict of a point (SAFE/UNSAFE in the harness's words: PASS / FAIL / INCONCLUSIVE / not needed)."""
    return (d.get("gate") or {}).get("verdict", "—")


def mode_table(res: SweepResult, mode: str, metric: str) -> list[str]:
    """Markdown lines of one mode's table."""
    stacked = mode in ("stacked", "cumulative")
    head = ["step" if stacked else "change", f"{metric} (tok/s)", "at", "TTFT p50", "TTFT p99", "ITL p50", "ITL p99",
            "speedup vs base [95 % CI]"] + (["vs previous", "kept", "note"] if stacked else []) + ["gate"]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for r in res.modes[mode]:
        d = res.points[r.point_id]
        ref = r.point_id == res.base_id
        row = [r.change, *point_cells(d), "1.00× (reference)" if ref else r.speedup.text() if r.speedup else "—"]
        if stacked:
            row += [r.vs_previous.text() if r.vs_previous else "—", "yes" if r.kept else "no", r.note]
        row.append(gate_cell(d))
        lines.append("| " + " | ".join(row) + " |")
    return lines


def pareto_rows(res: SweepResult) -> list[dict[str, Any]]:
    """Every measured operating point (point × load) with ``front`` marking the Pareto-optimal ones
    (maximising output tok/s per GPU and tok/s per user)."""
    rows = [{"point": pid, "label": _label(res, pid), **op} for pid, d in res.points.items() for op in d.get("operating", [])]
    front = set(an.pareto_front([(r["per_user"], r["per_gpu"]) for r in rows]))
    for i, r in enumerate(rows):
        r["front"] = i in front
    return rows


def _label(res: SweepResult, pid: str) -> str:
    return res.points[pid].get("label", pid)


def plot_pareto(rows: list[dict[str, Any]], path: Path, title: str) -> None:
    """Scatter of every operating point, the front joined by a line (matplotlib, Agg backend)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7.5, 5))
    labels = list(dict.fromkeys(r["label"] for r in rows))
    cmap = plt.get_cmap("tab10")
    for i, lbl in enumerate(labels):
        pts = [r for r in rows if r["label"] == lbl]
        ax.scatter([r["per_user"] for r in pts], [r["per_gpu"] for r in pts], color=cmap(i % 10), label=lbl, s=28,
                   marker="o" if all(r["meets_slo"] for r in pts) else "x")
    front = sorted((r for r in rows if r["front"]), key=lambda r: r["per_user"])
    ax.plot([r["per_user"] for r in front], [r["per_gpu"] for r in front], "k--", lw=1, label="Pareto front")
    ax.set_xlabel("output tokens/s per user")
    ax.set_ylabel("output tokens/s per GPU")
    ax.set_title(title, fontsize=10)
    ax.grid(alpha=0.3)
    ax.legend(fontsize=7, loc="best")
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)


def write(res: SweepResult, tune: Any, out: Path, *, wall_s: float) -> dict[str, Path]:
    """Write report.md, results.json, pareto.png and best_recipe.yaml into ``out``; returns their paths."""
    from pipeline.recipe import dump_recipe

    out = Path(out)
    obj = tune.spec.objective
    paths = {"report": out / REPORT_MD, "results": out / RESULTS_JSON, "pareto": out / PARETO_PNG}
    rows = pareto_rows(res)
    if rows:
        plot_pareto(rows, paths["pareto"], f"{tune.name}: operating points (x: SLO miss)")
    dec = res.decision
    best = res.points.get(dec.best) if dec and dec.best else None
    if best is not None:
        r = res.recipes.get(dec.best)
        if r is None:  # a point reused from disk: its resolved recipe
            from pipeline.recipe.load import load_recipe

            r = load_recipe(out / "points" / dec.best / "recipe.yaml")
        paths["best"] = out / BEST_RECIPE
        text = dump_recipe(r.model_copy(update={"name": f"{tune.name}-best",
                                                "description": f"trtpipe tune {tune.name}: {best['label']}"}))
        paths["best"].write_text(f"# best configuration of trtpipe tune {tune.path} ({dec.reason})\n" + text)
    elif (out / BEST_RECIPE).exists():
        (out / BEST_RECIPE).unlink()
    lines = [f"# trtpipe tune: {tune.name}", "",
             (f"Base recipe `{tune.recipe_path}`; modes {', '.join(tune.spec.modes)}; {tune.spec.repeats} repeat(s) per point; "
             f"scenarios {', '.join(f'{s.isl}/{s.osl}' for s in tune.bench.scenarios)} (ISL/OSL); "
             f"concurrency {', '.join(map(str, tune.bench.concurrency))}; wall time {wall_s / 60:.1f} min."), "",
             f"Objective: max `{obj.metric}` over the load points that meet "
             + (", ".join(f"`{s.metric}` {'≤ ' + format(s.max, 'g') if s.max is not None else '≥ ' + format(s.min, 'g')}" for s in obj.slo)
                or "(no SLO)") + ". Latencies in ms at that load point (means over repeats).", ""]
    for mode in res.modes:
        lines += [f"## {mode}", "", *mode_table(res, mode, obj.metric), ""]
    lines += ["## Accuracy gate", "",
              (f"`trtpipe eval` ({tune.gate.task}, n = {tune.gate.n}, rule {tune.gate.rule}) against the full-precision "
              "baseline, for every point whose numerics differ from the base (quantization, or the CPU engine's build.cpu.dtype). "
              "PASS is SAFE, FAIL is UNSAFE; "
              "INCONCLUSIVE means n is too small to resolve the rule's margin (the power analysis in eval.json) — "
              "it is not a pass, so such a point cannot be the best."), "",
              "| point | gate | detail |", "|---|---|---|"]
    for d in res.points.values():
        g = d.get("gate") or {}
        if g.get("verdict") in ("PASS", "FAIL", "INCONCLUSIVE"):
            a = (g.get("means") or {}).get("agreement") or {}
            k = (g.get("means") or {}).get("kld")
            kl = "" if not k or "mean_kld" not in k else (
                f"mean KLD {k['mean_kld']['value']:.4g} [{k['mean_kld']['ci'][0]:.4g}, {k['mean_kld']['ci'][1]:.4g}] "
                f"(limit {k['limits']['kld_max']:.4g}), same top-1 {k['same_top1_pct']['value']:.1f} % "
                f"(limit {k['limits']['same_top1_min']:.4g}); ")
            lines.append(f"| {d['label']} | {g['verdict']} | rule {g.get('rule')}, n = {g.get('n')}; {kl}exact agreement "
                         f"{_f(a.get('exact_match_pct'), '.0f')} %, ROUGE-L vs baseline {_f(a.get('rougeL_vs_baseline'))} |")
    skipped = [d for d in res.points.values() if d["status"] != "DONE"]
    if skipped:
        lines += ["", "## Not measured", ""] + [f"- {d['label']}: {d['status']}: {d.get('reason', '')}" for d in skipped]
    lines += ["", "## Pareto front: output tok/s per GPU vs tok/s per user", "", "![pareto](pareto.png)", "",
              "| point | load | tok/s per user | tok/s per GPU | meets SLO |", "|---|---|---|---|---|"]
    for r in sorted((r for r in rows if r["front"]), key=lambda r: r["per_user"]):
        lines.append(f"| {r['label']} | {r['load']} | {r['per_user']:.1f} | {r['per_gpu']:.1f} | {'yes' if r['meets_slo'] else 'no'} |")
    lines += ["", "## Best configuration", ""]
    if best is None:
        lines.append(dec.reason if dec else "no decision")
    else:
        verdict = f"**tie** between {best['label']} and {_label(res, dec.runner_up)}" if dec.tie else f"**{best['label']}**"
        lines += [f"{verdict} ({dec.reason}); recipe: [`{BEST_RECIPE}`]({BEST_RECIPE}) (the top mean is written out).",
                  ""]
    lines += ["## Statistics", "",
              ("Speedup = mean objective of the point / mean of the reference over the repeats. Its 95 % interval is a "
              f"percentile bootstrap of that ratio ({an.RESAMPLES} resamples, each side's repeats drawn independently "
              "with replacement); with 1 repeat there is no interval. Stacked mode keeps a change when the interval "
              "of its speedup over the configuration before it lies above 1 (with 1 repeat: when the point estimate "
              "does). A winner is named only when the interval of its ratio to the runner-up lies above 1; otherwise "
              "the report says they tie."), ""]
    paths["report"].write_text("\n".join(lines) + "\n")
    results = {"tune": tune.name, "base": res.base_id, "wall_s": wall_s,
               "decision": None if dec is None else {"best": dec.best, "runner_up": dec.runner_up, "tie": dec.tie,
                                                     "reason": dec.reason},
               "modes": {m: [{"point": r.point_id, "change": r.change, "kept": r.kept, "note": r.note,
                              "speedup": None if r.speedup is None else [r.speedup.value, r.speedup.ci]}
                             for r in rows_] for m, rows_ in res.modes.items()},
               "points": res.points, "pareto": rows}
    paths["results"].write_text(json.dumps(results, indent=2, default=str) + "\n")
    return paths
