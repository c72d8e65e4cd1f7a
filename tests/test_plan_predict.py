"""The achievable-throughput model: hand-computed steps, physical limits, the published calibration table,
the recipe-facing ``predict``, predicted-vs-measured on bench.json, the CLI."""

from __future__ import annotations

import json
import math
import re
import statistics
import subprocess
import sys
from pathlib import Path

import pytest
import yaml
from typer.testing import CliRunner

from pipeline.calibrate.measured import compare_run, median_abs_errors
from pipeline.cli import app
from pipeline.core import hardware
from pipeline.core.errors import UserError
from pipeline.plan import calibration as cal
from pipeline.plan import plan_recipe, predict
from pipeline.plan.achievable import (
    SchedulerLimits,
    kv_sequences,
    max_batch,
    predict_point,
)
from pipeline.plan.model_inputs import gpu_efficiency
from pipeline.plan.step import (
    Efficiency,
    StepCost,
    StepMix,
    activation_traffic_bytes,
    step_time,
)
from pipeline.recipe import load_recipe

REPO = Path(__file__).resolve().parents[1]
GPU_RECIPES = [p for p in sorted((REPO / "recipes").glob("*.yaml")) if "cpu" not in p.stem]
H200 = REPO / "recipes" / "llama31_8b_h200_fp8.yaml"
CPU = REPO / "recipes" / "smollm2_135m_cpu_fp8.yaml"
PUBLISHED_MD = REPO / "docs" / "reference" / "published-throughput-calibration.md"

# A toy engine: 1000 B of weights at 1000 B/s (1 s per step when memory-bound), 10 B of KV per token,
# 5 FLOPs per token at 100 FLOP/s, no lm_head / attention / activation cost unless a test sets it.
COST = StepCost(weight_bytes=1000, kv_token_bytes=10, linear_flops_per_token=5, head_flops_per_token=0, attn_flops_coeff=0,
                bandwidth=1000, gemm_flops=100, attn_flops=100)
IDEAL = Efficiency(bw_frac=1, gemm_frac=1, attn_frac=1, seq_overhead_us=0, step_overhead_ms=0, rel_error=0)
ROOMY = SchedulerLimits(max_batch_size=1000, max_num_tokens=100_000, chunked_prefill=False, kv_tokens=1_000_000, tokens_per_block=1)


# ------------------------------------------------------------------------------------------ hand-computed
def test_step_time_by_hand():
    eff = IDEAL.model_copy(update={"bw_frac": 0.5, "gemm_frac": 0.5, "seq_overhead_us": 1000, "step_overhead_ms": 10})
    cost = COST.model_copy(update={"head_flops_per_token": 20, "attn_flops_coeff": 2, "act_bytes_per_token": 4,
                                   "logit_bytes_per_token": 6})
    t = step_time(cost, eff, StepMix(n_seqs=3, n_tokens=50, n_logits=3, kv_read_tokens=40, attn_units=25))
    assert t.overhead_s == pytest.approx(0.010 + 3 * 0.001)
    # weights 1000 / (0.5 × 1000) = 2 s; FLOPs (5·50 + 20·3) / (0.5 × 100) = 6.2 s → compute-bound
    assert t.gemm_s == pytest.approx(6.2) and t.gemm_bound == "compute"
    assert t.act_s == pytest.approx((50 * 4 + 3 * 6) / 500)
    assert t.kv_s == pytest.approx(40 * 10 / 500)
    assert t.attn_s == pytest.approx(2 * 25 / (1.0 * 100))
    assert t.total_s == pytest.approx(0.013 + 6.2 + 0.436 + 0.8 + 0.5)
    assert step_time(cost.model_copy(update={"pp_size": 2}), eff, StepMix(n_seqs=1, n_tokens=1, n_logits=1, kv_read_tokens=0)).gemm_s == \
        pytest.approx(2 * 2.0)  # stages in series


