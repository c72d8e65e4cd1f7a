"""The profile's one shape for both sources, its table, plot and ``profile.json``.

A report is a plain dict (JSON as written):

- ``source``: ``nsys-sqlite`` (kernels of an Nsight Systems export) or ``cpu-engine-steps`` (the CPU engine's steps);
  ``unit``: ``kernel`` or ``step``; ``input``: what was read (file or metrics URL);
- ``window_s``: the analysed window (s); ``busy_s``: time in which at least one unit ran (s; the union of the units'
  intervals); ``active_pct`` = 100 · busy / window;
- ``count``, ``mean_ms``: units in the window and their mean duration (ms);
- ``categories``: ``[{name, count, time_s, share_pct}]``, share of the summed unit time (units that overlap, e.g.
  kernels on several streams, are each counted in full);
- ``gaps``: idle time between consecutive busy intervals: ``count``, ``total_s``, ``mean_ms``, ``p50_ms``,
  ``p99_ms``, ``max_ms`` (``None`` without gaps) and ``idle_pct`` = 100 · (window − busy) / window;
- ``top``: the units by total time, ``[{name, count, time_s, mean_ms, share_pct}]``;
- ``notes``: lines that qualify the figures.
"""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any

Report = dict[str, Any]
PROFILE_JSON = "profile.json"
PROFILE_PNG = "profile.png"


def gap_stats(gaps_s: list[float], window_s: float, busy_s: float) -> dict[str, Any]:
    """The ``gaps`` block from the individual gaps (s) between busy intervals: count, total (s), mean / p50 / p99 /
    max (ms; ``None`` without gaps; percentiles by nearest rank), and ``idle_pct`` of ``window_s``."""
    g = sorted(gaps_s)

    def rank(q: float) -> float | None:
        return 1e3 * g[min(len(g) - 1, max(0, math.ceil(q * len(g)) - 1))] if g else None

    return {"count": len(g), "total_s": sum(g), "mean_ms": 1e3 * sum(g) / len(g) if g else None,
            "p50_ms": rank(0.50), "p99_ms": rank(0.99), "max_ms": 1e3 * g[-1] if g else None,
            "idle_pct": 100.0 * max(window_s - busy_s, 0.0) / window_s if window_s > 0 else None}


def _f(v: Any, digits: int = 1) -> str:
    return "-" if v is None else f"{v:,.{digits}f}"


def tables(report: Report) -> list[Any]:
    """Rich tables of ``report``: the summary (active %, units, gaps), the categories, the top units."""
    from rich.table import Table

    unit = report["unit"]
    head = Table(title=f"profile ({report['source']}): {report['input']}", title_justify="left")
    for col in ("window s", "active %", f"{unit}s", f"mean {unit} ms", "gaps", "gap mean ms", "gap p99 ms",
                "gap max ms", "idle %"):
        head.add_column(col, justify="right")
    g = report["gaps"]
    head.add_row(_f(report["window_s"], 2), _f(report["active_pct"]), f"{report['count']:,}", _f(report["mean_ms"], 3),
                 f"{g['count']:,}", _f(g["mean_ms"], 3), _f(g["p99_ms"], 3), _f(g["max_ms"], 3), _f(g["idle_pct"]))
    cats = Table(title="categories", title_justify="left")
    for col in ("category", "count", "time ms", "share %"):
        cats.add_column(col, justify="right")
    for c in report["categories"]:
        cats.add_row(c["name"], f"{c['count']:,}", _f(1e3 * c["time_s"], 2), _f(c["share_pct"]))
    top = Table(title=f"top {unit}s", title_justify="left")
    for col in ("name", "count", "time ms", f"mean {unit} ms", "share %"):
        top.add_column(col, justify="right" if col != "name" else "left")
    for t in report["top"]:
        top.add_row(t["name"][:80], f"{t['count']:,}", _f(1e3 * t["time_s"], 2), _f(t["mean_ms"], 3), _f(t["share_pct"]))
    if report.get("notes"):
        top.caption = "\n".join(report["notes"])
    return [head, cats, top]


def plot(report: Report, path: Path) -> Path:
    """``path`` (PNG): the categories' share of the unit time beside busy vs idle time of the window."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (a, b) = plt.subplots(1, 2, figsize=(11, 4))
    names = [c["name"] for c in report["categories"]]
    a.barh(names, [c["share_pct"] for c in report["categories"]], color="tab:blue")
    a.set_xlabel(f"share of {report['unit']} time (%)")
    a.invert_yaxis()
    busy = report["busy_s"]
    idle = max(report["window_s"] - busy, 0.0)
    b.bar(["busy", "idle"], [busy, idle], color=["tab:green", "tab:gray"])
    b.set_ylabel("seconds")
    b.set_title(f"active {report['active_pct']:.1f} % of {report['window_s']:.2f} s")
    fig.suptitle(f"trtpipe profile ({report['source']})")
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return path


def write(report: Report, out: Path) -> Path:
    """``profile.json`` and ``profile.png`` into ``out`` (created); returns ``out``."""
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    tmp = out / (PROFILE_JSON + ".tmp")
    tmp.write_text(json.dumps(report, indent=1) + "\n")
    tmp.replace(out / PROFILE_JSON)
    plot(report, out / PROFILE_PNG)
    return out
