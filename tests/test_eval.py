"""trtpipe eval: statistics and rules on synthetic data, scoring, the embedded task, the CLI's user
mistakes, and the real gate on the CPU default (FP8 SmolLM2 vs its full-precision baseline; a damaged
build must FAIL).

Expected numbers are computed by hand from the published sources, never from the implementation:
MLPerf llama3.1-8b reference ROUGE1 38.7792, ROUGE2 15.9075, ROUGEL 24.4957, ROUGELSUM 35.793,
GEN_LEN 8,167,644 characters (mlcommons/inference tools/submission/submission_checker/constants.py @
9e3d1054ec143c87c06a0a305f6eca4a37fe662e); TensorRT-LLM CnnDailymail alpha 0.002, beta 0.2, sigma 11.06,
n 512 (tests/integration/defs/accuracy/accuracy_core.py @ 3e906a0ed7c66ed4df90aa4856bf1a6c98ca7df6).
"""

from __future__ import annotations

import json
import shutil
import subprocess
from pathlib import Path

import numpy as np
import pytest
from support import EVAL_PROMPTS

from pipeline.eval import scores, stats, tasks
from pipeline.recipe import load_recipe
from pipeline.recipe.eval import EvalSpec

REPO = Path(__file__).resolve().parents[1]
pytestmark = pytest.mark.xdist_group("eval_baseline")  # shares the full-precision baseline build with test_eval_kld
CPU_RECIPE = REPO / "recipes" / "smollm2_135m_cpu_fp8.yaml"


# ---------------------------------------------------------------------- statistics and rules
def test_mlperf_thresholds_reproduce_the_published_llama31_8b_targets():
    ref = {"rouge1": 38.7792, "rouge2": 15.9075, "rougeL": 24.4957, "rougeLsum": 35.793, "gen_len": 8167644}
    band = stats.mlperf_thresholds(ref)
    # by hand: 38.7792 x 0.99 = 38.391408; 15.9075 x 0.99 = 15.748425; 24.4957 x 0.99 = 24.250743;
    # 35.793 x 0.99 = 35.43507; gen_len 0.9 / 1.1 x 8167644 = 7350879.6 / 8984408.4
    assert band["rouge1"][0] == pytest.approx(38.391408)
    assert band["rouge2"][0] == pytest.approx(15.748425)
    assert band["rougeL"][0] == pytest.approx(24.250743)
    assert band["rougeLsum"][0] == pytest.approx(35.43507)
    assert band["gen_len"] == (pytest.approx(7350879.6), pytest.approx(8984408.4))
    assert band["rouge1"][1] == float("inf")
    high = stats.mlperf_thresholds(ref, high=True)
    assert high["rouge1"][0] == pytest.approx(38.7404208)  # 38.7792 x 0.999
    assert stats.PUBLISHED["llama3.1-8b"]["gen_len"] == pytest.approx(8167644 / 13368)


def test_trtllm_threshold_and_theta_at_the_cnn_dailymail_design_point():
    # scale = sqrt(2 x 11.06^2 / 512) = 11.06 / 16 = 0.69125; z(0.002) = -2.8781617, z(0.2) = -0.8416212
    assert stats.trtllm_threshold(30.0, 512, sigma=11.06, alpha=0.002) == pytest.approx(30.0 - 2.8781617 * 0.69125, abs=1e-5)
    assert stats.trtllm_theta(512, sigma=11.06, alpha=0.002, beta=0.2) == pytest.approx((2.8781617 + 0.8416212) * 0.69125, abs=1e-5)


def test_trtllm_rule_fails_far_below_and_is_inconclusive_at_small_n():
    rng = np.random.default_rng(0)
    at_ref = 30 + rng.normal(0, 11.06, 30)
    at_ref = at_ref - at_ref.mean() + 30  # exactly the reference on average
    small = stats.trtllm(at_ref, 30.0, sigma=11.06, alpha=0.002, beta=0.2)
    assert small.verdict == stats.INCONCLUSIVE  # n=30 has theta 10.6 > 2.57 at n=512
    far = stats.trtllm(at_ref - 15, 30.0, sigma=11.06, alpha=0.002, beta=0.2)
    assert far.verdict == stats.FAIL
    big = 30 + rng.normal(0, 11.06, 600)
    assert stats.trtllm(big - big.mean() + 30, 30.0, sigma=11.06, alpha=0.002, beta=0.2).verdict == stats.PASS


def _paired(cand, base, **kw):
    opts = dict(ratio=0.99, alpha=0.002, beta=0.2, resamples=2000, seed=0) | kw
    return stats.paired({m: cand for m in stats.ROUGE_KEYS}, {m: base for m in stats.ROUGE_KEYS}, **opts)


