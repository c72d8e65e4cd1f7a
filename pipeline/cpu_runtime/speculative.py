"""N-gram (prompt-lookup) speculative decoding in the CPU engine, as TensorRT-LLM's PyTorch backend defines it.

Upstream (read at the commits named; ``L12`` = ``tensorrt_llm/llmapi/llm_args.py@c292b9f997d68a6386229cee043c2e8151b1025a``,
``NG`` = ``tensorrt_llm/_torch/speculative/ngram.py@0249976575050d2c624a5f285683c66de311a3b7``;
/work/shared/reference/speculative-and-config-search.md §1):

* ``NGramDecodingConfig`` (L12:992; fields L12:1012-1015, base fields from ``DecodingBaseConfig`` L12:612-651):
  ``max_draft_len`` *v* (draft tokens per step; ``max_total_draft_tokens`` = *v*, a linear chain),
  ``max_matching_ngram_size`` *k* (longest pattern; 0, the 1.2 default, is refused at ``LLM()``, L12:2952-2953),
  ``is_keep_all`` (keep several matches per pattern), ``is_use_oldest`` (propose the oldest match, else the newest),
  ``is_public_pool`` (one pool for all requests, else one per request, dropped when it completes),
  ``max_concurrency`` (speculate only while the effective batch is at most this; ``None``: always).
* The pool (``NGramPoolManager.get_draft_tokens``, NG:86-143), run once per step for every request in the generation
  phase on ``prompt + generated`` (``NGramDrafter.prepare_draft_tokens``, NG:179-202): the draft budget is
  ``prompt_len + max_new_tokens - 1 - len(prefix)`` (NG:92-95, 199-200); every ``(pattern, match)`` of the tokens
  from the request's ``start_index`` on is added, sizes *k*…1, ``match`` = up to *v* tokens after the pattern
  (NG:104-126: a new pattern, or with ``is_keep_all`` off a longer match, replaces; else a new match drops the
  shorter ones and joins); the lookup takes the longest suffix of the prefix found in the pool (NG:128-136) and the
  next scan starts at ``len(prefix) - (v + k - 1)`` (NG:138-141). The public pool is never pruned (NG:72-75).
* Verification (``sampler.py`` ``_process_draft_tokens_greedy``, reference §1.2): one target forward over
  ``[last token, d1..dn]``; the target's token at step 0 is appended, then each draft equal to the target's token at its
  step is accepted and the next target token appended (the last one the bonus); stop criteria after every token.

Here the verification tokens ``[last token, d1..dn]`` of a request go into the step's one forward at positions
``p..p+n`` of the request's own KV slot. With the native kernels they are decode rows (each attends over its slot up to
its own position; every layer writes the step's K/V before its attention, so each row sees the rows before it): each
row computes exactly what a plain decode step at that position computes, and a step of decode rows only keeps the fused
one-call path. With the torch kernels (one decode row per slot) they are a prefill chunk starting at ``p`` (causal
attention over the slot, as a chunked prefill). Either way the K/V of rejected drafts lie beyond the accepted length
and are overwritten by the next step's writes before anything reads them: the rollback is by length.
Differences from a GPU run, by design: no CUDA graphs, so a request with no draft
is not padded to ``1 + v`` tokens (drafter.py ``pad_draft_tokens_for_cuda_graph``) but decodes one token as usual,
and a step where no request has a draft is a plain decode step; guided (xgrammar) requests are not drafted for, and
a step with an image request or on an mllama engine is a plain step (:func:`has_extras`).

Stats, named as upstream names them: :meth:`NGramSpeculator.iteration_stats` = ``IterationStats.specDecodingStats``
(``numDraftTokens``, ``numAcceptedTokens``, ``numRequestsWithDraftTokens``, ``acceptanceLength`` = (accepted +
requests) / requests, ``iterLatencyMS`` the drafting time, ``draftOverhead`` its share of the step; reference §1.3);
:meth:`NGramSpeculator.request_metrics` = ``RequestPerfMetrics.speculative_decoding`` (``acceptance_rate``,
``total_accepted_draft_tokens``, ``total_draft_tokens``).
"""

from __future__ import annotations

import collections
import time
from dataclasses import dataclass
from typing import Any

import torch

from pipeline.cpu_runtime.batch import build_step
from pipeline.cpu_runtime.guided import advance, mask
from pipeline.cpu_runtime.lora import step_for
from pipeline.cpu_runtime.requests import SequenceState

#: decoding_type of the only speculative mode the CPU engine runs
NGRAM = "NGram"
#: finished requests whose per-request counters are kept until read (:meth:`NGramSpeculator.request_metrics`)
_KEEP_FINISHED = 4096


