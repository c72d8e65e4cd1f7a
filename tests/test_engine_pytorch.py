"""The PyTorch LLM-API engine path (``build.engine: pytorch``): LLM() kwargs and the stage directory."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import yaml

from pipeline.core.artifacts import read_manifest
from pipeline.core.errors import StageError
from pipeline.core.layout import BuildLayout
from pipeline.engine import pytorch as pt
from pipeline.quantize.result import QuantizeResult
from pipeline.recipe import load_recipe
from pipeline.trtllm import llmapi

REPO = Path(__file__).resolve().parents[1]
RECIPE = REPO / "recipes" / "llama31_8b_h200_fp8_pytorch.yaml"


def quantized(tmp_path: Path, *, hf_config: dict | None = None) -> QuantizeResult:
    qdir = tmp_path / "quantize"
    (qdir / "hf_ckpt").mkdir(parents=True, exist_ok=True)
    if hf_config is not None:
        (qdir / "hf_ckpt" / "config.json").write_text(json.dumps(hf_config))
    return QuantizeResult(qdir, {"cache_key": "q-key", "stage": "quantize", "status": "built"})


HF_CONFIG = {"architectures": ["LlamaForCausalLM"], "num_hidden_layers": 32, "hidden_size": 4096,
             "num_attention_heads": 32, "num_key_value_heads": 8, "intermediate_size": 14336, "vocab_size": 128256,
             "max_position_embeddings": 131072}


def test_kwargs_use_llm_api_names_and_recipe_values(tmp_path):
    recipe = load_recipe(RECIPE)
    kw = llmapi.llm_api_kwargs(recipe, tmp_path / "hf_ckpt")
    assert llmapi.check_kwargs(kw) == []
    api = llmapi.llmapi_contract()
    assert set(kw) <= set(api["llm_args"])
    assert kw["model"] == kw["tokenizer"] == str(tmp_path / "hf_ckpt")
    assert kw["backend"] == "pytorch"
    b = recipe.build
    assert (kw["max_batch_size"], kw["max_num_tokens"], kw["max_seq_len"], kw["max_input_len"]) == (
        b.max_batch_size, b.max_num_tokens, b.max_seq_len, b.max_input_len)
    assert (kw["tensor_parallel_size"], kw["pipeline_parallel_size"]) == (recipe.target.tp_size, recipe.target.pp_size)
    kv = kw["kv_cache_config"]
    assert kv["dtype"] == "fp8" and kv["free_gpu_memory_fraction"] == 0.95 and kv["enable_block_reuse"] is True
    assert kv["tokens_per_block"] == b.tokens_per_block
    assert kw["scheduler_config"] == {"capacity_scheduler_policy": "GUARANTEED_NO_EVICT", "context_chunking_policy": None}
    assert kw["scheduler_config"]["capacity_scheduler_policy"] in api["configs"]["scheduler_config"]["capacity_scheduler_policy"]["values"]
    assert kw["enable_chunked_prefill"] is True


def test_kv_dtype_auto_without_fp8_kv_and_unknown_keys_are_reported(tmp_path):
    recipe = load_recipe(RECIPE, ["quantization.kv_cache_dtype=none"])
    kw = llmapi.llm_api_kwargs(recipe, tmp_path)
    assert kw["kv_cache_config"]["dtype"] == "auto"
    bad = {**kw, "kv_cache_free_gpu_mem_fraction": 0.9, "kv_cache_config": {**kw["kv_cache_config"], "fraction": 1}}
    assert len(llmapi.kwargs_problems(bad)) == 2


def test_max_seq_len_resolved_from_checkpoint(tmp_path):
    recipe = load_recipe(RECIPE, ["build.max_seq_len=null"])
    q = quantized(tmp_path, hf_config={**HF_CONFIG, "max_position_embeddings": 4096 * 3})
    assert llmapi.llm_api_kwargs(recipe, q.path / "hf_ckpt")["max_seq_len"] == 12288


def test_run_writes_yaml_json_and_manifest(tmp_path):
    recipe = load_recipe(RECIPE)
    res = pt.run(recipe, BuildLayout(tmp_path), quantized=quantized(tmp_path, hf_config=HF_CONFIG))
    from_yaml = yaml.safe_load((res.path / pt.CONFIG_YAML).read_text())
    from_json = json.loads((res.path / pt.CONFIG_JSON).read_text())
    assert from_yaml == from_json == res.manifest["llm_api_kwargs"]
    m = read_manifest(res.path)
    assert m["engine_kind"] == "pytorch" and m["status"] == "built" and m["checkpoint"]["present"]
    assert Path(from_json["model"]) == (tmp_path / "quantize" / "hf_ckpt").resolve()
    assert m["frontend"] == "triton" and m["trtllm_serve"] is None and "ignored_knobs" not in m
    assert from_yaml["cuda_graph_config"]["enable_padding"] is True  # the published-numbers setting reaches LLM()
    assert pt.run(recipe, BuildLayout(tmp_path), quantized=quantized(tmp_path, hf_config=HF_CONFIG)).cached


def test_dry_run_without_checkpoint_and_refusal_without_it(tmp_path):
    recipe = load_recipe(RECIPE)
    res = pt.run(recipe, BuildLayout(tmp_path), quantized=quantized(tmp_path), dry_run=True)
    assert res.manifest["status"] == "dry_run" and not res.manifest["checkpoint"]["present"]
    with pytest.raises(StageError, match="no unified HF checkpoint"):
        pt.run(recipe, BuildLayout(tmp_path / "b2"), quantized=quantized(tmp_path))
