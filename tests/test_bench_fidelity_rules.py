"""The timing rules of tests/bench_fidelity.py on synthetic runs (no server): they hold for a faithful run and each
catches the fault it is there for — a receipt mapped before the server's send, a time shorter than the model's
schedule, a reported average that is not the bench's own timestamps."""

from __future__ import annotations

import copy

from bench_fidelity import violations

from pipeline.bench.exporters import run_document
from pipeline.bench.records import RequestRecord
from pipeline.bench.results import BenchResult, LoadPoint
from pipeline.bench.run import summarize_run
from pipeline.recipe.bench import BenchSpec

MS = 1_000_000
EPOCH = 1_800_000_000 * 10**9  # the run's t0 on CLOCK_REALTIME


def _doc(receipt_delay_ms: float = 0.4, first_token_ms: float = 50.3) -> dict:
    """4 requests of 20 tokens 10 ms apart; the model sends the first ``first_token_ms`` after the client's send and
    each response arrives ``receipt_delay_ms`` after the model sent it."""
    spec = BenchSpec(model="tensorrt_llm", scenarios=[{"isl": 32, "osl": 20}], concurrency=[2])
    run = BenchResult(spec, started_at="now", t0_ns=0, t0_epoch_ns=EPOCH)
    for i in range(4):
        start = i * 300 * MS
        tx = [start + int((first_token_ms + 10 * k) * MS) for k in range(20)]
        r = RequestRecord("32:20", "c2", i, False, 32, 20, start_ns=start)
        r.response_ns = [t + int(receipt_delay_ms * MS) for t in tx]
        r.response_tokens = [1] * 20
        r.end_ns = r.response_ns[-1]
        r.server = {"arrival_time_ns": EPOCH + start + MS // 5, "first_token_time_ns": EPOCH + tx[0],
                    "last_token_time_ns": EPOCH + tx[-1]}
        run.records.append(r)
    run.load_points.append(LoadPoint("32:20", 32, 20, "concurrency", "c2", concurrency=2))
    summarize_run(run)
    return run_document(run)


def test_a_faithful_run_breaks_no_rule():
    assert violations(_doc()) == []


def test_a_receipt_mapped_before_the_send_is_caught():
    doc = _doc()
    doc["t0_epoch_ns"] -= MS  # the client's clock mapped 1 ms early: receipts 0.6 ms before the sends
    assert any("received before the server sent" in v for v in violations(doc))


def test_a_time_shorter_than_the_schedule_is_caught():
    bad = violations(_doc(first_token_ms=49.0))  # "first token" 49 ms after the send: the model's is 50
    assert any("TTFT 49.400 ms < the model's 50.0 ms" in v for v in bad)


def test_a_reported_average_that_is_not_the_timestamps_is_caught():
    doc = copy.deepcopy(_doc())
    doc["load_points"][0]["summary"]["metrics"]["time_to_first_token"]["avg"] += 0.5
    assert [v for v in violations(doc) if "reported time_to_first_token" in v]
