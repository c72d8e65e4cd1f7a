"""The PyTorch backend's own model (issue 37, item 1): fitted on NVIDIA's v1.0 PyTorch-backend H100 table, chosen for
``build.engine: pytorch`` recipes, with its held-out errors."""

from __future__ import annotations

import re
from pathlib import Path

import pytest
from typer.testing import CliRunner

from pipeline.cli import app
from pipeline.plan import calibration as cal
from pipeline.plan import calibration_pytorch as calp
from pipeline.plan import generalisation as gen
from pipeline.plan import plan_recipe
from pipeline.recipe import load_recipe

REPO = Path(__file__).resolve().parents[1]
PYTORCH = REPO / "recipes" / "llama31_8b_h200_fp8_pytorch.yaml"
TENSORRT = REPO / "recipes" / "llama31_8b_h200_fp8.yaml"
REFERENCE = REPO / "docs" / "reference" / "published-throughput-pytorch-backend.md"


def test_calibration_table_is_the_published_one():
    rows = {}
    for line in REFERENCE.read_text().splitlines():
        m = re.match(r"\| (\d+)/(\d+) \| ([\d,]+) \| ([\d,]+) \| ([\d,]+) \|", line)
        if m:
            rows[(int(m[1]), int(m[2]))] = [float(x.replace(",", "")) for x in m.groups()[2:]]
    assert len(rows) == 10
    shipped = {(r[0], r[1]): r[2:5] for r in calp._raw()["rows"]}  # the H100 columns; the H200 ones follow
    assert shipped == rows
    assert [(c["model"], c["tp"], c.get("gpu", "h100_sxm")) for c in calp._raw()["columns"].values()] == [
        ("meta-llama/Llama-3.1-8B-Instruct", 1, "h100_sxm"), ("meta-llama/Llama-3.3-70B-Instruct", 2, "h100_sxm"),
        ("meta-llama/Llama-3.1-405B-Instruct", 8, "h100_sxm"), ("meta-llama/Llama-3.1-8B-Instruct", 1, "h200"),
        ("meta-llama/Llama-3.3-70B-Instruct", 1, "h200"), ("meta-llama/Llama-3.1-405B-Instruct", 8, "h200")]


def _shipped_results():
    from pipeline.plan.model_inputs import pytorch_efficiency

    results = calp.evaluate(pytorch_efficiency())
    assert len(results) == 60
    return results


def test_shipped_fit_meets_the_issue_bound_for_70b():
    """Issue 37: Llama-3.3-70B FP8 TP2 on H100 within 15 % of the published numbers at every ISL/OSL (fit data);
    the leave-one-ISL/OSL-out errors below 30 % at worst (pipeline/data/plan_generalisation.yaml)."""
    for r in _shipped_results():
        if r.gpu == "llama33_70b":
            assert abs(r.error) < 0.15, r
    sets = gen.shipped()["engines"]["pytorch"]["sets"]
    assert max(s["max_abs_error"] for s in sets if s["kind"] == "isl_osl") < 0.30


def test_shipped_fit_meets_the_issue_bound_for_405b():
    """Issue 37: Llama-3.1-405B FP8 TP8 on H100 within 15 % of the published numbers at every ISL/OSL."""
    for r in _shipped_results():
        if r.gpu == "llama31_405b":
            assert abs(r.error) < 0.15, r


@pytest.mark.xfail(strict=True, reason="a known limit, reported in docs/plan.md (PyTorch backend): with the 8B left "
                   "out the fit is on 70B (TP1/TP2) + 405B TP8 only, part of the tp > 1 cost is absorbed by the shared "
                   "parameters and the 8B TP1 is then under-predicted by up to 41 %")
def test_leave_one_model_out_stays_below_30_percent():
    for s in gen.shipped()["engines"]["pytorch"]["sets"]:
        if s["kind"] == "model":
            assert s["max_abs_error"] < 0.30, s["held_out"]


def test_fitted_parameters_are_physical():
    doc = calp.shipped()
    e = doc["fitted"]
    assert 0.2 <= e["bw_frac"] <= 0.895  # not above the HBM read rate torch measured (4.30 / 4.8 TB/s on H200)
    assert 0.1 <= e["gemm_frac"] <= 1 and 0.05 <= e["attn_frac"] <= 0.75
    # the tensor-parallel all-reduces are measured (allreduce_measured.yaml), not fitted
    assert set(e) == set(calp.FREE) == {"bw_frac", "gemm_frac", "attn_frac", "seq_overhead_us", "allreduce_sync_us",
                                        "allreduce_sync_prefill_us"}
    assert 0 <= e["allreduce_sync_us"] <= 30 and 0 <= e["allreduce_sync_prefill_us"] <= 500


def test_refit_reproduces_the_shipped_file():
    data = calp.calibrate()
    assert cal.drift(calp.shipped(), data) == {}


def test_pytorch_recipe_uses_the_pytorch_model():
    py = plan_recipe(load_recipe(PYTORCH), scenarios=[(128, 128)])
    trt = plan_recipe(load_recipe(TENSORRT), scenarios=[(128, 128)])
    assert "pytorch" in py.efficiency.name and "tensorrt" in trt.efficiency.name
    assert py.efficiency.bw_frac != trt.efficiency.bw_frac
    assert "engine" not in py.error_terms
    assert py.scenarios[0].predicted.rel_error >= gen.shipped()["engines"]["pytorch"]["band"]


def test_tensor_parallel_pytorch_plan_is_calibrated_but_pp_is_not():
    tp2 = plan_recipe(load_recipe(PYTORCH, ["model.source=meta-llama/Llama-3.3-70B-Instruct", "target.gpu=h100_sxm",
                                            "target.num_gpus=2", "target.tp_size=2"]), scenarios=[(128, 128)])
    assert tp2.verdict.ok and "parallelism" not in tp2.error_terms
    pp2 = plan_recipe(load_recipe(PYTORCH, ["model.source=meta-llama/Llama-3.3-70B-Instruct", "target.gpu=h100_sxm",
                                            "target.num_gpus=2", "target.pp_size=2"]), scenarios=[(128, 128)])
    assert "parallelism" in pp2.error_terms


def test_cli_says_which_model():
    out = CliRunner().invoke(app, ["plan", str(PYTORCH), "--isl", "128", "--osl", "128"], terminal_width=250)
    assert out.exit_code == 0, out.output
    assert "pytorch backend" in out.output


def test_decode_sync_grows_linearly_with_tp():
    """The decode sync is tp 8's value × (tp − 1)/7 (none at tp 1); the prefill sync is the same at every tp > 1."""
    from pipeline.plan.model_inputs import pytorch_efficiency
    from pipeline.plan.step import StepMix, _sync_us

    eff = pytorch_efficiency()
    assert eff.allreduce_sync_tp_scaling == "linear" and eff.allreduce_sync_prefill_tp_scaling == "none"
    decode, prefill = StepMix(n_seqs=8, n_tokens=8, n_logits=8, kv_read_tokens=1000), StepMix(n_seqs=1, n_tokens=512, n_logits=1, kv_read_tokens=0, attn_units=1.0)
    assert _sync_us(eff, decode, 8) == pytest.approx(eff.allreduce_sync_us)
    assert _sync_us(eff, decode, 2) == pytest.approx(eff.allreduce_sync_us / 7)
    assert _sync_us(eff, decode, 1) == 0.0
    assert _sync_us(eff, prefill, 2) == _sync_us(eff, prefill, 8) == eff.allreduce_sync_prefill_us
