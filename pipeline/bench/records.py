"""Per-request measurements: :class:`RequestRecord`.

A record holds what the client saw for one request, as ``time.perf_counter_ns()`` values
(CLOCK_MONOTONIC, ns) taken on receipt. During the run only two appends happen per response:
the receipt timestamp and the token count of that response. Text responses whose token count
the server did not return keep their raw bytes and are counted after the run
(:func:`count_text_tokens`), so no tokenizer runs inside the measured loop. Servers that stream
the whole text so far in every response (TensorRT-LLM's LLM-API model) keep only the latest
text and each response's text length, so memory stays linear in the output length.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Iterable, Sequence
from typing import Any

import numpy as np

#: the error of a stream that stopped answering (``StreamClient(stall_s=…)``); ``trtpipe bench`` then stops the run
STALLED = "stalled"

#: Triton's python backend fails every request of a model whose stub process died (a crash, the OOM killer) with
#: ``Stub process '<model>_0_0' is not healthy.`` while the model stays READY (seen with the Triton 2.51 server of
#: ``nvidia-pytriton``, ``tests/test_engine_crash.py``); the watcher of ``trtpipe serve`` restarts such a server
DEAD_STUB = "Stub process"


def server_lost(error: str | None) -> str | None:
    """Why a request's error means the deployment is gone, or ``None`` for an error of this request alone.

    Args:
        error: :attr:`RequestRecord.error` (``None`` for a request that succeeded).

    Returns:
        ``"became unreachable"`` (gRPC/HTTP ``UNAVAILABLE``), ``"stopped answering"`` (no response within the
        stall timeout, :data:`STALLED`) or ``"lost its model process"`` (:data:`DEAD_STUB`); ``None`` otherwise.
    """
    if not error:
        return None
    if error.startswith("UNAVAILABLE"):
        return "became unreachable"
    if error.startswith(STALLED):
        return "stopped answering"
    if DEAD_STUB in error and "is not healthy" in error:
        return "lost its model process"
    return None


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
        text_len: cumulative text (LLM-API): byte length of the text so far at each response whose
            count is ``-1``, in order; ``None`` otherwise.
        text_last: cumulative text (LLM-API): the latest ``text_output`` tensor as received (a
            4-byte little-endian length, then the UTF-8 text); ``None`` otherwise.
        end_ns: receipt time of the final response, or of the failure.
        error: ``None`` on success, else a one-line reason (timeout, server error, cancelled).
        server: server-reported perf timestamps when returned (ns since epoch), else ``None``.
        server_tokens: output tokens as the server reported them besides ``output_ids``: the sum of the
            ``sequence_length`` of every streamed response (token interface; each is that response's token
            count, tensorrtllm_backend ``model_instance_state.cc@c2e65b88d852:1059-1099``), else ``None``.
            On the text interface the client count already is the server's (Σ ``num_output_tokens``).
        text_tokens: output tokens by re-tokenizing the returned text after the run (text
            interfaces with a tokenizer), else ``None``.
        images: images sent with the request (image workloads, :mod:`pipeline.bench.images`), else 0.
        image_tokens: tokens those images cost the model (mllama: encoder length; Qwen2-VL: spliced tokens), not
            part of ``input_tokens`` (the text ISL).
        cached_tokens: prompt tokens the server served from its KV cache (prefix reuse) as it reported them (OpenAI
            ``usage.prompt_tokens_details.cached_tokens``), else ``None``.
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
    text_len: list[int] | None = None
    text_last: bytes | None = None
    end_ns: int | None = None
    error: str | None = None
    server: dict[str, int] | None = None
    server_tokens: int | None = None
    text_tokens: int | None = None
    images: int = 0
    image_tokens: int = 0
    cached_tokens: int | None = None

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

    @property
    def osl_counts(self) -> dict[str, int]:
        """The output-token counts available for this request, by method: ``client`` (what the
        metrics use), ``server`` (:attr:`server_tokens`), ``retokenized`` (:attr:`text_tokens`)."""
        out = {"client": self.output_tokens}
        if self.server_tokens is not None:
            out["server"] = self.server_tokens
        if self.text_tokens is not None:
            out["retokenized"] = self.text_tokens
        return out

    @property
    def osl_mismatch(self) -> bool:
        """The available output-token counts disagree (finished requests only)."""
        return self.end_ns is not None and self.error is None and len(set(self.osl_counts.values())) > 1

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
            "server_tokens": self.server_tokens,
            "text_tokens": self.text_tokens,
        } | ({"images": self.images, "image_tokens": self.image_tokens} if self.images else {})

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
            server_tokens=d.get("server_tokens"),
            text_tokens=d.get("text_tokens"),
            images=d.get("images", 0),
            image_tokens=d.get("image_tokens", 0),
        )


def count_text_tokens(
    records: Iterable[RequestRecord],
    count: Callable[[str], int],
    token_ends: Callable[[str], Sequence[int]] | None = None,
) -> int:
    """Fill unknown (``-1``) token counts of text responses after the run; returns how many requests.

    Each response's text is counted on its own with ``count`` (e.g. ``len(tok.encode(t,
    add_special_tokens=False))``); the last response of a request absorbs the difference to the
    count of the whole concatenated text, so the request total equals re-tokenizing the full
    output (how genai-perf counts, docs/reference/benchmark-metrics.md §5.1 "Token counting").

    Cumulative text (``text_len``/``text_last`` set, see :func:`cumulative_counts`): the final
    text is tokenized once and each response gets the tokens that end inside the text it added;
    the total again equals re-tokenizing the full output. ``token_ends(text)`` (the end character
    offset of every token, from a fast tokenizer's offset mapping) makes this one tokenization per
    request; without it every distinct prefix is counted with ``count``.
    """
    filled = 0
    for r in records:
        if -1 not in r.response_tokens:
            if r.response_text is not None:  # counted by the server; re-tokenize to verify (osl_check)
                r.text_tokens = count(b"".join(r.response_text).decode("utf-8", errors="replace"))
            elif r.text_last is not None:  # cumulative text counted by the server: its final text, re-tokenized
                size = int.from_bytes(r.text_last[:4], "little")
                r.text_tokens = count(r.text_last[4:4 + size].decode("utf-8", errors="replace"))
            r.response_text = r.text_last = r.text_len = None
            continue
        if r.text_len is not None and r.text_last is not None:
            size = int.from_bytes(r.text_last[:4], "little")
            counts = iter(cumulative_counts(r.text_last[4:4 + size], r.text_len, count, token_ends))
            r.response_tokens = [next(counts, 0) if t == -1 else t for t in r.response_tokens]
        elif r.response_text is not None:
            texts = [b.decode("utf-8", errors="replace") for b in r.response_text]
            parts = [count(t) for t in texts]
            total = count("".join(texts))
            if parts:
                parts[-1] += total - sum(parts)
            r.response_tokens = [max(p, 0) for p in parts]
        else:
            continue
        r.text_tokens = sum(t for t in r.response_tokens if t > 0)
        r.response_text = r.text_last = r.text_len = None
        filled += 1
    return filled


def cumulative_counts(
    final: bytes,
    lengths: Sequence[int],
    count: Callable[[str], int],
    token_ends: Callable[[str], Sequence[int]] | None = None,
) -> list[int]:
    """Tokens added by each response of a stream whose responses carry the whole text so far.

    Args:
        final: the UTF-8 text of the last response (the full output).
        lengths: byte length of the text at each response, in order (non-decreasing for a
            well-behaved stream; a shorter length than before counts as no new tokens).
        count: tokens in a text (used only without ``token_ends``).
        token_ends: end character offset of every token of a text (offset mapping), or ``None``.

    Returns:
        One count per entry of ``lengths``: the tokens of ``final`` that end within that
        response's text but not within the previous one's; the last entry also gets every token
        not yet counted, so the sum is the token count of ``final``.
    """
    if not lengths:
        return []
    text = final.decode("utf-8", errors="replace")
    size = np.minimum(np.maximum.accumulate(np.asarray(lengths, dtype=np.int64)), len(final))
    if final.isascii():
        chars = size
    else:  # byte length of each prefix → characters fully inside it
        byte_end = np.cumsum([len(c.encode("utf-8")) for c in text])
        chars = np.searchsorted(byte_end, size, side="right")
    if token_ends is not None:
        ends = np.maximum.accumulate(np.asarray(token_ends(text), dtype=np.int64)) if text else np.zeros(0, np.int64)
        total = len(ends)
        cum = np.searchsorted(ends, chars, side="right")
    else:
        by_len = {int(c): count(text[: int(c)]) for c in np.unique(chars)}
        total = count(text)
        cum = np.maximum.accumulate(np.asarray([by_len[int(c)] for c in chars], dtype=np.int64))
    cum = np.minimum(cum, total)
    cum[-1] = total
    return np.diff(cum, prepend=0).tolist()


#: speculative-decoding counters a serving model returns with its perf metrics (C++ backend and LLM-API model:
#: pipeline/data/triton_backend_contract.yaml ``total_accepted_draft_tokens``/``total_draft_tokens``, TYPE_INT32 [1])
SPEC_COUNTERS = ("total_accepted_draft_tokens", "total_draft_tokens")


def _perf_times(ir: Any) -> dict[str, int]:
    """``*_time_ns`` outputs of the final response: INT64, or a number as text (the LLM-API model
    builds these tensors with ``text_output``'s STRING dtype); and, when the model returns them, the
    speculative-decoding counters :data:`SPEC_COUNTERS` (INT32, or a number as text)."""
    out = {}
    for i, o in enumerate(ir.outputs):
        if o.name in SPEC_COUNTERS and i < len(ir.raw_output_contents):
            raw = ir.raw_output_contents[i]
            try:
                out[o.name] = (int(float(raw[4:4 + int.from_bytes(raw[:4], "little")])) if o.datatype == "BYTES"
                               else int.from_bytes(raw[:4], "little", signed=True))
            except ValueError:
                pass
            continue
        if o.name.endswith("_time_ns") and i < len(ir.raw_output_contents):
            raw = ir.raw_output_contents[i]
            if o.datatype == "BYTES":
                try:
                    out[o.name] = int(float(raw[4:4 + int.from_bytes(raw[:4], "little")]))
                except ValueError:
                    continue
            else:
                out[o.name] = int.from_bytes(raw[:8], "little", signed=True)
    return out


def _fix_cumulative_counts(rec: RequestRecord) -> None:
    """Turn cumulative ``num_output_tokens`` into per-response counts (once per request).

    A server may report the running total instead of the tokens in each response. The sum of
    per-response counts can never exceed what was asked (``max_tokens``), so a strictly
    increasing series whose sum does proves running totals; it is differenced.
    """
    c = rec.response_tokens
    if len(c) >= 2 and -1 not in c and all(b > a for a, b in zip(c, c[1:])) and sum(c) > rec.requested_tokens >= c[-1]:
        rec.response_tokens = [c[0]] + [b - a for a, b in zip(c, c[1:])]