def test_single_client_by_hand():
    # ISL 2, OSL 3, one client: a prefill step (2 tokens: weights 1 s > FLOPs 0.1 s) then 2 decode steps
    # (1 s weights + KV of ISL + OSL/2 = 3.5 tokens × 10 B / 1000 B/s = 0.035 s).
    p = predict_point(COST, ROOMY, IDEAL, 2, 3, 1)
    assert p.batch == 1 and p.limited_by == "concurrency" and p.prefill_steps == 1
    assert p.ttft_ms == pytest.approx(1000.0)  # no running step to wait for
    assert p.itl_ms == pytest.approx(1035.0)
    assert p.e2e_ms == pytest.approx(1000 + 2 * 1035)
    assert p.output_tokens_per_s == pytest.approx(3 / (1.0 + 2 * 1.035))
    assert p.step_ms == pytest.approx((1000 + 2 * 1035) / 3)


def test_max_batch_limits_by_hand():
    tight_kv = ROOMY.model_copy(update={"kv_tokens": 100, "tokens_per_block": 10})
    assert kv_sequences(tight_kv, 20, 5) == 3  # 10 blocks // ceil(25 / 10)
    assert max_batch(tight_kv, 20, 5) == (3, "kv_cache")
    assert kv_sequences(tight_kv.model_copy(update={"policy": "MAX_UTILIZATION"}), 20, 5) == 4  # 100 // 22.5
    assert max_batch(ROOMY.model_copy(update={"max_batch_size": 7}), 20, 5) == (7, "max_batch_size")
    # token budget: 10 + 10 − 1 = 19 tokens per request through 10 steps of ≤ 64 tokens → floor(640 / 19) = 33
    # (the prompt fits one chunk: 64 − 32 decode tokens ≥ 10)
    budget = ROOMY.model_copy(update={"max_num_tokens": 64, "chunked_prefill": True, "tokens_per_block": 8})
    assert max_batch(budget, 10, 10) == (33, "max_num_tokens")
    # without chunking: on average floor(64 × 10 / 59) = 10 requests of 50 + 10 tokens
    unchunked = ROOMY.model_copy(update={"max_num_tokens": 64})
    assert max_batch(unchunked, 50, 10) == (10, "max_num_tokens")
    # … and a whole 50-token prompt must fit next to the decodes: floor((64 − 50) × 100/99) + 1 = 15 (average: 42)
    assert max_batch(unchunked, 50, 100) == (15, "max_num_tokens")
    with pytest.raises(ValueError, match="exceeds max_num_tokens"):
        max_batch(ROOMY.model_copy(update={"max_num_tokens": 64}), 100, 10)
    with pytest.raises(ValueError, match="cannot hold one sequence"):
        max_batch(tight_kv, 200, 10)


def test_chunked_prefill_splits_the_prompt():
    lim = ROOMY.model_copy(update={"max_num_tokens": 40, "chunked_prefill": True, "tokens_per_block": 8})
    p = predict_point(COST, lim, IDEAL, 100, 10, 1)
    assert p.prefill_steps == 3  # ceil(100 / 40)
    # three chunk steps of 100/3 tokens: 5 FLOPs × 33.3 / 100 FLOP/s = 1.67 s each (> 1 s of weight reads)
    assert p.ttft_ms == pytest.approx(3 * 5 * (100 / 3) / 100 * 1e3)


def test_clients_beyond_the_batch_queue():
    lim = ROOMY.model_copy(update={"max_batch_size": 4})
    at_cap = predict_point(COST, lim, IDEAL, 8, 16, 4)
    over = predict_point(COST, lim, IDEAL, 8, 16, 12)
    assert over.batch == 4 and over.limited_by == "max_batch_size"
    assert over.output_tokens_per_s == pytest.approx(at_cap.output_tokens_per_s)
    assert over.itl_ms == pytest.approx(at_cap.itl_ms)
    # Little's law: 12 clients at the request rate of 4 in flight → 3 × the unqueued latency
    rate = at_cap.output_tokens_per_s / 16
    assert over.e2e_ms == pytest.approx(12 / rate * 1e3, rel=1e-6)
    assert over.ttft_ms > at_cap.ttft_ms


def test_activation_traffic_by_hand():
    # Llama-3.1-8B: 13·4096 + 2·(32 + 16)·128 + 2·32·128 + 6·14336 = 159,744 elements per layer, × 32 layers × 2 B
    assert activation_traffic_bytes(4096, 32, 8, 128, 14336, 32) == 32 * 159_744 * 2
    assert activation_traffic_bytes(4096, 32, 8, 128, 14336, 32, tp=2) < activation_traffic_bytes(4096, 32, 8, 128, 14336, 32)


