"""KV block reuse for prompts that share a prefix, in the CPU engine (TensorRT-LLM's ``kv_cache_config.enable_block_reuse``).

TensorRT-LLM keeps the KV blocks of finished context phases in its paged pool, keyed by their tokens (and LoRA task),
and a new request whose prompt starts with the same full blocks points at them instead of recomputing them; what is
reported: ``KvCacheStats`` ``reusedBlocks``, ``missedBlocks``, ``cacheHitRate = reusedBlocks / (reusedBlocks +
missedBlocks)`` (iteration stats) and per request ``RequestPerfMetrics::KvCacheMetrics`` ``numReusedBlocks``,
``numMissedBlocks``, ``kvCacheHitRate`` (``cpp/include/tensorrt_llm/executor/types.h@a98a9061d72f6fd39f5d055ebdd2c6878a100e2c``,
``struct KvCacheStats`` and ``struct RequestPerfMetrics``); OpenAI responses carry the reused tokens as
``usage.prompt_tokens_details.cached_tokens`` (trtllm-serve ``UsageInfo``, reference speculative-and-config-search.md
§1.3).

The CPU engine's cache is one contiguous slot per request, so reuse here copies: :class:`PrefixCache` keeps a store of
``tokens_per_block``-token K/V blocks (every layer) keyed by the exact token prefix they end (plus the request's LoRA
adapter), filled from a request's slot once its prompt is prefilled (at the next admission while it runs, or when it
leaves its slot). At admission the longest run of stored full blocks that a prompt starts with — leaving at least the
last prompt token to compute, whose logits give the first output token — is copied into the new slot and only the rest
is prefilled (the chunked-prefill path over the slot). The store is LRU: when full, the least recently used block goes
(a prompt's deeper blocks count as used before the blocks they extend, so a prefix's root goes last).
"""

from __future__ import annotations

import collections
from typing import Any

import torch

from pipeline.cpu_runtime.speculative import has_extras

#: the store holds this share of the KV cache's tokens (its own memory, reserved like the cache: pages become resident
#: only when written)
STORE_SHARE = 0.25


