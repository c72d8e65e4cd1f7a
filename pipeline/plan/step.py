"""One engine step's time: the cost model under :mod:`pipeline.plan.achievable`'s scheduler.

One engine iteration ("step") costs

    t_step = step_overhead + n_seqs × seq_overhead
             + pp × [ max(W / (η_bw·BW), (F_lin·n_tokens + F_head·n_logits) / (η_gemm·T_gemm))   GEMMs
                      + (n_tokens × A + n_logits × G) / (η_bw·BW)                                activation and logits traffic
                      + kv_read_tokens × kv_bytes / (η_bw·BW)                                    decode attention
                      + F_attn / (η_attn·T_attn)                                                 prefill attention
                      + n_tokens × R / (η_link·BW_link) + n_ar × t_ar ]                          tensor-parallel all-reduces

(W: weight bytes streamed per step; BW: peak DRAM bandwidth; T: dense tensor peak of the dtype; F_lin,
F_head: GEMM FLOPs per token / per emitted token; n_tokens: tokens in the step; n_logits: sequences that
emit a token; A: activation bytes each token moves through DRAM between kernels; G: logits bytes each
emitted token writes and the sampler reads back; kv_read_tokens: context
tokens whose K and V the decoding sequences read; F_attn: causal prefill attention FLOPs; R: bytes a GPU sends per
token in the step's ring all-reduces, n_ar of them per step, t_ar the fixed time of one, BW_link the GPU-to-GPU
bandwidth per direction; MoE: W counts the routed experts the step's tokens select, :func:`expert_read_share`). The
η's, the overheads and their sources are in :class:`Efficiency`.

Units: bytes, FLOPs, bytes/s, FLOP/s, seconds. Pure arithmetic: no recipe, no I/O.
"""

from __future__ import annotations

from typing import Literal

from pydantic import BaseModel, ConfigDict, Field


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
    #: all-reduces per step (2 × layers per stage), and the GPU-to-GPU bandwidth per direction (B/s); 0 when tp = 1
    allreduce_bytes_per_token: float = Field(default=0.0, ge=0)
    allreduces_per_step: int = Field(default=0, ge=0)
    link_bandwidth: float = Field(default=0.0, ge=0)


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
    #: achieved fraction of the per-direction link bandwidth in the all-reduces, and the fixed time of one
    #: all-reduce (launch + synchronisation across the GPUs, µs); tensor parallelism only
    link_frac: float = Field(default=1.0, gt=0, le=1)
    allreduce_latency_us: float = Field(default=0.0, ge=0)
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
        comm_s=pp * _allreduce_s(cost, eff, mix.n_tokens),
    )


def _allreduce_s(cost: StepCost, eff: Efficiency, n_tokens: float) -> float:
    """Seconds of one stage's all-reduces in a step of ``n_tokens`` tokens: bytes / (η_link × link bandwidth)
    + all-reduces × latency (not overlapped with compute: each all-reduce sits between two GEMMs)."""
    if cost.allreduces_per_step == 0 or cost.link_bandwidth <= 0:
        return 0.0
    return (n_tokens * cost.allreduce_bytes_per_token / (eff.link_frac * cost.link_bandwidth)
            + cost.allreduces_per_step * eff.allreduce_latency_us * 1e-6)


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
