"""N-gram speculative decoding in the CPU engine (pipeline/cpu_runtime/speculative.py): the drafter's pool follows
``NGramPoolManager``'s rules (tensorrt_llm/_torch/speculative/ngram.py@02499765:86-143), and greedy output with
speculation is token-for-token the output without it, on a real FP8 SmolLM2 engine directory."""

from __future__ import annotations

import threading
from pathlib import Path

import pytest

from pipeline.cpu_runtime.engine import CpuEngine
from pipeline.cpu_runtime.speculative import NGramConfig, NGramPool
from pipeline.recipe import load_recipe

REPO = Path(__file__).resolve().parents[1]
WAIT_S = 180
END_ID = 2  # SmolLM2 <|im_end|>
NGRAM = {"decoding_type": "NGram", "max_draft_len": 5, "max_matching_ngram_size": 3}


def _pool(k: int, v: int, **kw) -> NGramPool:
    return NGramPool(NGramConfig(max_draft_len=v, max_matching_ngram_size=k, **kw))


def test_longest_suffix_pattern_wins_and_its_match_is_the_draft() -> None:
    # [1,2,3,1,2]: the suffix (1,2) was followed by 3,1,2 earlier; the 1-gram (2,) also matches, but 2-grams win
    assert _pool(2, 3).draft("r", [1, 2, 3, 1, 2], max_sequence_length=20) == [3, 1, 2]


def test_oldest_or_newest_match() -> None:
    # (1,) was followed by 7,1 and later by 8,1: two matches of equal length are both kept (is_keep_all)
    prefix = [1, 7, 1, 8, 1]
    assert _pool(1, 2).draft("a", prefix, 50) == [7, 1]
    assert _pool(1, 2, is_use_oldest=False).draft("a", prefix, 50) == [8, 1]


def test_draft_is_cut_to_the_tokens_left_and_none_at_the_end() -> None:
    # budget = max_sequence_length - 1 - len(prefix): 7 - 1 - 5 = 1 token; then none
    assert _pool(2, 3).draft("r", [1, 2, 3, 1, 2], max_sequence_length=7) == [3]
    assert _pool(2, 3).draft("r", [1, 2, 3, 1, 2], max_sequence_length=6) == []


def test_public_pool_shares_patterns_private_pool_does_not() -> None:
    pub, priv = _pool(2, 3), _pool(2, 3, is_public_pool=False)
    for p in (pub, priv):
        p.draft("a", [5, 6, 9, 9, 9], 50)  # request a teaches (5,6) → 9,9,9
    assert pub.draft("b", [4, 5, 6], 50) == [9, 9, 9]
    assert priv.draft("b", [4, 5, 6], 50) == []


def test_no_match_no_draft() -> None:
    assert _pool(3, 4).draft("r", [1, 2, 3, 4, 5], 50) == []


@pytest.mark.parametrize("spec, field", [
    ({"decoding_type": "Eagle", "max_draft_len": 3}, "decoding_type"),
    ({"decoding_type": "NGram", "max_draft_len": 3}, "max_matching_ngram_size"),
    ({"decoding_type": "NGram", "max_draft_len": 0, "max_matching_ngram_size": 2}, "max_draft_len"),
    ({**NGRAM, "draft_len_schedule": {1: 5}}, "draft_len_schedule"),
])
def test_config_refuses_what_it_cannot_run(spec: dict, field: str) -> None:
    with pytest.raises(ValueError, match=field):
        NGramConfig.from_dict(spec)


def test_cpu_recipe_takes_ngram_and_refuses_other_types() -> None:
    from pipeline.core.errors import RecipeError
    from pipeline.trtllm.llmapi import check_kwargs, llm_api_kwargs

    r = load_recipe(REPO / "recipes" / "smollm2_135m_cpu_ngram.yaml")
    kwargs = llm_api_kwargs(r, Path("/x"))
    assert kwargs["speculative_config"]["decoding_type"] == "NGram"
    assert check_kwargs(kwargs) == []
    with pytest.raises(RecipeError, match="NGram only"):
        load_recipe(REPO / "recipes" / "smollm2_135m_cpu_ngram.yaml",
                    ["build.pytorch.speculative_config={decoding_type: MTP}"])


# ---------------------------------------------------------------- the engine, for real
@pytest.fixture(scope="module")
def prompts(engine_dir: Path) -> list[list[int]]:
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(engine_dir, local_files_only=True)
    texts = [
        "Repeat this list exactly, one item per line: apple, banana, cherry, date, elderberry, fig, grape, honeydew.",
        "Rewrite this code with the variable renamed from x to count:\ndef f(x):\n    x = x + 1\n    return x * x\n",
        "Write a short poem about the sea.",
        "What is the capital of France? Explain in two sentences.",
    ]
    chats = [tok.apply_chat_template([{"role": "user", "content": t}], add_generation_prompt=True, tokenize=False)
             for t in texts]
    return [tok(c, add_special_tokens=False)["input_ids"] for c in chats]


def _run(engine: CpuEngine, prompts: list[list[int]], n: int, **kw) -> list[list[int]]:
    """Submit every prompt at once (they share steps: batch > 1) and return each one's streamed tokens."""
    outs: list[list[int]] = [[] for _ in prompts]
    done = [threading.Event() for _ in prompts]
    errors: list[str] = []
    for i, p in enumerate(prompts):
        def on_tokens(toks, fin, i=i):
            outs[i].extend(toks)
            if fin:
                done[i].set()
        engine.add_request(p, max_new_tokens=n, on_tokens=on_tokens, on_error=errors.append, **kw)
    for d in done:
        assert d.wait(WAIT_S), "request did not finish in time"
    assert not errors, errors
    return outs


