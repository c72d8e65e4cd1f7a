"""Streaming detokenization (triton_repo/detokenize.py) and the transformers-free tokenizer
(core/tokenizer.py) against the real SmolLM2 tokenizer and transformers' own."""

from __future__ import annotations

from pathlib import Path

import pytest

from pipeline.core.tokenizer import load_tokenizer
from pipeline.triton_repo.detokenize import DetokenizerRegistry, IncrementalDetokenizer

TEXT = "naïve café — 東京 🚀 and  two  spaces, Ünïcödé!"


@pytest.fixture(scope="module")
def tok_dir() -> Path:
    from support import smollm2_hf_dir

    return smollm2_hf_dir()


@pytest.fixture(scope="module")
def tokenizer(tok_dir):
    return load_tokenizer(str(tok_dir))


def test_tokenizer_matches_transformers(tokenizer, tok_dir):
    """The ``tokenizers``-only tokenizer of the python models encodes and decodes as transformers does."""
    from transformers import AutoTokenizer

    ref = AutoTokenizer.from_pretrained(tok_dir, local_files_only=True)
    texts = [TEXT, "<|im_start|>user\nSay hi.<|im_end|>\n<|im_start|>assistant\n", "  leading spaces\n\ttabs", "x" * 300]
    for text in texts:
        for special in (True, False):
            ids = tokenizer.encode(text, add_special_tokens=special)
            assert ids == ref.encode(text, add_special_tokens=special)
            for skip in (True, False):
                assert tokenizer.decode(ids, skip_special_tokens=skip) == ref.decode(
                    ids, skip_special_tokens=skip, clean_up_tokenization_spaces=False)
    assert (tokenizer.eos_token_id, tokenizer.pad_token_id) == (ref.eos_token_id, ref.pad_token_id) == (2, 2)


def full(tok, ids):
    return tok.decode(ids, skip_special_tokens=True, clean_up_tokenization_spaces=False)


def stream(tok, ids, step, **kw):
    d = IncrementalDetokenizer(tok, **kw)
    pieces = [d.add(ids[i:i + step]) for i in range(0, len(ids), step)]
    return pieces, d.flush()


def test_token_by_token_decoding_is_the_bug_we_fix(tokenizer):
    ids = tokenizer.encode(TEXT, add_special_tokens=False)
    naive = "".join(tokenizer.decode([i]) for i in ids)
    assert naive != TEXT and "\ufffd" in naive  # multi-byte characters split across tokens


@pytest.mark.parametrize("step", [1, 2, 3, 7])
def test_streamed_pieces_concatenate_to_full_decode(tokenizer, step):
    ids = tokenizer.encode(TEXT, add_special_tokens=False)
    pieces, rest = stream(tokenizer, ids, step)
    assert "".join(pieces) + rest == full(tokenizer, ids) == TEXT
    assert rest == ""
    assert not any("\ufffd" in p for p in pieces)
    assert " 東" in pieces or step > 1  # the leading space stays attached to the character


def test_context_ids_are_not_emitted_but_give_leading_space(tokenizer):
    prompt = tokenizer.encode("Say it:", add_special_tokens=False)
    answer = tokenizer.encode(" café 🚀 done", add_special_tokens=False)
    d = IncrementalDetokenizer(tokenizer, context_ids=prompt)
    out = "".join(d.add([t]) for t in answer) + d.flush()
    assert out == full(tokenizer, prompt + answer)[len(full(tokenizer, prompt)):] == " café 🚀 done"


def test_incomplete_character_is_held_back_then_flushed(tokenizer):
    ids = tokenizer.encode("🚀", add_special_tokens=False)
    assert len(ids) > 1
    d = IncrementalDetokenizer(tokenizer)
    assert d.add(ids[:-1]) == "" and d.pending
    assert d.add(ids[-1:]) == "🚀" and not d.pending
    d2 = IncrementalDetokenizer(tokenizer)
    d2.add(ids[:-1])
    assert d2.pending  # what the CPU tensorrt_llm model flushes into its final response
    assert d2.flush().endswith("\ufffd")  # cut mid-character: what a full decode would show
    assert not d2.pending


def test_special_tokens_skipped(tokenizer):
    ids = tokenizer.encode("<|im_start|>assistant\nHi there<|im_end|>", add_special_tokens=False)
    pieces, rest = stream(tokenizer, ids, 1)
    assert "".join(pieces) + rest == full(tokenizer, ids) == "assistant\nHi there"


def test_registry_keeps_streams_apart_and_expires_them(tokenizer):
    now = [0.0]
    reg = DetokenizerRegistry(lambda: IncrementalDetokenizer(tokenizer), max_streams=2, idle_timeout_s=10, clock=lambda: now[0])
    a = tokenizer.encode(" 東京 café", add_special_tokens=False)
    b = tokenizer.encode(" naïve 🚀", add_special_tokens=False)
    out = {"a": "", "b": ""}
    for i in range(max(len(a), len(b))):  # interleaved steps of two streams
        if i < len(a):
            out["a"] += reg.add("a", a[i:i + 1])
        if i < len(b):
            out["b"] += reg.add("b", b[i:i + 1])
    assert out == {"a": " 東京 café", "b": " naïve 🚀"}
    reg.add("c", a[:1])
    assert len(reg) == 2  # LRU bound
    now[0] = 100.0
    reg.add("d", b[:1])
    assert len(reg) == 1  # idle streams dropped
