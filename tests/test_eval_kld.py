"""trtpipe eval --rule kld: the per-position math and the rule on hand-computed data, the limits' sources, the
recipe/tune fields, the TensorRT build flag, and the real gate on the CPU default (FP8 SmolLM2 and its
full-precision baseline served at once; the baseline against itself; a damaged build; INT4 AWQ, slow).

Hand values: P = softmax(0, 0) = (1/2, 1/2), Q = softmax(ln 3, 0) = (3/4, 1/4):
KL(P || Q) = 1/2 ln(2/3) + 1/2 ln 2 = 1/2 ln(4/3) = 0.1438410; -ln P(1) = ln 2; -ln Q(1) = ln 4.
Limits: ggml-org/llama.cpp examples/perplexity/README.md @ 0b8d056692ed8650b9461b000245277c466dd27e, "LLaMA 2 vs.
LLaMA 3 Quantization comparison": L3 8b q8_0 Mean KLD 0.000753, Same top p 98.467 %; L3 8b q4_K_M 0.031046, 92.162 %.
"""

from __future__ import annotations

import json
import math
import shutil
from pathlib import Path

import numpy as np
import pytest
from support import EVAL_PROMPTS

from pipeline.eval import kld, stats
from pipeline.recipe import load_recipe
from pipeline.recipe.eval import EvalSpec, needs_context_logits

REPO = Path(__file__).resolve().parents[1]
pytestmark = pytest.mark.xdist_group("eval_baseline")  # shares the full-precision baseline build with test_eval
CPU_RECIPE = REPO / "recipes" / "smollm2_135m_cpu_fp8.yaml"


# ---------------------------------------------------------------------- math
def test_position_stats_by_hand():
    s = kld.position_stats(np.array([[0.0, 0.0]]), np.array([[math.log(3), 0.0]]), [1])
    assert s.n == 1 and s.kld_sum == pytest.approx(0.5 * math.log(4 / 3), rel=1e-9)
    assert s.top1_same == 1  # both argmax 0 (a tie takes the first index, as torch.argmax does)
    assert s.nll_base == pytest.approx(math.log(2)) and s.nll_cand == pytest.approx(math.log(4))
    same = kld.position_stats(np.array([[1.0, 2.0, 3.0]] * 4), np.array([[1.0, 2.0, 3.0]] * 4), [0, 1, 2, 2])
    assert same.kld_sum == 0.0 and same.top1_same == 4 and same.nll_base == same.nll_cand
    with pytest.raises(ValueError):
        kld.position_stats(np.zeros((2, 3)), np.zeros((2, 3)), [0])


def _seq(n: int, kld_each: float, same: int, dnll: float) -> kld.SeqStats:
    return kld.SeqStats(n, n * kld_each, same, 1.0 * n, (1.0 + dnll) * n, [kld_each] * n)


def test_summary_weighs_sequences_by_positions_and_brackets_the_estimate():
    seqs = [_seq(10, 0.1, 9, 0.05), _seq(30, 0.3, 24, 0.15)]
    s = kld.summarize(seqs, alpha=0.025, resamples=500, seed=0)
    # ratio of sums: (10 x 0.1 + 30 x 0.3) / 40 = 0.25; (9 + 24) / 40 = 82.5 %; (0.5 + 4.5) / 40 = 0.125
    assert s["mean_kld"]["value"] == pytest.approx(0.25)
    assert s["same_top1_pct"]["value"] == pytest.approx(82.5)
    assert s["delta_log_ppl"]["value"] == pytest.approx(0.125)
    assert s["p99_kld"]["value"] == pytest.approx(0.3)
    assert s["positions"] == {"value": 40, "sequences": 2}
    lo, hi = s["mean_kld"]["ci"]
    assert 0.1 <= lo <= 0.25 <= hi <= 0.3
    with pytest.raises(ValueError):
        kld.summarize([seqs[0], kld.SeqStats(0, 0.0, 0, 0.0, 0.0, [])], alpha=0.025, resamples=100, seed=0)


def test_rule_fails_beyond_the_limits_passes_well_inside_and_straddles_inconclusive():
    rng = np.random.default_rng(0)
    seqs = [_seq(40, float(k), 38, 0.01) for k in rng.uniform(0.004, 0.006, 30)]
    s = kld.summarize(seqs, alpha=0.002, resamples=1000, seed=0)
    fail = kld.decide(s, kld.limits("fp8"), alpha=0.002, beta=0.2)  # 0.005 nats > q8_0's 0.000753
    assert fail.verdict == stats.FAIL and fail.checks[0].verdict == stats.FAIL
    ok = kld.decide(s, kld.limits("fp8", kld_max=0.05, same_top1_min=80.0), alpha=0.002, beta=0.2)
    assert ok.verdict == stats.PASS, ok.reasons
    assert all(p.supported for p in ok.power)
    edge = kld.decide(s, kld.limits("fp8", kld_max=s["mean_kld"]["value"], same_top1_min=80.0), alpha=0.002, beta=0.2)
    assert edge.verdict == stats.INCONCLUSIVE and "straddles" in edge.reasons[0]


