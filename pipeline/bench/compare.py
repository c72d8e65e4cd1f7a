"""``trtpipe bench compare A B``: per scenario × load point deltas between two runs, judged against their noise.

A and B are each a run directory (``summary.csv``) or a directory of repeated runs (its subdirectories that are
runs, e.g. a tune point's ``bench-1/``, ``bench-2/``). Reads only the ``summary.csv`` files. For each row present on
both sides and each headline metric, it reports the mean of A's and B's repeats, the change in % ((B − A) / A) and a
verdict by the metric's direction (:data:`pipeline.bench.metrics.METRICS` ``larger_is_better``):

* **2+ repeats a side** — the run-to-run noise is measured: the 95 % percentile-bootstrap interval of
  mean(B) / mean(A) (:func:`pipeline.bench.stats.ratio_ci`, tune's speedup interval). ``better``/``worse`` when the
  interval excludes 1, else ``within noise``.
* **fewer** — the noise is unknown: a change inside ±:data:`DEFAULT_BAND_PCT` % is ``within noise``; only a larger
  one is ``better``/``worse``. The band is perf_analyzer's stability criterion: it takes measurements whose max/min
  is within 10 % as the same steady state (``--stability-percentage``, default 10;
  triton-inference-server/client@040e0adc3ec5 ``src/c++/perf_analyzer/docs/cli.md``:141-148).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from pipeline.bench.metrics import METRICS
from pipeline.bench.stats import ratio_ci
from pipeline.bench.summary_csv import SUMMARY_CSV, column, read_summary

#: (metric tag, statistic or None) compared by default
HEADLINE = (
    ("time_to_first_token", "avg"), ("time_to_first_token", "p99"),
    ("inter_token_latency", "avg"), ("inter_token_latency", "p99"),
    ("time_per_output_token", "avg"), ("request_latency", "avg"), ("request_latency", "p99"),
    ("output_token_throughput", None), ("total_token_throughput", None), ("request_throughput", None),
    ("output_token_throughput_per_user", "avg"), ("request_goodput", None),
)
#: without repeats, changes within ± this (%) are "within noise" (module docstring: perf_analyzer's stability band)
DEFAULT_BAND_PCT = 10.0


def run_dirs(path: Path) -> list[Path]:
    """The runs of one side: ``path`` itself when it holds ``summary.csv``, else its subdirectories that do (repeats,
    sorted by name); ``[path]`` when neither (:func:`read_summary` then names the problem)."""
    path = Path(path)
    if (path / SUMMARY_CSV).is_file() or not path.is_dir():
        return [path]
    runs = sorted(p for p in path.iterdir() if (p / SUMMARY_CSV).is_file())
    return runs or [path]


def _key(row: dict[str, Any]) -> tuple[str, str, Any]:
    load = row["concurrency"] if row.get("concurrency") is not None else row.get("request_rate")
    return (str(row["scenario"]), str(row["mode"]), load)


def _rows(path: Path) -> tuple[int, dict[tuple[str, str, Any], list[dict[str, Any]]]]:
    """(number of repeats, key → that key's row of each repeat)."""
    runs = run_dirs(path)
    out: dict[tuple[str, str, Any], list[dict[str, Any]]] = {}
    for run in runs:
        for r in read_summary(run):
            out.setdefault(_key(r), []).append(r)
    return len(runs), out


def _mean(values: list[float]) -> float:
    return sum(values) / len(values)


def verdict(a: list[float], b: list[float], larger_is_better: bool) -> tuple[float | None, str, str]:
    """``(change_pct, verdict, noise)`` of B's repeats ``b`` against A's ``a`` (module docstring): verdict ``better`` |
    ``worse`` | ``within noise`` | ``n/a`` (no values, or A's mean is 0); ``noise`` says what it was judged against."""
    if not a or not b or _mean(a) == 0:
        return None, "n/a", "-"
    change = (_mean(b) - _mean(a)) / abs(_mean(a)) * 100.0
    ci = ratio_ci(b, a) if _mean(a) > 0 else None
    if ci is not None:
        noise = f"95% CI [{(ci[0] - 1) * 100:+.1f}, {(ci[1] - 1) * 100:+.1f}] % ({len(a)}+{len(b)} repeats)"
        up, down = ci[0] > 1.0, ci[1] < 1.0
    else:
        noise = f"±{DEFAULT_BAND_PCT:g} % (noise unknown: no repeats)"
        up, down = change >= DEFAULT_BAND_PCT, change <= -DEFAULT_BAND_PCT
    if not (up or down):
        return change, "within noise", noise
    return change, "better" if up == larger_is_better else "worse", noise


def compare_runs(run_a: Path, run_b: Path) -> list[dict[str, Any]]:
    """Delta rows ``{scenario, mode, load, metric, unit, a, b, change_pct, verdict, noise}`` (``a``/``b`` the means of
    each side's repeats; :func:`verdict`). Rows only in one run are reported with verdict ``only in A/B``.

    Raises:
        UserError: a directory is neither a bench run nor a directory of runs.
    """
    _, a_rows = _rows(run_a)
    _, b_rows = _rows(run_b)
    out: list[dict[str, Any]] = []
    for key in list(a_rows) + [k for k in b_rows if k not in a_rows]:
        scenario, mode, load = key
        if key not in a_rows or key not in b_rows:
            out.append({"scenario": scenario, "mode": mode, "load": load, "metric": "-", "unit": "", "a": None,
                        "b": None, "change_pct": None, "verdict": "only in A" if key in a_rows else "only in B",
                        "noise": "-"})
            continue
        for tag, stat in HEADLINE:
            spec = METRICS[tag]
            col = column(tag, stat)
            a = [r[col] for r in a_rows[key] if r.get(col) is not None]
            b = [r[col] for r in b_rows[key] if r.get(col) is not None]
            change, word, noise = verdict(a, b, spec.larger_is_better)
            name = f"{spec.title} {stat}" if stat else spec.title
            out.append({"scenario": scenario, "mode": mode, "load": load, "metric": name, "unit": spec.unit,
                        "a": _mean(a) if a else None, "b": _mean(b) if b else None, "change_pct": change,
                        "verdict": word, "noise": noise})
    return out


def compare_table(rows: list[dict[str, Any]], title: str) -> Any:
    """A rich table of :func:`compare_runs` rows (green = better, red = worse; the noise each was judged against)."""
    from rich.table import Table

    t = Table(title=title, title_justify="left")
    for col, just in (("ISL:OSL", "left"), ("load", "right"), ("metric", "left"), ("A", "right"), ("B", "right"),
                      ("Δ %", "right"), ("", "left"), ("noise", "left")):
        t.add_column(col, justify=just)
    colors = {"better": "green", "worse": "red"}
    for r in rows:
        fmt = (lambda v: "-" if v is None else f"{v:,.2f}")
        pct = "-" if r["change_pct"] is None else f"{r['change_pct']:+.1f}"
        c = colors.get(r["verdict"])
        verdict_text = f"[{c}]{r['verdict']}[/]" if c else r["verdict"]
        load = "-" if r["load"] is None else (f"c{r['load']:g}" if r["mode"] == "concurrency" else f"r{r['load']:g}")
        t.add_row(r["scenario"], load, f"{r['metric']} ({r['unit']})" if r["unit"] else r["metric"],
                  fmt(r["a"]), fmt(r["b"]), pct, verdict_text, r["noise"])
    return t
