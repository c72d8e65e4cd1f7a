"""LLM serving metrics over :class:`~pipeline.bench.records.RequestRecord` lists.

Names and definitions follow docs/reference/benchmark-metrics.md §5.1 (genai-perf JSON keys):

==================================  ==========  ==========================================================
tag                                 unit        definition
==================================  ==========  ==========================================================
time_to_first_token (TTFT)          ms          first response carrying ≥1 token − request start
inter_token_latency (ITL)           ms          per gap: (receipt of response i − receipt of response i−1)
                                                / tokens in response i (empty responses skipped)
time_per_output_token (TPOT)        ms          per request: (e2e − TTFT) / (output tokens − 1)
request_latency (E2E)               ms          final response − request start
output_token_throughput_per_user    tokens/s    per request: (output tokens − 1) / (e2e − TTFT) = 1/TPOT
input_sequence_length               tokens      prompt tokens per request
output_sequence_length              tokens      tokens actually returned per request
output_token_throughput             tokens/s    Σ output tokens / benchmark duration
total_token_throughput              tokens/s    Σ (input + output tokens) / benchmark duration
request_throughput                  requests/s  completed requests / benchmark duration
request_goodput                     requests/s  completed requests meeting every SLO / benchmark duration
==================================  ==========  ==========================================================

Only measured (non-warmup) requests count. Latency distributions use requests that completed
without error (short ones included and counted in ``short_requests``). The benchmark duration
runs from the first measured request's start to the last measured response (ns → s).

Goodput SLOs are in ms: ``ttft`` (TTFT), ``itl`` and ``tpot`` (the request's mean ITL, i.e. its
TPOT, as genai-perf applies ``inter_token_latency`` per request), ``e2e`` (request latency).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Sequence
from typing import Any

from pipeline.bench.records import RequestRecord
from pipeline.bench.stats import Stats

_NS_PER_MS = 1e6


@dataclasses.dataclass(frozen=True)
class MetricSpec:
    """A metric's identity: ``tag`` (JSON/CSV key), display ``title``, ``unit``, and direction.

    ``distribution`` metrics are summarized with :class:`Stats`; the others are one number.
    """

    tag: str
    title: str
    unit: str
    larger_is_better: bool
    distribution: bool


#: every metric, in display order (explicit registry, no import side effects)
METRICS: dict[str, MetricSpec] = {
    m.tag: m
    for m in (
        MetricSpec("time_to_first_token", "TTFT", "ms", False, True),
        MetricSpec("inter_token_latency", "ITL", "ms", False, True),
        MetricSpec("time_per_output_token", "TPOT", "ms", False, True),
        MetricSpec("request_latency", "E2E latency", "ms", False, True),
        MetricSpec("output_token_throughput_per_user", "Output tokens/s/user", "tokens/s", True, True),
        MetricSpec("input_sequence_length", "ISL", "tokens", False, True),
        MetricSpec("output_sequence_length", "OSL", "tokens", True, True),
        MetricSpec("output_token_throughput", "Output tokens/s", "tokens/s", True, False),
        MetricSpec("total_token_throughput", "Total tokens/s", "tokens/s", True, False),
        MetricSpec("request_throughput", "Requests/s", "requests/s", True, False),
        MetricSpec("request_goodput", "Goodput", "requests/s", True, False),
    )
}

#: goodput SLO keys → the per-request value (ms) they bound
SLO_KEYS = ("ttft", "itl", "tpot", "e2e")


def ttft_ms(r: RequestRecord) -> float | None:
    """Time to first token of one request, ms (``None`` when no token arrived)."""
    times = r.token_times()
    return (times[0][0] - r.start_ns) / _NS_PER_MS if times else None


def e2e_ms(r: RequestRecord) -> float | None:
    """End-to-end latency of one request (start → final response), ms."""
    return None if r.end_ns is None else (r.end_ns - r.start_ns) / _NS_PER_MS


def tpot_ms(r: RequestRecord) -> float | None:
    """(e2e − TTFT) / (output tokens − 1) of one request, ms; ``None`` below 2 tokens."""
    times = r.token_times()
    n = r.output_tokens
    if n < 2 or not times:
        return None
    return (times[-1][0] - times[0][0]) / _NS_PER_MS / (n - 1)


def itl_gaps_ms(r: RequestRecord) -> list[float]:
    """Per-gap inter-token latencies of one request, ms: gap / tokens in the later response."""
    times = r.token_times()
    return [(t1 - t0) / _NS_PER_MS / n1 for (t0, _), (t1, n1) in zip(times, times[1:])]


def meets_slos(r: RequestRecord, slos: dict[str, float]) -> bool:
    """True when the request completed and every given SLO (ms) holds (see module docstring)."""
    if not r.ok:
        return False
    values: dict[str, Callable[[RequestRecord], float | None]] = {
        "ttft": ttft_ms,
        "itl": tpot_ms,
        "tpot": tpot_ms,
        "e2e": e2e_ms,
    }
    for key, limit in slos.items():
        if key not in values:
            raise ValueError(f"unknown goodput SLO {key!r}: use one of {', '.join(SLO_KEYS)}")
        v = values[key](r)
        if v is not None and v > limit:
            return False
    return True


def duration_s(records: Sequence[RequestRecord]) -> float:
    """Benchmark duration in s: first measured start → last measured response (0 if none)."""
    ends = [r.end_ns for r in records if r.end_ns is not None]
    if not records or not ends:
        return 0.0
    return (max(ends) - min(r.start_ns for r in records)) / 1e9


def summarize(records: Sequence[RequestRecord], slos: dict[str, float] | None = None) -> dict[str, Any]:
    """All metrics of one load point.

    Args:
        records: every request of the load point (warmup ones are filtered out here).
        slos: goodput SLOs in ms (keys from :data:`SLO_KEYS`); no goodput when empty.

    Returns:
        ``{"counts": {...}, "duration_s": s, "metrics": {tag: Stats dict or number}}`` where
        counts has ``requests`` (measured), ``completed``, ``failed``, ``short``, ``good``,
        ``input_tokens``, ``output_tokens``.
    """
    measured = [r for r in records if not r.warmup]
    done = [r for r in measured if r.ok]
    dur = duration_s(measured)
    in_tok = sum(r.input_tokens for r in done)
    out_tok = sum(r.output_tokens for r in done)
    good = sum(1 for r in done if meets_slos(r, slos)) if slos else None

    def per_s(x: float) -> float | None:
        return x / dur if dur > 0 else None

    def dist(fn: Callable[[RequestRecord], float | None]) -> dict[str, Any]:
        return Stats.of(v for v in map(fn, done) if v is not None).as_dict()

    metrics: dict[str, Any] = {
        "time_to_first_token": dist(ttft_ms),
        "inter_token_latency": Stats.of(g for r in done for g in itl_gaps_ms(r)).as_dict(),
        "time_per_output_token": dist(tpot_ms),
        "request_latency": dist(e2e_ms),
        "output_token_throughput_per_user": dist(lambda r: 1e3 / t if (t := tpot_ms(r)) else None),
        "input_sequence_length": dist(lambda r: float(r.input_tokens)),
        "output_sequence_length": dist(lambda r: float(r.output_tokens)),
        "output_token_throughput": per_s(out_tok),
        "total_token_throughput": per_s(in_tok + out_tok),
        "request_throughput": per_s(len(done)),
        "request_goodput": per_s(good) if good is not None else None,
    }
    counts = {
        "requests": len(measured),
        "completed": len(done),
        "failed": sum(1 for r in measured if r.error is not None),
        "short": sum(1 for r in measured if r.short),
        "good": good,
        "input_tokens": in_tok,
        "output_tokens": out_tok,
    }
    return {"counts": counts, "duration_s": dur, "metrics": metrics}
