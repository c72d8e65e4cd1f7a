"""Console output: the per-scenario results table and the progress bar (rich)."""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator
from typing import TYPE_CHECKING, Any

from rich.console import Console
from rich.progress import (
    BarColumn,
    MofNCompleteColumn,
    Progress,
    TextColumn,
    TimeElapsedColumn,
)
from rich.table import Table

if TYPE_CHECKING:
    from pipeline.bench.results import LoadPoint


def _f(v: Any, digits: int = 1) -> str:
    return "-" if v is None else f"{v:,.{digits}f}"


#: the results table: (column, metric tag, statistic or None, digits), after ``load`` and ``ok/short/fail``
COLUMNS = (
    ("TTFT avg", "time_to_first_token", "avg", 1), ("TTFT p99", "time_to_first_token", "p99", 1),
    ("ITL avg", "inter_token_latency", "avg", 2), ("ITL p99", "inter_token_latency", "p99", 2),
    ("TPOT avg", "time_per_output_token", "avg", 2), ("E2E avg", "request_latency", "avg", 1),
    ("E2E p99", "request_latency", "p99", 1), ("out tok/s", "output_token_throughput", None, 1),
    ("total tok/s", "total_token_throughput", None, 1), ("req/s", "request_throughput", None, 2),
    ("tok/s/user", "output_token_throughput_per_user", "avg", 1),
)
_GOODPUT = ("goodput req/s", "request_goodput", None, 2)


def scenario_tables(load_points: list[LoadPoint], goodput: bool = False) -> list[Table]:
    """One table per scenario (ISL:OSL), rows = load points; latencies ms, throughputs per s."""
    columns = COLUMNS + ((_GOODPUT,) if goodput else ())
    spec = any(p.summary is not None and p.summary.speculative for p in load_points)  # speculative decoding reported
    images = any(p.summary is not None and p.summary.images for p in load_points)  # an image workload
    cached = any(p.summary is not None and p.summary.prefix_cache for p in load_points)  # server-reported prefix reuse
    tables = []
    for scenario in dict.fromkeys(p.scenario for p in load_points):
        t = Table(title=f"ISL:OSL {scenario}", title_justify="left")
        for col in ("load", "ok/short/fail", *(c[0] for c in columns), *(("accept", "tok/step") if spec else ()),
                    *(("ISL text", "img/req", "img tok/req") if images else ()), *(("cached",) if cached else ())):
            t.add_column(col, justify="right")
        for p in (p for p in load_points if p.scenario == scenario and p.summary is not None):
            s, c = p.summary, p.summary.counts
            values = [s.metrics[tag] if stat is None else s.stat(tag, stat) for _, tag, stat, _ in columns]
            sd = s.speculative or {}
            extra = (_f(sd.get("acceptance_rate"), 2), _f(sd.get("accepted_tokens_per_step"), 2)) if spec else ()
            if images:
                im = s.images or {}
                extra += (_f(s.stat("input_sequence_length"), 0), _f((im.get("images_per_request") or {}).get("avg"), 1),
                          _f((im.get("image_tokens") or {}).get("avg"), 0))
            if cached:
                share = (s.prefix_cache or {}).get("cached_token_share")
                extra += (f"{100 * share:.0f} %" if share is not None else "-",)
            t.add_row(p.load, f"{c.completed}/{c.short}/{c.failed}",
                      *(_f(v, digits) for v, (_, _, _, digits) in zip(values, columns)), *extra)
        t.caption = "latencies in ms; ok/short/fail = completed / fewer than OSL tokens / failed requests" + (
            "; ISL text = prompt tokens (image placeholders included), img tok = image tokens (mllama: encoder length)"
            if images else "") + ("; cached = prompt tokens the server reported from its KV cache (prefix reuse)" if cached else "")
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
