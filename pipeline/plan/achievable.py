"""Achievable throughput and latency of an in-flight-batching engine: a step-time model with fitted efficiencies.

The roofline (:mod:`pipeline.plan.perf`) is an upper bound at datasheet peaks. This module predicts
what an engine reaches: one engine iteration ("step") costs

    t_step = step_overhead + n_seqs × seq_overhead
             + pp × [ max(W / (η_bw·BW), (F_lin·n_tokens + F_head·n_logits) / (η_gemm·T_gemm))   GEMMs
                      + (n_tokens × A + n_logits × G) / (η_bw·BW)                                activation and logits traffic
                      + kv_read_tokens × kv_bytes / (η_bw·BW)                                    decode attention
                      + F_attn / (η_attn·T_attn)                                                 prefill attention
                      + n_ar × (t_ar(m) + t_sync) ]                                            tensor-parallel all-reduces

(W: weight bytes streamed per step; BW: peak DRAM bandwidth; T: dense tensor peak of the dtype; F_lin,
F_head: GEMM FLOPs per token / per emitted token; n_tokens: tokens in the step; n_logits: sequences that
emit a token; A: activation bytes each token moves through DRAM between kernels; G: logits bytes each
emitted token writes and the sampler reads back; kv_read_tokens: context
tokens whose K and V the decoding sequences read; F_attn: causal prefill attention FLOPs; n_ar all-reduces per step
(2 per layer) of m = n_tokens × hidden × 2 B (BF16 activations) each, t_ar(m) the MEASURED time of one TensorRT-LLM
all-reduce of m bytes on the GPU at the tp degree (pipeline/data/allreduce_measured.yaml, log-log interpolation,
:func:`allreduce_time_s`), or on a GPU without measurements latency + 2(tp − 1)/tp × m / BW_link (:func:`_allreduce_s`);
t_sync: the fitted per-all-reduce sync time, one for pure-decode steps and one for steps carrying a prefill, see
:class:`Efficiency`; MoE: W counts the routed experts the step's tokens select, :func:`expert_read_share`). The η's, the overheads and their sources are in :class:`Efficiency`.

The scheduler is modelled in steady state (:func:`predict_point`): B sequences in flight, each living
k_p prefill steps (1, or ceil(ISL / chunk) with chunked prefill) + OSL − 1 decode steps; B is bounded
by the requested concurrency, ``max_batch_size``, the KV cache (GUARANTEED_NO_EVICT reserves ISL + OSL
per sequence) and ``max_num_tokens`` (every token of the cycle must pass through steps of at most
max_num_tokens tokens). Steps that carry a prefill and pure decode steps are costed separately when
there is less than one prefill per step, so that concurrency 1 is a prefill followed by memory-bound
decode steps, and max load is compute-bound mixed steps.

Units: bytes, FLOPs, seconds inside; the :class:`Prediction` fields carry their unit in the name
(``_ms``, ``_tokens_per_s``). Everything here is pure arithmetic: no recipe, no I/O.
"""

from __future__ import annotations

import bisect
import math
from collections.abc import Callable
from typing import Literal

from pydantic import BaseModel, ConfigDict, Field

Policy = Literal["GUARANTEED_NO_EVICT", "MAX_UTILIZATION"]
SyncScaling = Literal["none", "log2", "linear"]


