"""LLM serving metrics over :class:`~pipeline.bench.records.RequestRecord` lists.

Names follow AIPerf's metric tags (ai-dynamo/aiperf@db4f6397, ``aiperf/metrics/types/*.py``); the full
definitions table with the vLLM/GenAI-Perf equivalents is docs/bench-metrics.md and :data:`DEFINITIONS`
(also written into bench.json). In short, per request, times in ms:

==================================  ==========  ==========================================================
tag                                 unit        definition
==================================  ==========  ==========================================================
time_to_first_token (TTFT)          ms          first response carrying ≥1 token − request start
time_to_second_token (TTST)         ms          second token-carrying response − first one
inter_token_latency (ITL)           ms          per request: (E2E − TTFT) / (OSL − 1)  (AIPerf/GenAI-Perf)
inter_chunk_latency (ICL)           ms          every gap between consecutive token-carrying responses
                                                (vLLM's "ITL"), not normalised by tokens
time_per_output_token (TPOT)        ms          per request: (E2E − TTFT) / (OSL − 1) (vLLM's name for ITL)
request_latency (E2E)               ms          final response − request start
output_token_throughput_per_user    tokens/s    per request: 1000 / ITL
output_token_throughput_per_gpu     tokens/s    output_token_throughput / GPUs (tp × pp), when known
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

Goodput SLOs are in ms: ``ttft`` (TTFT), ``itl`` (the request's ITL as above), ``tpot`` (its TPOT),
``e2e`` (request latency).
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
        MetricSpec("time_to_second_token", "TTST", "ms", False, True),
        MetricSpec("inter_token_latency", "ITL", "ms", False, True),
        MetricSpec("inter_chunk_latency", "ICL", "ms", False, True),
        MetricSpec("time_per_output_token", "TPOT", "ms", False, True),
        MetricSpec("request_latency", "E2E latency", "ms", False, True),
        MetricSpec("output_token_throughput_per_user", "Output tokens/s/user", "tokens/s", True, True),
        MetricSpec("input_sequence_length", "ISL", "tokens", False, True),
        MetricSpec("output_sequence_length", "OSL", "tokens", True, True),
        MetricSpec("output_token_throughput", "Output tokens/s", "tokens/s", True, False),
        MetricSpec("output_token_throughput_per_gpu", "Output tokens/s/GPU", "tokens/s", True, False),
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


def meets_slos(r: RequestRecord, slos: dict[str, float]) -> bool:
    """True when the request completed and every given SLO (ms) holds (see module docstring)."""
    if not r.ok:
        return False
    values: dict[str, Callable[[RequestRecord], float | None]] = {
        "ttft": ttft_ms,
        "itl": itl_ms,
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


def summarize(records: Sequence[RequestRecord], slos: dict[str, float] | None = None, gpus: int | None = None) -> dict[str, Any]:
    """All metrics of one load point.

    Args:
        records: every request of the load point (warmup ones are filtered out here).
        slos: goodput SLOs in ms (keys from :data:`SLO_KEYS`); no goodput when empty.
        gpus: GPUs serving the model (tp × pp); ``output_token_throughput_per_gpu`` is ``None`` without it.

    Returns:
        ``{"counts": {...}, "duration_s": s, "metrics": {tag: Stats dict or number}}`` where
        counts has ``requests`` (measured), ``completed``, ``failed``, ``short``, ``good``,
        ``input_tokens``, ``output_tokens``, ``osl_mismatch``; ``osl_check`` says which output-token
        counts were available (``client``, ``server``, ``retokenized``; see
        :attr:`RequestRecord.osl_counts`), how many finished requests disagree and in what %, and up
        to five examples.
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
        "time_to_second_token": dist(ttst_ms),
        "inter_token_latency": dist(itl_ms),
        "inter_chunk_latency": Stats.of(g for r in done for g in chunk_gaps_ms(r)).as_dict(),
        "time_per_output_token": dist(tpot_ms),
        "request_latency": dist(e2e_ms),
        "output_token_throughput_per_user": dist(lambda r: 1e3 / t if (t := itl_ms(r)) else None),
        "input_sequence_length": dist(lambda r: float(r.input_tokens)),
        "output_sequence_length": dist(lambda r: float(r.output_tokens)),
        "output_token_throughput": per_s(out_tok),
        "output_token_throughput_per_gpu": per_s(out_tok / gpus) if gpus else None,
        "total_token_throughput": per_s(in_tok + out_tok),
        "request_throughput": per_s(len(done)),
        "request_goodput": per_s(good) if good is not None else None,
    }
    finished = [r for r in measured if r.error is None and r.end_ns is not None]
    mismatched = [r for r in finished if r.osl_mismatch]
    counts = {
        "requests": len(measured),
        "completed": len(done),
        "failed": sum(1 for r in measured if r.error is not None),
        "short": sum(1 for r in measured if r.short),
        "good": good,
        "input_tokens": in_tok,
        "output_tokens": out_tok,
        "osl_mismatch": len(mismatched),
    }
    osl_check = {
        "methods": sorted({k for r in finished for k in r.osl_counts}),
        "mismatch": len(mismatched),
        "mismatch_pct": 100.0 * len(mismatched) / len(finished) if finished else None,
        "examples": [{"index": r.index, "requested": r.requested_tokens} | r.osl_counts for r in mismatched[:5]],
    }
    return {"counts": counts, "duration_s": dur, "metrics": metrics, "osl_check": osl_check}