def test_paired_identical_outputs_pass_and_a_clear_drop_fails():
    base = np.random.default_rng(1).uniform(20, 60, 40)
    assert _paired(base, base).verdict == stats.PASS
    res = _paired(base - 10, base)
    assert res.verdict == stats.FAIL
    assert all(c.ci[1] < c.threshold for c in res.checks)


def test_paired_is_inconclusive_at_small_n_and_passes_at_large_n():
    rng = np.random.default_rng(2)
    base = rng.uniform(20, 60, 6)
    noisy = base + rng.normal(0, 5, 6)
    res = _paired(noisy, base)
    assert res.verdict == stats.INCONCLUSIVE
    rows = {p.metric: p for p in res.power}
    # the power row: SE = sd/sqrt(n) of the deltas; MDE = (z(0.998) + z(0.8)) x SE
    d = noisy - base
    se = d.std(ddof=1) / np.sqrt(6)
    assert rows["rouge1"].se == pytest.approx(se)
    assert rows["rouge1"].mde == pytest.approx((2.8781617 + 0.8416212) * se, rel=1e-6)
    assert rows["rouge1"].margin == pytest.approx(0.01 * base.mean())
    assert not rows["rouge1"].supported and rows["rouge1"].n_required > 6
    big = rng.uniform(20, 60, 3000)
    assert _paired(big + rng.normal(0, 0.2, 3000), big).verdict == stats.PASS


def test_a_pass_the_sample_size_cannot_support_is_inconclusive_never_pass():
    rng = np.random.default_rng(3)
    base = rng.uniform(30, 50, 12)
    cand = base + rng.normal(1.0, 3.0, 12)  # better on average: every CI lower bound may clear the margin...
    res = _paired(cand, base, alpha=0.2)
    if all(c.verdict == stats.PASS for c in res.checks):
        assert res.verdict == (stats.PASS if all(p.supported for p in res.power) else stats.INCONCLUSIVE)
    assert res.verdict != stats.FAIL


def test_bootstrap_ci_is_seeded_and_brackets_the_mean():
    x = np.random.default_rng(4).normal(5, 2, 50)
    a = stats.bootstrap_ci(x, alpha=0.025, resamples=2000, seed=7)
    assert a == stats.bootstrap_ci(x, alpha=0.025, resamples=2000, seed=7)
    assert a[0] < x.mean() < a[1]
    with pytest.raises(ValueError):
        stats.bootstrap_ci([1.0], alpha=0.05, resamples=100, seed=0)


def test_mlperf_rule_against_published_numbers():
    ref = {k: v for k, v in stats.PUBLISHED["llama3.1-8b"].items()}
    rng = np.random.default_rng(5)
    n = 8000  # rouge2 margin 0.159 at sd 3 needs n >= (3.72 x 3 / 0.159)^2 = 4,930
    ok = {m: rng.normal(ref[m], 3, n) for m in stats.ROUGE_KEYS} | {"gen_len": rng.normal(ref["gen_len"], 50, n)}
    assert stats.mlperf(ok, ref, alpha=0.002, beta=0.2, resamples=1000, seed=0).verdict == stats.PASS
    long = dict(ok, gen_len=rng.normal(ref["gen_len"] * 1.3, 50, n))  # 130 % of the reference length
    res = stats.mlperf(long, ref, alpha=0.002, beta=0.2, resamples=1000, seed=0)
    assert res.verdict == stats.FAIL and [c.metric for c in res.checks if c.verdict == stats.FAIL] == ["gen_len"]


# ---------------------------------------------------------------------- scoring
def test_rouge_scores_are_fmeasures_x100_with_stemming():
    assert scores.rouge("The cat sat.", "The cat sat.") == {k: pytest.approx(100.0) for k in stats.ROUGE_KEYS}
    assert scores.rouge("dogs bark", "the cat sat")["rouge1"] == 0.0
    # Porter stemming: "cats"/"cat" and "running"/"run" match
    assert scores.rouge("cats running", "cat run")["rouge1"] == pytest.approx(100.0)
    # unigram F1 of "a b c" vs "a b d": P = R = 2/3
    assert scores.rouge("a b c", "a b d")["rouge1"] == pytest.approx(200 / 3)


def test_rougelsum_splits_sentences_offline():
    assert scores.sentences_per_line("Mr. Smith went to Washington. He said hi!") == \
        "Mr. Smith went to Washington.\nHe said hi!"
    # summary-level LCS over sentences differs from rougeL on the joined text when the order changes
    r = scores.rouge("He said hi. Mr. Smith went to Washington.", "Mr. Smith went to Washington. He said hi.")
    assert r["rougeLsum"] > r["rougeL"]


