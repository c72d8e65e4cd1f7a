"""``trtpipe plan``: formulas on a toy geometry computed by hand, shipped recipes, refusals, CLI."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
from typer.testing import CliRunner

from pipeline.cli import app
from pipeline.core.geometry import ModelGeometry, geometry_from_config
from pipeline.plan import check_fits, plan_recipe
from pipeline.plan import memory as mem
from pipeline.plan.perf import Roofline, decode_flops_per_token, prefill_flops
from pipeline.recipe import load_recipe

REPO = Path(__file__).resolve().parents[1]
RECIPES = sorted((REPO / "recipes").glob("*.yaml"))
A100_LLAMA = REPO / "recipes" / "llama31_8b_a100_int8_sq.yaml"
A100_MISTRAL = REPO / "recipes" / "mistral_7b_a100_int8_sq.yaml"
H200 = REPO / "recipes" / "llama31_8b_h200_fp8.yaml"

# 2 layers, hidden 64, 4 heads × 16, 2 KV heads, MLP 128, vocab 100, untied lm_head.
# Linear params per layer: q 64·64 + k 64·32 + v 64·32 + o 64·64 + gate/up/down 3 · 64·128 = 36,864.
TOY = ModelGeometry(architecture="LlamaForCausalLM", num_hidden_layers=2, hidden_size=64, num_attention_heads=4,
                    num_key_value_heads=2, head_dim=16, intermediate_size=128, vocab_size=100, tie_word_embeddings=False)


# ------------------------------------------------------------------------------------------- formulas
def test_toy_parameter_count():
    assert TOY.layer_linear_params == 36_864
    # embed 6,400 + lm_head 6,400 + 2 × (36,864 + 2 norms × 64) + final norm 64
    assert TOY.num_parameters == 86_848


@pytest.mark.parametrize(
    ("qformat", "expected"),
    [
        # every param at 2 B: 2 × 86,848
        ("full_prec", 173_696),
        # Linear 73,728 × 1 B + 14 Linears × 8 B scales + embed 12,800 + lm_head 12,800 + norms 320 × 2
        ("fp8", 73_728 + 112 + 12_800 + 12_800 + 640),
        # scales per Linear out·4 + 4 + in·2: q 388, k 260, v 260, o 388, gate 644, up 644, down 516 = 3,100 per layer
        ("int8_sq", 73_728 + 2 * 3_100 + 26_240),
        # block 32: ceil(in/32)·out·2 + in·2: q 384, k 256, v 256, o 384, gate 640, up 640, down 768 = 3,328 per layer
        ("int4_awq", 36_864 + 2 * 3_328 + 26_240),
        # n/16 fp8 block scales + 8 B per Linear: 36,864/16 + 56 = 2,360 per layer
        ("nvfp4", 36_864 + 2 * 2_360 + 26_240),
    ],
)
def test_weight_bytes_by_hand(qformat, expected):
    w = mem.weight_bytes(TOY, qformat, 2, awq_block_size=32)
    assert w.total_bytes == expected
    assert w.per_gpu_bytes == expected


def test_weight_bytes_tied_and_parallel():
    tied = TOY.model_copy(update={"tie_word_embeddings": True})
    # the PyTorch backend shares a tied lm_head; a TensorRT engine holds its own copy
    assert mem.weight_bytes(tied, "full_prec", 2, lm_head_copy=False).total_bytes == 173_696 - 12_800
    assert mem.weight_bytes(tied, "full_prec", 2, lm_head_copy=True).total_bytes == 173_696
    # tp 2: Linear 73,728 B per layer / 2 + norms 256 → 37,120 × 2 layers + embed 12,800 (replicated)
    #       + lm_head 12,800 / 2 + final norm 128
    assert mem.weight_bytes(TOY, "full_prec", 2, tp_size=2).per_gpu_bytes == 74_240 + 12_800 + 6_400 + 128
    # pp 2: 1 layer per stage; first stage has the embedding, last the lm_head + final norm (same size here)
    assert mem.weight_bytes(TOY, "full_prec", 2, pp_size=2).per_gpu_bytes == 73_728 + 256 + 12_800 + 128


def test_kv_bytes_per_token():
    """The one KV-size rule (ModelGeometry.kv_bytes_per_token), used by the planner and the CPU engine alike."""
    assert TOY.kv_bytes_per_token(1) == 2 * 2 * 2 * 16 * 1 == 128
    assert TOY.kv_bytes_per_token(2) == 256
    assert TOY.kv_bytes_per_token(1, tp_size=2) == 64  # 1 KV head per rank
    assert TOY.kv_bytes_per_token(1, tp_size=4) == 64  # replicated when tp > kv heads
    assert TOY.kv_bytes_per_token(1, pp_size=2) == 64  # 1 layer per stage


def test_planner_and_cpu_engine_share_the_kv_rule():
    """The CPU engine's KV cache, its build stage and the planner's cpu target size K+V with the same rule."""
    import torch

    from pipeline.core.geometry import geometry_from_dict, known_geometry
    from pipeline.cpu_runtime.model import SlotKvCache
    from pipeline.engine.cpu import engine_config

    recipe = load_recipe(REPO / "recipes" / "smollm2_135m_cpu_fp8.yaml")
    cfg = known_geometry(recipe.model.source).hf_config()
    geo = geometry_from_dict(cfg)
    per_token = geo.kv_bytes_per_token(4)
    assert per_token == 2 * 30 * 3 * 64 * 4  # SmolLM2: 30 layers × K and V × 3 KV heads × 64 × float32
    assert SlotKvCache(geo, slots=2, slot_len=8, dtype=torch.float32).reserved_bytes == 2 * 8 * per_token
    assert engine_config(recipe, cfg)["kv_cache"]["bytes_per_token"] == per_token
    assert plan_recipe(recipe).memory.kv_token_bytes == per_token


def test_activation_bytes():
    # per token 4·64 + (4 + 2·2)·16 + 3·128 = 768 elements × 2 B × 10 tokens + logits 3 × 100 × 4 B
    assert mem.activation_bytes(TOY, max_num_tokens=10, max_batch_size=3) == 15_360 + 1_200
    assert mem.fixed_overhead_bytes(1) == 1 << 30
    assert mem.fixed_overhead_bytes(2) == (1 << 30) + (256 << 20)


def test_kv_capacity_and_sequences():
    # 10,000 B free × 0.5 = 5,000 B; blocks of 4 tokens × 128 B = 512 B → 9 blocks = 36 tokens
    assert mem.kv_capacity_tokens(10_000, 0.5, 128, 4) == (36, 36 * 128)
    assert mem.kv_capacity_tokens(10_000, 0.5, 128, 4, max_tokens=10) == (12, 12 * 128)  # ceil(10/4) blocks
    assert mem.kv_capacity_tokens(-5, 0.9, 128, 4) == (0, 0)
    assert mem.blocks_per_sequence(7, 4) == 2 and mem.blocks_per_sequence(8, 4) == 2 and mem.blocks_per_sequence(9, 4) == 3
    assert mem.max_sequences(36, 7, 4) == 4  # 9 blocks // 2


def test_flops():
    # matmul params 73,728 + lm_head 6,400 = 80,128
    assert decode_flops_per_token(TOY, 10) == 2 * 80_128 + 4 * 2 * 4 * 16 * 10
    assert prefill_flops(TOY, 8) == 2 * 80_128 * 8 + 2 * 2 * 4 * 16 * 64


def test_roofline_by_hand():
    r = Roofline(weight_bytes=1000, kv_token_bytes=10, bandwidth=1000, flops=100, flops_per_token=5,
                 avg_context=2, prefill_flops=50)
    assert r.step_time_s(1) == pytest.approx(1.02)  # (1000 + 1·2·10) / 1000 > 1·5/100
    assert r.bound(1) == "memory"
    assert r.crossover_batch() == pytest.approx(1 / 0.03)  # (1000/1000) / (5/100 − 2·10/1000)
    assert r.step_time_s(40) == pytest.approx(2.0) and r.bound(40) == "compute"
    assert r.decode_tokens_per_s(40) == pytest.approx(20.0)
    assert r.output_tokens_per_s(40, osl=10) == pytest.approx(10 / (10 * 2.0 / 40 + 0.5))
    assert r.prefill_time_s() == pytest.approx(1.0)  # max(50/100, 1000/1000)
    kv_heavy = r.model_copy(update={"avg_context": 10})  # 5/100 − 10·10/1000 < 0: never compute-bound
    assert kv_heavy.crossover_batch() is None
    assert r.model_copy(update={"pp_size": 2}).step_time_s(1) == pytest.approx(2.04)


# ------------------------------------------------------------------------------------------- recipes
@pytest.mark.parametrize("path", RECIPES, ids=lambda p: p.stem)
def test_shipped_recipes_plan_and_fit(path):
    recipe = load_recipe(path)
    plan = plan_recipe(recipe, recipe_dir=path.parent)
    assert plan.verdict.ok, plan.verdict.errors
    assert check_fits(recipe).ok
    assert [(s.isl, s.osl) for s in plan.scenarios] == [(s.isl, s.osl) for s in recipe.bench.scenarios]
    m = plan.memory
    assert 0 < m.weights.per_gpu_bytes < m.total_bytes and m.kv_tokens > 0 and m.full_sequences_at_max_seq_len >= 1
    for s in plan.scenarios:
        assert 1 <= s.max_concurrency <= recipe.build.max_batch_size
        if recipe.target.gpu != "cpu":
            assert s.peak_output_tokens_per_s > 0 and s.curve and s.saturation_batch <= s.max_concurrency
            tps = [p.output_tokens_per_s for p in s.curve]
            assert tps == sorted(tps)  # the bound never falls as concurrency grows


def test_published_sizing_on_a100_40gb():
    """Seeds' figures: Llama 3.1 8B INT8 ≈ 8 GB and Mistral 7B INT8 ≈ 7 GB of weights, 32–33 GB headroom."""
    llama = plan_recipe(load_recipe(A100_LLAMA), gpu="a100_40gb")
    mistral = plan_recipe(load_recipe(A100_MISTRAL), gpu="a100_40gb")
    # INT8 Linear + BF16 embedding and lm_head (2 × 0.525 B params for Llama's 128k vocab)
    assert llama.memory.weights.total_bytes / 1e9 == pytest.approx(9.09, abs=0.01)
    assert mistral.memory.weights.total_bytes / 1e9 == pytest.approx(7.52, abs=0.01)
    assert llama.memory.weights.linear_bytes == 32 * 218_103_808  # 6.98 GB: the "≈ 8 GB" minus the 16-bit vocab tensors
    headroom = [(p.memory.total_bytes - p.memory.weights.per_gpu_bytes) / 2**30 for p in (llama, mistral)]
    assert headroom == pytest.approx([31.54, 32.99], abs=0.01)
    assert llama.verdict.ok and mistral.verdict.ok