class StepCost(BaseModel):
    """Per-GPU cost coefficients of one engine step (bytes, FLOPs, bytes/s, FLOP/s).

    ``weight_bytes``: GEMM weights streamed once per step (Linear layers + lm_head, not the embedding
    table, of which a step reads only a few rows; for MoE without the routed experts, ``expert_weight_bytes``,
    of which a step reads the share its tokens select). ``kv_token_bytes``: K and V bytes per context token.
    ``linear_flops_per_token``: 2 × decoder Linear parameters per GPU. ``head_flops_per_token``:
    2 × vocab × hidden / tp, paid only by tokens whose logits are computed (one per emitting sequence).
    ``attn_flops_coeff``: 2 × layers × heads × head_dim per GPU, so that a causal prefill of n tokens
    costs coeff × n² FLOPs (QKᵀ and PV, half the square). ``act_bytes_per_token``: bytes of activations
    one token writes and reads back between the kernels of a step (norms, residual adds, GEMM outputs,
    SiLU·up, attention in/out; :func:`activation_traffic_bytes`). ``logit_bytes_per_token``: bytes of
    logits an emitted token writes (lm_head output) and the sampler reads: 2 × vocab / tp × 4 B (fp32). ``bandwidth``: peak DRAM bytes/s;
    ``gemm_flops``/``attn_flops``: dense peak FLOP/s of the GEMM and context-attention dtypes.
    """

    model_config = ConfigDict(frozen=True)

    weight_bytes: float = Field(gt=0)
    kv_token_bytes: float = Field(gt=0)
    linear_flops_per_token: float = Field(gt=0)
    head_flops_per_token: float = Field(ge=0)
    attn_flops_coeff: float = Field(ge=0)
    act_bytes_per_token: float = Field(default=0.0, ge=0)
    logit_bytes_per_token: float = Field(default=0.0, ge=0)
    bandwidth: float = Field(gt=0)
    gemm_flops: float = Field(gt=0)
    attn_flops: float = Field(gt=0)
    pp_size: int = Field(default=1, ge=1)
    #: MoE: bytes of the routed experts per GPU (not in ``weight_bytes``), routed experts per layer and experts
    #: each token is routed to; a step reads the experts its tokens chose (:func:`expert_read_share`)
    expert_weight_bytes: float = Field(default=0.0, ge=0)
    num_experts: int = Field(default=0, ge=0)
    experts_per_token: int = Field(default=0, ge=0)
    #: tensor parallelism: bytes each GPU sends per token per step in its all-reduces (ring: 2(tp−1)/tp × hidden ×
    #: activation bytes, 2 all-reduces per layer: after attention's o_proj and the MLP's down_proj), the number of
    #: all-reduces per step (2 × layers per stage), and the GPU-to-GPU bandwidth per direction (B/s); 0 when tp = 1;
    #: the tensor-parallel degree; ``allreduce_measured``: the measured (message bytes, seconds) points of one
    #: all-reduce on this GPU at this tp, ascending (pipeline/data/allreduce_measured.yaml; empty: not measured, the
    #: bandwidth formula applies), see :func:`_allreduce_s`
    allreduce_bytes_per_token: float = Field(default=0.0, ge=0)
    allreduces_per_step: int = Field(default=0, ge=0)
    link_bandwidth: float = Field(default=0.0, ge=0)
    allreduce_measured: tuple[tuple[float, float], ...] = ()
    tp_size: int = Field(default=1, ge=1)


def allreduce_bytes_per_token(hidden: int, layers: int, tp: int, act_bytes: int = 2) -> float:
    """Bytes one GPU sends (and receives) per token per step in tensor parallelism's all-reduces: 2 per layer
    (the row-parallel o_proj and down_proj outputs, Megatron-style TP as TensorRT-LLM does it), each a ring
    all-reduce of hidden × act_bytes per token, which moves 2(tp − 1)/tp of it over each GPU's link.
    = layers × 2 × 2(tp − 1)/tp × hidden × act_bytes; 0 at tp = 1. Llama-3.3-70B, tp 2, BF16 activations:
    80 × 2 × 1 × 8192 × 2 = 2.62 MB per token."""
    return layers * 2 * 2 * (tp - 1) / tp * hidden * act_bytes


def expert_read_share(num_experts: int, experts_per_token: int, n_tokens: float) -> float:
    """Expected share of a layer's routed experts that ``n_tokens`` tokens select, each choosing
    ``experts_per_token`` of ``num_experts`` uniformly and independently: 1 − (1 − k/E)^n. One token reads
    k/E of the experts' weights; a large batch reads all of them. 0 for a dense model (no experts)."""
    if num_experts <= 0:
        return 0.0
    return 1.0 - (1.0 - experts_per_token / num_experts) ** max(n_tokens, 1.0)


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