def test_agreement_scores_and_first_divergence():
    assert scores.first_divergence([1, 2, 3], [1, 2, 3]) is None
    assert scores.first_divergence([1, 2, 3], [1, 5, 3]) == 1
    assert scores.first_divergence([1, 2], [1, 2, 3]) == 2
    s = scores.sample_scores("abc", "abd", None)
    assert s["agreement"]["exact"] is False and s["agreement"]["first_divergent_token"] == 2
    assert s["candidate"] == {"gen_len": 3} and "rouge1" not in s["baseline"]


# ---------------------------------------------------------------------- spec and tasks
def test_eval_spec_bounds_and_recipe_default():
    assert load_recipe(CPU_RECIPE).eval == EvalSpec()
    for bad in ({"n": 0}, {"ratio": 1.5}, {"alpha": 0.7}, {"rule": "vibes"}, {"max_output_tokens": 0}, {"concurrency": 0}):
        with pytest.raises(ValueError):
            EvalSpec(**bad)


def test_embedded_task_ships_30_pairs_with_short_summaries_and_a_licence_note():
    samples = tasks.embedded()
    assert len(samples) == 30 and len({s.id for s in samples}) == 30
    for s in samples:
        assert 200 < len(s.article) < 3000
        assert 1 <= len(scores.sentences_per_line(s.reference).splitlines()) <= 3
    note = (REPO / "pipeline" / "eval" / "data" / "LICENSE-embedded.md").read_text()
    assert "PSF-2.0" in note and "Apache-2.0" in note
    picked = tasks.load(EvalSpec(n=7, seed=3))
    assert len(picked.samples) == 7 and picked.data_hash == tasks.load(EvalSpec(n=7, seed=3)).data_hash
    assert picked.data_hash != tasks.load(EvalSpec(n=7, seed=4)).data_hash


def test_jsonl_task_errors_are_one_line(tmp_path: Path):
    from pipeline.core.errors import UserError

    bad = tmp_path / "t.jsonl"
    bad.write_text('{"article": "x"}\n')
    with pytest.raises(UserError, match=r"t.jsonl:1: not a JSON object with `article` and `highlights`"):
        tasks.load(EvalSpec(task=str(bad)))
    with pytest.raises(UserError, match="expected embedded, agreement"):
        tasks.check("nope.txt", tmp_path)


def test_agreement_task_uses_calibration_passages_the_calibration_did_not_use(smollm2_tokenizer):
    from pipeline.quantize.calib import pack, split
    from pipeline.quantize.calib.sources import embedded_source

    cal_spec = load_recipe(CPU_RECIPE).quantization.calibration
    task = tasks.load(EvalSpec(task="agreement", n=10_000), calibration=cal_spec, tokenizer=smollm2_tokenizer)
    assert not task.labelled and all(s.reference is None for s in task.samples)
    samples = pack(embedded_source().records, smollm2_tokenizer, cal_spec.max_seq_length)
    cal, held = split(samples, cal_spec.size, cal_spec.eval_samples, cal_spec.seed)
    texts = [s.article for s in task.samples]
    assert texts[:len(held)] == [h.text for h in held]  # the quality report's held-out passages first
    rest = texts[len(held):]
    assert rest and not set(rest) & {c.text for c in cal} and len(set(rest)) == len(rest)


# ---------------------------------------------------------------------- CLI user mistakes
def _fake_build(root: Path) -> Path:
    (root / "triton_repo" / "ensemble").mkdir(parents=True)
    (root / "triton_repo" / "ensemble" / "config.pbtxt").write_text('name: "ensemble"\n')
    shutil.copy(CPU_RECIPE, root / "recipe.yaml")
    return root


@pytest.mark.parametrize("args, message", [
    (["--rule", "vibes"], "--rule"),
    (["--n", "0"], "--n"),
    (["--task", "missing.jsonl"], "--task"),
    (["--baseline", "nowhere"], "--baseline nowhere"),
    (["--reference", "gpt-5"], "--reference"),
])
def test_cli_user_mistakes_exit_2_with_one_line_and_write_nothing(tmp_path: Path, args: list[str], message: str):
    from tests.conftest import TRTPIPE

    build = _fake_build(tmp_path / "b")
    before = sorted(p for p in tmp_path.rglob("*"))
    res = subprocess.run([TRTPIPE, "eval", str(build), *args], cwd=tmp_path, capture_output=True, text=True, timeout=120)
    assert res.returncode == 2, res.stdout + res.stderr
    lines = [ln for ln in res.stderr.splitlines() if ln.strip()]
    assert len(lines) == 1 and message in lines[0], res.stderr
    assert sorted(p for p in tmp_path.rglob("*")) == before


# ---------------------------------------------------------------------- the real gate (CPU default)
EVAL_OPTS = EVAL_PROMPTS  # 4 prompts of <= 96 tokens, <= 16 output tokens: what tests/test_eval_kld.py asks too


