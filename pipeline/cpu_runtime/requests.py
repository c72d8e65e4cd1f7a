"""One request inside the CPU engine: its checked arguments and its state between steps."""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from typing import Any, NamedTuple

TokensCallback = Callable[[list[int], bool], None]
ErrorCallback = Callable[[str], None]
ContextLogitsCallback = Callable[[Any], None]


class QueueFullError(RuntimeError):
    """A request refused because ``max_queue_size`` requests already wait for a KV slot (TensorRT-LLM's executor
    throws the same on its own queue limit); the message, meant for the client, starts as upstream's does."""


class Health(NamedTuple):
    """Whether an engine takes requests: ``ok``, and ``reason`` (``""`` when ok, else why not, one line)."""

    ok: bool
    reason: str


class SequenceState:
    """One request's state (owned by the scheduler thread except ``done``/``lock``)."""

    __slots__ = ("rid", "prompt", "max_new", "min_tokens", "end_id", "stop_words", "on_tokens", "on_error",
                 "slot", "prefilled", "generated", "done", "lock", "arrival", "matcher", "on_context_logits", "lora",
                 "mm", "cross")

    def __init__(self, rid, prompt, max_new, min_tokens, end_id, stop_words, on_tokens, on_error, matcher=None,
                 on_context_logits=None):
        self.rid, self.prompt, self.max_new = rid, prompt, max_new
        self.min_tokens, self.end_id, self.stop_words = min_tokens, end_id, stop_words
        self.on_tokens, self.on_error = on_tokens, on_error
        #: ``on_context_logits(float32 [n, vocab])`` per prefill chunk (every prompt position), or ``None``
        self.on_context_logits: ContextLogitsCallback | None = on_context_logits
        self.slot: int | None = None
        self.prefilled = 0  # prompt tokens whose K/V are in the cache
        self.generated: list[int] = []
        self.done = False  # no callback may run once set (under ``lock``)
        self.lock = threading.Lock()
        self.arrival = time.perf_counter()
        self.matcher = matcher  # xgrammar GrammarMatcher of a guided request (pipeline/cpu_runtime/guided.py), or None
        self.lora = None  # the LoRA adapter this sequence uses (pipeline.cpu_runtime.lora.Adapter), if any
        self.mm = None  # image embeddings + M-RoPE positions (pipeline.cpu_runtime.mrope.PromptMultimodal), if any
        self.cross = None  # mllama: (features, mask) until admission, then its CrossState (cross_attention.py)


def checked_request(c: dict[str, Any], chunked: bool, vocab_size: int, input_ids: list[int], max_new_tokens: int,
                    min_tokens: int, end_id: int | None, stop_words: list[list[int]] | None
                    ) -> tuple[list[int], int, int, list[list[int]]]:
    """``(ids, min_tokens, end_id, stop_words)`` of a request to an engine of config ``c`` (engine_config.json:
    ``max_input_len``, ``max_seq_len``, ``max_num_tokens`` in tokens). ``end_id`` ``None``/negative becomes -1
    (never stops) and then ``min_tokens`` 0; empty stop words are dropped.

    Raises ``ValueError`` (message meant for the client): see :meth:`pipeline.cpu_runtime.engine.CpuEngine.add_request`.
    """
    n = len(input_ids)
    if n == 0:
        raise ValueError("input_ids is empty: a prompt needs at least one token")
    if n > c["max_input_len"]:
        raise ValueError(f"prompt has {n} tokens, more than the engine's max_input_len {c['max_input_len']}")
    if max_new_tokens < 1:
        raise ValueError(f"request_output_len must be at least 1, got {max_new_tokens}")
    if min_tokens < 0:
        raise ValueError(f"min_tokens must be >= 0, got {min_tokens}")
    if n + max_new_tokens > c["max_seq_len"]:
        raise ValueError(
            f"prompt {n} + request_output_len {max_new_tokens} = {n + max_new_tokens} tokens exceeds the "
            f"engine's max_seq_len {c['max_seq_len']}"
        )
    if not chunked and n > c["max_num_tokens"]:
        raise ValueError(
            f"prompt has {n} tokens, more than max_num_tokens {c['max_num_tokens']} and chunked prefill is off"
        )
    ids = [int(t) for t in input_ids]
    if min(ids) < 0 or max(ids) >= vocab_size:
        raise ValueError(f"input_ids hold token ids outside [0, {vocab_size})")
    eid = -1 if end_id is None or end_id < 0 else int(end_id)
    words = [list(map(int, w)) for w in (stop_words or []) if len(w)]
    return ids, int(min_tokens) if eid >= 0 else 0, eid, words