#: metric tag → definition written into bench.json (``definitions``) and docs/bench-metrics.md:
#: ``formula`` (per request unless it says per run), ``aiperf`` (AIPerf's tag, ai-dynamo/aiperf@db4f6397),
#: ``vllm`` (the name vLLM's ``benchmark_serving`` prints, or ``None``)
DEFINITIONS: dict[str, dict[str, str | None]] = {
    "time_to_first_token": {"formula": "first token-carrying response − request start", "aiperf": "time_to_first_token",
                            "vllm": "TTFT"},
    "time_to_second_token": {"formula": "second token-carrying response − first token-carrying response",
                             "aiperf": "time_to_second_token", "vllm": None},
    "inter_token_latency": {"formula": "(E2E − TTFT) / (OSL − 1), one value per request", "aiperf": "inter_token_latency",
                            "vllm": None},
    "inter_chunk_latency": {"formula": "every gap between consecutive token-carrying responses (not ÷ tokens)",
                            "aiperf": "inter_chunk_latency", "vllm": "ITL"},
    "time_per_output_token": {"formula": "(E2E − TTFT) / (OSL − 1), one value per request (= inter_token_latency)",
                              "aiperf": None, "vllm": "TPOT"},
    "request_latency": {"formula": "final response − request start", "aiperf": "request_latency", "vllm": "E2EL"},
    "output_token_throughput_per_user": {"formula": "1000 / inter_token_latency (ms), per request",
                                         "aiperf": "output_token_throughput_per_user", "vllm": None},
    "input_sequence_length": {"formula": "prompt tokens", "aiperf": "input_sequence_length", "vllm": None},
    "output_sequence_length": {"formula": "output tokens returned (the client's count, see osl_check)",
                               "aiperf": "output_sequence_length", "vllm": None},
    "output_token_throughput": {"formula": "per run: Σ OSL / benchmark duration", "aiperf": "output_token_throughput",
                                "vllm": "Output token throughput"},
    "output_token_throughput_per_gpu": {"formula": "per run: output_token_throughput / (tp × pp of the build's recipe)",
                                        "aiperf": None, "vllm": None},
    "total_token_throughput": {"formula": "per run: Σ (ISL + OSL) / benchmark duration", "aiperf": None,
                               "vllm": "Total Token throughput"},
    "request_throughput": {"formula": "per run: completed requests / benchmark duration", "aiperf": "request_throughput",
                           "vllm": "Request throughput"},
    "request_goodput": {"formula": "per run: completed requests meeting every SLO / benchmark duration",
                        "aiperf": "goodput", "vllm": "Request goodput"},
}


def definitions() -> dict[str, dict[str, Any]]:
    """Every metric's unit, direction, formula and peer names (the ``definitions`` block of bench.json)."""
    stats = "avg, min, max, std (population), p50, p90, p95, p99 (numpy linear interpolation) over the values"
    return {tag: {"title": m.title, "unit": m.unit, "larger_is_better": m.larger_is_better,
                  "statistics": stats if m.distribution else "one value per load point"} | DEFINITIONS[tag]
            for tag, m in METRICS.items()}
