"""Console output: the per-scenario results table and the progress bar (rich)."""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator
from typing import Any

from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn
from rich.table import Table


def _f(v: Any, digits: int = 1) -> str:
    return "-" if v is None else f"{v:,.{digits}f}"


def scenario_tables(load_points: list[dict[str, Any]], goodput: bool = False) -> list[Table]:
    """One table per scenario (ISL:OSL), rows = load points; latencies ms, throughputs per s."""
    tables = []
    for scenario in dict.fromkeys(p["scenario"] for p in load_points):
        t = Table(title=f"ISL:OSL {scenario}", title_justify="left")
        for col in ("load", "ok/short/fail", "TTFT avg", "TTFT p99", "ITL avg", "ITL p99", "TPOT avg", "E2E avg",
                    "E2E p99", "out tok/s", "total tok/s", "req/s", "tok/s/user"):
            t.add_column(col, justify="right")
        if goodput:
            t.add_column("goodput req/s", justify="right")
        for p in (p for p in load_points if p["scenario"] == scenario and "summary" in p):
            s, m = p["summary"]["counts"], p["summary"]["metrics"]
            row = [
                p["load"], f"{s['completed']}/{s['short']}/{s['failed']}",
                _f(m["time_to_first_token"]["avg"]), _f(m["time_to_first_token"]["p99"]),
                _f(m["inter_token_latency"]["avg"], 2), _f(m["inter_token_latency"]["p99"], 2),
                _f(m["time_per_output_token"]["avg"], 2),
                _f(m["request_latency"]["avg"]), _f(m["request_latency"]["p99"]),
                _f(m["output_token_throughput"]), _f(m["total_token_throughput"]), _f(m["request_throughput"], 2),
                _f(m["output_token_throughput_per_user"]["avg"]),
            ]
            if goodput:
                row.append(_f(m["request_goodput"], 2))
            t.add_row(*row)
        t.caption = "latencies in ms; ok/short/fail = completed / fewer than OSL tokens / failed requests"
        tables.append(t)
    return tables


@contextlib.contextmanager
def progress_bar(console: Console) -> Iterator[Callable[[str, int], Callable[[int], None]]]:
    """Yield ``start(description, total) -> advance(n)``; one bar per load point. The display starts
    with the first bar, so a run that fails before any load prints nothing here."""
    prog = Progress(TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(), TimeElapsedColumn(),
                    console=console, transient=False)

    def start(description: str, total: int) -> Callable[[int], None]:
        if not prog.live.is_started:
            prog.start()
        task = prog.add_task(description, total=total)
        return lambda n: prog.advance(task, n)

    try:
        yield start
    finally:
        if prog.live.is_started:
            prog.stop()
