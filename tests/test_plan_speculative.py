"""Issue 48 item 2: speculative decoding in the planner — the draft's memory, the verification cost per step and the
predicted speed-up from an acceptance length (given, defaulted, or measured by a bench run)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import yaml
from support import RECIPES, shipped_recipe
from typer.testing import CliRunner

from pipeline.cli import app
from pipeline.core.errors import UserError
from pipeline.plan import plan_recipe
from pipeline.plan.speculative import (
    DEFAULT_ACCEPTANCE,
    acceptance_from_bench,
    decode_speedup,
    parse_acceptance,
    speculative_plan,
    step_figures,
)

EAGLE = "llama31_8b_h200_fp8_eagle3"
NGRAM = "smollm2_135m_cpu_ngram"
#: one measured run pair on the CPU host (benchmarks/check_spec_speedup.py --write): plain and n-gram `trtpipe bench`
#: tok/s at 1 and 4 clients on two workloads, the n-gram run's acceptance length and drafts per step, and the host's
#: `trtpipe plan measure-host` rates taken right after
MEASURED = Path(__file__).resolve().parent / "data" / "ngram_speedup_cpu.json"


def test_eagle3_head_memory_is_the_published_checkpoint():
    """yuhuili/EAGLE3-LLaMA3.1-Instruct-8B is one 850 MB fp16 pytorch_model.bin (reference §1.5): the counted head is
    within 1 MB of it; the plan's reserve holds it and its KV layer shrinks the pool against the same recipe without
    speculation."""
    plan = plan_recipe(shipped_recipe(EAGLE))
    d = plan.speculative.draft
    assert d.decoding_type == "Eagle" and d.max_draft_len == 3 and d.extra_kv_tokens_per_seq == 2
    assert abs(d.weight_bytes - 850e6) < 1e6 and d.weight_bytes == 2 * d.draft_params
    assert d.kv_token_bytes == 2 * 1 * 8 * 128 * 1  # K and V, 1 layer, 8 KV heads × 128, FP8 KV cache
    plain = plan_recipe(shipped_recipe(EAGLE, ["build.pytorch.speculative_config=null"]))
    assert plain.speculative is None
    assert plan.memory.overhead_bytes - plain.memory.overhead_bytes == d.weight_bytes
    assert plan.memory.kv_tokens < plain.memory.kv_tokens


def test_eagle3_plan_reports_a_speedup_for_the_stated_acceptance():
    plan = plan_recipe(shipped_recipe(EAGLE), acceptance=2.5)
    sp = plan.speculative
    assert sp.acceptance_length == 2.5 and "given" in sp.acceptance_source
    one = next(p for p in sp.points if p.concurrency == 1 and p.isl == 128)
    # at one client a decode step is weight-bound: verifying 4 tokens costs little more than 1, the head adds 3 small
    # forwards, so the speed-up is below 2.5 but well above 1
    assert 1.5 < one.speedup < 2.5 and one.itl_ms < one.plain_itl_ms
    assert plan_recipe(shipped_recipe(EAGLE)).speculative.acceptance_length == DEFAULT_ACCEPTANCE["Eagle"]


def test_decode_speedup_arithmetic():
    plan = plan_recipe(shipped_recipe(EAGLE))
    cost, eff = plan.step_cost, plan.efficiency
    # no drafts: AL 1 → exactly the plain step
    s = decode_speedup(cost, eff, batch=8, context=1000, acceptance_length=1.0, verified_drafts_per_seq=0)
    assert s.speedup == pytest.approx(1.0) and s.spec_step_ms == pytest.approx(s.plain_step_ms)
    # more accepted tokens per step: faster, at most AL × (the plain step over the verification step)
    a, b = (decode_speedup(cost, eff, batch=8, context=1000, acceptance_length=al, verified_drafts_per_seq=3) for al in (2, 3))
    assert b.speedup == pytest.approx(a.speedup * 1.5) and a.spec_step_ms > a.plain_step_ms
    # a compute-bound batch gains less than a weight-bound one
    big = decode_speedup(cost, eff, batch=512, context=1000, acceptance_length=2, verified_drafts_per_seq=3)
    assert big.speedup < a.speedup
    off = decode_speedup(cost, eff, batch=64, context=1000, acceptance_length=2, verified_drafts_per_seq=3, max_concurrency=32)
    assert not off.active and off.speedup == 1.0
    with pytest.raises(ValueError, match="between 1 and"):
        decode_speedup(cost, eff, batch=8, context=10, acceptance_length=5, verified_drafts_per_seq=3)


def test_acceptance_from_a_bench_run(tmp_path):
    run = tmp_path / "run"
    run.mkdir()
    (run / "bench.json").write_text(json.dumps({"points": [
        {"concurrency": 1, "speculative": {"acceptance_length": 1.8, "draft_tokens": 400, "requests_with_drafts": 100}},
        {"concurrency": 4, "acceptance_length": 1.6}]}))
    assert acceptance_from_bench(run) == (pytest.approx(1.7), pytest.approx(4.0))
    assert parse_acceptance("2.5") == 2.5 and parse_acceptance(str(run)) == run
    (tmp_path / "empty.json").write_text(json.dumps({"points": [{"concurrency": 1}]}))
    with pytest.raises(UserError, match="no load point reports an acceptance length"):
        acceptance_from_bench(tmp_path / "empty.json")
    with pytest.raises(UserError, match="cannot read"):
        acceptance_from_bench(tmp_path / "nope")
    plan = plan_recipe(shipped_recipe(EAGLE), acceptance=run)
    assert plan.speculative.acceptance_length == pytest.approx(1.7) and "measured by" in plan.speculative.acceptance_source


def test_cli_speculative_lines_and_bad_acceptance():
    r = CliRunner().invoke(app, ["plan", str(RECIPES / f"{EAGLE}.yaml"), "--acceptance", "2.5"], terminal_width=250)
    assert r.exit_code == 0, r.output
    assert "draft memory 0.79 GiB" in r.output and "predicted speed-up" in r.output and "acceptance length 2.5" in r.output
    bad = CliRunner().invoke(app, ["plan", str(RECIPES / f"{EAGLE}.yaml"), "--acceptance", "9"], terminal_width=250)
    assert bad.exit_code == 2 and "between 1 and 1 + max_draft_len = 4" in bad.output and "Traceback" not in bad.output


def _cpu_ngram_plan(acceptance, concurrency=(1, 4), isl=100, osl=200):
    """The shipped CPU n-gram recipe (max_draft_len 5, k 3), planned on the host."""
    return plan_recipe(shipped_recipe(NGRAM), scenarios=[(isl, osl)], concurrency=list(concurrency), acceptance=acceptance)


def test_cpu_ngram_formula_uses_the_cpu_step_model():
    """On the CPU engine no CUDA-graph padding: the verification step holds 1 + the drafts actually found per step
    (from the bench run), so a run that drafted little pays little; no draft weights."""
    plan = _cpu_ngram_plan(1.4)
    sp = plan.speculative
    assert sp.draft.weight_bytes == 0 and sp.verified_drafts_per_seq == 5  # no measurement: the upper bound
    one = next(p for p in sp.points if p.concurrency == 1)
    assert 1.0 < one.speedup < 1.4
    cost, eff = plan.step_cost, plan.efficiency
    base = next(p for p in plan.scenarios[0].predicted_by_concurrency if p.concurrency == 1)
    direct = decode_speedup(cost, eff, batch=base.batch, context=200, acceptance_length=1.4, verified_drafts_per_seq=5)
    assert direct.speedup > one.speedup  # the prefill share of E2E is not sped up (nor the streamed tokens' serving CPU)
    assert speculative_plan(sp.draft, cost, eff, plan.scenarios[0].predicted_by_concurrency, 30, acceptance=1.0,
                            on_gpu=False).points[0].speedup < 1.0  # nothing accepted: only the verification cost
    few = speculative_plan(sp.draft, cost, eff, [base], 30, acceptance=1.4, on_gpu=False, drafts_per_step=1.0)
    assert few.verified_drafts_per_seq == 1.0 and few.points[0].speedup > one.speedup  # fewer drafts verified: cheaper


def test_streamed_tokens_cost_the_served_cpu_per_token():
    """A speculative step streams AL tokens per sequence; the serving CPU per streamed token (the host's
    serving_cpu_per_token_us, charged once per sequence per step by the plain step model) is paid AL − 1 more times:
    spec step = the same step without it + batch × (AL − 1) × that cost, exactly."""
    plan = _cpu_ngram_plan(2.0)
    cost, eff = plan.step_cost, plan.efficiency
    kw = {"batch": 4, "context": 150, "acceptance_length": 3.0, "verified_drafts_per_seq": 4}
    bare, served = decode_speedup(cost, eff, **kw), decode_speedup(cost, eff, **kw, token_overhead_s=2e-3)
    assert served.spec_step_ms == pytest.approx(bare.spec_step_ms + 4 * 2 * 2.0)
    assert served.plain_step_ms == pytest.approx(bare.plain_step_ms) and served.speedup < bare.speedup
    gpu = plan_recipe(shipped_recipe(EAGLE), acceptance=2.5).speculative.points[0]
    assert gpu.active  # on a GPU no serving CPU term: the GPU step does not wait for it (tested above at 1.5-2.5)


def test_bench_point_step_figures_count_every_generation_step():
    """`trtpipe bench`'s speculative summary (pipeline/bench/metrics.py speculative): 8 requests of 128 tokens, 400
    accepted of 1000 drafted → 8 × 127 = 1016 generation-token slots, 1016 − 400 = 616 steps: 1016 / 616 tokens per
    step and 1000 / 616 drafts per step."""
    pt = {"concurrency": 1, "summary": {"metrics": {"output_sequence_length": {"avg": 128.0}},
                                        "speculative": {"requests": 8, "accepted_draft_tokens": 400, "draft_tokens": 1000,
                                                        "acceptance_rate": 0.4, "accepted_tokens_per_step": 1016 / 616}}}
    al, drafts = step_figures(pt)
    assert al == pytest.approx(1016 / 616) and drafts == pytest.approx(1000 / 616)
    assert step_figures({"concurrency": 1}) is None


def test_cpu_ngram_prediction_within_20_percent_of_measured(tmp_path, monkeypatch):
    """Issue 48: on the CPU n-gram recipe the predicted speed-up is within 20 % of the measured one at 1 and 4 streams,
    on both workloads, from the run's own acceptance length and drafts per step and on the measuring host's rates (the
    file's `host`, as `trtpipe plan measure-host` wrote it). The prediction is computed here, live."""
    doc = json.loads(MEASURED.read_text())
    host = tmp_path / "cpu_host.yaml"
    host.write_text(yaml.safe_dump(doc["host"], sort_keys=False, allow_unicode=True))
    monkeypatch.setenv("TRTPIPE_HOST_FILE", str(host))
    assert {(m["workload"], m["concurrency"]) for m in doc["points"]} == {(w, c) for w in ("repetitive", "open") for c in (1, 4)}
    for m in doc["points"]:
        plan = _cpu_ngram_plan(m["acceptance_length"], (m["concurrency"],), round(m["isl"]), round(m["osl"]))
        assert doc["host"]["name"] in plan.efficiency.source  # the measuring host's rates, not the shipped reference
        pts = speculative_plan(plan.speculative.draft, plan.step_cost, plan.efficiency, plan.scenarios[0].predicted_by_concurrency,
                               plan.geometry.num_hidden_layers, acceptance=m["acceptance_length"], on_gpu=False,
                               drafts_per_step=m["drafts_per_step"])
        pred = pts.points[0].speedup
        measured = m["spec_tokens_per_s"] / m["plain_tokens_per_s"]
        assert abs(pred / measured - 1) <= 0.20, (m, pred, measured)
