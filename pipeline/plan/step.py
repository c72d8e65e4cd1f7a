"""One engine step's time: the cost model under :mod:`pipeline.plan.achievable`'s scheduler.

One engine iteration ("step") costs

    t_step = step_overhead + n_seqs × seq_overhead
             + pp × [ max(W / (η_bw·BW), (F_lin·n_tokens + F_head·n_logits) / (η_gemm·T_gemm))   GEMMs
                      + (n_tokens × A + n_logits × G) / (η_bw·BW)                                activation and logits traffic
                      + kv_read_tokens × kv_bytes / (η_bw·BW)                                    decode attention
                      + F_attn / (η_attn·T_attn)                                                 prefill attention
                      + n_ar × (t_ar(m) + t_sync) ]                                              tensor-parallel all-reduces

(W: weight bytes streamed per step; BW: peak DRAM bandwidth; T: dense tensor peak of the dtype; F_lin,
F_head: GEMM FLOPs per token / per emitted token; n_tokens: tokens in the step; n_logits: sequences that
emit a token; A: activation bytes each token moves through DRAM between kernels; G: logits bytes each
emitted token writes and the sampler reads back; kv_read_tokens: context
tokens whose K and V the decoding sequences read; F_attn: causal prefill attention FLOPs; n_ar all-reduces per step
(2 per layer) of m = n_tokens × hidden × 2 B (BF16 activations) each, t_ar(m) the MEASURED time of one TensorRT-LLM
all-reduce of m bytes on the GPU at the tp degree (pipeline/data/allreduce_measured.yaml, log-log interpolation,
:func:`allreduce_time_s`), or on a GPU without measurements latency + 2(tp − 1)/tp × m / BW_link (:func:`_allreduce_s`);
t_sync: the fitted per-all-reduce sync time, one for pure-decode steps and one for steps carrying a prefill, see
:class:`Efficiency`; MoE: W counts the routed experts the step's tokens select, :func:`expert_read_share`). The η's,
the overheads and their sources are in :class:`Efficiency`.

Units: bytes, FLOPs, bytes/s, FLOP/s, seconds. Pure arithmetic: no recipe, no I/O.
"""

from __future__ import annotations

import bisect
import math
from collections.abc import Callable
from typing import Literal

from pydantic import BaseModel, ConfigDict, Field

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
    #: vision-language (mllama): bytes of cross-attention K/V each decoding sequence reads per step (its images'
    #: encoder tokens × cross-attention layers); FLOPs each new prompt adds once (vision encoder over its images, the
    #: cross-attention K/V projections of the encoder tokens and its prompt's cross-attention) and the peak FLOP/s they
    #: run at (the encoder dtype); pipeline/plan/vision.py vision_step_terms
    cross_kv_bytes_per_seq: float = Field(default=0.0, ge=0)
    prompt_extra_flops: float = Field(default=0.0, ge=0)
    prompt_extra_flops_rate: float = Field(default=0.0, ge=0)


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
    n_decoding: float = 0.0
    new_prompts: float = 0.0


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
    vision_s: float = 0.0

    @property
    def total_s(self) -> float:
        """Sum of the terms (s)."""
        return self.overhead_s + self.gemm_s + self.act_s + self.kv_s + self.attn_s + self.comm_s + self.vision_s


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
        kv_s=pp * (mix.kv_read_tokens * cost.kv_token_bytes + mix.n_decoding * cost.cross_kv_bytes_per_seq) / bw,
        attn_s=pp * cost.attn_flops_coeff * mix.attn_units / (eff.attn_frac * cost.attn_flops),
        comm_s=pp * (_allreduce_s(cost, mix.n_tokens)
                     + (cost.allreduces_per_step * _sync_us(eff, mix, cost.tp_size) * 1e-6 if mix.n_tokens > 0 else 0.0)),
        vision_s=(mix.new_prompts * cost.prompt_extra_flops / (eff.gemm_frac * cost.prompt_extra_flops_rate)
                  if cost.prompt_extra_flops else 0.0),
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