def test_impossible_recipe_is_refused_with_numbers():
    r = load_recipe(A100_LLAMA, ["target.gpu=l4", "quantization.qformat=full_prec", "quantization.kv_cache_dtype=none",
                                 "build.max_batch_size=16384", "build.max_num_tokens=16384"])
    v = check_fits(r)
    assert not v.ok
    assert any("exceed l4's 22.49 GiB" in e and "weights 14.96 GiB" in e for e in v.errors), v.errors


def test_kv_too_small_for_one_sequence_is_refused_unless_accepted():
    r = load_recipe(A100_LLAMA, ["target.gpu=l4", "quantization.qformat=full_prec", "quantization.kv_cache_dtype=none",
                                 "build.max_seq_len=65536", "build.max_batch_size=64"])
    v = check_fits(r)
    assert not v.ok and any("one build.max_seq_len sequence needs 65536" in e for e in v.errors), v.errors
    v = check_fits(r, allow_kv_oversubscription=True)
    assert v.ok and any("allow_kv_oversubscription" in w for w in v.warnings)


def test_max_tokens_beyond_capacity_is_refused():
    r = load_recipe(A100_LLAMA, ["build.kv_cache_config.max_tokens=5000000"])
    v = check_fits(r)
    assert not v.ok and any("max_tokens 5000000 exceeds the 1021728 tokens" in e for e in v.errors), v.errors


