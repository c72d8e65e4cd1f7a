"""The CPU engine's step timeline over one bench load point, as the profile report.

The served CPU ``tensorrt_llm`` model publishes the engine's cumulative step counters
(:mod:`pipeline.cpu_runtime.timeline`) as ``trtpipe_cpu_engine_step_*`` gauges; ``trtpipe bench`` scrapes the
metrics endpoint right before and after a load point's measured phase and stores their change in the load point's
``server_metrics["trtpipe"]`` (:func:`pipeline.bench.server_metrics.delta`). Here that change and the measured
phase's wall time (``LoadPoint.wall_s``) become the report: steps (the unit; ``context`` / ``generation`` / ``mixed``
by what the batch held) and their time, the share of step time in the forward pass, gaps between steps while
sequences were in KV slots (``gap``) and with none (``wait``), and the histogram of the ``gap`` durations.

The gauges are refreshed every ``serving.stats_check_period_ms`` (100 ms by default), so each end of the window may
miss up to that much of the engine's work; the report says so.
"""

from __future__ import annotations

import re
from typing import Any

from pipeline.core.errors import StageError
from pipeline.profile.report import Report

_KEY = re.compile(r"^(?P<name>[^{]+)\{(?P<labels>.*)\}$")
PREFIX = "trtpipe_cpu_engine_step_"


def parse_deltas(deltas: dict[str, float]) -> dict[tuple[str, str], float]:
    """``{"trtpipe_cpu_engine_step_seconds{model=…,step_type=context,…}": Δ}`` → ``{("seconds", "context"): Δ}``
    (summed over models; the label is ``step_type``, ``token_type`` or ``le``)."""
    out: dict[tuple[str, str], float] = {}
    for key, v in deltas.items():
        m = _KEY.match(key)
        if not m or not m["name"].startswith(PREFIX):
            continue
        labels = dict(p.split("=", 1) for p in m["labels"].split(",") if "=" in p)
        value = labels.get("step_type") or labels.get("token_type") or labels.get("le")
        if value is not None:
            k = (m["name"].removeprefix(PREFIX), value)
            out[k] = out.get(k, 0.0) + float(v)
    return out


def report(point: Any, metrics_url: str | None) -> Report:
    """The report of one measured bench load point (a :class:`~pipeline.bench.results.LoadPoint`).

    Raises:
        StageError: the server published no step timeline (not the CPU engine's Triton model, or its metrics off).
    """
    d = parse_deltas(((point.server_metrics or {}).get("trtpipe")) or {})
    if not d:
        raise StageError(f"{metrics_url or 'no metrics URL'}: no trtpipe_cpu_engine_step_* gauges over the load point "
                         "— profile on CPU needs the CPU engine served by Triton (trtpipe serve of a build.engine: cpu build)")
    window = float(point.wall_s)
    kinds = ("context", "generation", "mixed")
    times = {k: d.get(("seconds", k), 0.0) for k in kinds}
    counts = {k: round(d.get(("count", k), 0.0)) for k in kinds}
    busy, steps = sum(times.values()), sum(counts.values())
    gap_n, gap_s = round(d.get(("count", "gap"), 0.0)), d.get(("seconds", "gap"), 0.0)
    wait_n, wait_s = round(d.get(("count", "wait"), 0.0)), d.get(("seconds", "wait"), 0.0)
    forward = d.get(("seconds", "forward"), 0.0)
    pct = (lambda t: 100.0 * t / busy) if busy else (lambda t: 0.0)
    buckets = sorted(((k[1], v) for k, v in d.items() if k[0] == "gap_bucket"),
                     key=lambda kv: float("inf") if kv[0] == "+Inf" else float(kv[0]))
    p99 = next((le for le, c in buckets if gap_n and c >= 0.99 * gap_n), None)
    p50 = next((le for le, c in buckets if gap_n and c >= 0.50 * gap_n), None)
    cats = [{"name": k, "count": counts[k], "time_s": times[k], "share_pct": pct(times[k])} for k in kinds]
    cats += [{"name": "forward pass (in steps)", "count": steps, "time_s": forward, "share_pct": pct(forward)},
             {"name": "schedule+sample (in steps)", "count": steps, "time_s": max(busy - forward, 0.0),
              "share_pct": pct(max(busy - forward, 0.0))}]
    return {
        "source": "cpu-engine-steps", "unit": "step", "input": metrics_url or "-", "window_s": window, "busy_s": busy,
        "active_pct": 100.0 * busy / window if window > 0 else None, "count": steps,
        "mean_ms": 1e3 * busy / steps if steps else None, "categories": cats,
        "gaps": {"count": gap_n + wait_n, "total_s": gap_s + wait_s,
                 "mean_ms": 1e3 * (gap_s + wait_s) / (gap_n + wait_n) if gap_n + wait_n else None,
                 "p50_ms": _ms(p50), "p99_ms": _ms(p99), "max_ms": None,
                 "idle_pct": 100.0 * max(window - busy, 0.0) / window if window > 0 else None,
                 "with_work": {"count": gap_n, "total_s": gap_s}, "no_work": {"count": wait_n, "total_s": wait_s},
                 "buckets_ms": dict(buckets)},
        "top": [{"name": f"{k} step", "count": counts[k], "time_s": times[k],
                 "mean_ms": 1e3 * times[k] / counts[k] if counts[k] else None, "share_pct": pct(times[k])}
                for k in sorted(kinds, key=lambda k: -times[k])],
        "tokens": {"context": d.get(("tokens", "context"), 0.0), "generation": d.get(("tokens", "generation"), 0.0)},
        "notes": [("steps of the CPU engine (pipeline/cpu_runtime/timeline.py); gap p50/p99 = upper bound of the "
                   "histogram bucket (ms) holding it, gaps with work only; idle % = window minus step time; the gauges "
                   "refresh every stats_check_period_ms (100 ms default), so each end of the window may miss that much")],
    }


def _ms(le: str | None) -> float | None:
    return None if le is None or le == "+Inf" else float(le)