@dataclass(frozen=True)
class NGramConfig:
    """The ``NGramDecodingConfig`` fields the CPU engine honours (module docstring; lengths in tokens)."""

    max_draft_len: int
    max_matching_ngram_size: int
    is_keep_all: bool = True
    is_use_oldest: bool = True
    is_public_pool: bool = True
    max_concurrency: int | None = None

    @classmethod
    def from_dict(cls, spec: dict[str, Any]) -> NGramConfig:
        """From an LLM-API ``speculative_config`` mapping (``decoding_type: NGram`` and the fields above; other base
        fields that do not change the tokens, e.g. ``max_total_draft_tokens`` equal to ``max_draft_len``, are accepted).

        Raises ``ValueError`` (one line naming the field) for another ``decoding_type``, a missing or non-positive
        ``max_draft_len`` / ``max_matching_ngram_size`` (upstream asserts both > 0 at ``LLM()``), a ``max_concurrency``
        below 1, or a field the CPU engine cannot honour (``draft_len_schedule``, ``acceptance_*``, a
        ``max_total_draft_tokens`` other than ``max_draft_len``)."""
        kind = spec.get("decoding_type")
        if kind != NGRAM:
            raise ValueError(f"speculative_config.decoding_type is {kind!r}: the CPU engine speculates with NGram only")
        out: dict[str, Any] = {}
        for name in ("max_draft_len", "max_matching_ngram_size"):
            v = spec.get(name)
            if not isinstance(v, int) or isinstance(v, bool) or v < 1:
                raise ValueError(f"speculative_config.{name} is {v!r}: NGram needs it > 0")
            out[name] = v
        for name in ("is_keep_all", "is_use_oldest", "is_public_pool"):
            if spec.get(name) is not None:
                out[name] = bool(spec[name])
        mc = spec.get("max_concurrency")
        if mc is not None and (not isinstance(mc, int) or mc < 1):
            raise ValueError(f"speculative_config.max_concurrency is {mc!r}: must be >= 1 or null")
        out["max_concurrency"] = mc
        total = spec.get("max_total_draft_tokens")
        if total is not None and total != out["max_draft_len"]:
            raise ValueError("speculative_config.max_total_draft_tokens must equal max_draft_len (a linear draft chain)")
        for name in ("draft_len_schedule", "acceptance_window", "acceptance_length_threshold"):
            if spec.get(name) is not None:
                raise ValueError(f"speculative_config.{name}: not implemented by the CPU engine's n-gram drafter")
        return cls(**out)


class NGramPool:
    """Pattern → matches pool(s) of the n-gram drafter (``NGramPoolManager``'s rules, module docstring)."""

    def __init__(self, cfg: NGramConfig):
        self.cfg = cfg
        self.public: dict[tuple[int, ...], dict[tuple[int, ...], None]] = {}  # an insertion-ordered set per pattern
        self.private: dict[str, dict] = {}
        self.start_index: dict[str, int] = {}

    def draft(self, rid: str, prefix: list[int], max_sequence_length: int) -> list[int]:
        """Draft tokens for request ``rid`` whose tokens so far are ``prefix`` (prompt + generated) and which may reach
        ``max_sequence_length`` tokens (prompt + max_new_tokens); updates the pool first. ``[]``: no draft."""
        c = self.cfg
        n = len(prefix)
        budget = max_sequence_length - 1 - n
        if budget <= 0:
            return []
        if rid not in self.start_index:
            self.start_index[rid] = 0
            if not c.is_public_pool:
                self.private[rid] = {}
        pool = self.public if c.is_public_pool else self.private[rid]
        seq = prefix[self.start_index[rid]:]
        top = min(c.max_matching_ngram_size, n - 1)
        for size in range(top, 0, -1):
            for i in range(len(seq) - size):
                pattern = tuple(seq[i:i + size])
                match = tuple(seq[i + size:min(i + size + c.max_draft_len, len(seq))])
                have = pool.get(pattern)
                if have is None or (not c.is_keep_all and len(match) > len(next(iter(have)))):
                    pool[pattern] = {match: None}
                elif match not in have:
                    for m in [m for m in have if len(m) < len(match)]:
                        del have[m]
                    have[match] = None
        out: list[int] = []
        for size in range(top, 0, -1):
            have = pool.get(tuple(prefix[-size:]))
            if have is None:
                continue
            pick = next(iter(have)) if c.is_use_oldest else next(reversed(have))
            out = list(pick)[:budget]
            break
        self.start_index[rid] = max(0, n - (c.max_draft_len + c.max_matching_ngram_size - 1))
        return out

    def finish(self, rid: str) -> None:
        """Request ``rid`` completed: drop its private pool and scan position (the public pool stays, as upstream)."""
        self.start_index.pop(rid, None)
        self.private.pop(rid, None)


