"""Per-request measurements: :class:`RequestRecord`.

A record holds what the client saw for one request, as ``time.perf_counter_ns()`` values
(CLOCK_MONOTONIC, ns) taken on receipt. During the run only two appends happen per response:
the receipt timestamp and the token count of that response. Text responses whose token count
the server did not return keep their raw bytes and are counted after the run
(:func:`count_text_tokens`), so no tokenizer runs inside the measured loop.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Iterable
from typing import Any


@dataclasses.dataclass(slots=True)
class RequestRecord:
    """One request: when it was sent, every response's receipt time and token count.

    Attributes:
        scenario: ``"ISL:OSL"`` label of the scenario.
        load: load-point label, e.g. ``"c8"`` (concurrency 8) or ``"r2.5"`` (2.5 requests/s).
        index: request number within its load point (warmup requests first).
        warmup: excluded from statistics when true.
        input_tokens: prompt length in tokens (exact ISL for synthetic prompts).
        requested_tokens: output tokens asked for (OSL).
        start_ns: ``perf_counter_ns`` just before the request was written to the stream.
        response_ns: receipt time of each response (ns), in order.
        response_tokens: tokens carried by each response; ``-1`` = not known yet (text).
        response_text: raw text bytes per response when its token count was not returned.
        end_ns: receipt time of the final response, or of the failure.
        error: ``None`` on success, else a one-line reason (timeout, server error, cancelled).
        server: server-reported perf timestamps when returned (ns since epoch), else ``None``.
    """

    scenario: str
    load: str
    index: int
    warmup: bool
    input_tokens: int
    requested_tokens: int
    start_ns: int = 0
    response_ns: list[int] = dataclasses.field(default_factory=list)
    response_tokens: list[int] = dataclasses.field(default_factory=list)
    response_text: list[bytes] | None = None
    end_ns: int | None = None
    error: str | None = None
    server: dict[str, int] | None = None

    @property
    def output_tokens(self) -> int:
        """Tokens actually returned (sum over responses; unknown counts as 0)."""
        return sum(t for t in self.response_tokens if t > 0)

    @property
    def ok(self) -> bool:
        """Finished without error and received at least one token."""
        return self.error is None and self.end_ns is not None and self.output_tokens > 0

    @property
    def short(self) -> bool:
        """Finished but returned fewer tokens than requested (OSL not met)."""
        return self.error is None and self.end_ns is not None and self.output_tokens < self.requested_tokens

    def token_times(self) -> list[tuple[int, int]]:
        """``(receipt ns, tokens)`` of the responses that carried tokens (empty ones dropped)."""
        return [(t, n) for t, n in zip(self.response_ns, self.response_tokens) if n > 0]

    def to_json(self, t0_ns: int) -> dict[str, Any]:
        """JSON-able dict with times relative to ``t0_ns`` (the run start), in ns."""
        return {
            "scenario": self.scenario,
            "load": self.load,
            "index": self.index,
            "warmup": self.warmup,
            "input_tokens": self.input_tokens,
            "requested_tokens": self.requested_tokens,
            "output_tokens": self.output_tokens,
            "short": self.short,
            "start_ns": self.start_ns - t0_ns,
            "end_ns": None if self.end_ns is None else self.end_ns - t0_ns,
            "response_ns": [t - t0_ns for t in self.response_ns],
            "response_tokens": list(self.response_tokens),
            "error": self.error,
            "server": self.server,
        }

    @classmethod
    def from_json(cls, d: dict[str, Any]) -> RequestRecord:
        """Inverse of :meth:`to_json` (times stay relative to the run start)."""
        return cls(
            scenario=d["scenario"],
            load=d["load"],
            index=d["index"],
            warmup=d["warmup"],
            input_tokens=d["input_tokens"],
            requested_tokens=d["requested_tokens"],
            start_ns=d["start_ns"],
            response_ns=list(d["response_ns"]),
            response_tokens=list(d["response_tokens"]),
            end_ns=d["end_ns"],
            error=d["error"],
            server=d.get("server"),
        )


def count_text_tokens(records: Iterable[RequestRecord], count: Callable[[str], int]) -> int:
    """Fill unknown (``-1``) token counts of text responses after the run; returns how many.

    Each response's text is counted on its own with ``count`` (e.g. ``len(tok.encode(t,
    add_special_tokens=False))``); the last response of a request absorbs the difference to the
    count of the whole concatenated text, so the request total equals re-tokenizing the full
    output (how genai-perf counts, benchmark-metrics.md §5.1 "Token counting").
    """
    filled = 0
    for r in records:
        if r.response_text is None or -1 not in r.response_tokens:
            continue
        texts = [b.decode("utf-8", errors="replace") for b in r.response_text]
        parts = [count(t) for t in texts]
        total = count("".join(texts))
        if parts:
            parts[-1] += total - sum(parts)
        r.response_tokens = [max(p, 0) for p in parts]
        r.response_text = None
        filled += 1
    return filled
