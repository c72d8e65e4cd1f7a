"""Incremental (streaming) detokenization that keeps spaces and multi-byte UTF-8 intact.

Decoding a stream token by token (``tokenizer.decode([t])`` per step) drops the leading space of
SentencePiece tokens and splits multi-byte characters (``é``, ``東``, ``🚀``) into U+FFFD
(tensorrtllm_backend issues #34, #112, #332). :class:`IncrementalDetokenizer` uses the
prefix-offset / read-offset technique (as in vLLM and TensorRT-LLM's LLM API): it decodes a short
window of already-emitted tokens plus the new ones, emits only the text beyond the window's own
decoding, and holds text back while it ends in U+FFFD (an incomplete UTF-8 sequence). The
concatenation of the emitted pieces plus :meth:`IncrementalDetokenizer.flush` equals
``tokenizer.decode(all_ids)``.

:class:`DetokenizerRegistry` keeps one detokenizer per stream for a stateless-looking caller (the
ensemble's ``postprocessing`` model, which sees every streamed step as a separate request).

Pure module: needs only an object with ``decode(ids, skip_special_tokens=..., clean_up_tokenization_spaces=...)``
(a transformers tokenizer). It is copied next to each python model in a generated repository.
"""

from __future__ import annotations

import collections
import time
from collections.abc import Hashable, Sequence
from typing import Any, Callable

REPLACEMENT_CHAR = "\ufffd"
#: Tokens of already-emitted text decoded together with new tokens (vLLM uses 5 too).
CONTEXT_WINDOW = 5


class IncrementalDetokenizer:
    """Turn a growing token-id sequence into text deltas.

    Args:
        tokenizer: a transformers tokenizer (only ``decode`` is used).
        skip_special_tokens: passed to ``decode``.
        context_ids: ids already known before the first :meth:`add` (e.g. the prompt); their text is
            never emitted but gives the first generated token its leading space (SentencePiece).
    """

    def __init__(self, tokenizer: Any, *, skip_special_tokens: bool = True, context_ids: Sequence[int] = ()):
        self._tok = tokenizer
        self._skip = skip_special_tokens
        self.ids: list[int] = [int(t) for t in context_ids]
        self._read = len(self.ids)  # ids before this index have been emitted (or are context)
        self._prefix = max(self._read - CONTEXT_WINDOW, 0)  # start of the decode window

    def _decode(self, ids: Sequence[int]) -> str:
        return self._tok.decode(list(ids), skip_special_tokens=self._skip, clean_up_tokenization_spaces=False)

    def add(self, new_ids: Sequence[int]) -> str:
        """Append ``new_ids`` and return the newly stable text ('' while a character is incomplete)."""
        self.ids.extend(int(t) for t in new_ids)
        prefix_text = self._decode(self.ids[self._prefix:self._read])
        full_text = self._decode(self.ids[self._prefix:])
        if len(full_text) <= len(prefix_text) or full_text.endswith(REPLACEMENT_CHAR):
            return ""
        delta = full_text[len(prefix_text):]
        self._prefix, self._read = self._read, len(self.ids)
        return delta

    def flush(self) -> str:
        """Return whatever is still held back (possibly ending in U+FFFD) and mark it emitted."""
        prefix_text = self._decode(self.ids[self._prefix:self._read])
        full_text = self._decode(self.ids[self._prefix:])
        self._prefix, self._read = self._read, len(self.ids)
        return full_text[len(prefix_text):]


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