class Efficiency(BaseModel):
    """The model's efficiency parameters (dimensionless fractions of peak, and overheads).

    - ``bw_frac`` η_bw: achieved fraction of peak DRAM bandwidth when a step streams weights and KV.
    - ``gemm_frac`` η_gemm: achieved fraction of the dense tensor-core peak in the GEMMs.
    - ``attn_frac`` η_attn: achieved fraction of the dense tensor-core peak in prefill attention (FMHA).
    - ``seq_overhead_us``: time per sequence in a step outside the GEMM/attention roofline (sampling,
      logits copy, the runtime's per-request bookkeeping), µs.
    - ``step_overhead_ms``: fixed time per step (kernel launches, scheduler iteration), ms.
    - ``allreduce_sync_us`` t_sync: fixed time per tensor-parallel all-reduce of a pure-decode step beyond its
      isolated measured time (the ranks meet at a barrier after drifting apart since the previous one; the step runs
      as one CUDA graph, so no launch gap), µs; none at tp = 1.
    - ``allreduce_sync_prefill_us``: the same for a step that carries a prefill (the PyTorch backend runs it eagerly,
      without a CUDA graph: each layer's kernels are launched from Python, and every all-reduce waits for the slowest
      rank's launches), µs; None: ``allreduce_sync_us``.
    - ``allreduce_sync_tp_scaling`` / ``allreduce_sync_prefill_tp_scaling``: how each sync grows with the tensor-parallel
      degree (:data:`SYNC_SCALE`): "none" the same at every tp > 1; "log2" × log2(tp)/3 (the barrier's depth, the value
      is tp 8's); "linear" × (tp − 1)/7 (one more rank to wait for each, the value is tp 8's).
    - ``rel_error``: expected relative error of the output tokens/s where the parameters were calibrated
      (one standard deviation of the log error, from leave-one-GPU-out refits).
    - ``step_overhead_uncertainty_ms``: how far ``step_overhead_ms`` may be off (it is not identifiable
      from max-load data); adds (uncertainty / step time) to the error of low-concurrency predictions.

    ``source`` says where the numbers come from (fit, measurement, assumption).
    """

    model_config = ConfigDict(frozen=True)

    bw_frac: float = Field(gt=0, le=1)
    gemm_frac: float = Field(gt=0, le=1)
    attn_frac: float = Field(gt=0, le=1)
    seq_overhead_us: float = Field(ge=0)
    step_overhead_ms: float = Field(ge=0)
    rel_error: float = Field(ge=0)
    step_overhead_uncertainty_ms: float = Field(default=0.0, ge=0)
    allreduce_sync_us: float = Field(default=0.0, ge=0)
    allreduce_sync_prefill_us: float | None = Field(default=None, ge=0)
    allreduce_sync_tp_scaling: SyncScaling = "none"
    allreduce_sync_prefill_tp_scaling: SyncScaling = "none"
    source: str = ""
    #: which fitted model these are (the engine path's, the PyTorch backend's, a host's measurement)
    name: str = ""


class StepMix(BaseModel):
    """One step's contents (averages over the steady state): sequences, tokens, emitted logits,
    context tokens read by decode attention, and prefill-attention work in units of attn_flops_coeff."""

    model_config = ConfigDict(frozen=True)

    n_seqs: float
    n_tokens: float
    n_logits: float
    kv_read_tokens: float
    attn_units: float = 0.0


class StepTime(BaseModel):
    """Seconds of one step, split by term (``gemm`` is the max of its weight-read and compute times)."""

    model_config = ConfigDict(frozen=True)

    overhead_s: float
    gemm_s: float
    gemm_bound: Literal["memory", "compute"]
    act_s: float
    kv_s: float
    attn_s: float
    comm_s: float = 0.0

    @property
    def total_s(self) -> float:
        """Sum of the terms (s)."""
        return self.overhead_s + self.gemm_s + self.act_s + self.kv_s + self.attn_s + self.comm_s


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


def step_time(cost: StepCost, eff: Efficiency, mix: StepMix) -> StepTime:
    """Time of one step with contents ``mix`` (see the module docstring for the formula).

    GEMMs: the weights are read once per step whatever the number of tokens, so their time is the larger
    of weight_bytes / (η_bw·BW) and the GEMM FLOPs / (η_gemm·T). Decode attention reads every context
    token's K and V (memory-bound); prefill attention is compute-bound. Pipeline stages run in series.
    """
    pp = cost.pp_size
    bw = eff.bw_frac * cost.bandwidth
    experts = cost.expert_weight_bytes * expert_read_share(cost.num_experts, cost.experts_per_token, mix.n_tokens)
    t_w = (cost.weight_bytes + experts) / bw
    t_c = (cost.linear_flops_per_token * mix.n_tokens + cost.head_flops_per_token * mix.n_logits) / (eff.gemm_frac * cost.gemm_flops)
    return StepTime(
        overhead_s=eff.step_overhead_ms * 1e-3 + mix.n_seqs * eff.seq_overhead_us * 1e-6,
        gemm_s=pp * max(t_w, t_c),
        gemm_bound="compute" if t_c > t_w else "memory",
        act_s=pp * (mix.n_tokens * cost.act_bytes_per_token + mix.n_logits * cost.logit_bytes_per_token) / bw,
        kv_s=pp * mix.kv_read_tokens * cost.kv_token_bytes / bw,
        attn_s=pp * cost.attn_flops_coeff * mix.attn_units / (eff.attn_frac * cost.attn_flops),
        comm_s=pp * (_allreduce_s(cost, mix.n_tokens)
                     + (cost.allreduces_per_step * _sync_us(eff, mix, cost.tp_size) * 1e-6 if mix.n_tokens > 0 else 0.0)),
    )


