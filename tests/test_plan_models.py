"""Known geometry of the larger and MoE models (issue 37, item 5) and what the planner does with it: parameter
counts against the model cards' published totals, MoE memory (all experts) vs decode traffic (routed experts),
and a plan of a 70B recipe that no longer stops at "geometry unknown"."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from pipeline.core.geometry import ModelGeometry, geometry_from_dict, known_geometry
from pipeline.plan import memory as mem
from pipeline.plan import plan_recipe
from pipeline.plan.step import expert_read_share
from pipeline.recipe import load_recipe

REPO = Path(__file__).resolve().parents[1]
H200 = REPO / "recipes" / "llama31_8b_h200_fp8.yaml"

# Published parameter totals (billions, as the model cards / hub pages round them) — independent of the config
# fields the table copies: Llama-3.3-70B "70.6B" and Llama-3.1-405B "406B" (hub safetensors parameter count),
# Qwen3-8B "8.2B", Qwen3-32B "32.8B", Qwen3-30B-A3B "30.5B in total and 3.3B activated" (Qwen model cards),
# Mixtral-8x7B "46.7B total parameters but only uses 12.9B parameters per token" (mistral.ai/news/mixtral-of-experts).
PUBLISHED = {
    "meta-llama/Llama-3.3-70B-Instruct": (70.6, 70.6),
    "meta-llama/Llama-3.1-405B-Instruct": (406, 406),
    "Qwen/Qwen3-8B": (8.2, 8.2),
    "Qwen/Qwen3-32B": (32.8, 32.8),
    "Qwen/Qwen3-30B-A3B": (30.5, 3.3),
    "mistralai/Mixtral-8x7B-Instruct-v0.1": (46.7, 12.9),
}


@pytest.mark.parametrize("source", sorted(PUBLISHED))
def test_known_geometry_matches_the_published_parameter_counts(source):
    geo = known_geometry(source)
    assert geo is not None, source
    assert geo.source.startswith("https://huggingface.co/")
    total, active = PUBLISHED[source]
    # the cards round (or truncate: Qwen's "3.3B activated" is 3.35 B) to 0.1 B, the 405B's page to 1 B
    tol = 0.5 if total > 100 else 0.1
    assert abs(geo.num_parameters / 1e9 - total) <= tol
    assert abs(geo.num_active_parameters / 1e9 - active) <= tol


# toy MoE: 1 layer, hidden 8, 2 heads × 4, 1 KV head, 4 experts of width 6, 2 per token, vocab 10
TOY_MOE = ModelGeometry(architecture="MixtralForCausalLM", num_hidden_layers=1, hidden_size=8, num_attention_heads=2,
                        num_key_value_heads=1, head_dim=4, intermediate_size=6, vocab_size=10, num_experts=4,
                        num_experts_per_tok=2)


def test_moe_params_by_hand():
    # attention q 8·8 + k 8·4 + v 8·4 + o 8·8 = 192; router 8·4 = 32; one expert 3 · 8·6 = 144
    assert TOY_MOE.layer_linear_params == 192 + 32 + 4 * 144
    assert TOY_MOE.layer_active_linear_params == 192 + 32 + 2 * 144
    assert TOY_MOE.layer_expert_params == 4 * 144
    assert TOY_MOE.active_mlp_width == 12


def test_moe_weight_memory_counts_every_expert():
    w = mem.weight_bytes(TOY_MOE, "full_prec", 2)
    # Linear 800 params × 2 B + embed and lm_head 2 × 80 × 2 B + norms 3 × 8 × 2 B
    assert w.total_bytes == 800 * 2 + 320 + 48
    assert w.expert_bytes == 4 * 144 * 2
    fp8 = mem.weight_bytes(TOY_MOE, "fp8", 2)
    # every expert's 3 Linears carry their own 8 B of fp8 scales
    assert fp8.expert_bytes == 4 * (144 + 3 * 8)


def test_expert_read_share():
    assert expert_read_share(0, 0, 100) == 0.0
    assert expert_read_share(128, 8, 1) == pytest.approx(8 / 128)
    # two tokens: 1 − (120/128)²
    assert expert_read_share(128, 8, 2) == pytest.approx(1 - (120 / 128) ** 2)
    assert expert_read_share(8, 2, 4096) == pytest.approx(1.0)


def test_moe_config_json_spellings():
    qwen = geometry_from_dict({"architectures": ["Qwen3MoeForCausalLM"], "num_hidden_layers": 2, "hidden_size": 8,
                               "num_attention_heads": 2, "intermediate_size": 32, "moe_intermediate_size": 6,
                               "num_experts": 4, "num_experts_per_tok": 2, "vocab_size": 10})
    mix = geometry_from_dict({"architectures": ["MixtralForCausalLM"], "num_hidden_layers": 2, "hidden_size": 8,
                              "num_attention_heads": 2, "intermediate_size": 6, "num_local_experts": 4,
                              "num_experts_per_tok": 2, "vocab_size": 10})
    assert qwen.expert_width == mix.expert_width == 6
    assert qwen.num_experts == mix.num_experts == 4
    dense = geometry_from_dict({"num_hidden_layers": 2, "hidden_size": 8, "num_attention_heads": 2,
                                "intermediate_size": 6, "vocab_size": 10})
    assert not dense.is_moe and "num_experts" not in dense.hf_config()


def _recipe(source: str, gpu: str, tp: int, extra: list[str] | None = None):
    return load_recipe(H200, [f"model.source={source}", f"target.gpu={gpu}", f"target.num_gpus={tp}",
                              f"target.tp_size={tp}", "build.max_input_len=2048", "build.max_seq_len=4096",
                              *(extra or [])])


def test_llama33_70b_plans_offline():
    plan = plan_recipe(_recipe("meta-llama/Llama-3.3-70B-Instruct", "h100_sxm", 2), scenarios=[(128, 128)])
    assert plan.verdict.ok, plan.verdict.errors
    # 70.6 B params: FP8 Linear ≈ 69.5 GB + 2 × 1.05 GB BF16 vocab tensors; over 2 GPUs ≈ 35–37 GB each
    assert 34e9 < plan.memory.weights.per_gpu_bytes < 38e9
    assert plan.scenarios[0].predicted is not None


def test_moe_decode_reads_routed_experts_memory_holds_all():
    """Mixtral-8x7B: 46.7 B parameters stored, but one client's decode step reads ~2 of 8 experts, so it is
    faster than a dense model of the same total size would be, and slower than one of the active size."""
    plan = plan_recipe(_recipe("mistralai/Mixtral-8x7B-Instruct-v0.1", "h200", 1), scenarios=[(128, 128)])
    assert plan.verdict.ok, plan.verdict.errors
    w = plan.memory.weights
    assert w.total_bytes > 45e9  # FP8: every expert stored
    cost = plan.step_cost
    assert cost.num_experts == 8 and cost.experts_per_token == 2
    assert cost.expert_weight_bytes > 3 * cost.weight_bytes
    # one client's step: the attention, router and lm_head + 2/8 of the experts
    from pipeline.plan.achievable import predict_point
    one = predict_point(cost, plan.scheduler, plan.efficiency, 128, 128, 1)
    bw = plan.efficiency.bw_frac * cost.bandwidth
    dense_all = (cost.weight_bytes + cost.expert_weight_bytes) / bw * 1e3
    active = (cost.weight_bytes + cost.expert_weight_bytes * 2 / 8) / bw * 1e3
    assert active < one.itl_ms < dense_all


# ------------------------------------------------------------------------------- tensor parallelism (item 3)
def test_interconnect_figures_are_sourced():
    from pipeline.core import hardware

    c = hardware.catalog()
    for key, g in c.items():
        assert g.interconnect_gbs is not None and g.sources.get("interconnect_gbs"), key
    # datasheets: H100/H200 SXM NVLink 900 GB/s, A100 SXM 600 GB/s, B200 1.8 TB/s, L40S PCIe Gen4 x16 64 GB/s
    assert c["h100_sxm"].link_bytes_per_s == 450e9 and c["h200"].link_bytes_per_s == 450e9
    assert c["a100_80gb"].link_bytes_per_s == 300e9 and c["b200"].link_bytes_per_s == 900e9
    assert c["l40s"].link_bytes_per_s == 32e9


def test_allreduce_bytes_by_hand():
    from pipeline.plan.step import allreduce_bytes_per_token

    assert allreduce_bytes_per_token(8192, 80, 1) == 0
    # Llama-3.3-70B tp 2: 80 layers × 2 all-reduces × 2·(1/2) × 8192 × 2 B
    assert allreduce_bytes_per_token(8192, 80, 2) == 80 * 2 * 8192 * 2
    # tp 8: 2·7/8 = 1.75 of the message per all-reduce
    assert allreduce_bytes_per_token(16384, 126, 8) == pytest.approx(126 * 2 * 1.75 * 16384 * 2)


def test_tensor_parallel_step_pays_its_measured_all_reduces():
    """The 70B with tp 4 on H100 SXM: each of the 160 all-reduces of a 256-token step (256 × 8192 × 2 B = 4 MiB =
    2 M elements, a tabulated size) takes the measured time of AIConfigurator's H100 tp-4 row; on a GPU without
    measurements (the same cost, table dropped) the ring bytes over the link at full bandwidth + the fallback
    latency, 14× the bytes' time on a 14× slower link; no all-reduce at tp 1."""
    from pipeline.plan.model_inputs import allreduce_table
    from pipeline.plan.step import FALLBACK_ALLREDUCE_LATENCY_US, StepMix, step_time

    plan = plan_recipe(_recipe("meta-llama/Llama-3.3-70B-Instruct", "h100_sxm", 4), scenarios=[(128, 128)])
    cost, eff = plan.step_cost, plan.efficiency
    assert cost.allreduces_per_step == 160 and cost.link_bandwidth == 450e9
    row = next(r for r in allreduce_table()["tables"]["h100_sxm"] if r[0] == 4 and r[1] == 256 * 8192)
    mix = StepMix(n_seqs=256, n_tokens=256, n_logits=256, kv_read_tokens=256 * 192)
    t = step_time(cost, eff, mix)
    assert t.comm_s == pytest.approx(160 * row[2] * 1e-6, rel=1e-12)
    bare = cost.model_copy(update={"allreduce_measured": ()})
    lat = 160 * FALLBACK_ALLREDUCE_LATENCY_US * 1e-6
    assert step_time(bare, eff, mix).comm_s == pytest.approx(256 * (80 * 2 * 1.5 * 8192 * 2) / 450e9 + lat)
    slow = step_time(bare.model_copy(update={"link_bandwidth": 32e9}), eff, mix)
    assert slow.comm_s - lat == pytest.approx((step_time(bare, eff, mix).comm_s - lat) * 450 / 32)
    one = plan_recipe(_recipe("meta-llama/Llama-3.1-8B-Instruct", "h100_sxm", 1), scenarios=[(128, 128)])
    assert one.step_cost.allreduces_per_step == 0
    assert step_time(one.step_cost, one.efficiency, mix).comm_s == 0


