"""The quantize stage's TensorRT-LLM export keeps the source model's geometry (pipeline/trtllm/checkpoint.py).

Tiny random-initialised models are made offline from configs shaped like the GPU recipes' models —
Llama-3.1-8B (rope_theta 500000, llama3 RoPE scaling), Mistral-7B-v0.3 (rope_theta 1e6) and Qwen2.5
(qkv bias) — with the SmolLM2 tokenizer, then quantized FP8 and INT4 AWQ by the real stage. Under
transformers 5 ModelOpt drops ``rotary_base``/``rotary_scaling`` (they live in ``rope_parameters``); the
stage must fill them in and record the adjustment. CI also runs this module in the parity venv
(nvidia-modelopt 0.37 + transformers 4.57.3, TensorRT-LLM 1.2.1's pins), where the exporter writes them
itself: both version sets must end with the same checkpoint geometry.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import yaml

from pipeline.core.layout import BuildLayout
from pipeline.quantize import stage as quantize
from pipeline.recipe import load_recipe
from pipeline.trtllm.checkpoint import check_checkpoint_config, expected_values, hf_rope

LLAMA3_SCALING = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                  "original_max_position_embeddings": 8192}
TINY = dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
            vocab_size=49152, max_position_embeddings=16384, rms_norm_eps=1e-5)
MODELS = {
    # name: (config class, extra config, expected rotary_base, expected rotary_scaling)
    "llama31": ("LlamaConfig", {"rope_theta": 500000.0, "rope_scaling": LLAMA3_SCALING, "head_dim": 16}, 500000.0,
                {"type": "llama3", **{k: v for k, v in LLAMA3_SCALING.items() if k != "rope_type"}}),
    "mistral_v03": ("MistralConfig", {"rope_theta": 1000000.0, "sliding_window": None, "head_dim": 16}, 1000000.0, None),
    "qwen25": ("Qwen2Config", {"rope_theta": 1000000.0, "rms_norm_eps": 1e-6, "tie_word_embeddings": True}, 1000000.0, None),
}


@pytest.fixture(scope="module")
def tiny_models(tmp_path_factory, smollm2_dir) -> dict[str, Path]:
    """Each tiny model saved as a local HF checkpoint with SmolLM2's tokenizer files."""
    import torch
    import transformers

    root = tmp_path_factory.mktemp("tiny")
    out = {}
    for name, (cls, extra, _, _) in MODELS.items():
        torch.manual_seed(0)
        cfg = getattr(transformers, cls)(**{**TINY, **extra})
        model = transformers.AutoModelForCausalLM.from_config(cfg).to(torch.float32)
        path = root / name
        model.save_pretrained(path)
        for f in smollm2_dir.iterdir():
            if f.name.startswith(("tokenizer", "special_tokens", "vocab", "merges")):
                shutil.copy2(f, path / f.name)
        out[name] = path
    return out


def _recipe(tmp: Path, source: Path, qformat: str):
    data = {
        "model": {"source": str(source), "dtype": "float32"},
        "target": {"gpu": "cpu"},
        "quantization": {"qformat": qformat, "awq_block_size": 32, "kv_cache_dtype": "fp8",
                         "calibration": {"dataset": "embedded", "size": 4, "max_seq_length": 64, "batch_size": 4,
                                         "eval_samples": 2}},
        "build": {"engine": "cpu", "max_batch_size": 4, "max_input_len": 256, "max_seq_len": 512, "max_num_tokens": 512},
        "bench": {"scenarios": [{"isl": 16, "osl": 16}]},
    }
    path = tmp / f"{source.name}_{qformat}.yaml"
    path.write_text(yaml.safe_dump(data))
    return load_recipe(path)