#: Factor of a fitted sync time at tensor parallelism tp, per scaling (1 at tp 8 for "log2" and "linear").
SYNC_SCALE: dict[str, Callable[[int], float]] = {
    "none": lambda tp: 1.0,
    "log2": lambda tp: math.log2(tp) / 3,
    "linear": lambda tp: (tp - 1) / 7,
}


def _sync_us(eff: Efficiency, mix: StepMix, tp: int = 8) -> float:
    """Sync time (µs) of one all-reduce at tensor parallelism ``tp`` in a step of ``mix``: the prefill-carrying
    steps' own when set, each scaled with tp as its ``*_tp_scaling`` says."""
    if mix.attn_units > 0 and eff.allreduce_sync_prefill_us is not None:
        return eff.allreduce_sync_prefill_us * SYNC_SCALE[eff.allreduce_sync_prefill_tp_scaling](tp)
    return eff.allreduce_sync_us * SYNC_SCALE[eff.allreduce_sync_tp_scaling](tp)


#: Fixed time (µs) of one all-reduce on a GPU (or tp) without measured all-reduce times, added to its bytes over the
#: link at the full per-direction bandwidth (η_link = 1). Judgment: about 3× the small-message floor measured on
#: NVSwitch nodes (2.6–3.8 µs at 128–512 elements, H100/H200 tp 2–8, pipeline/data/allreduce_measured.yaml), for a
#: launch plus a barrier over a slower link (PCIe); such plans carry the "parallelism" error term
#: (:data:`pipeline.plan.model_inputs.UNCALIBRATED_ERROR`).
FALLBACK_ALLREDUCE_LATENCY_US = 10.0


def allreduce_time_s(points: tuple[tuple[float, float], ...], msg_bytes: float) -> float:
    """Seconds of one all-reduce of ``msg_bytes`` from measured (bytes, seconds) ``points`` (ascending in bytes):
    the tabulated value at a tabulated size; between two sizes, linear in log(time) over log(bytes); below the
    smallest, the smallest's time (the latency floor); above the largest, its time × bytes / its bytes
    (bandwidth-bound)."""
    xs = [x for x, _ in points]
    i = bisect.bisect_left(xs, msg_bytes)
    if i < len(xs) and xs[i] == msg_bytes:
        return points[i][1]
    if i == 0:
        return points[0][1]
    if i == len(xs):
        return points[-1][1] * msg_bytes / xs[-1]
    (x0, t0), (x1, t1) = points[i - 1], points[i]
    w = math.log(msg_bytes / x0) / math.log(x1 / x0)
    return math.exp(math.log(t0) + w * math.log(t1 / t0))


def _allreduce_s(cost: StepCost, n_tokens: float) -> float:
    """Seconds of one stage's all-reduces in a step of ``n_tokens`` tokens (not overlapped with compute: each sits
    between two GEMMs): ``allreduces_per_step`` all-reduces of m = n_tokens × hidden × activation bytes each.

    - measured GPU and tp (``cost.allreduce_measured``): each takes :func:`allreduce_time_s` of m — TensorRT-LLM's
      AllReduce with its AUTO strategy as AIConfigurator timed it (custom one-/two-shot kernels for small messages,
      NCCL for large ones, the choice TensorRT-LLM makes; nothing fitted);
    - otherwise: 2(tp − 1)/tp × m over the link at full bandwidth (ring) + :data:`FALLBACK_ALLREDUCE_LATENCY_US`.
    """
    if cost.allreduces_per_step == 0 or cost.allreduce_bytes_per_token <= 0 or n_tokens <= 0:
        return 0.0
    tp = cost.tp_size
    ring = n_tokens * cost.allreduce_bytes_per_token  # bytes per GPU per step, 2(tp − 1)/tp × m per all-reduce
    if cost.allreduce_measured:
        msg = ring / (cost.allreduces_per_step * 2 * (tp - 1) / tp)
        return cost.allreduces_per_step * allreduce_time_s(cost.allreduce_measured, msg)
    if cost.link_bandwidth <= 0:
        return 0.0
    return ring / cost.link_bandwidth + cost.allreduces_per_step * FALLBACK_ALLREDUCE_LATENCY_US * 1e-6


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
        for k in ("overhead_s", "gemm_s", "act_s", "kv_s", "attn_s", "comm_s"):
            split[k] = split.get(k, 0.0) + w * getattr(t, k)
        mem_s += w * (t.act_s + t.kv_s + t.comm_s + (t.gemm_s if t.gemm_bound == "memory" else 0.0))
        cmp_s += w * (t.attn_s + (t.gemm_s if t.gemm_bound == "compute" else 0.0))
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
                   kv_read_tokens=decoding * (isl + osl / 2), attn_units=prompt_tokens * isl)


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
        decoding = max(b - 2 * b / g, 0.0) if g > 1 else 0.0
        g_new = min(b, max(1, math.ceil(b * isl / max(n - decoding, limits.tokens_per_block))))
        if g_new == g:
            break
        g = g_new
    return g


