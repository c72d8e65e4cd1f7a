"""Achievable throughput and latency of an in-flight-batching engine: the scheduler over the step-time model.

The roofline (:mod:`pipeline.plan.perf`) is an upper bound at datasheet peaks. This module predicts what an engine
reaches from the time of one step (:mod:`pipeline.plan.step`) and how the in-flight batcher fills its steps
(:func:`predict_point`): B sequences in flight, each living k_p prefill steps (1, or ceil(ISL / chunk) with chunked
prefill) + OSL − 1 decode steps; B is bounded by the requested concurrency, ``max_batch_size``, the KV cache
(GUARANTEED_NO_EVICT reserves ISL + OSL per sequence) and ``max_num_tokens`` (every token of the cycle must pass
through steps of at most max_num_tokens tokens). At maximum load the steady state is averaged over every phase; a
closed loop of identical requests moves in groups (:func:`prefill_groups`). Searches over the prediction: the knee
(:func:`knee_batch`) and the largest concurrency within an SLO (:func:`max_concurrency_within`).

Units: bytes, FLOPs, seconds inside; the :class:`Prediction` fields carry their unit in the name
(``_ms``, ``_tokens_per_s``). Everything here is pure arithmetic: no recipe, no I/O.
"""

from __future__ import annotations

import math
from typing import Literal

from pydantic import BaseModel, ConfigDict, Field

from pipeline.plan.step import Efficiency, StepCost, StepMix, StepTime, step_time

Policy = Literal["GUARANTEED_NO_EVICT", "MAX_UTILIZATION"]


class SchedulerLimits(BaseModel):
    """What bounds the in-flight batch: TensorRT-LLM's max_batch_size, max_num_tokens, chunked prefill,
    the KV cache (tokens, block size) and the capacity-scheduler policy."""

    model_config = ConfigDict(frozen=True)

    max_batch_size: int = Field(ge=1)
    max_num_tokens: int = Field(ge=1)
    chunked_prefill: bool = False
    kv_tokens: int = Field(ge=0)
    tokens_per_block: int = Field(ge=1)
    policy: Policy = "GUARANTEED_NO_EVICT"


class Prediction(BaseModel):
    """Predicted steady-state performance at one ISL/OSL (tokens) and concurrency.

    ``concurrency`` None means maximum load (the largest batch the engine admits; TTFT then excludes the
    queueing of an infinite-rate benchmark, which depends on how many requests are sent).
    ``batch``: sequences in flight; ``limited_by``: what sets it. ``ttft_ms``: request start → first
    token; ``itl_ms``: mean gap between later tokens (= TPOT); ``e2e_ms``: request latency.
    ``rel_error``: expected relative error (1 σ) of ``output_tokens_per_s``; ``output_tokens_per_s_low``
    / ``_high`` = value / (1 + e) and × (1 + e). ``step_ms``: mean step; ``step_split_ms``: its terms.
    """

    isl: int
    osl: int
    concurrency: int | None
    batch: int
    limited_by: Literal["concurrency", "max_batch_size", "kv_cache", "max_num_tokens"]
    prefill_steps: int
    output_tokens_per_s: float
    output_tokens_per_s_low: float
    output_tokens_per_s_high: float
    per_user_tokens_per_s: float
    ttft_ms: float
    ttft_p99_ms: float | None = None
    itl_ms: float
    e2e_ms: float
    step_ms: float
    bound: Literal["memory", "compute", "overhead"]
    step_split_ms: dict[str, float]
    rel_error: float
    error_terms: dict[str, float] = Field(default_factory=dict)
    prefill_groups: int = 0


