"""Bench metrics, stats and record handling on synthetic records with hand-computed values (no server)."""

from __future__ import annotations

import math

import numpy as np
import pytest

from pipeline.bench.client import _fix_cumulative_counts
from pipeline.bench.metrics import itl_gaps_ms, meets_slos, summarize, tpot_ms, ttft_ms
from pipeline.bench.records import RequestRecord, count_text_tokens
from pipeline.bench.results import Counts
from pipeline.bench.stats import Stats

MS = 1_000_000  # ns per ms


def rec(start_ms, responses, requested, *, isl=10, warmup=False, error=None, end_ms=None):
    """A record whose responses are ``[(receipt ms, tokens)]``; it ends at the last response."""
    r = RequestRecord("10:4", "c1", 0, warmup, isl, requested, start_ns=int(start_ms * MS))
    r.response_ns = [int(t * MS) for t, _ in responses]
    r.response_tokens = [n for _, n in responses]
    r.end_ns = int((end_ms if end_ms is not None else responses[-1][0]) * MS)
    r.error = error
    return r


@pytest.fixture
def records():
    a = rec(0, [(50, 1), (60, 1), (80, 2)], 4, isl=10)  # TTFT 50, gaps 10 and 20/2=10, TPOT 30/3=10, e2e 80
    b = rec(10, [(40, 1), (70, 1)], 2, isl=20)  # TTFT 30, gap 30, TPOT 30, e2e 60
    warm = rec(0, [(5, 1), (6, 1)], 2, warmup=True)  # excluded
    failed = rec(5, [], 4, error="UNAVAILABLE: gone", end_ms=20)
    short = rec(20, [(45, 1)], 4, isl=5)  # TTFT 25, e2e 25, one token of four
    return [a, b, warm, failed, short]


def test_per_request_values_match_hand_computation(records):
    a, b, _, _, short = records
    assert ttft_ms(a) == 50 and ttft_ms(b) == 30 and ttft_ms(short) == 25
    assert itl_gaps_ms(a) == [10, 10]  # second gap carried 2 tokens: 20 ms / 2
    assert tpot_ms(a) == 10 and tpot_ms(b) == 30
    assert tpot_ms(short) is None
    assert short.short and not a.short and a.output_tokens == 4


def test_summary_counts_throughputs_and_distributions(records):
    s = summarize(records)
    assert s.counts == Counts(requests=4, completed=3, failed=1, short=1, good=None, input_tokens=35, output_tokens=7,
                              osl_mismatch=0)
    assert s.duration_s == pytest.approx(0.080)  # first measured start 0 → last end 80 ms
    m = s.metrics
    assert m["output_token_throughput"] == pytest.approx(7 / 0.08)
    assert m["total_token_throughput"] == pytest.approx(42 / 0.08)
    assert m["request_throughput"] == pytest.approx(3 / 0.08)
    assert m["request_goodput"] is None
    ttft = m["time_to_first_token"]
    assert (ttft["avg"], ttft["min"], ttft["max"], ttft["p50"], ttft["count"]) == (35, 25, 50, 30, 3)
    assert m["inter_token_latency"]["avg"] == pytest.approx((10 + 30) / 2)  # AIPerf: per request (E2E − TTFT)/(OSL − 1)
    assert m["inter_chunk_latency"]["avg"] == pytest.approx((10 + 20 + 30) / 3)  # every gap, not ÷ tokens
    assert m["time_to_second_token"]["avg"] == pytest.approx((10 + 30) / 2)
    assert m["time_per_output_token"]["avg"] == pytest.approx(20)
    assert m["output_token_throughput_per_user"]["avg"] == pytest.approx((100 + 1000 / 30) / 2)
    assert m["request_latency"]["max"] == 80 and m["request_latency"]["min"] == 25
    assert m["output_sequence_length"]["avg"] == pytest.approx(7 / 3)