def _closed_loop(cost: StepCost, limits: SchedulerLimits, eff: Efficiency, isl: int, osl: int, b: int) -> _Run:
    """B clients in a closed loop of identical requests, moving in g groups (:func:`prefill_groups`).

    One cycle: each group's prompts are prefilled in one step (or, when one prompt exceeds a step, k_p steps) and
    emit their first token; then OSL − 1 decode steps. A request's next one arrives while the engine runs the step
    after its last token, so with g > 1 it waits that step: the cycle is L = g·k_p + (OSL − 1) + 1 steps, of which
    g·k_p carry one group's prompts next to B − 2B/g decoding sequences (the others but the one waiting), and the
    rest decode (B − B/g sequences in one of them, B in the others). With g = 1 all requests end in the same step and
    the next ones find the engine idle: L = k_p + OSL − 1, prefill alone.

    TTFT: g = 1: the prefill step(s); g > 1: the step waited + its own prefill — the first group waits a decode
    step, the others the previous group's prefill step (mean over groups; p99 = the last group's). ITL: a
    request's OSL − 1 later tokens span the other groups' prefill steps and decode steps."""
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
        decoding = max(b - 2 * per, 0.0)
        budget = max(limits.max_num_tokens - decoding, limits.tokens_per_block)
        k_p = max(1, math.ceil(per * isl / budget)) if limits.chunked_prefill else 1
        t_pf = step_time(cost, eff, _mix(isl, osl, decoding, per, per * isl / k_p, per / k_p))
        t_gap = step_time(cost, eff, _mix(isl, osl, b - per, 0, 0, 0))  # the step a group waits in
        n_pf = g * k_p
        n_dec = max(osl - 1 - (g - 1) * k_p, 0)  # decode-only steps in a cycle besides the wait step
        length = n_pf + n_dec + 1
        cycle = n_pf * t_pf.total_s + n_dec * t_dec.total_s + t_gap.total_s
        steps = [(t_pf, n_pf / length), (t_dec, n_dec / length), (t_gap, 1 / length)]
        ttft = k_p * t_pf.total_s + (t_gap.total_s + (g - 1) * k_p * t_pf.total_s) / g
        ttft_p99 = 2 * k_p * t_pf.total_s
        other_pf = min((g - 1) * k_p, osl - 1)
        itl = (other_pf * t_pf.total_s + (osl - 1 - other_pf) * t_dec.total_s) / max(osl - 1, 1)
    return _Run(cycle_s=cycle, ttft_s=ttft, ttft_p99_s=ttft_p99, itl_s=itl, e2e_s=ttft + (osl - 1) * itl, steps=steps,
                prefill_steps=k_p, groups=g)


def activation_traffic_bytes(hidden: int, heads: int, kv_heads: int, head_dim: int, intermediate: int, layers: int,
                             act_bytes: int = 2, tp: int = 1) -> float:
    """DRAM bytes of activations one token moves between the kernels of a step (per GPU), Llama layer:

    per layer, in elements: 2 RMSNorms (read h, write h) 4h + 2 residual adds (read 2h, write h) 6h +
    q/k/v and gate/up read the normed input 2h + o_proj and down write h … 1h → 13h; QKV output written and
    read by attention 2(H + 2K)d/tp; attention output written and read by o_proj 2Hd/tp; gate/up output
    written (2I) and read by SiLU·mul (2I), its product written (I) and read by down (I) 6I/tp.
    Bytes = layers × elements × act_bytes (2: BF16/FP16 activations). Llama-3.1-8B: 32 × 159,744 × 2 B
    = 10.2 MB per token. Counted from the unfused graph (TensorRT-LLM fuses some of it: an upper bound).
    """
    per_layer = 13 * hidden + (2 * (heads + 2 * kv_heads) * head_dim + 2 * heads * head_dim + 6 * intermediate) / tp
    return layers * per_layer * act_bytes


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