def kv_sequences(limits: SchedulerLimits, isl: int, osl: int) -> int:
    """Sequences of ISL + OSL tokens the KV cache admits at once.

    GUARANTEED_NO_EVICT reserves each request's whole ISL + OSL up front: kv_blocks //
    ceil((ISL + OSL) / tokens_per_block). MAX_UTILIZATION allocates blocks as tokens arrive, so in
    steady state a sequence holds ISL + OSL/2 tokens on average: floor(kv_tokens / (ISL + OSL/2)).
    """
    tpb = limits.tokens_per_block
    if limits.policy == "MAX_UTILIZATION":
        return int(limits.kv_tokens // (isl + osl / 2))
    return (limits.kv_tokens // tpb) // math.ceil((isl + osl) / tpb)


def _prefill_steps(limits: SchedulerLimits, isl: int, batch: int) -> int:
    """Steps one prompt takes: 1, or with chunked prefill ceil(ISL / chunk) where chunk is the token
    budget left after the other sequences' decode tokens (at least one KV block)."""
    if not limits.chunked_prefill:
        return 1
    chunk = max(limits.max_num_tokens - (batch - 1), limits.tokens_per_block)
    return max(1, math.ceil(isl / chunk))


def max_batch(limits: SchedulerLimits, isl: int, osl: int) -> tuple[int, str]:
    """Largest steady-state batch and what limits it: ``max_batch_size``, ``kv_cache`` or ``max_num_tokens``.

    Token budget: a request's ISL + OSL − 1 tokens (prompt, then one per decode step) pass through its
    k_p + OSL − 1 steps, each of at most max_num_tokens tokens, so B ≤ max_num_tokens × (k_p + OSL − 1) /
    (ISL + OSL − 1). Without chunked prefill a whole prompt must fit one step next to the other
    sequences' decode tokens: B × (OSL − 1) / (OSL) + ISL ≤ max_num_tokens.

    Raises ``ValueError`` when a prompt can never be scheduled (ISL > max_num_tokens without chunked
    prefill) or when the KV cache cannot hold one sequence.
    """
    if not limits.chunked_prefill and isl > limits.max_num_tokens:
        raise ValueError(f"ISL {isl} exceeds max_num_tokens {limits.max_num_tokens} and chunked prefill is off")
    kv = kv_sequences(limits, isl, osl)
    if kv < 1:
        raise ValueError(f"the KV cache ({limits.kv_tokens} tokens) cannot hold one sequence of {isl + osl} tokens")
    cands = {"max_batch_size": limits.max_batch_size, "kv_cache": kv}
    b = min(cands.values())
    # token budget depends on k_p, which depends on the batch: two passes converge (k_p only grows as b shrinks)
    for _ in range(3):
        steps = _prefill_steps(limits, isl, b) + osl - 1
        tok = math.floor(limits.max_num_tokens * steps / (isl + osl - 1))
        if not limits.chunked_prefill:
            tok = min(tok, math.floor((limits.max_num_tokens - isl) * osl / max(osl - 1, 1)) + 1)
        cands["max_num_tokens"] = max(tok, 1)
        b = min(cands.values())
    lim = min(cands, key=lambda k: (cands[k], k != "kv_cache", k != "max_batch_size"))
    return max(b, 1), lim


def predict_point(cost: StepCost, limits: SchedulerLimits, eff: Efficiency, isl: int, osl: int,
                  concurrency: int | None = None, *, extra_error: dict[str, float] | None = None) -> Prediction:
    """Output tokens/s, TTFT (mean and p99) and ITL at ``concurrency`` clients, or at maximum load when None.

    Maximum load (``concurrency`` None, an infinite-rate benchmark such as ``trtllm-bench throughput``): requests
    arrive at every phase, so the steady state is averaged (:func:`_steady_state`). With ``concurrency`` clients in a
    closed loop of identical requests (fixed ISL/OSL, as ``trtpipe bench``, ``trtllm-bench --concurrency`` and
    GenAI-Perf send them) the clients move in groups (:func:`_closed_loop`): the first requests arrive together, the
    scheduler packs their prompts into steps of at most ``max_num_tokens`` tokens, and since every request then lives
    the same number of steps, each group keeps its phase. With more clients than the engine admits (B), the extra ones
    queue: Little's law adds latency = clients / request rate − the in-engine latency to TTFT (mean and p99 alike).

    ``extra_error``: named relative error terms added in quadrature to ``eff.rel_error`` (conditions the
    calibration did not cover). Raises ``ValueError`` as :func:`max_batch` does, or for ISL/OSL/concurrency < 1.
    """
    if isl < 1 or osl < 1 or (concurrency is not None and concurrency < 1):
        raise ValueError(f"ISL {isl}, OSL {osl} and concurrency {concurrency} must be at least 1")
    b_max, lim = max_batch(limits, isl, osl)
    b = b_max if concurrency is None else min(concurrency, b_max)
    limited_by = lim if concurrency is None or concurrency >= b_max else "concurrency"
    run = _steady_state(cost, limits, eff, isl, osl, b) if concurrency is None else _closed_loop(cost, limits, eff, isl, osl, b)
    ttft, ttft_p99, itl, e2e = run.ttft_s, run.ttft_p99_s, run.itl_s, run.e2e_s
    clients = concurrency if concurrency is not None else b
    if clients > b:  # closed loop beyond the batch: the extra clients queue (Little's law)
        wait = max(clients * run.cycle_s / b - e2e, 0.0)
        ttft, ttft_p99, e2e = ttft + wait, ttft_p99 + wait, e2e + wait
    out_tps = b * osl / run.cycle_s
    split, mem_s, cmp_s = {}, 0.0, 0.0
    for t, w in run.steps:
        for k in ("overhead_s", "gemm_s", "act_s", "kv_s", "attn_s", "comm_s", "vision_s"):
            split[k] = split.get(k, 0.0) + w * getattr(t, k)
        mem_s += w * (t.act_s + t.kv_s + t.comm_s + (t.gemm_s if t.gemm_bound == "memory" else 0.0))
        cmp_s += w * (t.attn_s + t.vision_s + (t.gemm_s if t.gemm_bound == "compute" else 0.0))
    t_mean = sum(split.values())
    bound = "overhead" if split["overhead_s"] > mem_s + cmp_s else ("memory" if mem_s >= cmp_s else "compute")
    terms = {"calibration": eff.rel_error}
    if eff.step_overhead_uncertainty_ms:
        terms["step_overhead"] = eff.step_overhead_uncertainty_ms * 1e-3 / t_mean
    terms.update(extra_error or {})
    err = math.sqrt(sum(v * v for v in terms.values()))
    return Prediction(
        isl=isl, osl=osl, concurrency=concurrency, batch=b, limited_by=limited_by, prefill_steps=run.prefill_steps,
        output_tokens_per_s=out_tps, output_tokens_per_s_low=out_tps / (1 + err), output_tokens_per_s_high=out_tps * (1 + err),
        per_user_tokens_per_s=1.0 / itl, ttft_ms=ttft * 1e3, ttft_p99_ms=ttft_p99 * 1e3, itl_ms=itl * 1e3, e2e_ms=e2e * 1e3,
        step_ms=t_mean * 1e3, bound=bound, step_split_ms={k[:-2]: v * 1e3 for k, v in split.items()}, rel_error=err,
        error_terms={k: round(v, 4) for k, v in terms.items()}, prefill_groups=run.groups,
    )


class _Run(BaseModel):
    """A load point's timing (s): a request's cycle (B requests complete every ``cycle_s``), TTFT (mean, p99), ITL,
    request latency, the engine steps with their weight in the mean step (``steps``: (time, share)), the steps one
    prompt takes and the groups the clients move in (0 at maximum load)."""

    model_config = ConfigDict(arbitrary_types_allowed=True)

    cycle_s: float
    ttft_s: float
    ttft_p99_s: float
    itl_s: float
    e2e_s: float
    steps: list[tuple[StepTime, float]]
    prefill_steps: int
    groups: int = 0


def _mix(isl: int, osl: int, decoding: float, prompts: float, prompt_tokens: float, emitting_prompts: float) -> StepMix:
    """A step holding ``decoding`` decoding sequences (one token each, context ISL + OSL/2 on average) and
    ``prompt_tokens`` tokens of ``prompts`` prompts' prefill, of which ``emitting_prompts`` finish their prompt in the
    step and emit a first token. Prefill attention: a chunk of n tokens of a prompt costs about ISL × n units."""
    return StepMix(n_seqs=decoding + prompts, n_tokens=decoding + prompt_tokens, n_logits=decoding + emitting_prompts,
                   kv_read_tokens=decoding * (isl + osl / 2), attn_units=prompt_tokens * isl, n_decoding=decoding,
                   new_prompts=emitting_prompts)


def _steady_state(cost: StepCost, limits: SchedulerLimits, eff: Efficiency, isl: int, osl: int, b: int) -> _Run:
    """Maximum load: B sequences in flight at every phase. With S = k_p + OSL − 1 steps per request, a step holds on
    average p = B·k_p/S prefill chunks and B − p decoding sequences. When p ≥ 1 every step is alike; when p < 1 a
    share p of the steps carries one chunk (ISL / k_p tokens) and the others are pure decode. Output tokens/s =
    B × OSL / (S × mean step); ITL = mean step seen by a decoding sequence (other requests' prefills included);
    TTFT = k_p steps carrying its chunks + half a step of waiting for the running one (B > 1)."""
    k_p = _prefill_steps(limits, isl, b)
    steps = k_p + osl - 1
    p = b * k_p / steps
    chunk = isl / k_p
    if p >= 1:
        t_mixed = t_decode = step_time(cost, eff, _mix(isl, osl, b - p, p, p * chunk, b / steps))
        share, share_other = 1.0, 1.0
    else:
        t_mixed = step_time(cost, eff, _mix(isl, osl, b - 1, 1, chunk, 1 / k_p))
        t_decode = step_time(cost, eff, _mix(isl, osl, b, 0, 0, 0))
        share, share_other = p, min((b - 1) * k_p / steps, 1.0)
    t_mean = share * t_mixed.total_s + (1 - share) * t_decode.total_s
    itl = share_other * t_mixed.total_s + (1 - share_other) * t_decode.total_s
    ttft = k_p * t_mixed.total_s + (t_mean / 2 if b > 1 else 0.0)
    return _Run(cycle_s=steps * t_mean, ttft_s=ttft, ttft_p99_s=ttft, itl_s=itl, e2e_s=ttft + (osl - 1) * itl,
                steps=[(t_mixed, share), (t_decode, 1 - share)], prefill_steps=k_p)


def prefill_groups(limits: SchedulerLimits, isl: int, b: int) -> int:
    """Groups that B clients arriving together form: the steps their B prompts (B × ISL tokens) are packed into.

    With chunked prefill each step takes up to ``max_num_tokens`` tokens, the prompts after the first group sharing it
    with the decode tokens of the groups already running: g = ceil(B·ISL / (max_num_tokens − decoding)), decoding =
    B − 2B/g (all but the prefilling group and the one waiting for its next request), solved by iteration. Without
    chunked prefill whole prompts fill a step: g = ceil(B / floor(max_num_tokens / ISL)). At least 1, at most B
    (a prompt longer than a step spreads over several steps: :func:`_prefill_steps`)."""
    n = limits.max_num_tokens
    if not limits.chunked_prefill:
        return min(b, max(1, math.ceil(b / max(n // isl, 1))))
    g = max(1, math.ceil(b * isl / n))
    for _ in range(4):
        decoding = max(b - b / g - b * (g - 1) / g ** 2, 0.0) if g > 1 else 0.0
        g_new = min(b, max(1, math.ceil(b * isl / max(n - decoding, limits.tokens_per_block))))
        if g_new == g:
            break
        g = g_new
    return g


def _closed_loop(cost: StepCost, limits: SchedulerLimits, eff: Efficiency, isl: int, osl: int, b: int) -> _Run:
    """B clients in a closed loop of identical requests, moving in g groups (:func:`prefill_groups`).

    One cycle: each group's prompts are prefilled in one step (or, when one prompt exceeds a step, k_p steps) and
    emit their first token; then OSL − 1 decode steps. A request's next one arrives while the engine runs the step
    after its last token, so with g > 1 it waits that step: the cycle is L = g·k_p + (OSL − 1) + 1 steps. Group j's
    prefill step holds its B/g prompts next to the decoding groups: all but itself and group j + 1, which waits in
    it (the last group's step: all but itself); the other steps decode, B sequences, or B − B/g in the step group 0
    waits in. With g = 1 all requests end in the same step and the next ones find the engine idle: L = k_p + OSL − 1,
    the prefill alone.

    TTFT: g = 1: the prefill step(s); g > 1: the step waited + its own prefill — group 0 waits a decode step, the
    others the previous group's prefill step (mean over groups; p99 = the last group's). ITL: a request's OSL − 1
    later gaps span decode steps and the prefill steps of the groups whose turn falls between its first and last
    token (see the comment in the code)."""
    g = prefill_groups(limits, isl, b)
    per = b / g  # prompts per group
    t_dec = step_time(cost, eff, _mix(isl, osl, b, 0, 0, 0))
    if g == 1:
        k_p = _prefill_steps(limits, isl, b) if b == 1 else 1
        t_pf = step_time(cost, eff, _mix(isl, osl, 0, per, per * isl / k_p, per / k_p))
        n_dec = osl - 1
        cycle = k_p * t_pf.total_s + n_dec * t_dec.total_s
        steps = [(t_pf, k_p / (k_p + n_dec)), (t_dec, n_dec / (k_p + n_dec))]
        ttft = ttft_p99 = k_p * t_pf.total_s
        itl = t_dec.total_s
    else:
        # prefill step of group j: group j + 1 waits in it (its request arrives during it), except after the last group
        decoding = max(b - per - per * (g - 1) / g, 0.0)
        budget = max(limits.max_num_tokens - decoding, limits.tokens_per_block)
        k_p = max(1, math.ceil(per * isl / budget)) if limits.chunked_prefill else 1
        t_pf = step_time(cost, eff, _mix(isl, osl, decoding, per, per * isl / k_p, per / k_p))
        t_gap = step_time(cost, eff, _mix(isl, osl, b - per, 0, 0, 0))  # the decode step group 0 waits in
        n_pf = g * k_p
        n_dec = max(osl - 1 - (g - 1) * k_p, 0)  # decode-only steps in a cycle besides the wait step
        length = n_pf + n_dec + 1
        cycle = n_pf * t_pf.total_s + n_dec * t_dec.total_s + t_gap.total_s
        steps = [(t_pf, n_pf / length), (t_dec, n_dec / length), (t_gap, 1 / length)]
        ttft = k_p * t_pf.total_s + (t_gap.total_s + (g - 1) * k_p * t_pf.total_s) / g
        ttft_p99 = 2 * k_p * t_pf.total_s
        # between its first and last token, group 0 sees the other g − 1 groups' prefills, group j ≥ 1 all but group
        # j − 1's (which is its own wait step) and group 0's wait step: on average (g − 1)²/g prefills and (g − 1)/g gaps
        pf_seen = min((g - 1) ** 2 / g * k_p, osl - 1)
        gap_seen = min((g - 1) / g, osl - 1 - pf_seen)
        itl = ((pf_seen * t_pf.total_s + gap_seen * t_gap.total_s + (osl - 1 - pf_seen - gap_seen) * t_dec.total_s)
               / max(osl - 1, 1))
    return _Run(cycle_s=cycle, ttft_s=ttft, ttft_p99_s=ttft_p99, itl_s=itl, e2e_s=ttft + (osl - 1) * itl, steps=steps,
                prefill_steps=k_p, groups=g)


def knee_batch(cost: StepCost, limits: SchedulerLimits, eff: Efficiency, isl: int, osl: int, share: float = 0.9) -> int:
    """Smallest concurrency whose predicted output tokens/s reaches ``share`` of the maximum-load prediction
    (bisection; throughput does not fall as concurrency grows): a starting ``max_batch_size`` that gives
    most of the throughput with the lowest latency. Raises ``ValueError`` as :func:`max_batch` does."""
    b_max, _ = max_batch(limits, isl, osl)
    target = share * predict_point(cost, limits, eff, isl, osl, None).output_tokens_per_s
    lo, hi = 1, b_max
    while lo < hi:
        mid = (lo + hi) // 2
        if predict_point(cost, limits, eff, isl, osl, mid).output_tokens_per_s >= target:
            hi = mid
        else:
            lo = mid + 1
    return lo


#: latency SLO keys (ms) the planner answers, as ``trtpipe bench --goodput`` names them, and the predicted figure each is
#: checked against: TTFT against the p99 (the last group of clients to be prefilled), ITL and TPOT against the ITL
#: (equal in this model), E2E against the p99 request latency
#: SLO keys of ``--slo`` → what each is checked against: TTFT p99, ITL (= TPOT) mean, request latency with TTFT at p99
SLO_FIELDS = {"ttft": "TTFT p99", "itl": "ITL", "tpot": "ITL (= TPOT)", "e2e": "E2E with TTFT at p99"}


def slo_value(p: Prediction, key: str) -> float:
    """The predicted figure (ms) the SLO ``key`` (:data:`SLO_FIELDS`) is checked against; TTFT p99 is the mean where
    the prediction has none (maximum load)."""
    ttft_p99 = p.ttft_ms if p.ttft_p99_ms is None else p.ttft_p99_ms
    if key == "ttft":
        return ttft_p99
    if key == "e2e":
        return p.e2e_ms + ttft_p99 - p.ttft_ms
    return p.itl_ms


class SloAnswer(BaseModel):
    """The largest concurrency whose predicted latency meets every SLO (ms) at one ISL/OSL: ``concurrency`` (None when
    even one client misses), the prediction there, and what stops it going further: the SLO key missed at the next
    concurrency, or ``max_concurrency`` (the engine admits no more: extra clients only queue)."""

    slo: dict[str, float]
    concurrency: int | None
    prediction: Prediction | None
    limited_by: str


def max_concurrency_within(cost: StepCost, limits: SchedulerLimits, eff: Efficiency, isl: int, osl: int,
                           slo: dict[str, float], *, extra_error: dict[str, float] | None = None) -> SloAnswer:
    """Largest closed-loop concurrency c ≤ the engine's maximum batch (:func:`max_batch`) such that every concurrency up
    to c meets ``slo`` (key → ms, keys of :data:`SLO_FIELDS`), trying 1, 2, … in turn: latency is not monotone in the
    concurrency where the clients split into one more prefill group (:func:`prefill_groups`), so no bisection; about
    0.1 ms per concurrency tried. Raises ``ValueError`` as :func:`max_batch` does, or for an unknown key."""
    bad = [k for k in slo if k not in SLO_FIELDS]
    if bad:
        raise ValueError(f"unknown SLO {bad[0]!r} (use {', '.join(SLO_FIELDS)})")
    b_max, _ = max_batch(limits, isl, osl)

    def at(c: int) -> Prediction:
        return predict_point(cost, limits, eff, isl, osl, c, extra_error=extra_error)

    def missed(c: int) -> str | None:
        p = at(c)
        return next((k for k, v in slo.items() if slo_value(p, k) > v), None)

    for c in range(1, b_max + 1):
        if (key := missed(c)) is not None:
            return SloAnswer(slo=slo, concurrency=c - 1 or None, prediction=at(max(c - 1, 1)), limited_by=key)
    return SloAnswer(slo=slo, concurrency=b_max, prediction=at(b_max), limited_by="max_concurrency")


def predicted_tps(cost: StepCost | None, limits: SchedulerLimits | None, eff: Efficiency | None,
                  isl: int, osl: int, concurrency: int) -> float | None:
    """Predicted output tokens/s at ``concurrency`` clients, or None without model inputs or when the point
    cannot run (see :func:`max_batch`)."""
    if cost is None or limits is None or eff is None:
        return None
    try:
        return predict_point(cost, limits, eff, isl, osl, concurrency).output_tokens_per_s
    except ValueError:
        return None
