"""Latency at a given concurrency (issue 37, item 6): the closed-loop model of identical requests worked by hand on a
step whose time is 10 ms + 1 ms per token, the SLO search against a brute-force scan, and ``trtpipe plan
--concurrency / --slo`` as a user runs them."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from typer.testing import CliRunner

from pipeline.cli import app
from pipeline.plan.achievable import (
    SchedulerLimits,
    max_batch,
    max_concurrency_within,
    predict_point,
    prefill_groups,
    slo_value,
)
from pipeline.plan.step import Efficiency, StepCost

REPO = Path(__file__).resolve().parents[1]
runner = CliRunner()

# a step costs 10 ms + 1 ms per token: GEMMs compute-bound at 1 FLOP per token on 1000 FLOP/s, everything read from
# memory negligible (1 B at 1 TB/s), no per-sequence overhead
COST = StepCost(weight_bytes=1, kv_token_bytes=1e-9, linear_flops_per_token=1, head_flops_per_token=0, attn_flops_coeff=0,
                bandwidth=1e12, gemm_flops=1000, attn_flops=1)
EFF = Efficiency(bw_frac=1, gemm_frac=1, attn_frac=1, seq_overhead_us=0, step_overhead_ms=10, rel_error=0)


def _limits(max_num_tokens: int, chunked: bool = True) -> SchedulerLimits:
    return SchedulerLimits(max_batch_size=64, max_num_tokens=max_num_tokens, chunked_prefill=chunked, kv_tokens=1_000_000,
                           tokens_per_block=1)


def test_prefill_groups_by_hand():
    assert prefill_groups(_limits(100), isl=10, b=4) == 1  # 40 prompt tokens fit one step
    assert prefill_groups(_limits(64), isl=30, b=4) == 2  # 120 tokens: two steps of ≤ 64
    assert prefill_groups(_limits(64, chunked=False), isl=30, b=4) == 2  # 2 whole prompts per step
    assert prefill_groups(_limits(64, chunked=False), isl=30, b=5) == 3
    assert prefill_groups(_limits(1000), isl=100, b=16) == 2  # the CPU default at 16 clients: 1,600 tokens, 1,024 per step


def test_one_group_by_hand():
    # 4 clients, ISL 10, OSL 5: the 4 prompts (40 tokens) in one step of 50 ms, then 4 decode steps of 14 ms
    p = predict_point(COST, _limits(100), EFF, 10, 5, 4)
    assert p.prefill_groups == 1
    assert p.ttft_ms == pytest.approx(50.0) and p.ttft_p99_ms == pytest.approx(50.0)
    assert p.itl_ms == pytest.approx(14.0)
    assert p.output_tokens_per_s == pytest.approx(4 * 5 / (0.050 + 4 * 0.014))


def test_two_groups_by_hand():
    # 4 clients, ISL 30, OSL 5, 64 tokens per step: groups A and B of 2 prompts. One cycle of 6 steps:
    #   0: A's prompts (60 tokens), B waiting            → 70 ms
    #   1: B's prompts (60) + A decoding (2)             → 72 ms
    #   2, 3, 4: A and B decoding (4)                    → 14 ms each
    #   5: B decoding (2), A waiting                     → 12 ms
    p = predict_point(COST, _limits(64), EFF, 30, 5, 4)
    assert p.prefill_groups == 2
    assert p.output_tokens_per_s == pytest.approx(4 * 5 / (0.070 + 0.072 + 3 * 0.014 + 0.012))
    # TTFT: A waits step 5 then its prefill (12 + 70), B waits step 0 then its own (70 + 72); the model averages the
    # two prefill steps (71 ms): mean (83 + 142) / 2, p99 = B's
    assert p.ttft_ms == pytest.approx((12 + 71 + 71 + 71) / 2)
    assert p.ttft_p99_ms == pytest.approx(142.0)
    # ITL: A's gaps are steps 1-4 (72 + 3 × 14), B's steps 2-5 (3 × 14 + 12); mean over 8 gaps (72 → 71 averaged)
    assert p.itl_ms == pytest.approx((71 + 3 * 14 + 3 * 14 + 12) / 8)


def test_a_prompt_longer_than_a_step_at_one_client():
    p = predict_point(COST, _limits(40), EFF, 100, 10, 1)
    assert p.prefill_steps == 3  # ceil(100 / 40) chunks of 33.3 tokens: 43.3 ms each
    assert p.ttft_ms == pytest.approx(3 * (10 + 100 / 3))


def test_the_max_load_prediction_is_the_steady_state():
    # at maximum load (no concurrency) requests arrive at every phase: no groups, TTFT of one prompt
    p = predict_point(COST, _limits(64), EFF, 30, 5, None)
    assert p.prefill_groups == 0 and p.concurrency is None


def _brute_force(lim, isl, osl, slo):
    """Largest c such that every concurrency up to c meets ``slo``, by trying each one."""
    best = None
    for c in range(1, max_batch(lim, isl, osl)[0] + 1):
        p = predict_point(COST, lim, EFF, isl, osl, c)
        if any(slo_value(p, k) > v for k, v in slo.items()):
            break
        best = c
    return best


@pytest.mark.parametrize("slo", [{"ttft": 150.0}, {"itl": 30.0}, {"ttft": 400.0, "itl": 60.0}, {"e2e": 2000.0}, {"ttft": 5.0}])
def test_slo_search_matches_a_scan(slo):
    lim = _limits(64)
    got = max_concurrency_within(COST, lim, EFF, 30, 50, slo)
    assert got.concurrency == _brute_force(lim, 30, 50, slo)
    if got.concurrency is None:
        assert got.limited_by in slo  # even one client misses it
    elif got.limited_by != "max_concurrency":
        nxt = predict_point(COST, lim, EFF, 30, 50, got.concurrency + 1)
        assert slo_value(nxt, got.limited_by) > slo[got.limited_by]


def test_slo_search_rejects_an_unknown_key():
    with pytest.raises(ValueError, match="unknown SLO 'ttfb'"):
        max_concurrency_within(COST, _limits(64), EFF, 30, 50, {"ttfb": 1.0})


RECIPE = str(REPO / "recipes" / "llama31_8b_h200_fp8_pytorch.yaml")


def test_cli_concurrency_and_slo_as_json():
    res = runner.invoke(app, ["plan", RECIPE, "--isl", "128", "--osl", "128", "--concurrency", "1,8,64",
                              "--slo", "ttft:500,itl:50", "--json"])
    assert res.exit_code == 0, res.output
    sc = json.loads(res.stdout)["scenarios"][0]
    preds = sc["predicted_by_concurrency"]
    assert [p["concurrency"] for p in preds] == [1, 8, 64]
    assert all(p["ttft_ms"] > 0 and p["ttft_p99_ms"] >= p["ttft_ms"] and p["itl_ms"] > 0 for p in preds)
    assert preds[0]["itl_ms"] < preds[2]["itl_ms"] and preds[0]["ttft_ms"] < preds[2]["ttft_ms"]
    ans = sc["within_slo"]
    assert ans["slo"] == {"ttft": 500.0, "itl": 50.0} and ans["concurrency"] >= 64
    assert ans["prediction"]["ttft_p99_ms"] <= 500 and ans["prediction"]["itl_ms"] <= 50


def test_cli_tables_show_the_requested_concurrencies_and_the_slo_answer():
    res = runner.invoke(app, ["plan", RECIPE, "--isl", "128", "--osl", "128", "--concurrency", "3,7", "--slo", "itl:20"],
                        env={"COLUMNS": "200"})
    assert res.exit_code == 0, res.output
    assert "Largest concurrency within the SLO (itl ≤ 20 ms" in res.stdout
    rows = [[c.strip() for c in line.split("│")] for line in res.stdout.splitlines() if line.strip().startswith("128/128")]
    assert {r[1] for r in rows} >= {"3", "7"}


@pytest.mark.parametrize("args, message", [
    (["--slo", "ttfb:100"], "--slo 'ttfb:100': unknown SLO 'ttfb'"),
    (["--slo", "ttft:0"], "SLO ttft:0: use ttft, itl, tpot or e2e with a limit in ms above 0"),
    (["--concurrency", "0,4"], "concurrency 0: must be at least 1"),
    (["--concurrency", "x"], "--concurrency 'x': expected comma-separated integers"),
    (["--concurrency", "all"], "--concurrency all goes with --against"),
    (["--against", "run", "--slo", "itl:5"], "--isl/--osl/--slo do not go with --against"),
])
def test_cli_bad_concurrency_or_slo_is_one_line(args, message):
    res = runner.invoke(app, ["plan", RECIPE, *args])
    assert res.exit_code == 2
    assert message in res.stderr and "Traceback" not in res.output


def test_the_cpu_deployment_measured_on_the_reference_host():
    """The served CPU default measured by ``trtpipe bench`` at 1 / 4 / 16 clients on the reference host of
    pipeline/data/cpu_host.yaml (tests/data/bench_cpu_20261127: its load points, the requests dropped) against the
    prediction from that host's measured rates: median |error| ≤ 20 % (issue 37; before the closed-loop groups and
    the served CPU per token, the error at 16 clients was +42-62 % in tok/s and −90 % in TTFT)."""
    from pipeline.calibrate.measured import compare_run, median_abs_errors
    from pipeline.core import hardware

    assert hardware.cpu_host().serving_cpu_per_token_us  # the shipped reference host, served probe included
    rows = compare_run(REPO / "tests" / "data" / "bench_cpu_20261127", REPO / "recipes" / "smollm2_135m_cpu_fp8.yaml")
    assert [r.concurrency for r in rows] == [1, 4, 16]
    med = median_abs_errors(rows)
    assert med["all"] <= 0.20, med
    assert all(med[k] <= 0.20 for k in ("tok/s", "TTFT", "ITL")), med
