"""Samples from records: packing to ``max_seq_length`` tokens, seeded calib/eval split, batching.

Consecutive records are packed (joined by a blank line) until a sample reaches
``max_seq_length`` tokens, so short paragraphs make coherent full-length samples and long
records (news articles) become one sample truncated to ``max_seq_length`` as TensorRT-LLM's
quantize.py does. The samples are then shuffled with ``random.Random(seed)``; the first
``eval_samples`` are held out for evaluation and the next ``size`` calibrate. A record belongs
to exactly one sample, so calibration and evaluation text never overlap.
"""

from __future__ import annotations

import dataclasses
import itertools
import random
from collections.abc import Iterable, Iterator
from typing import Any

SEPARATOR = "\n\n"
_CHUNK = 256  # records tokenized per tokenizer call


@dataclasses.dataclass(frozen=True)
class Sample:
    """One packed sample: its text and the half-open range of record indices it holds."""

    text: str
    records: tuple[int, int]


def pack(records: Iterable[str], tokenizer: Any, max_seq_length: int, limit: int | None = None) -> list[Sample]:
    """Pack consecutive records into samples of ≥ ``max_seq_length`` tokens (the last may be shorter).

    Args:
        records: text records in source order.
        tokenizer: a HF tokenizer (lengths are counted without special tokens).
        max_seq_length: target sample length in tokens.
        limit: stop after this many samples (for unbounded streams); ``None`` = all records.

    Returns:
        The samples in source order; a trailing partial sample is kept only if it is at least
        half of ``max_seq_length`` tokens.
    """
    out: list[Sample] = []
    parts: list[str] = []
    start = n_tok = 0
    it = iter(records)
    index = 0
    while limit is None or len(out) < limit:
        chunk = list(itertools.islice(it, _CHUNK))
        if not chunk:
            break
        lengths = [len(ids) for ids in tokenizer(chunk, add_special_tokens=False)["input_ids"]]
        for text, length in zip(chunk, lengths):
            if not parts:
                start = index
            parts.append(text)
            n_tok += length + (2 if len(parts) > 1 else 0)  # ~tokens of the separator
            index += 1
            if n_tok >= max_seq_length:
                out.append(Sample(SEPARATOR.join(parts), (start, index)))
                parts, n_tok = [], 0
                if limit is not None and len(out) >= limit:
                    break
    if parts and n_tok >= max_seq_length // 2 and (limit is None or len(out) < limit):
        out.append(Sample(SEPARATOR.join(parts), (start, index)))
    return out


def split(samples: list[Sample], size: int, eval_samples: int, seed: int) -> tuple[list[Sample], list[Sample]]:
    """Shuffle ``samples`` with ``random.Random(seed)`` and return ``(calib, eval)``.

    The first ``eval_samples`` after shuffling are held out (so the eval set does not change
    with ``size``); calibration gets up to ``size`` of the rest. Disjoint by construction.
    """
    order = list(samples)
    random.Random(seed).shuffle(order)
    held = order[:eval_samples]
    return order[eval_samples:eval_samples + size], held


def batches(tokenizer: Any, texts: list[str], max_seq_length: int, batch_size: int) -> Iterator[dict[str, Any]]:
    """Tokenize ``texts`` into batches of ``batch_size`` (last may be smaller).

    Each batch is ``{"input_ids": LongTensor[B, T], "attention_mask": LongTensor[B, T]}``,
    T ≤ ``max_seq_length``, right-padded with ``tokenizer.pad_token_id`` (falls back to eos).
    The attention mask is always present: SmolLM2's pad id equals its eos id (2), which also
    occurs in real text, so padding cannot be recovered from the ids.
    """
    pad_id = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id
    for i in range(0, len(texts), batch_size):
        enc = tokenizer(texts[i:i + batch_size], truncation=True, max_length=max_seq_length, padding=False)
        width = max(len(ids) for ids in enc["input_ids"])
        yield _pad(enc["input_ids"], width, pad_id)


def _pad(seqs: list[list[int]], width: int, pad_id: int) -> dict[str, Any]:
    import torch

    ids = torch.full((len(seqs), width), pad_id, dtype=torch.long)
    mask = torch.zeros((len(seqs), width), dtype=torch.long)
    for row, s in enumerate(seqs):
        ids[row, :len(s)] = torch.tensor(s, dtype=torch.long)
        mask[row, :len(s)] = 1
    return {"input_ids": ids, "attention_mask": mask}
