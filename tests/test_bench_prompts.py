"""Exact-ISL prompt construction with the real SmolLM2 tokenizer, and dataset prompts."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest

from pipeline.bench.prompts import FALLBACK_ID_RANGE, dataset_prompts, load_tokenizer, text_prompts, token_prompts
from pipeline.errors import UserError

TMP_SMOLLM2 = Path("/tmp/smollm2_hf")


@pytest.fixture(scope="module")
def tokenizer():
    """SmolLM2's tokenizer: the converted checkpoint in /tmp if present, else the embedded one (cached)."""
    if (TMP_SMOLLM2 / "tokenizer.json").is_file():
        return load_tokenizer(TMP_SMOLLM2)
    from pipeline.sources import embedded_smollm2_dir

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
