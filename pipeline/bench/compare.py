"""``trtpipe bench compare RUN_A RUN_B``: per scenario × load point deltas between two runs.

Reads only the two ``summary.csv`` files. For each row present in both runs and each headline
metric, it reports A, B, the change in % ((B − A) / A) and whether B is better or worse by the
metric's direction (:data:`pipeline.bench.metrics.METRICS` ``larger_is_better``).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from pipeline.bench.metrics import METRICS
from pipeline.bench.summary_csv import column, read_summary

#: (metric tag, statistic or None) compared by default
HEADLINE = (
    ("time_to_first_token", "avg"), ("time_to_first_token", "p99"),
    ("inter_token_latency", "avg"), ("inter_token_latency", "p99"),
    ("time_per_output_token", "avg"), ("request_latency", "avg"), ("request_latency", "p99"),
    ("output_token_throughput", None), ("total_token_throughput", None), ("request_throughput", None),
    ("output_token_throughput_per_user", "avg"), ("request_goodput", None),
)
#: relative changes below this (%) are reported as "same"
NOISE_PCT = 1.0


def _key(row: dict[str, Any]) -> tuple[str, str, Any]:
    load = row["concurrency"] if row.get("concurrency") is not None else row.get("request_rate")
    return (str(row["scenario"]), str(row["mode"]), load)


def compare_runs(run_a: Path, run_b: Path) -> list[dict[str, Any]]:
    """Delta rows ``{scenario, mode, load, metric, unit, a, b, change_pct, verdict}``.

    ``verdict`` is ``better``/``worse``/``same`` (|change| < :data:`NOISE_PCT` %), or ``n/a``
    when a value is missing. Rows only in one run are reported with verdict ``only in A/B``.

    Raises:
        UserError: a directory is not a bench run.
    """
    a_rows = {_key(r): r for r in read_summary(run_a)}
    b_rows = {_key(r): r for r in read_summary(run_b)}
    out: list[dict[str, Any]] = []
    for key in list(a_rows) + [k for k in b_rows if k not in a_rows]:
        scenario, mode, load = key
        if key not in a_rows or key not in b_rows:
            out.append({"scenario": scenario, "mode": mode, "load": load, "metric": "-", "unit": "", "a": None,
                        "b": None, "change_pct": None, "verdict": "only in A" if key in a_rows else "only in B"})
            continue
        for tag, stat in HEADLINE:
            spec = METRICS[tag]
            col = column(tag, stat)
            a, b = a_rows[key].get(col), b_rows[key].get(col)
            change = None if a in (None, 0) or b is None else (b - a) / abs(a) * 100.0
            if change is None:
                verdict = "n/a"
            elif abs(change) < NOISE_PCT:
                verdict = "same"
            else:
                verdict = "better" if (change > 0) == spec.larger_is_better else "worse"
            name = f"{spec.title} {stat}" if stat else spec.title
            out.append({"scenario": scenario, "mode": mode, "load": load, "metric": name, "unit": spec.unit,
                        "a": a, "b": b, "change_pct": change, "verdict": verdict})
    return out


def compare_table(rows: list[dict[str, Any]], title: str) -> Any:
    """A rich table of :func:`compare_runs` rows (green = better, red = worse)."""
    from rich.table import Table

    t = Table(title=title, title_justify="left")
    for col, just in (("ISL:OSL", "left"), ("load", "right"), ("metric", "left"), ("A", "right"), ("B", "right"),
                      ("Δ %", "right"), ("", "left")):
        t.add_column(col, justify=just)
    colors = {"better": "green", "worse": "red"}
    for r in rows:
        fmt = (lambda v: "-" if v is None else f"{v:,.2f}")
        pct = "-" if r["change_pct"] is None else f"{r['change_pct']:+.1f}"
        c = colors.get(r["verdict"])
        verdict = f"[{c}]{r['verdict']}[/]" if c else r["verdict"]
        load = "-" if r["load"] is None else (f"c{r['load']:g}" if r["mode"] == "concurrency" else f"r{r['load']:g}")
        t.add_row(r["scenario"], load, f"{r['metric']} ({r['unit']})" if r["unit"] else r["metric"],
                  fmt(r["a"]), fmt(r["b"]), pct, verdict)
    return t