ALLREDUCE_SRC = re.compile(r"^ai-dynamo/aiconfigurator/aic-core/src/aiconfigurator_core/systems/data/(h100_sxm|h200_sxm)/comm/"
                           r"trtllm/1\.3\.0rc10/custom_allreduce_perf\.parquet@[0-9a-f]{40}:(\d+)$")


def test_allreduce_rows_are_cited():
    """Every measured all-reduce row cites owner/repo/path@commit:row, the commit the file's; per GPU the rows are the
    table's rows 1..69 in order (tp 2, 4, 8 × 23 sizes from 128 elements (decode) to 512 M elements (1 GiB))."""
    from pipeline.plan.model_inputs import allreduce_table

    doc = allreduce_table()
    assert set(doc["tables"]) == {"h100_sxm", "h200"}
    for gpu, rows in doc["tables"].items():
        assert [r[0] for r in rows] == [2] * 23 + [4] * 23 + [8] * 23
        for i, (tp, n, lat_us, src) in enumerate(rows, 1):
            m = ALLREDUCE_SRC.match(src)
            assert m, src
            assert m[1] == {"h100_sxm": "h100_sxm", "h200": "h200_sxm"}[gpu] and int(m[2]) == i
            assert f"@{doc['commit']}:" in src and lat_us > 0
        assert {r[1] for r in rows} == {128 * 2 ** k for k in range(23)}


