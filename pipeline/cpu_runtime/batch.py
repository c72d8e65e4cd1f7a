"""One engine step's batch: which tokens of which sequences go into the next forward pass (in-flight batching)."""

from __future__ import annotations

import torch

from pipeline.cpu_runtime.model import StepBatch
from pipeline.cpu_runtime.requests import SequenceState


def build_step(active: list[SequenceState], max_num_tokens: int, chunked: bool
               ) -> tuple[StepBatch, list[SequenceState], list[tuple[SequenceState, int]]]:
    """The next step of the sequences in KV slots (``active``, slot order): one token for every decoding sequence,
    then prefill chunks of the admitted prompts, at most ``max_num_tokens`` tokens in all (a prompt longer than what is
    left is split across steps when ``chunked``, else waits for a step it fits whole). Advances each chunk's
    ``prefilled``. Returns the batch, the sequences whose next-token logits it yields (in logit-row order, first), and
    ``(sequence, n)`` per prefill chunk of a request that wants context logits: its ``n`` rows follow, in that order."""
    budget = int(max_num_tokens)
    tokens: list[int] = []
    positions: list[int] = []
    slots: list[int] = []
    decode: list[SequenceState] = []
    ctx: list[int] = []
    for seq in active:  # slot order
        if seq.prefilled == len(seq.prompt) and seq.generated:
            pos = len(seq.prompt) + len(seq.generated) - 1
            tokens.append(seq.generated[-1])
            positions.append(pos)
            slots.append(seq.slot)
            ctx.append(pos + 1)
            decode.append(seq)
    budget -= len(decode)
    chunks, ctx_rows, ctx_seqs = [], [], []  # context logits: every row of the chunks that want them
    mm_chunks: list[tuple[SequenceState, int, int]] = []  # (sequence with images, batch offset, prompt start)
    rows = list(range(len(decode)))
    logit_seqs = list(decode)
    for seq in active:
        left = len(seq.prompt) - seq.prefilled
        if left == 0 or budget <= 0:
            continue
        n = min(left, budget)
        if n < left and not chunked:
            continue
        off = len(tokens)
        tokens.extend(seq.prompt[seq.prefilled:seq.prefilled + n])
        positions.extend(range(seq.prefilled, seq.prefilled + n))
        slots.extend([seq.slot] * n)
        chunks.append((off, n, seq.slot, seq.prefilled))
        if seq.mm is not None:
            mm_chunks.append((seq, off, seq.prefilled))
        seq.prefilled += n
        budget -= n
        if seq.on_context_logits is not None:
            ctx_rows.extend(range(off, off + n))
            ctx_seqs.append((seq, n))
        if seq.prefilled == len(seq.prompt):
            rows.append(off + n - 1)
            logit_seqs.append(seq)
    i64 = torch.int64
    rope3, embed_rows, embed_vals = _image_rows(decode, [(seq, off, n) for seq, off, n in mm_chunks], positions)
    batch = StepBatch(
        tokens=torch.tensor(tokens, dtype=i64), positions=torch.tensor(positions, dtype=i64),
        slots=torch.tensor(slots, dtype=i64), n_decode=len(decode), decode_slots=[s.slot for s in decode],
        decode_ctx=torch.tensor(ctx, dtype=i64), chunks=chunks, logit_rows=torch.tensor(rows + ctx_rows, dtype=i64),
        rope3=rope3, embed_rows=embed_rows, embed_vals=embed_vals,
    )
    return batch, logit_seqs, ctx_seqs


def _image_rows(decode: list[SequenceState], mm_chunks: list[tuple[SequenceState, int, int]], positions: list[int]
                ) -> tuple[torch.Tensor | None, torch.Tensor | None, torch.Tensor | None]:
    """The step's image-token extras (:class:`~pipeline.cpu_runtime.model.StepBatch` ``rope3``/``embed_rows``/
    ``embed_vals``), all ``None`` when no sequence of the step carries images: M-RoPE positions (a decode token of an
    image request at ``position + delta`` on all three axes, a prefill chunk's columns of its prompt positions, every
    other token its 1-D position thrice) and the spliced embeddings of the chunks' image rows."""
    mm_decode = [(r, s) for r, s in enumerate(decode) if s.mm is not None]
    if not mm_decode and not mm_chunks:
        return None, None, None
    rope3 = torch.tensor(positions, dtype=torch.int64).expand(3, -1).clone()
    for r, s in mm_decode:
        rope3[:, r] += s.mm.delta
    rows, vals = [], []
    for seq, off, start in mm_chunks:
        n = seq.prefilled - start  # build_step advanced it past this chunk
        if seq.mm.positions is not None:
            rope3[:, off:off + n] = seq.mm.positions[:, start:start + n]
        sel = (seq.mm.rows >= start) & (seq.mm.rows < start + n)
        rows.append(seq.mm.rows[sel] - start + off)
        vals.append(seq.mm.embeds[sel])
    has = any(r.numel() for r in rows)
    return rope3, torch.cat(rows) if has else None, torch.cat(vals) if has else None