def test_a_fail_against_the_default_limits_says_where_they_come_from_and_how_to_set_this_models(tmp_path: Path):
    """#44: the FP8 default FAILed llama.cpp's q8_0 limit with no word on what the limit is or what a user can do."""
    recipe = load_recipe(CPU_RECIPE)
    rng = np.random.default_rng(0)
    seqs = [_seq(40, float(k), 38, 0.01) for k in rng.uniform(0.012, 0.018, 30)]  # ~0.015 nats: as FP8 measured
    rows = [{"scores": {"agreement": {"rougeL": 0.8}, "candidate": {}, "baseline": {}}} for _ in seqs]
    rule, summary = kld.judge(EvalSpec(rule="kld", resamples=500), seqs, rows, recipe)
    assert rule.verdict == stats.FAIL
    text = "\n".join(rule.reasons)
    for needed in ("LLaMA-3-8B", "q8_0", "0.000753", "135 M parameters", "--kld-max", "eval.kld_max",
                   "eval.same_top1_min", f"{summary['mean_kld']['ci'][1]:.3g}"):
        assert needed in text, (needed, text)
    # limits the user set for this model: judged against them, and nothing about the defaults
    own, _ = kld.judge(EvalSpec(rule="kld", resamples=500, kld_max=0.05, same_top1_min=80.0), seqs, rows, recipe)
    assert own.verdict == stats.PASS and not any("LLaMA-3-8B" in r for r in own.reasons)


def test_limits_come_from_the_published_table_by_weight_width():
    def pair(q):
        lim = kld.limits(q)
        return lim.kld_max, lim.same_top1_min

    assert pair("fp8") == pair("int8_sq") == (0.000753, 98.467)
    assert pair("int4_awq") == pair("nvfp4") == (0.031046, 92.162)
    assert kld.limits("full_prec").kld_max == 0.000753  # a compute-dtype / KV-cache change: the 8-bit limits
    assert "0b8d056692ed8650b9461b000245277c466dd27e" in kld.limits("fp8").source
    own = kld.limits("fp8", kld_max=0.02)
    assert own.kld_max == 0.02 and own.same_top1_min == 98.467 and own.source.startswith("recipe")


# ---------------------------------------------------------------------- recipe, tune, build flag
def test_kld_rule_and_limits_in_the_recipe_and_the_tune_gate(tmp_path: Path):
    from pipeline.tune.spec import GateSpec

    assert EvalSpec(rule="kld", kld_max=0.01, same_top1_min=95).rule == "kld"
    for bad in ({"kld_max": 0}, {"same_top1_min": 101}):
        with pytest.raises(ValueError):
            EvalSpec(**bad)
    assert GateSpec(rule="kld", kld_max=0.05).kld_max == 0.05
    assert needs_context_logits(EvalSpec(rule="kld")) and not needs_context_logits(EvalSpec())


def test_tensorrt_build_gathers_context_logits_only_when_the_gate_needs_them():
    from pipeline.engine import tensorrt as trt

    path = next(p for p in sorted((REPO / "recipes").glob("*.yaml")) if load_recipe(p).build.engine == "tensorrt")
    for rule, want in (("paired", False), ("kld", True)):
        recipe = load_recipe(path, [f"eval.rule={rule}"])
        argv = trt.build_command(recipe, source=Path("ckpt"), from_model_config=False, plugins={}, max_seq_len=4096)
        assert ("--gather_context_logits" in argv) is want
        cfg = trt.build_config_dict(recipe, plugins={}, max_seq_len=4096, dtype="float16")
        assert cfg["gather_context_logits"] is want


def test_cli_refuses_a_bad_limit_with_one_line(tmp_path: Path):
    import subprocess

    from tests.conftest import TRTPIPE

    res = subprocess.run([TRTPIPE, "eval", "nowhere", "--rule", "kld"], cwd=tmp_path, capture_output=True, text=True,
                         timeout=120)
    assert res.returncode == 2 and len([ln for ln in res.stderr.splitlines() if ln.strip()]) == 1, res.stderr


# ---------------------------------------------------------------------- the real gate (CPU default)
KLD_OPTS = dict(rule="kld", resamples=500, **EVAL_PROMPTS)  # tests/test_eval.py's prompts: their outputs are cached


def _run(candidate: Path, baseline: Path | None, out: Path, **kw):
    from pipeline.core.layout import BuildLayout
    from pipeline.eval import stage

    recipe = load_recipe(candidate / "recipe.yaml")
    base = None if baseline is None else stage.EvalTarget(layout=BuildLayout(baseline))
    return stage.run(EvalSpec(**(KLD_OPTS | kw)), stage.EvalTarget(layout=BuildLayout(candidate)), base, recipe=recipe,
                     recipe_dir=CPU_RECIPE.parent, out=out)