def has_extras(seq: Any) -> bool:
    """Whether ``seq`` carries more than token ids: image embeddings / M-RoPE positions (``mm``, mrope.py) or mllama
    cross-attention inputs (``cross``). Such requests are neither drafted for nor share prefix blocks: their K/V depend
    on more than the tokens, and their steps carry per-row extras only the engine's plain step assembles."""
    return getattr(seq, "mm", None) is not None or getattr(seq, "cross", None) is not None


def _take(seq: SequenceState, tok: int) -> tuple[list[int], bool]:
    """Append target token ``tok`` to ``seq`` and check its stop criteria (the engine's rules: ``end_id`` ends the
    request unreturned, a completed grammar ends it, ``max_new_tokens`` and stop words end it returned).
    Returns (tokens to deliver, finished)."""
    seq.generated.append(tok)
    if tok == seq.end_id or advance(seq.matcher, tok):
        return [], True
    end = len(seq.generated) >= seq.max_new or any(
        len(w) <= len(seq.generated) and seq.generated[-len(w):] == w for w in seq.stop_words)
    return [tok], end


class NGramSpeculator:
    """Runs the CPU engine's steps that carry drafts (the engine's hook: :meth:`step`), and counts drafts."""

    def __init__(self, cfg: NGramConfig, *, max_batch_size: int, max_num_tokens: int):
        self.cfg = cfg
        self.pool = NGramPool(cfg)
        self.max_batch_size, self.max_num_tokens = int(max_batch_size), int(max_num_tokens)
        self.totals = {"draft_tokens": 0, "accepted_draft_tokens": 0, "requests_with_drafts": 0, "spec_steps": 0,
                       "draft_s": 0.0}
        self._last: dict[str, Any] = {}
        self._per_request: dict[str, list[int]] = {}  # rid → [drafted, accepted]
        self._finished: collections.OrderedDict[str, tuple[int, int]] = collections.OrderedDict()

    @classmethod
    def from_config(cls, spec: dict[str, Any] | None, engine_cfg: dict[str, Any]) -> NGramSpeculator | None:
        """``None`` without a ``speculative_config``; else the speculator for engine_config ``engine_cfg``
        (``max_batch_size``, ``max_num_tokens``). Raises ``ValueError``: see :meth:`NGramConfig.from_dict`."""
        if not spec:
            return None
        return cls(NGramConfig.from_dict(dict(spec)), max_batch_size=int(engine_cfg["max_batch_size"]),
                   max_num_tokens=int(engine_cfg["max_num_tokens"]))

    # ------------------------------------------------------------------ reporting
    def stats(self) -> dict[str, Any]:
        """Totals since load: ``draft_tokens``, ``accepted_draft_tokens``, ``requests_with_drafts`` (summed over steps),
        ``spec_steps`` (steps that verified drafts), ``draft_s`` (time spent drafting), ``acceptance_rate`` (accepted /
        drafted), ``acceptance_length`` (mean tokens per drafted request-step, incl. the target's own token)."""
        t = dict(self.totals)
        t["acceptance_rate"] = t["accepted_draft_tokens"] / t["draft_tokens"] if t["draft_tokens"] else None
        r = t["requests_with_drafts"]
        t["acceptance_length"] = (t["accepted_draft_tokens"] + r) / r if r else None
        return t

    def iteration_stats(self) -> dict[str, Any]:
        """The latest step's ``specDecodingStats`` (upstream's names; zeros before any step drafted)."""
        return dict(self._last) or {"numDraftTokens": 0, "numAcceptedTokens": 0, "numRequestsWithDraftTokens": 0,
                                    "acceptanceLength": 0.0, "iterLatencyMS": 0.0, "draftOverhead": 0.0}

    def request_metrics(self, rid: str) -> dict[str, Any]:
        """``speculative_decoding`` perf metrics of engine request ``rid`` (``acceptance_rate``,
        ``total_accepted_draft_tokens``, ``total_draft_tokens``; zeros for an unknown id)."""
        drafted, accepted = self._finished.get(rid) or tuple(self._per_request.get(rid, (0, 0)))
        return {"acceptance_rate": accepted / drafted if drafted else 0.0, "total_accepted_draft_tokens": accepted,
                "total_draft_tokens": drafted}

    # ------------------------------------------------------------------ the step
    def _sweep(self, live: set[str]) -> None:
        """Close the records of requests that left the engine through its plain step or a cancellation."""
        for rid in [r for r in self.pool.start_index if r not in live]:
            self.pool.finish(rid)
        for rid in [r for r in self._per_request if r not in live]:
            self._finished[rid] = tuple(self._per_request.pop(rid))
        while len(self._finished) > _KEEP_FINISHED:
            self._finished.popitem(last=False)

    def _on(self, n_requests: int) -> bool:
        """``Drafter.should_use_spec_decode``: speculate unless the effective batch exceeds ``max_concurrency``."""
        mc = self.cfg.max_concurrency
        if mc is None:
            return True
        return min(n_requests, self.max_batch_size, self.max_num_tokens // (1 + self.cfg.max_draft_len)) <= mc

    @staticmethod
    def _verify_rows(drafted: list[SequenceState], drafts: dict[int, list[int]]) -> tuple[list[int], list[int], list[int]]:
        """(tokens, positions, slots) of every drafted request's ``[last token, d1..dn]``, request after request."""
        toks, pos, slots = [], [], []
        for s in drafted:
            d = drafts[id(s)]
            p = len(s.prompt) + len(s.generated) - 1
            toks += [s.generated[-1], *d]
            pos += range(p, p + 1 + len(d))
            slots += [s.slot] * (1 + len(d))
        return toks, pos, slots

    def _as_decode_rows(self, batch: Any, drafted: list[SequenceState], drafts: dict[int, list[int]]) -> None:
        """Add the verification tokens to ``batch`` as decode rows (native kernels): each attends over its slot up to
        its own position, the K/V of the rows before it in the same step included (every layer writes the step's K/V
        before its attention), so each row computes what a plain decode step at that position would; the decode-only
        fused path stays open. Their logit rows go last."""
        toks, pos, slots = self._verify_rows(drafted, drafts)
        nd, n = batch.n_decode, len(toks)
        i64 = torch.int64
        cat = torch.cat
        batch.tokens = cat([batch.tokens[:nd], torch.tensor(toks, dtype=i64), batch.tokens[nd:]])
        batch.positions = cat([batch.positions[:nd], torch.tensor(pos, dtype=i64), batch.positions[nd:]])
        batch.slots = cat([batch.slots[:nd], torch.tensor(slots, dtype=i64), batch.slots[nd:]])
        batch.decode_slots = batch.decode_slots + slots
        batch.decode_ctx = cat([batch.decode_ctx, torch.tensor(pos, dtype=i64) + 1])
        batch.n_decode = nd + n
        batch.chunks = [(off + n, ln, slot, start) for off, ln, slot, start in batch.chunks]
        rows = batch.logit_rows
        batch.logit_rows = cat([torch.where(rows >= nd, rows + n, rows), torch.arange(nd, nd + n, dtype=i64)])

    def _as_chunks(self, batch: Any, drafted: list[SequenceState], drafts: dict[int, list[int]]) -> None:
        """Add the verification tokens to ``batch`` as one prefill chunk per drafted request, starting at its last
        token's position (the torch kernels' decode path takes one row per slot); their logit rows go last."""
        toks, pos, slots = self._verify_rows(drafted, drafts)
        off = int(batch.tokens.numel())
        for s in drafted:
            n = 1 + len(drafts[id(s)])
            batch.chunks.append((off, n, s.slot, len(s.prompt) + len(s.generated) - 1))
            off += n
        i64 = torch.int64
        batch.tokens = torch.cat([batch.tokens, torch.tensor(toks, dtype=i64)])
        batch.positions = torch.cat([batch.positions, torch.tensor(pos, dtype=i64)])
        batch.slots = torch.cat([batch.slots, torch.tensor(slots, dtype=i64)])
        batch.logit_rows = torch.cat([batch.logit_rows, torch.arange(off - len(toks), off, dtype=i64)])

    def step(self, eng: Any, t0: float) -> bool:
        """Run engine ``eng``'s next step with drafts (called on the scheduler thread at the start of a step begun at
        ``t0``, ``time.perf_counter()``). Returns False, having changed nothing but the pool, when no request in the
        generation phase has a draft this step (the engine then runs its plain step)."""
        active = eng._active
        if len(self.pool.start_index) > len(active) or len(self._per_request) > len(active):
            self._sweep({s.rid for s in active})
        gen = [s for s in active if s.prefilled == len(s.prompt) and s.generated]
        if (not gen or not self._on(len(active)) or getattr(eng.model, "cross", None) is not None
                or any(has_extras(s) for s in active)):  # image / cross-attention steps: the plain step
            return False
        # every generating request takes at least its last token; without chunked prefill the next prompt waiting to
        # be prefilled keeps room to go in whole (drafts never starve it)
        waiting = [len(s.prompt) - s.prefilled for s in active if s.prefilled < len(s.prompt)]
        budget = self.max_num_tokens - len(gen) - (waiting[0] if waiting and not eng.chunked else 0)
        drafts: dict[int, list[int]] = {}
        for s in gen:
            if s.matcher is not None or budget <= 0:
                continue
            d = self.pool.draft(s.rid, s.prompt + s.generated, len(s.prompt) + s.max_new)[:budget]
            if d:
                drafts[id(s)] = d
                budget -= len(d)
        t_draft = time.perf_counter() - t0
        self.totals["draft_s"] += t_draft
        if not drafts:
            return False
        drafted = [s for s in gen if id(s) in drafts]
        rest = [s for s in active if id(s) not in drafts]
        batch, seqs, ctx_seqs = build_step(rest, self.max_num_tokens - sum(1 + len(d) for d in drafts.values()),
                                           eng.chunked)
        n_plain = int(batch.logit_rows.numel())
        if eng.model.kernels == "torch":
            self._as_chunks(batch, drafted, drafts)
        else:
            self._as_decode_rows(batch, drafted, drafts)
        batch.lora = step_for(batch.slots, [s.lora for s in active]) if eng.lora is not None else None
        t1 = time.perf_counter()
        logits = eng.model.forward(batch)
        t2 = time.perf_counter()
        o = len(seqs)
        for seq, n in ctx_seqs:  # delivered before the step's tokens, as in the plain step
            eng._out.put(("logits", seq, logits[o:o + n].clone()))
            o += n
        plain, spec = logits[:len(seqs)], logits[n_plain:]
        ban = [(r, s.end_id) for r, s in enumerate(seqs) if len(s.generated) < s.min_tokens]
        r0 = 0
        for s in drafted:  # the end token is masked at every position still short of min_tokens
            ban_spec = [(r0 + j, s.end_id) for j in range(1 + len(drafts[id(s)])) if len(s.generated) + j < s.min_tokens]
            if ban_spec:
                r, e = zip(*ban_spec)
                spec[list(r), list(e)] = float("-inf")
            r0 += 1 + len(drafts[id(s)])
        if ban:
            r, e = zip(*ban)
            plain[list(r), list(e)] = float("-inf")
        mask(plain, [s.matcher for s in seqs])
        out, finished = [], []
        for s, tok in zip(seqs, plain.argmax(-1).tolist() if seqs else []):
            toks, end = _take(s, tok)
            out.append(("tokens", s, toks, end))
            if end:
                finished.append(s)
        target = spec.argmax(-1).tolist()
        r0, n_draft, n_acc, made = 0, 0, 0, len(seqs)
        for s in drafted:
            d = drafts[id(s)]
            toks, end, acc = [], False, 0
            for j in range(len(d) + 1):
                got, end = _take(s, target[r0 + j])
                toks += got
                made += 1
                if end or j == len(d) or d[j] != target[r0 + j]:
                    break
                acc += 1
            r0 += len(d) + 1
            n_draft, n_acc = n_draft + len(d), n_acc + acc
            c = self._per_request.setdefault(s.rid, [0, 0])
            c[0], c[1] = c[0] + len(d), c[1] + acc
            out.append(("tokens", s, toks, end))
            if end:
                finished.append(s)
        for s in finished:
            self.pool.finish(s.rid)
            self._finished[s.rid] = tuple(self._per_request.pop(s.rid, (0, 0)))
            while len(self._finished) > _KEEP_FINISHED:
                self._finished.popitem(last=False)
        eng._retire(finished, out)
        step_s = time.perf_counter() - t0
        tt = self.totals
        tt["draft_tokens"] += n_draft
        tt["accepted_draft_tokens"] += n_acc
        tt["requests_with_drafts"] += len(drafted)
        tt["spec_steps"] += 1
        self._last = {"numDraftTokens": n_draft, "numAcceptedTokens": n_acc, "numRequestsWithDraftTokens": len(drafted),
                      "acceptanceLength": (n_acc + len(drafted)) / len(drafted), "iterLatencyMS": 1e3 * t_draft,
                      "draftOverhead": t_draft / step_s if step_s > 0 else 0.0}
        cnt = eng._counters
        cnt["forward_passes"] += 1
        cnt["forward_s"] += t2 - t1
        cnt["step_s"] += step_s
        cnt["tokens"] += made
        eng._batch_hist[int(batch.tokens.numel())] += 1
        return True