def test_allreduce_interpolation_reproduces_the_table():
    """At a tabulated size the measured time itself (exactly); between sizes log-log interpolation (the geometric mean
    at the geometric-mean size); below the smallest its time; above the largest proportional to the bytes."""
    from pipeline.plan.model_inputs import allreduce_table, measured_allreduce
    from pipeline.plan.step import allreduce_time_s

    pts = measured_allreduce("h200", 8)
    for tp, n, lat_us, _ in allreduce_table()["tables"]["h200"]:
        if tp == 8:
            assert allreduce_time_s(pts, 2 * n) == lat_us * 1e-6
    (x0, t0), (x1, t1) = pts[10], pts[11]
    assert allreduce_time_s(pts, (x0 * x1) ** 0.5) == pytest.approx((t0 * t1) ** 0.5, rel=1e-12)
    assert allreduce_time_s(pts, 2.0) == pts[0][1]
    assert allreduce_time_s(pts, 2 * pts[-1][0]) == pytest.approx(2 * pts[-1][1])
    assert measured_allreduce("l40s", 2) == () and measured_allreduce("h100_sxm", 3) == ()


def test_tensor_parallel_per_gpu_memory():
    """tp 8 of the 405B: every Linear and the lm_head split 8 ways, the BF16 embedding (4.2 GB) whole on each GPU;
    KV heads 8 / tp 8 = 1 per GPU."""
    plan = plan_recipe(_recipe("meta-llama/Llama-3.1-405B-Instruct", "h100_sxm", 8), scenarios=[(128, 128)])
    w = plan.memory.weights
    assert w.embedding_bytes == 128256 * 16384 * 2
    assert w.per_gpu_bytes == pytest.approx((w.total_bytes - w.embedding_bytes) / 8 + w.embedding_bytes, rel=1e-3)
    assert plan.memory.kv_token_bytes == 2 * 126 * 1 * 128 * 1