def test_goodput_applies_every_slo(records):
    assert summarize(records, {"ttft": 40}).metrics["request_goodput"] == pytest.approx(2 / 0.08)  # b, short
    both = summarize(records, {"ttft": 40, "itl": 20})
    assert both.counts.good == 1  # b's mean ITL is 30 ms; short has no ITL so only TTFT applies
    assert both.metrics["request_goodput"] == pytest.approx(1 / 0.08)
    assert meets_slos(records[0], {"e2e": 80}) and not meets_slos(records[0], {"e2e": 79.9})
    with pytest.raises(ValueError, match="unknown goodput SLO"):
        meets_slos(records[0], {"latency": 1})


def test_empty_responses_do_not_count_as_tokens():
    r = rec(0, [(50, 1), (60, 1), (61, 0)], 2)  # an empty final response ends the stream
    assert ttft_ms(r) == 50 and itl_gaps_ms(r) == [10] and r.end_ns == 61 * MS and not r.short


def test_stats_use_numpy_percentiles():
    v = [1.0, 2.0, 3.0, 4.0, 10.0]
    s = Stats.of(v)
    assert s.p90 == pytest.approx(np.percentile(v, 90)) and s.p99 == pytest.approx(np.percentile(v, 99))
    assert s.std == pytest.approx(np.std(v)) and s.avg == 4.0 and s.count == 5
    empty = Stats.of([])
    assert empty.count == 0 and math.isnan(empty.avg) and empty.as_dict()["p99"] is None


def test_text_tokens_are_counted_after_the_run():
    r = rec(0, [(50, -1), (60, -1)], 3)
    r.response_text = [b"a b", b" c"]
    n = count_text_tokens([r], lambda t: len(t.split()))
    assert n == 1 and r.response_tokens == [2, 1] and r.output_tokens == 3 and r.response_text is None


def _word_ends(text):
    import re

    return [m.end() for m in re.finditer(r"\S+", text)]


@pytest.mark.parametrize(("with_offsets", "expected"), [(True, [1, 0, 1, 0, 2]), (False, [1, 1, 0, 0, 2])])
def test_cumulative_text_is_counted_once_per_request(with_offsets, expected):
    """LLM-API responses carry the whole text so far; only the last text and the lengths are kept.

    With token end offsets a response gets the tokens of the final text that end inside it ("bé"
    is not complete after 4 bytes); without, each prefix is re-tokenized on its own ("b" counts)."""
    final = "a bé c dë".encode()
    r = rec(0, [(50, -1), (60, -1), (70, -1), (80, -1), (90, -1)], 8)
    r.text_len = [1, 4, 5, 5, len(final)]  # 4 bytes cuts "é" in half: "bé" is not complete there
    r.text_last = len(final).to_bytes(4, "little") + final
    n = count_text_tokens([r], lambda t: len(t.split()), token_ends=_word_ends if with_offsets else None)
    assert n == 1 and r.response_tokens == expected and r.output_tokens == 4
    assert r.text_last is None and r.text_len is None


def test_cumulative_server_counts_are_differenced():
    r = rec(0, [(50, 1), (60, 2), (70, 3)], 3)  # running totals 1, 2, 3: sum 6 > 3 asked
    _fix_cumulative_counts(r)
    assert r.response_tokens == [1, 1, 1]
    per_response = rec(0, [(50, 1), (60, 2)], 3)  # 1 + 2 = 3 = asked: already per response
    _fix_cumulative_counts(per_response)
    assert per_response.response_tokens == [1, 2]


def test_record_json_round_trip_is_relative_to_run_start():
    r = rec(100, [(150, 1), (160, 1)], 2)
    d = r.to_json(t0_ns=100 * MS)
    assert d["start_ns"] == 0 and d["response_ns"] == [50 * MS, 60 * MS] and d["output_tokens"] == 2
    back = RequestRecord.from_json(d)
    assert ttft_ms(back) == 50 and back.output_tokens == 2
