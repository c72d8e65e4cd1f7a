"""The issue-#36 GPU recipes (EAGLE-3 speculative decoding, Qwen3-30B-A3B with expert parallelism, Llama-3.3-70B TP2,
Llama-3.3-70B NVFP4 on B200): they validate, plan and dry-run build, and what they generate carries their speculative,
MoE/EP, TP and NVFP4 settings and passes the upstream contract checks; bad speculative/EP/NVFP4 input is one line,
exit 2, nothing written; the LLM-API checker catches each kind of speculative/MoE defect."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from pipeline.assemble import stage as build_stage
from pipeline.core.errors import RecipeError
from pipeline.plan import planner
from pipeline.recipe import load_recipe
from pipeline.trtllm import contract, llmapi, triton_contract

REPO = Path(__file__).resolve().parents[1]
RECIPES = ("llama31_8b_h200_fp8_eagle3", "qwen3_30b_a3b_h200_fp8", "llama33_70b_h100_fp8_tp2", "llama33_70b_b200_nvfp4")
EAGLE = REPO / "recipes" / "llama31_8b_h200_fp8_eagle3.yaml"
QWEN = REPO / "recipes" / "qwen3_30b_a3b_h200_fp8.yaml"


def raw(name: str) -> dict:
    """The recipe file as written (expected values come from it, not from trtpipe's output)."""
    return yaml.safe_load((REPO / "recipes" / f"{name}.yaml").read_text())


@pytest.fixture(scope="module")
def built(tmp_path_factory) -> dict[str, Path]:
    out = {}
    for name in RECIPES:
        d = tmp_path_factory.mktemp(name)
        build_stage.run(load_recipe(REPO / "recipes" / f"{name}.yaml"), d, recipe_dir=REPO / "recipes", dry_run=True,
                        warn=lambda _m: None)
        out[name] = d
    return out


def model_yaml_kwargs(build: Path) -> dict:
    data = yaml.safe_load((build / "triton_repo" / "tensorrt_llm" / "1" / "model.yaml").read_text())
    data.pop("triton_config")
    return data


@pytest.mark.parametrize("name", RECIPES)
def test_recipe_plans_and_its_repository_passes_the_contract(built, name):
    recipe = load_recipe(REPO / "recipes" / f"{name}.yaml")
    plan = planner.plan_recipe(recipe)
    assert plan.memory.weights.per_gpu_bytes < plan.memory.total_bytes
    assert planner.check_fits(recipe).ok
    repo = built[name] / "triton_repo"
    impl = "llmapi" if recipe.build.engine == "pytorch" else "cpp"
    assert triton_contract.repository_problems(triton_contract.load_repository(repo), impl) == []
    if impl == "llmapi":  # the LLM() arguments the Triton llmapi model passes, held to the LLM-API contract
        kw = model_yaml_kwargs(built[name])
        assert llmapi.check_kwargs(kw) == []
        assert kw == json.loads((built[name] / "engine" / "llm_api_config.json").read_text())


def test_eagle3_recipe_carries_the_draft_config(built):
    want = raw("llama31_8b_h200_fp8_eagle3")["build"]["pytorch"]["speculative_config"]
    kw = model_yaml_kwargs(built["llama31_8b_h200_fp8_eagle3"])
    assert kw["speculative_config"] == want  # dry run: the HF id as written (a real build: the local snapshot)
    assert kw["speculative_config"]["decoding_type"] == "Eagle"  # 1.2.1's key (DecodingBaseConfig.from_dict)
    assert kw["return_perf_metrics"] is True


def test_moe_recipe_carries_ep_tp_and_moe_backend(built):
    r = raw("qwen3_30b_a3b_h200_fp8")
    kw = model_yaml_kwargs(built["qwen3_30b_a3b_h200_fp8"])
    assert kw["tensor_parallel_size"] == r["target"]["tp_size"] == 2
    assert kw["moe_expert_parallel_size"] == r["target"]["ep_size"] == 2
    assert kw["moe_config"] == {"backend": r["build"]["pytorch"]["moe_config"]["backend"]}
    assert "enable_attention_dp" not in kw  # false = upstream's default: not written


def test_tp2_engine_checkpoint_and_build_are_per_rank(built):
    d = built["llama33_70b_h100_fp8_tp2"]
    cfg = json.loads((d / "engine" / "checkpoint_config.json").read_text())
    assert cfg["mapping"] == {"world_size": 2, "tp_size": 2, "pp_size": 1}
    assert contract.checkpoint_config_problems(cfg, load_recipe(REPO / "recipes" / "llama33_70b_h100_fp8_tp2.yaml")) == []
    cmd = json.loads((d / "quantize" / "manifest.json").read_text())["command"]  # quantize_command.sh's argv
    assert cmd[cmd.index("--tp_size") + 1] == "2"
    assert json.loads((d / "engine" / "manifest.json").read_text())["world_size"] == 2


def test_nvfp4_recipe_quantizes_nvfp4(built):
    m = json.loads((built["llama33_70b_b200_nvfp4"] / "quantize" / "manifest.json").read_text())
    assert m["modelopt_config"] == "NVFP4_DEFAULT_CFG" and m["exported"]["quant_algo"] == "NVFP4"
    assert m["command"][m["command"].index("--qformat") + 1] == "nvfp4"


# ------------------------------------------------------------------ bad input: one line naming the field
def draft_dir(tmp_path: Path, **cfg) -> Path:
    d = tmp_path / "draft"
    d.mkdir()
    base = {"architectures": ["LlamaForCausalLMEagle3"], "num_hidden_layers": 1, "hidden_size": 4096,
            "num_attention_heads": 32, "num_key_value_heads": 8, "intermediate_size": 14336, "vocab_size": 128256}
    (d / "config.json").write_text(json.dumps({**base, **cfg}))
    return d


def moe_dir(tmp_path: Path, experts: int) -> Path:
    d = tmp_path / "moe"
    d.mkdir()
    (d / "config.json").write_text(json.dumps({
        "architectures": ["Qwen3MoeForCausalLM"], "num_hidden_layers": 2, "hidden_size": 64, "num_attention_heads": 4,
        "num_key_value_heads": 4, "head_dim": 16, "intermediate_size": 128, "moe_intermediate_size": 32,
        "num_experts": experts, "num_experts_per_tok": 2, "vocab_size": 1000, "max_position_embeddings": 16384}))
    return d


SPEC = "build.pytorch.speculative_config"


@pytest.mark.parametrize(("sets", "field", "words"), [
    (lambda t: [f"{SPEC}.speculative_model_dir={draft_dir(t, vocab_size=32000)}"], f"{SPEC}.speculative_model_dir",
     "draft vocabulary 32000"),
    (lambda t: [f"{SPEC}.speculative_model_dir={draft_dir(t, hidden_size=5120)}"], f"{SPEC}.speculative_model_dir",
     "hidden_size 5120"),
    (lambda t: [f"{SPEC}.speculative_model_dir={draft_dir(t, architectures=['LlamaForCausalLM'])}"],
     f"{SPEC}.speculative_model_dir", "not an EAGLE-3 head"),
    (lambda t: [f"{SPEC}={{decoding_type: MTP, num_nextn_predict_layers: 1}}"], f"{SPEC}.decoding_type", "MTP layers"),
    (lambda t: [f"{SPEC}.decoding_type=Eagle3"], f"{SPEC}.decoding_type", "Eagle3"),
    (lambda t: [f"{SPEC}={{decoding_type: NGram, max_draft_len: 3}}"], f"{SPEC}.max_matching_ngram_size", "missing"),  # the section tag (NGram) is not in the path
    (lambda t: ["target.ep_size=2"], "target.ep_size", "no experts"),
    (lambda t: ["target.gpu=h100_sxm"], "quantization.qformat", None),  # the eagle recipe is fp8: fine on H100
])
def test_bad_speculative_input_names_the_field(tmp_path, sets, field, words):
    overrides = sets(tmp_path)
    if words is None:
        load_recipe(EAGLE, overrides)
        return
    with pytest.raises(RecipeError) as e:
        load_recipe(EAGLE, overrides)
    msg = str(e.value)
    assert f" {field}:" in msg and words in msg and "\n" not in msg, msg


@pytest.mark.parametrize(("recipe", "sets", "words"), [
    (QWEN, ["target.ep_size=3"], "does not divide tp_size 2"),
    (QWEN, ["target.ep_size=4", "target.tp_size=4", "target.num_gpus=4"], "does not divide the model's 6 experts"),
    (REPO / "recipes" / "llama33_70b_h100_fp8_tp2.yaml", ["target.ep_size=2"], "use build.engine: pytorch"),
])
def test_bad_ep_size_names_the_field(tmp_path, recipe, sets, words):
    src = moe_dir(tmp_path, experts=6)
    with pytest.raises(RecipeError) as e:
        load_recipe(recipe, [f"model.source={src}", *sets])
    assert " target.ep_size:" in str(e.value) and words in str(e.value), str(e.value)


def test_moe_knobs_on_a_dense_model_and_attention_dp_on_one_gpu_are_refused():
    with pytest.raises(RecipeError, match=r" build\.pytorch\.moe_config: .*no experts"):
        load_recipe(EAGLE, ["build.pytorch.moe_config={backend: CUTLASS}"])
    with pytest.raises(RecipeError, match=r" build\.pytorch\.enable_attention_dp: .*tp_size > 1"):
        load_recipe(EAGLE, ["build.pytorch.enable_attention_dp=true"])
    kw = llmapi.llm_api_kwargs(load_recipe(QWEN, ["build.pytorch.enable_attention_dp=true"]), Path("/ckpt"))
    assert kw["enable_attention_dp"] is True and llmapi.check_kwargs(kw) == []


def test_cli_refuses_nvfp4_on_hopper_and_writes_nothing(tmp_path):
    out = tmp_path / "build"
    res = subprocess.run([sys.executable, "-m", "pipeline.cli", "build", str(REPO / "recipes" / "llama33_70b_b200_nvfp4.yaml"),
                          "--dry-run", "--out", str(out), "--set", "target.gpu=h200"],
                         cwd=tmp_path, capture_output=True, text=True, timeout=120)
    assert res.returncode == 2, res.stderr
    lines = [ln for ln in (res.stdout + res.stderr).splitlines() if ln.strip()]
    assert len(lines) == 1 and "quantization.qformat: nvfp4 needs a Blackwell GPU" in lines[0], lines
    assert not out.exists()


# ------------------------------------------------------------------ the LLM-API checker, one defect at a time
@pytest.mark.parametrize(("mutate", "expect"), [
    (lambda s: s.update(decoding_type="Eagle3"), "decoding_type is 'Eagle3': must be one of"),
    (lambda s: s.update(decoding_type="Medusa"), "decoding_type is 'Medusa'"),
    (lambda s: s.pop("speculative_model_dir"), "speculative_model_dir: Eagle needs it set"),
    (lambda s: s.update(max_draft_len=0), "max_draft_len is 0: Eagle needs it > 0"),
    (lambda s: s.update(speculative_model=s.pop("speculative_model_dir")), "speculative_model: Eagle speculative_config has no such field"),
    (lambda s: s.update(max_matching_ngram_size=2), "max_matching_ngram_size: Eagle speculative_config has no such field"),
    (lambda s: s.update(eagle3_one_model="yes"), "eagle3_one_model is 'yes': must be bool"),
])
def test_speculative_checker_catches_each_defect(mutate, expect):
    kw = llmapi.llm_api_kwargs(load_recipe(EAGLE), Path("/ckpt"))
    mutate(kw["speculative_config"])
    problems = llmapi.check_kwargs(kw)
    assert any(expect in p for p in problems), problems


def test_backend_support_and_moe_checks():
    kw = llmapi.llm_api_kwargs(load_recipe(QWEN), Path("/ckpt"))
    assert llmapi.check_kwargs(dict(kw, moe_config={"backend": "MARLIN"}))[0].startswith("moe_config.backend is 'MARLIN'")
    assert "moe_expert_parallel_size is '2'" in llmapi.check_kwargs(dict(kw, moe_expert_parallel_size="2"))[0]
    ngram = {"decoding_type": "NGram", "max_draft_len": 4, "max_matching_ngram_size": 2}
    assert llmapi.check_kwargs(dict(kw, speculative_config=ngram)) == []
    trt = llmapi.check_kwargs({"model": "/m", "speculative_config": ngram}, "tensorrt")
    assert trt == [next(p for p in trt if "NGram does not support the tensorrt backend" in p)]


# ------------------------------------------------------------------ bench: speculative-decoding counters when returned
def test_bench_reads_the_speculative_counters_and_summarizes_them():
    import numpy as np
    from tritonclient.grpc import service_pb2

    from pipeline.bench.metrics import summarize
    from pipeline.bench.records import RequestRecord, _perf_times

    def final(accepted: int, drafted: int, as_text: bool) -> service_pb2.ModelInferResponse:
        ir = service_pb2.ModelInferResponse()
        for name, v in (("total_accepted_draft_tokens", accepted), ("total_draft_tokens", drafted), ("last_token_time_ns", 7)):
            if as_text:  # the LLM-API model's STRING tensors: a 4-byte length, then the number as text
                ir.outputs.add(name=name, datatype="BYTES", shape=[1])
                ir.raw_output_contents.append(len(str(v)).to_bytes(4, "little") + str(v).encode())
            else:
                ir.outputs.add(name=name, datatype="INT64" if name.endswith("_ns") else "INT32", shape=[1])
                ir.raw_output_contents.append((np.int64 if name.endswith("_ns") else np.int32)(v).tobytes())
        return ir

    def record(i: int, osl: int, ir) -> RequestRecord:
        r = RequestRecord("16:11", "c1", i, False, 16, osl, start_ns=0, response_ns=[1_000_000 * (k + 1) for k in range(osl)],
                          response_tokens=[1] * osl, end_ns=1_000_000 * osl)
        r.server = _perf_times(ir)
        return r

    a, b = record(0, 11, final(6, 9, as_text=False)), record(1, 5, final(0, 6, as_text=True))
    assert a.server == {"total_accepted_draft_tokens": 6, "total_draft_tokens": 9, "last_token_time_ns": 7}
    assert b.server["total_accepted_draft_tokens"] == 0 and b.server["total_draft_tokens"] == 6
    spec = summarize([a, b]).speculative
    # 6 of 15 drafts accepted; 10 + 4 generated tokens in (10 - 6) + (4 - 0) = 8 generation steps
    assert spec == {"requests": 2, "accepted_draft_tokens": 6, "draft_tokens": 15, "acceptance_rate": 0.4,
                    "accepted_tokens_per_step": 1.75}
    plain = record(2, 5, service_pb2.ModelInferResponse())
    assert summarize([plain]).speculative is None and "speculative" not in summarize([plain]).to_json()


def test_a_speculative_change_keeps_numerics_but_a_new_target_does_not():
    """Greedy verification of the same target reproduces the target's greedy tokens (eval decodes greedily and the
    recipe exposes no relaxed acceptance), so tune runs no accuracy gate for adding EAGLE-3; a different target does."""
    from pipeline.tune.points import numerics_changed

    base = load_recipe(REPO / "recipes" / "llama31_8b_h200_fp8_pytorch.yaml")
    eagle = load_recipe(EAGLE)
    assert not numerics_changed(eagle, base)
    assert numerics_changed(load_recipe(EAGLE, ["quantization.qformat=full_prec", "quantization.kv_cache_dtype=none"]), base)


def test_moe_roofline_reads_only_the_experts_a_step_selects():
    from pipeline.plan.perf import Roofline

    moe = dict(weight_bytes=10e9, kv_token_bytes=0.0, bandwidth=1e12, flops=1e18, flops_per_token=1.0, avg_context=0.0,
               prefill_flops=0.0, expert_bytes=8e9, num_experts=128, experts_per_token=8)
    r = Roofline(**moe)
    assert r.step_time_s(1) == pytest.approx((2e9 + 8e9 * 8 / 128) / 1e12)  # one token: 8 of 128 experts
    assert r.step_time_s(2) == pytest.approx((2e9 + 8e9 * (1 - (120 / 128) ** 2)) / 1e12)
    assert r.step_time_s(4096) == pytest.approx(10e9 / 1e12, rel=1e-6)  # a large batch reads every expert
    assert Roofline(**{**moe, "num_experts": 0, "experts_per_token": 0}).step_time_s(1) == pytest.approx(10e9 / 1e12)
