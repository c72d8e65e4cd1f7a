"""Incremental (streaming) detokenization that keeps spaces and multi-byte UTF-8 intact.

Decoding a stream token by token (``tokenizer.decode([t])`` per step) drops the leading space of
SentencePiece tokens and splits multi-byte characters (``é``, ``東``, ``🚀``) into U+FFFD
(tensorrtllm_backend issues #34, #112, #332). :class:`IncrementalDetokenizer` runs the Hugging Face
``tokenizers`` library's own streaming decoder (``tokenizers.decoders.DecodeStream``: the
prefix-offset / read-offset technique of vLLM and TGI, in Rust), which emits only text beyond what
was already emitted and holds text back while it ends in U+FFFD (an incomplete UTF-8 sequence);
this module adds the context ids and :meth:`IncrementalDetokenizer.flush` for what is held back when
a stream ends. The concatenation of the emitted pieces plus ``flush()`` equals
``tokenizer.decode(all_ids)``.

:class:`DetokenizerRegistry` keeps one detokenizer per stream for a stateless-looking caller (the
ensemble's ``postprocessing`` model, which sees every streamed step as a separate request).

Needs a :class:`tokenizer.Tokenizer` (``backend`` = a ``tokenizers.Tokenizer``). It is copied next to
each python model in a generated repository.
"""

from __future__ import annotations

import collections
import time
from collections.abc import Hashable, Sequence
from typing import Any, Callable

REPLACEMENT_CHAR = "\ufffd"
#: Emitted tokens decoded together with held-back ones by :meth:`IncrementalDetokenizer.flush`
#: (vLLM uses 5 too).
CONTEXT_WINDOW = 5


class IncrementalDetokenizer:
    """Turn a growing token-id sequence into text deltas.

    Args:
        tokenizer: a :class:`tokenizer.Tokenizer` (its ``backend`` and ``decode`` are used).
        skip_special_tokens: leave special tokens out of the text.
        context_ids: ids already known before the first :meth:`add` (e.g. the prompt); their text is
            never emitted but gives the first generated token its leading space (SentencePiece).
    """

    def __init__(self, tokenizer: Any, *, skip_special_tokens: bool = True, context_ids: Sequence[int] = ()):
        from tokenizers.decoders import DecodeStream

        self._tok = tokenizer
        self._skip = skip_special_tokens
        ctx = [int(t) for t in context_ids]
        self._stream = DecodeStream(ids=ctx or None, skip_special_tokens=skip_special_tokens)
        self._emitted: collections.deque[int] = collections.deque(ctx[-CONTEXT_WINDOW:], maxlen=CONTEXT_WINDOW)
        self._held: list[int] = []  # ids added since the last emitted piece

    def add(self, new_ids: Sequence[int]) -> str:
        """Append ``new_ids`` and return the newly stable text ('' while a character is incomplete)."""
        ids = [int(t) for t in new_ids]
        if not ids:
            return ""
        piece = self._stream.step(self._tok.backend, ids)
        self._held.extend(ids)
        if piece is None:
            return ""
        self._emitted.extend(self._held)
        self._held.clear()
        return piece

    @property
    def pending(self) -> bool:
        """Whether ids added since the last emitted piece are held back (an incomplete character)."""
        return bool(self._held)

    def flush(self) -> str:
        """Return whatever is still held back (possibly ending in U+FFFD) and mark it emitted."""
        if not self._held:
            return ""
        window = list(self._emitted)
        before = self._tok.decode(window, skip_special_tokens=self._skip)
        after = self._tok.decode(window + self._held, skip_special_tokens=self._skip)
        self._emitted.extend(self._held)
        self._held.clear()
        from tokenizers.decoders import DecodeStream

        self._stream = DecodeStream(ids=list(self._emitted) or None, skip_special_tokens=self._skip)
        return after[len(before):]


class DetokenizerRegistry:
    """One :class:`IncrementalDetokenizer` per stream key, evicted when idle or when full.

    Args:
        factory: builds a fresh detokenizer for a new key.
        max_streams: most live streams kept (least recently used is dropped first).
        idle_timeout_s: a stream untouched this long is dropped (its request has ended).
        clock: monotonic seconds (injectable for tests).
    """

    def __init__(
        self,
        factory: Callable[[], IncrementalDetokenizer],
        *,
        max_streams: int = 4096,
        idle_timeout_s: float = 300.0,
        clock: Callable[[], float] = time.monotonic,
    ):
        self._factory = factory
        self._max = max_streams
        self._ttl = idle_timeout_s
        self._clock = clock
        self._streams: collections.OrderedDict[Hashable, tuple[float, IncrementalDetokenizer]] = collections.OrderedDict()

    def __len__(self) -> int:
        return len(self._streams)

    def add(self, key: Hashable, new_ids: Sequence[int]) -> str:
        """Feed ``new_ids`` to the stream ``key`` (created on first use) and return its text delta."""
        now = self._clock()
        self._expire(now)
        entry = self._streams.pop(key, None)
        detok = entry[1] if entry else self._factory()
        text = detok.add(new_ids)
        self._streams[key] = (now, detok)
        while len(self._streams) > self._max:
            self._streams.popitem(last=False)
        return text

    def _expire(self, now: float) -> None:
        while self._streams:
            key, (last, _) = next(iter(self._streams.items()))
            if now - last <= self._ttl:
                break
            del self._streams[key]