def test_qformat_the_gpu_cannot_run_is_refused():
    v = plan_recipe(load_recipe(H200), gpu="a100_80gb").verdict
    assert not v.ok and any("fp8 needs FP8 tensor cores" in e for e in v.errors)


def test_capacity_left_on_the_table_is_a_warning():
    small_frac = check_fits(load_recipe(H200, ["build.kv_cache_config.free_gpu_memory_fraction=0.3"]))
    assert small_frac.ok and any("free_gpu_memory_fraction 0.3 leaves" in w for w in small_frac.warnings)
    small_batch = check_fits(load_recipe(H200, ["build.max_batch_size=16"]))
    assert small_batch.ok and any("max_batch_size 16 caps concurrency" in w for w in small_batch.warnings)
    capped = check_fits(load_recipe(H200, ["build.kv_cache_config.max_tokens=100000"]))
    assert capped.ok and any("caps the KV cache at 100000 tokens" in w for w in capped.warnings)


def test_tensor_parallel_halves_weights_and_kv():
    one = plan_recipe(load_recipe(H200))
    two = plan_recipe(load_recipe(H200, ["target.num_gpus=2", "target.tp_size=2"]))
    assert two.memory.kv_token_bytes == one.memory.kv_token_bytes // 2
    # Linear and lm_head split; the embedding (0.98 GiB) stays whole on every rank
    assert two.memory.weights.per_gpu_bytes == pytest.approx(
        (one.memory.weights.per_gpu_bytes - one.memory.weights.embedding_bytes) / 2 + one.memory.weights.embedding_bytes, rel=1e-3)
    assert two.memory.kv_tokens > 2 * one.memory.kv_tokens * 0.99


