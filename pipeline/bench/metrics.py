"""LLM serving metrics over :class:`~pipeline.bench.records.RequestRecord` lists: one :class:`Metric` object each.

:data:`METRICS` is the registry: each metric's tag (AIPerf's, ai-dynamo/aiperf@db4f6397 ``aiperf/metrics/types/*.py``),
display title, unit, direction, formula text, how it is computed (per request, or per run) and its names in AIPerf
and vLLM. :func:`summarize`, :func:`definitions` (the ``definitions`` block of bench.json, and docs/bench-metrics.md),
summary.csv, the console table, ``compare`` and the AIPerf/vLLM exports all read it; adding a metric is one entry.

Only measured (non-warmup) requests count. Latency distributions use requests that completed without error (short
ones included and counted in ``short``). The benchmark duration runs from the first measured request's start to the
last measured response (ns → s). Times are ms. Goodput SLOs are in ms: ``ttft`` (TTFT), ``itl`` (the request's ITL),
``tpot`` (its TPOT), ``e2e`` (request latency).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Sequence
from typing import Any

from pipeline.bench.images import image_summary
from pipeline.bench.records import RequestRecord
from pipeline.bench.results import Counts, OslCheck, Summary
from pipeline.bench.stats import Stats
from pipeline.recipe.bench import SLO_KEYS

__all__ = ["METRICS", "SLO_KEYS", "Metric", "Peer", "definitions", "summarize"]

_NS_PER_MS = 1e6

# ----------------------------------------------------------------------------------------- per-request values


def ttft_ms(r: RequestRecord) -> float | None:
    """Time to first token of one request, ms (``None`` when no token arrived)."""
    times = r.token_times()
    return (times[0][0] - r.start_ns) / _NS_PER_MS if times else None


def e2e_ms(r: RequestRecord) -> float | None:
    """End-to-end latency of one request (start → final response), ms."""
    return None if r.end_ns is None else (r.end_ns - r.start_ns) / _NS_PER_MS


def ttst_ms(r: RequestRecord) -> float | None:
    """Time to second token (AIPerf ``time_to_second_token``): second token-carrying response − first, ms."""
    times = r.token_times()
    return (times[1][0] - times[0][0]) / _NS_PER_MS if len(times) >= 2 else None


def itl_ms(r: RequestRecord) -> float | None:
    """AIPerf/GenAI-Perf ``inter_token_latency`` of one request: (E2E − TTFT) / (OSL − 1), ms;
    ``None`` below 2 tokens (ai-dynamo/aiperf@db4f6397 ``inter_token_latency_metric.py``)."""
    n = r.output_tokens
    ttft, e2e = ttft_ms(r), e2e_ms(r)
    if n < 2 or ttft is None or e2e is None:
        return None
    return (e2e - ttft) / (n - 1)


def chunk_gaps_ms(r: RequestRecord) -> list[float]:
    """Gaps between consecutive token-carrying responses of one request, ms (AIPerf
    ``inter_chunk_latency``; vLLM ``benchmark_serving``'s per-chunk "ITL"); not divided by tokens."""
    times = r.token_times()
    return [(t1 - t0) / _NS_PER_MS for (t0, _), (t1, _) in zip(times, times[1:])]


def tpot_ms(r: RequestRecord) -> float | None:
    """vLLM's TPOT of one request: (E2E − TTFT) / (output tokens − 1), ms; ``None`` below 2 tokens
    (vllm-project/vllm@0049e29c ``benchmarks/benchmark_serving.py`` ``calculate_metrics``: the same
    formula as AIPerf's ``inter_token_latency``, :func:`itl_ms`)."""
    return itl_ms(r)


def itl_gaps_ms(r: RequestRecord) -> list[float]:
    """Per-gap inter-token latencies of one request, ms: gap / tokens in the later response."""
    times = r.token_times()
    return [(t1 - t0) / _NS_PER_MS / n1 for (t0, _), (t1, n1) in zip(times, times[1:])]


def tokens_per_s_per_user(r: RequestRecord) -> float | None:
    """1000 / ITL of one request (tokens/s), ``None`` without an ITL."""
    return 1e3 / t if (t := itl_ms(r)) else None


# ----------------------------------------------------------------------------------------- the registry


@dataclasses.dataclass(frozen=True)
class Totals:
    """What per-run metrics are computed from: one load point's duration (s), token and request counts, GPUs."""

    duration_s: float
    counts: Counts
    gpus: int | None

    def per_s(self, x: float | None) -> float | None:
        """``x`` per second of the benchmark duration (``None`` for a zero duration or no ``x``)."""
        return x / self.duration_s if x is not None and self.duration_s > 0 else None


@dataclasses.dataclass(frozen=True)
class Peer:
    """A metric's name in a peer tool's output: ``name`` (its key), ``header`` and ``unit`` as that tool displays
    them, ``pos`` the metric's place in that tool's file (AIPerf: per-record metrics, then run metrics; vLLM:
    run values, then latency stems)."""

    name: str
    pos: int
    header: str = ""
    unit: str = ""


@dataclasses.dataclass(frozen=True)
class Metric:
    """One metric: ``tag`` (JSON/CSV key), display ``title``, ``unit``, direction and ``formula`` (the definition text).

    A distribution metric has ``per_request`` (one value or a list of values per completed request, summarized with
    :class:`~pipeline.bench.stats.Stats`); a per-run metric has ``per_run`` (one number per load point, or ``None``).
    ``aiperf``/``vllm`` are its names in those tools' exports, ``None`` when they have no such metric.
    """

    tag: str
    title: str
    unit: str
    larger_is_better: bool
    formula: str
    per_request: Callable[[RequestRecord], float | list[float] | None] | None = None
    per_run: Callable[[Totals], float | None] | None = None
    aiperf: Peer | None = None
    vllm: Peer | None = None

    @property
    def distribution(self) -> bool:
        """Summarized as a distribution (avg, p50, …) rather than one value."""
        return self.per_request is not None

    def definition(self) -> dict[str, Any]:
        """This metric's entry in the ``definitions`` block of bench.json."""
        stats = "avg, min, max, std (population), p50, p90, p95, p99 (numpy linear interpolation) over the values"
        return {"title": self.title, "unit": self.unit, "larger_is_better": self.larger_is_better,
                "statistics": stats if self.distribution else "one value per load point", "formula": self.formula,
                "aiperf": self.aiperf.name if self.aiperf else None, "vllm": self.vllm.header if self.vllm else None}


#: every metric, in display/CSV order (an explicit registry, no import side effects)
METRICS: dict[str, Metric] = {m.tag: m for m in (
    Metric("time_to_first_token", "TTFT", "ms", False, "first token-carrying response − request start", ttft_ms,
           aiperf=Peer("time_to_first_token", 1, "Time to First Token", "ms"), vllm=Peer("ttft", 0, "TTFT")),
    Metric("time_to_second_token", "TTST", "ms", False, "second token-carrying response − first token-carrying response",
           ttst_ms, aiperf=Peer("time_to_second_token", 2, "Time to Second Token", "ms")),
    Metric("inter_token_latency", "ITL", "ms", False, "(E2E − TTFT) / (OSL − 1), one value per request", itl_ms,
           aiperf=Peer("inter_token_latency", 7, "Inter Token Latency", "ms")),
    Metric("inter_chunk_latency", "ICL", "ms", False,
           "every gap between consecutive token-carrying responses (not ÷ tokens)", chunk_gaps_ms,
           aiperf=Peer("inter_chunk_latency", 5, "Inter Chunk Latency", "ms"), vllm=Peer("itl", 2, "ITL")),
    Metric("time_per_output_token", "TPOT", "ms", False,
           "(E2E − TTFT) / (OSL − 1), one value per request (= inter_token_latency)", tpot_ms,
           vllm=Peer("tpot", 1, "TPOT")),
    Metric("request_latency", "E2E latency", "ms", False, "final response − request start", e2e_ms,
           aiperf=Peer("request_latency", 3, "Request Latency", "ms"), vllm=Peer("e2el", 3, "E2EL")),
    Metric("output_token_throughput_per_user", "Output tokens/s/user", "tokens/s", True,
           "1000 / inter_token_latency (ms), per request", tokens_per_s_per_user,
           aiperf=Peer("output_token_throughput_per_user", 8, "Output Token Throughput Per User", "tokens/sec/user")),
    Metric("input_sequence_length", "ISL", "tokens", False, "prompt tokens", lambda r: r.input_tokens,
           aiperf=Peer("input_sequence_length", 0, "Input Sequence Length", "tokens")),
    Metric("output_sequence_length", "OSL", "tokens", True, "output tokens returned (the client's count, see osl_check)",
           lambda r: r.output_tokens, aiperf=Peer("output_sequence_length", 6, "Output Sequence Length", "tokens")),
    Metric("output_token_throughput", "Output tokens/s", "tokens/s", True, "per run: Σ OSL / benchmark duration",
           per_run=lambda t: t.per_s(t.counts.output_tokens),
           aiperf=Peer("output_token_throughput", 1, "Output Token Throughput", "tokens/sec"),
           vllm=Peer("output_throughput", 2, "Output token throughput")),
    Metric("output_token_throughput_per_gpu", "Output tokens/s/GPU", "tokens/s", True,
           "per run: output_token_throughput / (tp × pp of the build's recipe)",
           per_run=lambda t: t.per_s(t.counts.output_tokens / t.gpus) if t.gpus else None),
    Metric("total_token_throughput", "Total tokens/s", "tokens/s", True, "per run: Σ (ISL + OSL) / benchmark duration",
           per_run=lambda t: t.per_s(t.counts.input_tokens + t.counts.output_tokens),
           vllm=Peer("total_token_throughput", 3, "Total Token throughput")),
    Metric("request_throughput", "Requests/s", "requests/s", True, "per run: completed requests / benchmark duration",
           per_run=lambda t: t.per_s(t.counts.completed),
           aiperf=Peer("request_throughput", 0, "Request Throughput", "requests/sec"),
           vllm=Peer("request_throughput", 0, "Request throughput")),
    Metric("request_goodput", "Goodput", "requests/s", True,
           "per run: completed requests meeting every SLO / benchmark duration", per_run=lambda t: t.per_s(t.counts.good),
           aiperf=Peer("goodput", 8, "Goodput", "requests/sec"), vllm=Peer("request_goodput", 1, "Request goodput")),
)}

#: per-request SLO key (:data:`SLO_KEYS`) → the value (ms) it bounds
_SLO_VALUES: dict[str, Callable[[RequestRecord], float | None]] = {"ttft": ttft_ms, "itl": itl_ms, "tpot": tpot_ms,
                                                                   "e2e": e2e_ms}


def meets_slos(r: RequestRecord, slos: dict[str, float]) -> bool:
    """True when the request completed and every given SLO (ms) holds (see module docstring).

    Raises:
        ValueError: an SLO key not in :data:`SLO_KEYS`.
    """
    if not r.ok:
        return False
    for key, limit in slos.items():
        if key not in _SLO_VALUES:
            raise ValueError(f"unknown goodput SLO {key!r}: use one of {', '.join(SLO_KEYS)}")
        v = _SLO_VALUES[key](r)
        if v is not None and v > limit:
            return False
    return True


def duration_s(records: Sequence[RequestRecord]) -> float:
    """Benchmark duration in s: first measured start → last measured response (0 if none)."""
    ends = [r.end_ns for r in records if r.end_ns is not None]
    if not records or not ends:
        return 0.0
    return (max(ends) - min(r.start_ns for r in records)) / 1e9


def values(metric: Metric, records: Sequence[RequestRecord]) -> list[float]:
    """Every value of a distribution metric over ``records`` (list-valued metrics flattened), in its unit."""
    assert metric.per_request is not None
    out: list[float] = []
    for r in records:
        v = metric.per_request(r)
        if isinstance(v, list):
            out += v
        elif v is not None:
            out.append(float(v))
    return out


def summarize(records: Sequence[RequestRecord], slos: dict[str, float] | None = None, gpus: int | None = None) -> Summary:
    """All metrics of one load point.

    Args:
        records: every request of the load point (warmup ones are filtered out here).
        slos: goodput SLOs in ms (keys from :data:`SLO_KEYS`); no goodput when empty.
        gpus: GPUs serving the model (tp × pp); ``output_token_throughput_per_gpu`` is ``None`` without it.

    Returns:
        The :class:`~pipeline.bench.results.Summary`: counts (``requests`` measured, ``completed``, ``failed``,
        ``short``, ``good``, ``input_tokens``, ``output_tokens``, ``osl_mismatch``), duration (s), every metric of
        :data:`METRICS` by tag, and the OSL check (see :attr:`RequestRecord.osl_counts`).

    Raises:
        ValueError: an unknown SLO key.
    """
    measured = [r for r in records if not r.warmup]
    done = [r for r in measured if r.ok]
    finished = [r for r in measured if r.error is None and r.end_ns is not None]
    mismatched = [r for r in finished if r.osl_mismatch]
    counts = Counts(
        requests=len(measured), completed=len(done), failed=sum(1 for r in measured if r.error is not None),
        short=sum(1 for r in measured if r.short), good=sum(1 for r in done if meets_slos(r, slos)) if slos else None,
        input_tokens=sum(r.input_tokens for r in done), output_tokens=sum(r.output_tokens for r in done),
        osl_mismatch=len(mismatched),
    )
    totals = Totals(duration_s(measured), counts, gpus)
    metrics = {tag: Stats.of(values(m, done)).as_dict() if m.per_request else m.per_run(totals)  # type: ignore[misc]
               for tag, m in METRICS.items()}  # every metric has per_request or per_run
    osl_check = OslCheck(
        methods=sorted({k for r in finished for k in r.osl_counts}), mismatch=len(mismatched),
        mismatch_pct=100.0 * len(mismatched) / len(finished) if finished else None,
        examples=[{"index": r.index, "requested": r.requested_tokens} | r.osl_counts for r in mismatched[:5]],
    )
    return Summary(counts, totals.duration_s, metrics, osl_check, speculative(done), image_summary(measured),
                   prefix_cache(done))


def prefix_cache(records: Sequence[RequestRecord]) -> dict[str, Any] | None:
    """The KV-cache prefix reuse the server reported for the completed ``records`` that carry a count
    (:attr:`RequestRecord.cached_tokens`): ``requests`` with a count, ``cached_tokens`` and ``input_tokens`` summed
    over them, ``cached_token_share`` = cached / input (0..1; ``None`` without input tokens); ``None`` when the
    route reported no count (the Triton routes, servers without prefix caching)."""
    have = [r for r in records if r.cached_tokens is not None]
    if not have:
        return None
    cached, total = sum(r.cached_tokens or 0 for r in have), sum(r.input_tokens for r in have)
    return {"requests": len(have), "cached_tokens": cached, "input_tokens": total,
            "cached_token_share": cached / total if total > 0 else None}


def speculative(records: Sequence[RequestRecord]) -> dict[str, Any] | None:
    """Speculative decoding over the completed requests whose final response carried the counters (the serving
    model declares ``total_accepted_draft_tokens`` / ``total_draft_tokens`` and perf metrics were asked for);
    ``None`` when none did.

    ``acceptance_rate`` = Σ accepted draft tokens / Σ draft tokens; ``accepted_tokens_per_step`` = output tokens per
    generation step, Σ (OSL − 1) / Σ (OSL − 1 − accepted): the first token comes from the context phase, and each
    generation step emits one target token plus the drafts it accepted; ``requests``: how many carried the counters.
    """
    spec = [r for r in records if r.server and all(k in r.server for k in ("total_accepted_draft_tokens", "total_draft_tokens"))]
    if not spec:
        return None
    accepted = sum(r.server["total_accepted_draft_tokens"] for r in spec)  # type: ignore[index]
    drafted = sum(r.server["total_draft_tokens"] for r in spec)  # type: ignore[index]
    gen = sum(max(0, r.output_tokens - 1) for r in spec)
    steps = gen - accepted
    return {"requests": len(spec), "accepted_draft_tokens": accepted, "draft_tokens": drafted,
            "acceptance_rate": accepted / drafted if drafted else None,
            "accepted_tokens_per_step": gen / steps if steps > 0 else None}


def definitions() -> dict[str, dict[str, Any]]:
    """Every metric's unit, direction, formula and peer names (the ``definitions`` block of bench.json)."""
    return {tag: m.definition() for tag, m in METRICS.items()}