def test_error_terms_add_in_quadrature():
    eff = IDEAL.model_copy(update={"rel_error": 0.1, "step_overhead_ms": 0, "step_overhead_uncertainty_ms": 0})
    p = predict_point(COST, ROOMY, eff, 4, 4, 1, extra_error={"parallelism": 0.2})
    assert p.rel_error == pytest.approx(math.hypot(0.1, 0.2))
    assert p.output_tokens_per_s_low == pytest.approx(p.output_tokens_per_s / (1 + p.rel_error))
    assert p.output_tokens_per_s_high == pytest.approx(p.output_tokens_per_s * (1 + p.rel_error))
    with pytest.raises(ValueError):
        predict_point(COST, ROOMY, eff, 0, 4, 1)


# ------------------------------------------------------------------------------------------ calibration
def test_calibration_table_is_the_published_one():
    """The 27 figures in pipeline/data/plan_calibration.yaml are those of the reference table."""
    rows = re.findall(r"^\| (\d+), (\d+) \| ([\d.]+) \| ([\d.]+) \| ([\d.]+) \|$", PUBLISHED_MD.read_text(), re.M)
    published = {(int(i), int(o)): [float(v) for v in vals] for i, o, *vals in rows}
    ours = {}
    for p in cal.points():
        ours.setdefault((p.isl, p.osl), []).append(p.published)
    assert len(published) == 9 and ours == published


def test_shipped_parameters_meet_the_error_bounds():
    """Issue #18 done-when: median |error| ≤ 15 % and worst ≤ 30 % on the published table."""
    res = cal.evaluate(gpu_efficiency())
    assert len(res) == 27
    errs = [abs(r.error) for r in res]
    assert statistics.median(errs) <= 0.15, res
    assert max(errs) <= 0.30, res
    for r in res:  # every published point is a max-load run: the batch must be a real limit, not a client count
        assert r.limited_by in ("kv_cache", "max_batch_size", "max_num_tokens")


def test_shipped_file_matches_a_refit():
    """benchmarks/calibrate_plan.py's output is reproducible: refitting gives the shipped parameters, and the
    shipped per-point table and error summary are what the shipped parameters predict."""
    shipped = yaml.safe_load((REPO / "pipeline" / "data" / "plan_efficiency.yaml").read_text())
    eff = cal.fit()
    for k, v in shipped["fitted"].items():
        assert getattr(eff, k) == pytest.approx(v, rel=2e-3, abs=2e-3), k
    res = cal.evaluate(gpu_efficiency())
    assert [(r.gpu, r.isl, r.osl) for r in res] == [(p["gpu"], p["isl"], p["osl"]) for p in shipped["points"]]
    for r, p in zip(res, shipped["points"]):
        assert r.predicted == pytest.approx(p["predicted"], rel=1e-3)
    assert cal.summary(res)["median_abs_error"] == pytest.approx(shipped["fit"]["median_abs_error"], abs=1e-3)


def test_calibrate_reproduces_the_shipped_file():
    """calibration.calibrate() (what benchmarks/calibrate_plan.py writes) gives the shipped document: parameters,
    expected error, per-point predictions; dump() is that document behind the header."""
    data, ship = cal.calibrate(), cal.shipped()
    assert set(data) == set(ship) and not cal.drift(ship, data)
    assert data["leave_one_pair_out"]["rms_log_error"] == pytest.approx(ship["leave_one_pair_out"]["rms_log_error"], abs=2e-3)
    assert set(data["leave_one_gpu_out"]) == set(ship["leave_one_gpu_out"]) == {"h100_sxm", "l40s", "a100_80gb"}
    assert [p["predicted"] for p in data["points"]] == pytest.approx([p["predicted"] for p in ship["points"]], rel=2e-3)
    text = cal.dump(data)
    assert text.startswith(cal.EFFICIENCY_HEADER) and yaml.safe_load(text) == data
    assert cal.drift(ship, {"fitted": {**data["fitted"], "bw_frac": data["fitted"]["bw_frac"] + 0.1}}).keys() == {"bw_frac"}