@pytest.fixture(scope="module")
def fp8_eval(cpu_build: Path, tmp_path_factory: pytest.TempPathFactory):
    """FP8 SmolLM2 vs its full-precision baseline (built next to it by the stage) on the embedded task."""
    from pipeline.core.layout import BuildLayout
    from pipeline.eval import stage as stage

    recipe = load_recipe(cpu_build / "recipe.yaml")
    spec = EvalSpec(**EVAL_OPTS)
    out = tmp_path_factory.mktemp("eval") / "fp8"
    return stage.run(spec, stage.EvalTarget(layout=BuildLayout(cpu_build)), None, recipe=recipe,
                     recipe_dir=CPU_RECIPE.parent, out=out)


@pytest.mark.triton
def test_fp8_vs_full_precision_passes_or_is_inconclusive(fp8_eval, cpu_build: Path, smollm2_tokenizer):
    res = fp8_eval
    assert res.verdict in (stats.PASS, stats.INCONCLUSIVE), res.rule.reasons
    doc = json.loads((res.run_dir / "eval.json").read_text())
    assert doc["verdict"] == res.verdict and doc["n"] == 4 and doc["rule"]["power"]
    rows = [json.loads(x) for x in (res.run_dir / "samples.jsonl").read_text().splitlines()]
    assert len(rows) == 4 and all(r["candidate"] and r["baseline"] for r in rows)
    # greedy + real EOS, max_tokens = 16: each output is the streamed text once, at most 16 tokens (re-tokenized; a
    # streamed piece kept twice read "TheThe yieldyield ..."), not forced to a length
    for r in rows:
        for text in (r["candidate"], r["baseline"]):
            assert len(smollm2_tokenizer(text, add_special_tokens=False).input_ids) <= 16 + 1, text
    assert (cpu_build.parent / f"{cpu_build.name}-baseline" / "triton_repo").is_dir()
    assert not any(res.cached.values())


@pytest.mark.triton
def test_a_second_eval_reuses_the_cached_outputs(fp8_eval, cpu_build: Path, tmp_path: Path):
    from pipeline.core.layout import BuildLayout
    from pipeline.eval import stage as stage

    recipe = load_recipe(cpu_build / "recipe.yaml")
    again = stage.run(EvalSpec(**EVAL_OPTS), stage.EvalTarget(layout=BuildLayout(cpu_build)), None, recipe=recipe,
                      recipe_dir=CPU_RECIPE.parent, out=tmp_path / "again")
    assert again.cached == {"candidate": True, "baseline": True}
    assert again.verdict == fp8_eval.verdict and again.means == fp8_eval.means


@pytest.mark.triton
def test_a_damaged_build_fails(fp8_eval, cpu_build: Path, tmp_path: Path):
    """A copy of the FP8 build whose engine weights are scrambled: served for real, it must FAIL."""
    import torch
    from safetensors.torch import load_file, save_file

    from pipeline.core import artifacts
    from pipeline.core.layout import BuildLayout
    from pipeline.eval import stage as stage

    damaged = tmp_path / "damaged"
    shutil.copytree(cpu_build, damaged, ignore=shutil.ignore_patterns("*.log", "eval_outputs"))
    for cfg in (damaged / "triton_repo").glob("*/config.pbtxt"):  # point the copy's repository at the copy
        cfg.write_text(cfg.read_text().replace(str(cpu_build.resolve()), str(damaged.resolve())))
    weights = damaged / "engine" / "model.safetensors"
    tensors = load_file(weights)
    gen = torch.Generator().manual_seed(0)
    for name, t in tensors.items():
        if t.is_floating_point() and t.dim() == 2 and "embed" not in name:
            tensors[name] = t[torch.randperm(t.shape[0], generator=gen)]  # rows shuffled: the layers compute nonsense
    save_file(tensors, weights)
    # a build that produced bad weights (not a file damaged after the build, which serve refuses by its hash): the
    # engine's manifest records the scrambled file's sha256
    manifest = artifacts.read_manifest(damaged / "engine")
    manifest["files"]["model.safetensors"] = artifacts.sha256_file(weights)
    artifacts.write_manifest(damaged / "engine", manifest)
    baseline = cpu_build.parent / f"{cpu_build.name}-baseline"
    res = stage.run(EvalSpec(**EVAL_OPTS), stage.EvalTarget(layout=BuildLayout(damaged)),
                    stage.EvalTarget(layout=BuildLayout(baseline)), recipe=load_recipe(cpu_build / "recipe.yaml"),
                    recipe_dir=CPU_RECIPE.parent, out=tmp_path / "run")
    assert res.cached["baseline"] is True  # the baseline's outputs came from the first eval's cache
    assert res.verdict == stats.FAIL, (res.means, res.rule.reasons)
    assert res.means["candidate"]["rouge1"] < res.means["baseline"]["rouge1"]
