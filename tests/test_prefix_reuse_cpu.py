"""Prompt-prefix KV block reuse in the CPU engine (pipeline/cpu_runtime/prefix.py, ``kv_cache_config.enable_block_reuse``):
a prompt that starts with stored full blocks gets their K/V copied and prefills only the rest; greedy output is the
same as without reuse, on a real FP8 SmolLM2 engine directory; the LLM facade reports the reused blocks per request."""

from __future__ import annotations

import asyncio
import threading
from pathlib import Path

import pytest

from pipeline.cpu_runtime.engine import CpuEngine
from pipeline.recipe import load_recipe

REPO = Path(__file__).resolve().parents[1]
WAIT_S = 180
END_ID = 2
TPB = 16


@pytest.fixture(scope="module")
def prompts(engine_dir: Path) -> list[list[int]]:
    """Four chat prompts with one long shared system prompt (several blocks) and different questions."""
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(engine_dir, local_files_only=True)
    system = ("You are a careful assistant for a public library. Answer briefly and politely. The library opens at nine "
              "and closes at six on weekdays, opens at ten and closes at four on Saturdays, and is closed on Sundays. "
              "Members may borrow up to ten books for three weeks; renewals are possible twice unless reserved.")
    questions = ["When does the library open on Saturday?", "How many books can I borrow?",
                 "Is the library open on Sunday?", "Can I renew a book three times?"]
    chats = [tok.apply_chat_template([{"role": "system", "content": system}, {"role": "user", "content": q}],
                                     add_generation_prompt=True, tokenize=False) for q in questions]
    return [tok(c, add_special_tokens=False)["input_ids"] for c in chats]


def _run(engine: CpuEngine, prompts: list[list[int]], n: int) -> list[list[int]]:
    outs: list[list[int]] = [[] for _ in prompts]
    done = [threading.Event() for _ in prompts]
    for i, p in enumerate(prompts):
        def on_tokens(toks, fin, i=i):
            outs[i].extend(toks)
            if fin:
                done[i].set()
        engine.add_request(p, max_new_tokens=n, end_id=END_ID, on_tokens=on_tokens)
    for d in done:
        assert d.wait(WAIT_S)
    return outs


def test_shared_prefix_is_reused_and_outputs_are_unchanged(engine_dir: Path, prompts: list[list[int]]) -> None:
    shared = next(i for i, (a, b) in enumerate(zip(prompts[0], prompts[1])) if a != b)  # tokens all prompts share
    assert shared >= 3 * TPB
    with CpuEngine(engine_dir, num_threads=1) as plain:
        want_seq = [_run(plain, [p], 24)[0] for p in prompts]
        want_batch = _run(plain, prompts, 24)
        assert "reusedBlocks" not in plain.iteration_stats()["kvCacheStats"]
    with CpuEngine(engine_dir, num_threads=1, block_reuse=TPB) as reuse:
        got_seq = [_run(reuse, [p], 24)[0] for p in prompts]  # one after another: each finds the shared blocks stored
        first = reuse.iteration_stats()["kvCacheStats"]
        got_batch = _run(reuse, prompts, 24)  # all at once: they find what the sequential ones left
        st = reuse.iteration_stats()["kvCacheStats"]
    assert got_seq == want_seq and got_batch == want_batch
    # the 2nd-4th sequential requests reuse every full block of the shared prefix; the first reuses nothing
    assert first["reusedBlocks"] == 3 * (shared // TPB) and first["cachedTokens"] == first["reusedBlocks"] * TPB
    assert 0 < first["cacheHitRate"] < 1
    # the batch: each prompt was seen before, so all its full blocks but one token's worth are reused
    blocks = [(len(p) - 1) // TPB for p in prompts]
    assert st["reusedBlocks"] - first["reusedBlocks"] == sum(blocks)


def test_llm_facade_reports_reused_blocks_per_request(engine_dir: Path, prompts: list[list[int]]) -> None:
    from pipeline.cpu_runtime.llm import LLM, SamplingParams

    kwargs = {"model": str(engine_dir), "kv_cache_config": {"enable_block_reuse": True, "tokens_per_block": TPB}}

    async def one(llm, ids):
        res = llm.generate_async(ids, SamplingParams(max_tokens=8, return_perf_metrics=True))
        async for _ in res:
            pass
        return res.outputs[0].request_perf_metrics.kv_cache_metrics, res.cached_tokens

    with LLM(**kwargs) as llm:
        first, cached0 = asyncio.run(one(llm, prompts[0]))
        second, cached1 = asyncio.run(one(llm, prompts[1]))
    # what trtllm-serve's stand-in reports as usage.prompt_tokens_details.cached_tokens
    assert cached0 == 0 and cached1 == second.num_reused_blocks * TPB
    assert first.num_reused_blocks == 0 and first.num_missed_blocks == -(-len(prompts[0]) // TPB)
    assert second.num_reused_blocks > 0
    assert second.kv_cache_hit_rate == pytest.approx(
        second.num_reused_blocks / (second.num_reused_blocks + second.num_missed_blocks))


def test_the_engine_path_recipe_still_refuses_block_reuse_and_the_llmapi_one_takes_it() -> None:
    from pipeline.core.errors import RecipeError

    with pytest.raises(RecipeError, match="LLM-API path only"):
        load_recipe(REPO / "recipes" / "smollm2_135m_cpu_fp8.yaml", ["build.kv_cache_config.enable_block_reuse=true"])
    r = load_recipe(REPO / "recipes" / "smollm2_135m_cpu_llmapi.yaml", ["build.kv_cache_config.enable_block_reuse=true"])
    assert r.build.kv_cache_config.enable_block_reuse is True


def test_store_copies_blocks_exactly_and_evicts_the_least_recently_used() -> None:
    import types

    import torch

    from pipeline.cpu_runtime.prefix import PrefixCache

    tpb, L = 4, 2
    k = [torch.randn(2, 1, 16, 3) for _ in range(L)]  # [slots, kv_heads, slot_len, head_dim]
    v = [torch.randn(2, 1, 16, 3) for _ in range(L)]
    cache = types.SimpleNamespace(k=k, v=v, slots=2, slot_len=16, dtype=torch.float32)
    store = PrefixCache(cache, tpb, max_blocks=2)

    def seq(rid, prompt, slot, prefilled=None):
        return types.SimpleNamespace(rid=rid, prompt=prompt, slot=slot, lora=None, on_context_logits=None,
                                     prefilled=len(prompt) if prefilled is None else prefilled)

    a = seq("a", list(range(9)), 0)  # two full blocks (0-3, 4-7) + one token
    store.release(a)
    b = seq("b", [*range(8), 99, 98], 1, prefilled=0)  # starts with both blocks
    assert store.admit(b, []) == 8 and b.prefilled == 8
    for t, src in ((k, 0), (v, 0)):
        for layer in t:
            assert torch.equal(layer[1, :, :8], layer[src, :, :8])  # slot 1 got slot 0's first 8 positions, bit for bit
    c = seq("c", [50, 51, 52, 53, 54], 1)  # a third block: the store (2 blocks) drops its least recently used one
    store.release(c)
    d = seq("d", [*range(8), 7], 0, prefilled=0)
    assert store.admit(d, []) == 4  # the deeper block 4-7 went, the root block 0-3 it extends stayed