def test_leave_one_gpu_out_generalises():
    """Fitted without a GPU, the model still predicts that GPU within the issue's bounds."""
    for gpu, (_, res) in cal.leave_one_gpu_out().items():
        errs = [abs(r.error) for r in res]
        assert statistics.median(errs) <= 0.15, (gpu, res)
        assert max(errs) <= 0.30, (gpu, res)


def test_held_out_table_is_the_published_one():
    """The 9 H200 figures in pipeline/data/plan_held_out.yaml are those of the reference notes' held-out table
    (the H200 column of the same v0.17 table), and none of them is a calibration point."""
    text = PUBLISHED_MD.read_text().split("## Held out", 1)[1]
    published = {(int(i), int(o)): float(v) for i, o, v in re.findall(r"^\| (\d+), (\d+) \| ([\d.]+) \|$", text, re.MULTILINE)}
    pts = cal.held_out_points()
    assert len(published) == 9 and {(p.isl, p.osl): p.published for p in pts} == published
    assert {p.gpu for p in pts} == {"h200"} and not {p.gpu for p in pts} & {p.gpu for p in cal.points()}


def test_off_the_fitting_gpus_within_the_stated_error():
    """Off its fitting GPUs (the H200, same table, never fitted) the engine-path model stays within what it claims:
    median |error| ≤ 6 % and every point within twice its own ± (rel_error: 1 σ, the largest held-out RMS ln error,
    pipeline/data/plan_generalisation.yaml). Measured 2026-11-27: median |error| 4.3 %, worst 9.4 % (+4.3 % median: a
    bias, see docs/plan.md "Off the fitting GPUs")."""
    eff = gpu_efficiency()
    res = cal.evaluate(eff, cal.held_out_points())
    errs = [abs(r.error) for r in res]
    assert statistics.median(errs) <= 0.06, res
    assert max(errs) <= 2 * eff.rel_error, res
    for r in res:
        assert r.limited_by in ("kv_cache", "max_batch_size", "max_num_tokens")


def test_other_versions_h200_is_the_same_scaling_bias():
    """The H200 columns of the v0.13 and v0.14 engine-path tables (pipeline/data/plan_held_out.yaml other_versions,
    never fitted) are over-predicted at every pair, median +11.4 % / +11.6 % (measured 2026-11-28): their own H100
    column is over-predicted too (+5.6 % / +3.0 %, the version offset), and the rest is the H100 -> H200 scaling of the
    v0.17 check (published over model H200/H100 ratio, median 0.941 / 0.940; v0.17: 0.932). Bounded so that a model
    change which moves either part shows here."""
    eff = gpu_efficiency()
    tables = cal.held_out_other_versions()
    assert set(tables) == {"0.13.0", "0.14.0"}
    for version, pts in tables.items():
        assert len(pts) == 18 and {p.gpu for p in pts} == {"h200", "h100_sxm"}
        res = cal.evaluate(eff, pts)
        h200 = [r for r in res if r.gpu == "h200"]
        h100 = [r for r in res if r.gpu == "h100_sxm"]
        ratio = [(a.published / b.published) / (a.predicted / b.predicted) for a, b in zip(h200, h100, strict=True)]
        assert statistics.median(abs(r.error) for r in h200) <= 0.15, (version, h200)
        assert statistics.median(r.error for r in h100) <= 0.07, (version, h100)
        assert 0.90 <= statistics.median(ratio) <= 0.97, (version, ratio)


def test_trtllm_bench_heuristic_by_hand():
    h100 = hardware.catalog()["h100_sxm"]
    # (79.65 GiB − 8.03e9 B / 2^30) × 0.95 / (64 KiB × 256 tokens) ≈ 4,190 requests → capped 4096 → 256-rounded;
    # tokens 4096 × 2 = 8192 → 1024-rounded
    assert cal.trtllm_bench_settings(h100, 8_030_261_248, 1.0, 65536, 128, 128) == (4096, 8192)
    # 20000/2000: ≈ 48.8 requests → 64 (minimum); 48.8 × 11 ≈ 537 tokens → 2048 (minimum)
    assert cal.trtllm_bench_settings(h100, 8_030_261_248, 1.0, 65536, 20000, 2000) == (64, 2048)