def test_speculative_greedy_output_equals_plain_greedy(engine_dir: Path, prompts: list[list[int]]) -> None:
    with CpuEngine(engine_dir, num_threads=1) as plain:
        want_batch = _run(plain, prompts, 48, end_id=END_ID)
        want_one = [_run(plain, [p], 48, end_id=END_ID)[0] for p in prompts[:2]]
        want_min = _run(plain, prompts[:2], 40, end_id=END_ID, min_tokens=40)
        stop = [want_one[0][12:14]]  # a stop word the copy answer emits mid-way (inside an accepted draft run, likely)
        want_stop = _run(plain, prompts[:1], 48, end_id=END_ID, stop_words=stop)[0]
    with CpuEngine(engine_dir, num_threads=1, speculative_config=NGRAM) as spec:
        got_batch = _run(spec, prompts, 48, end_id=END_ID)
        got_one = [_run(spec, [p], 48, end_id=END_ID)[0] for p in prompts[:2]]
        got_min = _run(spec, prompts[:2], 40, end_id=END_ID, min_tokens=40)
        got_stop = _run(spec, prompts[:1], 48, end_id=END_ID, stop_words=stop)[0]
        st = spec.stats()["speculative"]
        it = spec.iteration_stats()["specDecodingStats"]
    assert got_batch == want_batch
    assert got_one == want_one
    assert got_min == want_min and all(len(t) == 40 for t in got_min)
    assert got_stop == want_stop and got_stop[-2:] == stop[0] and len(got_stop) < len(want_one[0])
    # the copy prompts draft and accept; each step that verified drafts emitted accepted + 1 tokens per request
    assert st["draft_tokens"] > 0 and 0 < st["accepted_draft_tokens"] <= st["draft_tokens"]
    assert st["acceptance_length"] == pytest.approx(
        (st["accepted_draft_tokens"] + st["requests_with_drafts"]) / st["requests_with_drafts"])
    assert set(it) == {"numDraftTokens", "numAcceptedTokens", "numRequestsWithDraftTokens", "acceptanceLength",
                       "iterLatencyMS", "draftOverhead"}


def test_fewer_forward_passes_on_a_copy_prompt_and_per_request_counters(engine_dir: Path, prompts: list[list[int]]) -> None:
    copy = prompts[0]
    with CpuEngine(engine_dir, num_threads=1) as plain:
        want = _run(plain, [copy], 64, end_id=None)[0]
        plain_passes = plain.stats()["forward_passes"]
    with CpuEngine(engine_dir, num_threads=1, speculative_config={**NGRAM, "is_public_pool": False}) as spec:
        rid_box: list[str] = []
        done = threading.Event()
        got: list[int] = []

        def on_tokens(toks, fin):
            got.extend(toks)
            if fin:
                done.set()
        rid_box.append(spec.add_request(copy, max_new_tokens=64, on_tokens=on_tokens))
        assert done.wait(WAIT_S)
        per = spec.speculation.request_metrics(rid_box[0])
        st = spec.stats()
    assert got == want and len(got) == 64
    assert st["forward_passes"] < plain_passes  # accepted drafts: several tokens per forward
    # one request only: its counters are the engine's totals
    assert per["total_draft_tokens"] == st["speculative"]["draft_tokens"]
    assert per["total_accepted_draft_tokens"] == st["speculative"]["accepted_draft_tokens"] > 0
    assert per["acceptance_rate"] == pytest.approx(per["total_accepted_draft_tokens"] / per["total_draft_tokens"])


def test_torch_kernels_verify_drafts_as_chunks_with_the_same_output(engine_dir: Path, prompts: list[list[int]],
                                                                     monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("TRTPIPE_CPU_KERNELS", "torch")  # the decoder's torch path: drafts go in as prefill chunks
    with CpuEngine(engine_dir, num_threads=1) as plain:
        assert plain.runtime["kernels"] == "torch"
        want = _run(plain, prompts[:2], 32, end_id=END_ID)
    with CpuEngine(engine_dir, num_threads=1, speculative_config=NGRAM) as spec:
        got = _run(spec, prompts[:2], 32, end_id=END_ID)
        accepted = spec.stats()["speculative"]["accepted_draft_tokens"]
    assert got == want and accepted > 0


def test_max_concurrency_turns_speculation_off_above_it() -> None:
    from pipeline.cpu_runtime.speculative import NGramSpeculator

    # Drafter.should_use_spec_decode: min(requests, max_batch_size, max_num_tokens // (1 + v)) <= max_concurrency
    on = NGramSpeculator(NGramConfig(max_draft_len=5, max_matching_ngram_size=3, max_concurrency=2),
                         max_batch_size=8, max_num_tokens=1024)._on
    assert on(1) and on(2) and not on(3)
    tight = NGramSpeculator(NGramConfig(max_draft_len=5, max_matching_ngram_size=3, max_concurrency=2),
                            max_batch_size=8, max_num_tokens=12)._on  # 12 // 6 = 2 requests' worth of tokens
    assert tight(7)
    assert NGramSpeculator(NGramConfig(max_draft_len=5, max_matching_ngram_size=3), max_batch_size=8,
                           max_num_tokens=1024)._on(8)