@pytest.mark.parametrize("qformat", ["fp8", "int4_awq"])
@pytest.mark.parametrize("name", sorted(MODELS))
def test_export_carries_the_source_geometry(tiny_models, tmp_path, quant_one_thread, name: str, qformat: str):
    from importlib.metadata import version

    import transformers

    from pipeline.core.errors import StageError

    _, _, theta, scaling = MODELS[name]
    source = tiny_models[name]
    recipe = _recipe(tmp_path, source, qformat)
    if name == "qwen25" and version("nvidia-modelopt").startswith("0.37."):
        # ModelOpt 0.37 (TensorRT-LLM 1.2.1's pin) refuses a Qwen2 TensorRT-LLM checkpoint (its
        # tensorrt_llm_utils.py: "not supported by TensorRT-LLM yet ... deploy with the pytorch backend"). This
        # recipe's engine reads the unified HF checkpoint: the stage keeps it, writes no TensorRT-LLM checkpoint and
        # says why in its manifest; a tensorrt-engine recipe is refused in one line (pipeline/quantize/stage.py)
        res = quantize.run(recipe, BuildLayout(tmp_path / "b"), recipe_dir=tmp_path)
        assert "not supported by TensorRT-LLM" in res.manifest["trtllm_ckpt_skipped"], res.manifest
        assert not res.trtllm_ckpt.exists() and (res.hf_ckpt / "config.json").is_file()
        with pytest.raises(StageError, match="not supported by TensorRT-LLM"):
            # the same recipe on the engine path (a GPU target: tensorrt engines do not run on the CPU target)
            trt = recipe.model_copy(update={"build": recipe.build.model_copy(update={"engine": "tensorrt"}),
                                            "target": recipe.target.model_copy(update={"gpu": "h100_sxm"})})
            quantize.run(trt, BuildLayout(tmp_path / "t"), recipe_dir=tmp_path)
        return
    res = quantize.run(recipe, BuildLayout(tmp_path / "b"), recipe_dir=tmp_path)
    ckpt = json.loads((res.trtllm_ckpt / "config.json").read_text())
    assert ckpt["rotary_base"] == theta
    # TensorRT-LLM reads the scaling type from "type", else "rope_type" (see pipeline/data/trtllm_geometry.yaml):
    # ModelOpt 0.37 copies HF's rope_scaling (rope_type), trtpipe's fill writes type
    got = {("type" if k == "rope_type" else k): v for k, v in (ckpt.get("rotary_scaling") or {}).items()}
    assert (got or None) == scaling
    hf = json.loads((source / "config.json").read_text())
    # every field TensorRT-LLM takes from the HF config now agrees, re-checked from the files on disk
    report = check_checkpoint_config(dict(ckpt), hf, has_lm_head=None)
    assert report.problems == [] and report.adjustments == []
    assert {"rotary_base", "num_key_value_heads", "head_size", "norm_epsilon", "attn_bias"} <= set(report.checked)
    assert ckpt["num_key_value_heads"] == 2 and ckpt["head_size"] == 16
    if name == "qwen25":
        assert ckpt.get("attn_bias", True) is True and ckpt["qwen_type"] == "qwen2" and ckpt["norm_epsilon"] == pytest.approx(1e-6)
    adjusted = {a["key"] for a in res.manifest["adjustments"]}
    if int(transformers.__version__.split(".")[0]) >= 5:
        assert "rotary_base" in adjusted  # ModelOpt dropped it: rope_parameters (transformers 5)
        assert ("rotary_scaling" in adjusted) == (scaling is not None)
    assert set(res.manifest["geometry_checked"]) >= {"rotary_base", "rotary_scaling"}


def test_hf_rope_reads_both_transformers_majors():
    v4 = {"rope_theta": 500000.0, "rope_scaling": LLAMA3_SCALING}
    v5 = {"rope_parameters": {"rope_theta": 500000.0, **LLAMA3_SCALING}}
    assert hf_rope(v4) == hf_rope(v5) == (500000.0, MODELS["llama31"][3])
    assert hf_rope({"rope_parameters": {"rope_theta": 1e6, "rope_type": "default"}}) == (1e6, None)


def test_a_wrong_value_fails_and_a_dropped_one_is_filled():
    hf = {"architectures": ["LlamaForCausalLM"], **TINY, "hidden_act": "silu", "head_dim": 16,
          "rope_parameters": {"rope_theta": 500000.0, **LLAMA3_SCALING}}
    full = {k: v for k, v in expected_values(hf).items() if k != "tie_word_embeddings"}
    dropped = {k: v for k, v in full.items() if k not in ("rotary_base", "rotary_scaling", "num_key_value_heads")}
    report = check_checkpoint_config(dropped, hf)
    assert {a["key"] for a in report.adjustments} == {"rotary_base", "rotary_scaling", "num_key_value_heads"}
    assert report.problems == [] and dropped["rotary_base"] == 500000.0 and dropped["num_key_value_heads"] == 2
    wrong = {**full, "rotary_base": 10000.0, "hidden_act": "gelu"}
    report = check_checkpoint_config(wrong, hf)
    assert len(report.problems) == 2 and any(p.startswith("rotary_base: checkpoint has 10000.0") for p in report.problems)
    tied = check_checkpoint_config(dict(full), {**hf, "tie_word_embeddings": True}, has_lm_head=False)
    assert tied.problems and "tie_word_embeddings" in tied.problems[0]