def test_cpu_target_and_gpu_recipe_on_cpu_do_not_crash():
    cpu = plan_recipe(load_recipe(REPO / "recipes" / "smollm2_135m_cpu_fp8.yaml"))
    assert cpu.target == "host" and cpu.memory.kv_tokens == 36864 and cpu.memory.kv_limited_by == "max_tokens"
    assert cpu.scenarios[0].peak_output_tokens_per_s is None  # no throughput estimate on CPU
    # the CPU engine's KV cache is in build.cpu.dtype: SmolLM2's 30 layers × K and V × 3 KV heads × 64 × 4 / 2 bytes
    assert cpu.memory.kv_token_bytes == 30 * 2 * 3 * 64 * 4
    bf16 = plan_recipe(load_recipe(REPO / "recipes" / "smollm2_135m_cpu_fp8.yaml", ["build.cpu.dtype=bfloat16"]))
    assert bf16.memory.kv_token_bytes == 30 * 2 * 3 * 64 * 2
    big = plan_recipe(load_recipe(A100_LLAMA), gpu="cpu")  # 8B fp32 on this host: a verdict, not a crash
    assert big.target == "host" and isinstance(big.verdict.ok, bool)


def test_geometry_from_a_local_config_json(tmp_path):
    cfg = {"architectures": ["LlamaForCausalLM"], "num_hidden_layers": 2, "hidden_size": 64, "num_attention_heads": 4,
           "num_key_value_heads": 2, "head_dim": 16, "intermediate_size": 128, "vocab_size": 100,
           "max_position_embeddings": 256, "torch_dtype": "float32"}
    (tmp_path / "config.json").write_text(json.dumps(cfg))
    geo = geometry_from_config(tmp_path / "config.json")
    assert geo.num_parameters == TOY.num_parameters and geo.torch_dtype == "float32"
    r = load_recipe(A100_LLAMA, [f"model.source={tmp_path}", "model.dtype=auto", "build.max_input_len=128",
                                 "build.max_seq_len=256", "build.max_num_tokens=256",
                                 "bench.scenarios=[{isl: 100, osl: 100}]", "quantization.calibration.max_seq_length=128"])
    plan = plan_recipe(r)
    # fp32 checkpoint → float16 (quantize.py), lm_head copy in the engine
    assert plan.memory.weights.model_dtype_bytes == 2
    assert plan.memory.weights.total_bytes == 73_728 + 6_200 + 26_240  # int8_sq toy, awq-free scales as above


def test_unknown_scenario_lengths_are_user_errors():
    from pipeline.core.errors import UserError

    with pytest.raises(UserError, match="exceeds build.max_seq_len"):
        plan_recipe(load_recipe(A100_LLAMA), scenarios=[(4096, 8000)])
    with pytest.raises(UserError, match="not in the GPU catalog"):
        plan_recipe(load_recipe(A100_LLAMA), gpu="h300")


# ------------------------------------------------------------------------------------------- CLI
runner = CliRunner()


def test_cli_json_parses():
    res = runner.invoke(app, ["plan", str(H200), "--json", "--isl", "128", "--osl", "128"])
    assert res.exit_code == 0, res.output
    data = json.loads(res.stdout)
    assert data["target"] == "h200" and data["verdict"]["ok"] is True
    assert [(s["isl"], s["osl"]) for s in data["scenarios"]] == [(128, 128)]
    assert data["memory"]["kv_token_bytes"] == 65536


def test_cli_table_and_refusal_exit_codes():
    res = runner.invoke(app, ["plan", str(A100_LLAMA)])
    assert res.exit_code == 0 and "KV cache" in res.stdout and "fits" in res.stdout
    res = runner.invoke(app, ["plan", str(A100_LLAMA), "--gpu", "l4", "--set", "quantization.qformat=full_prec",
                              "--set", "build.max_batch_size=16384", "--set", "build.max_num_tokens=16384"])
    assert res.exit_code == 2 and "does not fit" in res.stdout


def test_cli_bad_gpu_is_one_line_exit_2():
    proc = subprocess.run([sys.executable, "-m", "pipeline.cli", "plan", str(A100_LLAMA), "--gpu", "h300"],
                          capture_output=True, text=True, timeout=120, cwd=REPO)
    assert proc.returncode == 2
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1 and "h300" in lines[0] and "Traceback" not in proc.stderr