@pytest.fixture(scope="module")
def fp8_kld(cpu_build: Path, tmp_path_factory: pytest.TempPathFactory):
    """FP8 vs its full-precision baseline (built next to it by the stage, or reused), both served at once."""
    return _run(cpu_build, None, tmp_path_factory.mktemp("kld") / "fp8")


@pytest.mark.triton
def test_fp8_gate_decides_and_reports_every_statistic(fp8_kld):
    res = fp8_kld
    assert res.verdict in (stats.PASS, stats.FAIL), res.rule.reasons
    k = res.means["kld"]
    assert k["mean_kld"]["value"] > 0 and k["mean_kld"]["ci"][0] <= k["mean_kld"]["value"] <= k["mean_kld"]["ci"][1]
    assert 0 < k["same_top1_pct"]["value"] <= 100 and k["p99_kld"]["value"] >= k["mean_kld"]["value"]
    assert k["positions"]["value"] > 4 and k["limits"]["kld_max"] == 0.000753
    doc = json.loads((res.run_dir / "eval.json").read_text())
    assert doc["rule"]["rule"] == "kld" and [c["metric"] for c in doc["rule"]["checks"]] == ["mean_kld", "same_top1_pct"]
    assert doc["hashes"]["candidate"]["weights_key"] != doc["hashes"]["baseline"]["weights_key"]
    rows = [json.loads(x) for x in (res.run_dir / "samples.jsonl").read_text().splitlines()]
    assert sum(r["kld"]["positions"] for r in rows) == k["positions"]["value"]


@pytest.mark.triton
def test_full_precision_against_itself_passes_with_zero_kld(fp8_kld, cpu_build: Path, tmp_path: Path):
    baseline = cpu_build.parent / f"{cpu_build.name}-baseline"
    res = _run(baseline, baseline, tmp_path / "self")
    k = res.means["kld"]
    assert res.verdict == stats.PASS, res.rule.reasons
    assert k["mean_kld"]["value"] == pytest.approx(0.0, abs=1e-9) and k["same_top1_pct"]["value"] == 100.0
    assert res.cached == {"candidate": True, "baseline": True}  # the fp8 eval's baseline outputs, keyed on its weights


@pytest.mark.triton
@pytest.mark.slow
def test_a_damaged_build_fails_the_kld_gate(fp8_kld, cpu_build: Path, tmp_path: Path):
    from safetensors.torch import load_file, save_file

    from pipeline.core import artifacts

    damaged = tmp_path / "damaged"
    shutil.copytree(cpu_build, damaged, ignore=shutil.ignore_patterns("*.log", "eval_outputs"))
    for cfg in (damaged / "triton_repo").glob("*/config.pbtxt"):
        cfg.write_text(cfg.read_text().replace(str(cpu_build.resolve()), str(damaged.resolve())))
    weights = damaged / "engine" / "model.safetensors"
    tensors = load_file(weights)
    name = next(n for n, t in tensors.items() if t.is_floating_point() and t.dim() == 2 and "mlp" in n)
    tensors[name] = tensors[name].flip(0)  # one MLP matrix with its rows reversed
    save_file(tensors, weights)
    manifest = artifacts.read_manifest(damaged / "engine")
    manifest["files"]["model.safetensors"] = artifacts.sha256_file(weights)
    artifacts.write_manifest(damaged / "engine", manifest)
    res = _run(damaged, cpu_build.parent / f"{cpu_build.name}-baseline", tmp_path / "run")
    assert res.verdict == stats.FAIL, res.means["kld"]
    assert res.means["kld"]["mean_kld"]["value"] > fp8_kld.means["kld"]["mean_kld"]["value"]


@pytest.mark.triton
@pytest.mark.slow
def test_int4_awq_is_further_from_the_baseline_than_fp8(fp8_kld, cpu_build: Path, int4_awq, tmp_path: Path):
    """INT4 AWQ (block 64, as tunes/smollm2_cpu.yaml): the session's INT4 quantize stage (tests/conftest.py) built on
    into a CPU engine and a repository, gated against the FP8 build's baseline: a larger mean KLD than FP8's."""
    from pipeline.assemble import stage as build
    from pipeline.core import artifacts

    with artifacts.last_build_kept():
        built = build.run(int4_awq.recipe, int4_awq.root, recipe_dir=int4_awq.recipe_dir)
    assert built.quantize.cached  # the shared calibration, not a second one
    res = _run(int4_awq.root, cpu_build.parent / f"{cpu_build.name}-baseline", tmp_path / "int4")
    assert res.means["kld"]["mean_kld"]["value"] > fp8_kld.means["kld"]["mean_kld"]["value"]
    assert res.means["kld"]["limits"]["kld_max"] == 0.031046