# ------------------------------------------------------------------------------------------ physical limits
@pytest.mark.parametrize("path", GPU_RECIPES, ids=lambda p: p.stem)
def test_prediction_never_exceeds_the_roofline(path):
    plan = plan_recipe(load_recipe(path))
    for s in plan.scenarios:
        assert s.predicted is not None and s.curve
        assert s.predicted.output_tokens_per_s <= max(pt.output_tokens_per_s for pt in s.curve)
        for pt in s.curve:
            assert pt.predicted_output_tokens_per_s is not None
            assert pt.predicted_output_tokens_per_s <= pt.output_tokens_per_s * (1 + 1e-9), (s.isl, s.osl, pt.batch)
        assert s.predicted.batch <= min(s.kv_max_sequences, plan.memory.kv_tokens) and s.predicted.batch <= s.max_concurrency


@pytest.mark.parametrize("path", GPU_RECIPES, ids=lambda p: p.stem)
def test_more_clients_never_lower_throughput_or_latency(path):
    r = load_recipe(path)
    sc = r.bench.scenarios[0]
    preds = [predict(r, sc.isl, sc.osl, c) for c in (1, 2, 4, 8, 16, 32, 64, 128, 256)]
    tps = [p.output_tokens_per_s for p in preds]
    assert tps == sorted(tps)
    itl = [p.itl_ms for p in preds]
    assert itl == sorted(itl)
    # one client cannot stream faster than the weights can be read at datasheet bandwidth
    plan = plan_recipe(r, scenarios=[(sc.isl, sc.osl)])
    floor_ms = plan.step_cost.weight_bytes * plan.step_cost.pp_size / plan.step_cost.bandwidth * 1e3
    assert preds[0].itl_ms > floor_ms