class PrefixCache:
    """Stored prompt-prefix K/V blocks and the reuse counters (scheduler thread only, except :meth:`request_metrics`).

    Args:
        cache: the engine's :class:`~pipeline.cpu_runtime.model.SlotKvCache` (per layer ``[slots, kv_heads, slot_len,
            head_dim]``).
        tokens_per_block: block size in tokens (``build.tokens_per_block`` / ``kv_cache_config.tokens_per_block``).
        max_blocks: blocks the store holds (default: :data:`STORE_SHARE` of the cache's tokens, at least one slot).

    Raises ``ValueError`` for ``tokens_per_block`` < 1 or ``max_blocks`` < 1.
    """

    def __init__(self, cache: Any, tokens_per_block: int, max_blocks: int | None = None):
        tpb = int(tokens_per_block)
        if tpb < 1:
            raise ValueError(f"tokens_per_block is {tokens_per_block}: must be >= 1")
        if max_blocks is None:
            max_blocks = max(int(STORE_SHARE * cache.slots * cache.slot_len), cache.slot_len) // tpb
        if max_blocks < 1:
            raise ValueError(f"the prefix store needs at least one block, got {max_blocks}")
        self.cache, self.tpb, self.max_blocks = cache, tpb, int(max_blocks)
        _, kvh, _, d = cache.k[0].shape
        shape = (self.max_blocks, kvh, tpb, d)
        self.k = [torch.empty(shape, dtype=cache.dtype) for _ in cache.k]
        self.v = [torch.empty(shape, dtype=cache.dtype) for _ in cache.v]
        self.index: collections.OrderedDict[tuple, int] = collections.OrderedDict()  # key → block, LRU first
        self.free = list(range(self.max_blocks))
        self.saved: set[str] = set()  # requests whose prompt blocks were stored
        self.totals = {"reused_blocks": 0, "missed_blocks": 0, "cached_tokens": 0, "prompt_tokens": 0}
        self._per_request: collections.OrderedDict[str, tuple[int, int]] = collections.OrderedDict()

    def _keys(self, seq: Any) -> list[tuple]:
        """One key per full block of ``seq.prompt``: (the adapter's identity, every token up to the block's end)."""
        lora = id(seq.lora) if seq.lora is not None else None
        p = seq.prompt
        return [(lora, tuple(p[:(i + 1) * self.tpb])) for i in range(len(p) // self.tpb)]

    # ------------------------------------------------------------------ scheduler hooks
    def admit(self, seq: Any, active: list[Any]) -> int:
        """``seq`` just got KV slot ``seq.slot``: first store the prompts of running requests whose prefill is done,
        then copy the longest stored prefix of ``seq``'s prompt into its slot and set ``seq.prefilled``. Returns the
        reused tokens."""
        for s in active:
            if s is not seq and s.rid not in self.saved and s.prefilled == len(s.prompt):
                self.save(s)
        # a request that wants every prompt position's logits (return_context_logits) computes its whole prompt
        whole = seq.on_context_logits is not None or has_extras(seq)  # images / cross-attention: K/V not by tokens only
        keys = [] if whole else self._keys(seq)[:(len(seq.prompt) - 1) // self.tpb]
        hit: list[int] = []
        for key in keys:
            bid = self.index.get(key)
            if bid is None:
                break
            hit.append(bid)
        self._touch(keys[:len(hit)])
        n = len(hit) * self.tpb
        if hit:
            idx = torch.tensor(hit, dtype=torch.int64)
            for store, dst in ((self.k, self.cache.k), (self.v, self.cache.v)):
                for s_l, d_l in zip(store, dst):  # [blocks, kvh, tpb, d] → the slot's first n positions [kvh, n, d]
                    d_l[seq.slot, :, :n].copy_(s_l[idx].transpose(0, 1).reshape(d_l.shape[1], n, d_l.shape[3]))
        seq.prefilled = n
        blocks = -(-len(seq.prompt) // self.tpb)  # the prompt's blocks, the last one possibly partial
        t = self.totals
        t["reused_blocks"] += len(hit)
        t["missed_blocks"] += blocks - len(hit)
        t["cached_tokens"] += n
        t["prompt_tokens"] += len(seq.prompt)
        self._per_request[seq.rid] = (len(hit), blocks - len(hit))
        while len(self._per_request) > 4096:
            self._per_request.popitem(last=False)
        return n

    def save(self, seq: Any) -> None:
        """Store the full prompt blocks of ``seq`` (still in its slot, prompt prefilled) that the store lacks."""
        if seq.rid in self.saved or seq.slot is None or seq.prefilled < len(seq.prompt) or has_extras(seq):
            return
        self.saved.add(seq.rid)
        keys = self._keys(seq)
        for i, key in enumerate(keys):
            if key in self.index:
                continue
            if self.free:
                bid = self.free.pop()
            else:
                _, bid = self.index.popitem(last=False)  # evict the least recently used block
            lo, hi = i * self.tpb, (i + 1) * self.tpb
            for store, src in ((self.k, self.cache.k), (self.v, self.cache.v)):
                for s_l, c_l in zip(store, src):
                    s_l[bid].copy_(c_l[seq.slot, :, lo:hi])
            self.index[key] = bid
        self._touch(keys)

    def _touch(self, keys: list[tuple]) -> None:
        """Mark a prompt's blocks used, the first block last: a prefix's deeper blocks are evicted before the blocks
        they extend (a block is reachable only through every block before it)."""
        for key in reversed(keys):
            if key in self.index:
                self.index.move_to_end(key)

    def release(self, seq: Any) -> None:
        """``seq`` leaves its slot (finished or cancelled): store its prompt blocks if they are complete and new."""
        self.save(seq)
        self.saved.discard(seq.rid)

    # ------------------------------------------------------------------ reporting
    def kv_cache_stats(self) -> dict[str, Any]:
        """``KvCacheStats`` reuse fields since load: ``reusedBlocks``, ``missedBlocks``, ``cacheHitRate``; plus
        ``cachedTokens`` (reused prompt tokens) and ``cachedTokenShare`` (of all admitted prompt tokens)."""
        t = self.totals
        seen = t["reused_blocks"] + t["missed_blocks"]
        return {"reusedBlocks": t["reused_blocks"], "missedBlocks": t["missed_blocks"],
                "cacheHitRate": t["reused_blocks"] / seen if seen else 0.0, "cachedTokens": t["cached_tokens"],
                "cachedTokenShare": t["cached_tokens"] / t["prompt_tokens"] if t["prompt_tokens"] else 0.0}

    def request_metrics(self, rid: str) -> dict[str, Any]:
        """``KvCacheMetrics`` of engine request ``rid``: ``num_reused_blocks``, ``num_missed_blocks``,
        ``kv_cache_hit_rate`` (zeros for an unknown id) and ``cached_tokens`` (reused blocks × tokens per block)."""
        reused, missed = self._per_request.get(rid, (0, 0))
        return {"num_reused_blocks": reused, "num_missed_blocks": missed,
                "kv_cache_hit_rate": reused / (reused + missed) if reused + missed else 0.0,
                "cached_tokens": reused * self.tpb}


class NoReuse:
    """The engine's prefix hooks when block reuse is off: nothing is stored, reused or reported."""

    def admit(self, seq: Any, active: list[Any]) -> int:
        """Nothing reused: returns 0."""
        return 0

    def release(self, seq: Any) -> None:
        """Nothing stored."""

    def kv_cache_stats(self) -> dict[str, Any]:
        """No reuse fields: ``{}``."""
        return {}

    def request_metrics(self, rid: str) -> None:
        """No per-request reuse counters: ``None``."""


def prefix_cache(cache: Any, tokens_per_block: int | None) -> PrefixCache | NoReuse:
    """The engine's prefix hooks: a :class:`PrefixCache` of ``tokens_per_block``-token blocks over ``cache``, or
    :class:`NoReuse` when ``tokens_per_block`` is ``None`` (block reuse off). Raises ``ValueError`` as PrefixCache."""
    return NoReuse() if tokens_per_block is None else PrefixCache(cache, tokens_per_block)
