"""ModelOpt PTQ of a mixture-of-experts model, for real on CPU: a tiny random Qwen3-MoE-shaped model (2 layers, 4
experts, top-2, hidden 64, SmolLM2's tokenizer) through the quantize stage with FP8 weights/activations and an FP8 KV
cache. The unified HF checkpoint must keep the source's geometry (experts, active experts, expert width, heads) and
hold every routed expert's gate/up/down projection as its own FP8 tensor with a scale. ModelOpt 0.47 has no
TensorRT-LLM checkpoint export for Qwen3-MoE blocks (its MoE export takes llama/dbrx/phi3/deepseek/qwen decoders):
the stage skips that checkpoint, which only build.engine: tensorrt reads, and says why."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import yaml

from pipeline.core.geometry import geometry_from_config
from pipeline.core.layout import BuildLayout
from pipeline.quantize import stage as quantize
from pipeline.recipe import load_recipe

#: a real calibration + both exports on one thread: ~1 min (the refusal test runs a second one)
pytestmark = pytest.mark.slow

TINY_MOE = dict(hidden_size=64, intermediate_size=128, moe_intermediate_size=32, num_hidden_layers=2, num_attention_heads=4,
                num_key_value_heads=2, head_dim=16, num_experts=4, num_experts_per_tok=2, vocab_size=49152,
                max_position_embeddings=16384, rope_theta=1000000.0, rms_norm_eps=1e-6, decoder_sparse_step=1,
                mlp_only_layers=[], norm_topk_prob=True, tie_word_embeddings=False)


@pytest.fixture(scope="module")
def moe_fp8(tmp_path_factory, smollm2_dir, quant_one_thread):
    import torch
    import transformers

    root = tmp_path_factory.mktemp("moe")
    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(transformers.Qwen3MoeConfig(**TINY_MOE)).to(torch.float32)
    src = root / "tiny_qwen3_moe"
    model.save_pretrained(src)
    for f in smollm2_dir.iterdir():
        if f.name.startswith(("tokenizer", "special_tokens", "vocab", "merges")):
            shutil.copy2(f, src / f.name)
    recipe_file = root / "moe_fp8.yaml"
    recipe_file.write_text(yaml.safe_dump({
        "model": {"source": str(src), "dtype": "float32"},
        "target": {"gpu": "cpu"},
        "quantization": {"qformat": "fp8", "kv_cache_dtype": "fp8",
                         "calibration": {"dataset": "embedded", "size": 4, "max_seq_length": 64, "batch_size": 4,
                                         "eval_samples": 2}},
        "build": {"engine": "cpu", "max_batch_size": 4, "max_input_len": 256, "max_seq_len": 512, "max_num_tokens": 512},
        "bench": {"scenarios": [{"isl": 16, "osl": 16}]},
    }))
    res = quantize.run(load_recipe(recipe_file), BuildLayout(root / "build"), recipe_dir=root)
    return src, res


def _tensors(hf_dir: Path) -> dict:
    from safetensors import safe_open

    out = {}
    for f in sorted(hf_dir.glob("*.safetensors")):
        with safe_open(str(f), "pt") as st:
            out.update({k: st.get_tensor(k) for k in st.keys()})
    return out


def test_moe_export_keeps_the_expert_geometry(moe_fp8):
    src, res = moe_fp8
    assert res.manifest["status"] == "built"
    before, after = geometry_from_config(src / "config.json"), geometry_from_config(res.hf_ckpt / "config.json")
    assert before.is_moe and (before.num_experts, before.num_experts_per_tok) == (4, 2)
    keys = ("architecture", "num_hidden_layers", "hidden_size", "num_attention_heads", "num_key_value_heads", "head_dim",
            "vocab_size", "num_experts", "num_experts_per_tok", "num_shared_experts", "moe_intermediate_size")
    assert {k: getattr(after, k) for k in keys} == {k: getattr(before, k) for k in keys}
    assert res.manifest["exported"] == {"quant_algo": "FP8", "kv_cache_quant_algo": "FP8"}
    assert "num_experts" in res.manifest["hf_geometry_checked"]  # the stage's own check of the HF export ran
    if res.manifest["trtllm_ckpt_skipped"]:
        assert "tensorrt" in res.manifest["trtllm_ckpt_skipped"] and not res.trtllm_ckpt.exists()
    else:  # a ModelOpt that exports Qwen3-MoE to TensorRT-LLM: its checkpoint passed the geometry check
        assert res.manifest["geometry_checked"]


def test_moe_without_a_trtllm_export_is_refused_for_the_tensorrt_engine(moe_fp8, tmp_path):
    from pipeline.core.errors import StageError

    src, res = moe_fp8
    if not res.manifest["trtllm_ckpt_skipped"]:
        pytest.skip("this ModelOpt exports Qwen3-MoE to TensorRT-LLM")
    f = tmp_path / "trt.yaml"
    data = yaml.safe_load((res.path.parent.parent / "moe_fp8.yaml").read_text())
    data.update(target={"gpu": "h200"}, build={"engine": "tensorrt", "max_batch_size": 4, "max_input_len": 256,
                                               "max_seq_len": 512, "max_num_tokens": 512})
    f.write_text(yaml.safe_dump(data))
    with pytest.raises(StageError, match="TensorRT-LLM checkpoint failed"):
        quantize.run(load_recipe(f), BuildLayout(tmp_path / "b"), recipe_dir=tmp_path)


def test_every_expert_is_its_own_fp8_tensor(moe_fp8):
    import torch

    src, res = moe_fp8
    geo = geometry_from_config(src / "config.json")
    t = _tensors(res.hf_ckpt)
    for layer in range(geo.num_hidden_layers):
        for e in range(geo.num_experts):
            for name, fan_in, fan_out in geo.expert_linear_shapes:
                w = t[f"model.layers.{layer}.mlp.experts.{e}.{name}.weight"]
                assert w.dtype == torch.float8_e4m3fn and tuple(w.shape) == (fan_out, fan_in), (layer, e, name)
                scale = t[f"model.layers.{layer}.mlp.experts.{e}.{name}.weight_scale"]
                assert scale.numel() == 1 and float(scale) > 0
        router = t[f"model.layers.{layer}.mlp.gate.weight"]  # the router stays unquantized
        assert router.dtype != torch.float8_e4m3fn and tuple(router.shape) == (geo.num_experts, geo.hidden_size)
    quant = json.loads((res.hf_ckpt / "hf_quant_config.json").read_text())["quantization"]
    assert quant["quant_algo"] == "FP8" and quant["kv_cache_quant_algo"] == "FP8"