def test_faster_gpu_never_predicts_less():
    r = load_recipe(H200)
    h200 = hardware.catalog()["h200"]
    for isl, osl in ((128, 128), (500, 2000), (2048, 128), (20000 // 5, 4000)):
        base = predict(r, isl, osl, gpu=h200)
        more_bw = predict(r, isl, osl, gpu=h200.model_copy(update={"memory_bandwidth_tbs": 2 * h200.memory_bandwidth_tbs}))
        more_flops = predict(r, isl, osl, gpu=h200.model_copy(update={"fp8_tflops": 2 * h200.fp8_tflops, "bf16_tflops": 2 * h200.bf16_tflops}))
        assert more_bw.output_tokens_per_s >= base.output_tokens_per_s
        assert more_flops.output_tokens_per_s >= base.output_tokens_per_s
        assert more_bw.itl_ms <= base.itl_ms and more_flops.ttft_ms <= base.ttft_ms
        # doubling both cannot more than double throughput (overheads do not scale)
        both = predict(r, isl, osl, gpu=h200.model_copy(update={"memory_bandwidth_tbs": 2 * h200.memory_bandwidth_tbs,
                                                                 "fp8_tflops": 2 * h200.fp8_tflops, "bf16_tflops": 2 * h200.bf16_tflops}))
        assert both.output_tokens_per_s <= 2 * base.output_tokens_per_s * (1 + 1e-9)


def test_uncalibrated_conditions_widen_the_error():
    base = predict(load_recipe(H200), 128, 128)
    assert base.error_terms["calibration"] == pytest.approx(gpu_efficiency().rel_error, abs=1e-4)
    tp2 = predict(load_recipe(H200, ["target.num_gpus=2", "target.tp_size=2"]), 128, 128)
    assert "parallelism" in tp2.error_terms and tp2.rel_error > base.rel_error
    awq = predict(load_recipe(REPO / "recipes" / "llama31_8b_l40s_int4_awq.yaml"), 128, 128)
    assert "qformat" in awq.error_terms
    b200 = predict(load_recipe(H200), 128, 128, gpu="b200")
    assert "architecture" in b200.error_terms
    # at one client the fixed step overhead (not calibrated) is a larger share of the step: wider band
    assert predict(load_recipe(H200), 128, 128, 1).rel_error > base.rel_error


def test_predict_errors_are_user_errors():
    r = load_recipe(H200)
    with pytest.raises(UserError, match="concurrency 0"):
        predict(r, 128, 128, 0)
    with pytest.raises(UserError, match="not in the GPU catalog"):
        predict(r, 128, 128, gpu="h300")
    with pytest.raises(UserError, match="exceeds build.max_seq_len"):
        predict(r, 4000, 8000)
    with pytest.raises(UserError, match="does not fit a100_80gb: quantization.qformat fp8 needs FP8 tensor cores"):
        predict(r, 128, 128, gpu="a100_80gb")


# ------------------------------------------------------------------------------------------ cpu target
def test_cpu_prediction_uses_the_measured_host():
    host = hardware.cpu_host()
    assert host.read_bandwidth_gbs > 0 and host.fp32_gflops > 0 and host.engine_step_overhead_ms >= 0
    assert set(host.sources) >= {"read_bandwidth_gbs", "fp32_gflops", "engine_step_overhead_ms", "engine_seq_overhead_us"}
    r = load_recipe(CPU)
    preds = [predict(r, 100, 200, c) for c in (1, 4, 16)]
    assert [p.output_tokens_per_s for p in preds] == sorted(p.output_tokens_per_s for p in preds)
    # at one client a step streams all fp32 weights: not faster than the measured bandwidth allows
    plan = plan_recipe(r, scenarios=[(100, 200)])
    assert preds[0].itl_ms >= plan.step_cost.weight_bytes / host.bandwidth_bytes_per_s * 1e3
    assert preds[0].itl_ms >= host.engine_step_overhead_ms
    assert plan.scenarios[0].predicted is not None and plan.scenarios[0].peak_output_tokens_per_s is None


# ------------------------------------------------------------------------------------------ predicted vs measured
def _bench_json(tmp_path: Path, build_dir: Path | None, tps: dict[int, float]) -> Path:
    points = [{"scenario": "100:200", "isl": 100, "osl": 200, "mode": "concurrency", "load": f"c{c}", "concurrency": c,
               "request_rate": None, "summary": {"counts": {"completed": 2 * c}, "duration_s": 10.0, "metrics": {
                   "output_token_throughput": v, "time_to_first_token": {"avg": 150.0, "p99": 300.0}, "inter_token_latency": {"avg": 60.0}}}}
              for c, v in tps.items()]
    run = tmp_path / "run"
    run.mkdir()
    (run / "bench.json").write_text(json.dumps({"schema": "trtpipe.bench/1", "config": {"build_dir": str(build_dir) if build_dir else None},
                                                "environment": {}, "load_points": points, "requests": []}))
    return run


def test_compare_run_against_a_bench_json(tmp_path):
    build = tmp_path / "build"
    build.mkdir()
    (build / "recipe.yaml").write_text(CPU.read_text())
    expect = {c: predict(load_recipe(CPU), 100, 200, c).output_tokens_per_s for c in (1, 4, 16)}
    # measured = the prediction for c=1 and c=4, three times lower for c=16
    run = _bench_json(tmp_path, build, {1: expect[1], 4: expect[4], 16: expect[16] / 3})
    rows = compare_run(run)
    assert [r.concurrency for r in rows] == [1, 4, 16]
    assert rows[0].error == pytest.approx(0.0, abs=1e-9) and rows[0].within
    assert rows[2].error == pytest.approx(2.0) and not rows[2].within
    assert rows[0].measured_ttft_ms == 150.0 and rows[0].measured_itl_ms == 60.0 and rows[0].measured_ttft_p99_ms == 300.0
    p16 = rows[2].predicted
    assert rows[2].errors() == pytest.approx({"tok/s": 2.0, "TTFT": p16.ttft_ms / 150 - 1, "TTFT p99": p16.ttft_p99_ms / 300 - 1,
                                              "ITL": p16.itl_ms / 60 - 1})
    med = median_abs_errors(rows)
    assert med["tok/s"] == pytest.approx(0.0, abs=1e-9)  # 0, 0, 2 → median 0
    assert med["ITL"] == pytest.approx(sorted(abs(r.predicted.itl_ms / 60 - 1) for r in rows)[1])
    assert [r.concurrency for r in compare_run(run, concurrency=[4])] == [4]
    with pytest.raises(UserError, match="no completed closed-loop load point at concurrency 64"):
        compare_run(run, concurrency=[64])


def test_plan_against_a_bench_run_cli(tmp_path):
    """``trtpipe plan [RECIPE] --against RUN_DIR`` (formerly scripts/plan_vs_measured.py RUN [--recipe R])."""
    run = _bench_json(tmp_path, None, {1: 10.0, 4: 25.0})
    cli = [sys.executable, "-m", "pipeline.cli", "plan"]
    proc = subprocess.run([*cli, "--against", str(run)], capture_output=True, text=True, timeout=120, cwd=REPO)
    assert proc.returncode == 2 and "pass the recipe" in proc.stderr
    proc = subprocess.run([*cli, str(CPU), "--against", str(run), "--json"], capture_output=True,
                          text=True, timeout=120, cwd=REPO)
    assert proc.returncode == 0, proc.stderr
    rows = json.loads(proc.stdout)
    assert [(r["concurrency"], r["measured_output_tokens_per_s"]) for r in rows] == [(1, 10.0), (4, 25.0)]
    proc = subprocess.run([*cli, str(CPU), "--against", str(tmp_path / "nope")], capture_output=True,
                          text=True, timeout=120, cwd=REPO)
    assert proc.returncode == 2 and "no bench.json" in proc.stderr


def test_plan_against_tables(tmp_path):
    """The plain and Markdown tables of ``--against``; --concurrency picks the load points."""
    run = _bench_json(tmp_path, None, {1: 10.0, 4: 25.0})
    res = runner.invoke(app, ["plan", str(CPU), "--against", str(run), "--concurrency", "4"])
    assert res.exit_code == 0, res.output
    lines = res.stdout.strip().splitlines()
    assert lines[0].split()[:3] == ["run", "ISL/OSL", "conc."] and len(lines) == 3 and " 100/200 " in f" {lines[1]} "
    res = runner.invoke(app, ["plan", str(CPU), "--against", str(run), "--concurrency", "all", "--markdown"])
    assert res.exit_code == 0, res.output
    md = res.stdout.strip().splitlines()
    assert md[0].startswith("| run | ISL/OSL |") and md[1].startswith("|---|") and len(md) == 6
    assert md[-1].startswith("median |error|: tok/s ")
    res = runner.invoke(app, ["plan", str(CPU), "--against", str(run), "--concurrency", "x"])
    assert res.exit_code == 2 and "--concurrency" in res.stderr


# ------------------------------------------------------------------------------------------ CLI
runner = CliRunner()


def test_cli_json_carries_the_prediction():
    res = runner.invoke(app, ["plan", str(H200), "--json", "--isl", "500", "--osl", "2000"])
    assert res.exit_code == 0, res.output
    s = json.loads(res.stdout)["scenarios"][0]
    p = s["predicted"]
    assert 0 < p["output_tokens_per_s"] < s["peak_output_tokens_per_s"]
    assert p["output_tokens_per_s_low"] < p["output_tokens_per_s"] < p["output_tokens_per_s_high"]
    assert p["rel_error"] > 0 and p["ttft_ms"] > 0 and p["itl_ms"] > 0
    assert [q["concurrency"] for q in s["predicted_by_concurrency"]] == [1, 8, 64, 256]


def test_cli_table_shows_prediction_next_to_bound():
    res = runner.invoke(app, ["plan", str(H200), "--isl", "128", "--osl", "128"], env={"COLUMNS": "160"})
    assert res.exit_code == 0, res.output
    assert "bound" in res.stdout and "predicted" in res.stdout and re.search(r"\d ±\d+%", res.stdout)


def test_cli_compares_gpus():
    res = runner.invoke(app, ["plan", str(H200), "--gpu", "h100_sxm", "--gpu", "h200", "--gpu", "a100_80gb",
                              "--isl", "128", "--osl", "128"], env={"COLUMNS": "200"})
    assert res.exit_code == 0, res.output  # fits two of the three
    out = res.stdout
    assert "h100_sxm" in out and "h200" in out and "a100_80gb ✗" in out and "fp8 needs FP8 tensor cores" in out
    res = runner.invoke(app, ["plan", str(H200), "--gpu", "h100_sxm", "--gpu", "h200", "--json", "--isl", "128", "--osl", "128"])
    plans = json.loads(res.stdout)
    assert [p["target"] for p in plans] == ["h100_sxm", "h200"]
    res = runner.invoke(app, ["plan", str(H200), "--gpu", "a100_80gb", "--gpu", "a100_40gb"])
    assert res.exit_code == 2  # fits none
