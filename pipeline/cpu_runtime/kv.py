"""How big the CPU engine's KV cache is: the one rule, shared by the engine, its build stage and ``trtpipe plan``.

Pure Python (no torch, no pydantic): the planner imports it, and so does the engine inside the Triton stub.
"""

from __future__ import annotations


def kv_slots(*, max_batch_size: int, max_seq_len: int, bytes_per_token: int, available_bytes: int,
             max_tokens: int | None, free_memory_fraction: float) -> tuple[int, int]:
    """(slots, tokens): KV-cache slots of ``max_seq_len`` tokens and the tokens they hold.

    The CPU analogue of TensorRT-LLM's ``KvCacheConfig``: ``free_memory_fraction`` (the recipe's
    ``free_gpu_memory_fraction``) of the host memory available when the engine loads, after its
    weights (``available_bytes``), divided by the K+V bytes of one token, capped by ``max_tokens``
    when set (the smaller wins, as on a GPU). Each admitted request owns one slot, so slots =
    min(``max_batch_size``, tokens // ``max_seq_len``) and the cache holds slots × ``max_seq_len``
    tokens.

    Raises ``ValueError`` (one line) when not even one ``max_seq_len`` sequence fits.
    """
    by_ram = int(free_memory_fraction * max(available_bytes, 0)) // bytes_per_token
    tokens = by_ram if max_tokens is None else min(int(max_tokens), by_ram)
    slots = min(int(max_batch_size), tokens // int(max_seq_len))
    if slots < 1:
        raise ValueError(
            f"the KV cache holds {tokens} tokens (max_tokens {max_tokens}, {free_memory_fraction:g} × "
            f"{available_bytes / 2**30:.1f} GiB available RAM / {bytes_per_token} B per token): "
            f"less than one max_seq_len {max_seq_len} sequence"
        )
    return slots, slots * int(max_seq_len)
