"""Throughput bounds of the planner: decode bandwidth/compute roofline and prefill compute bound.

These are upper bounds from datasheet peaks (no kernel efficiency, no scheduling overhead, no
communication): measured throughput is typically 50–80 % of them. Units: bytes, seconds, FLOPs,
tokens/s. ``bandwidth`` is bytes/s per GPU, ``flops`` dense tensor ops/s per GPU of the GEMM dtype.
"""

from __future__ import annotations

from pydantic import BaseModel, ConfigDict

from pipeline.core import hardware
from pipeline.core.geometry import ModelGeometry

#: GEMM compute dtype per qformat: the tensor-core rate that bounds prefill (and decode when compute-bound).
#: Weight-only formats (int4_awq, int4_wo, int8_wo) dequantize to 16-bit and run 16-bit GEMMs.
QFORMAT_COMPUTE: dict[str, str] = {
    "full_prec": "bf16", "fp8": "fp8", "int8_sq": "int8", "int4_awq": "bf16", "w4a8_awq": "fp8",
    "int8_wo": "bf16", "int4_wo": "bf16", "nvfp4": "fp4",
}


def matmul_params(geo: ModelGeometry) -> int:
    """Parameters that take part in GEMMs per token: layers × Linear params a token passes through (MoE: its
    routed experts only) + vocab × hidden (lm_head). The embedding is a lookup, the norms are elementwise: neither counts."""
    return geo.num_hidden_layers * geo.layer_active_linear_params + geo.vocab_size * geo.hidden_size


def decode_flops_per_token(geo: ModelGeometry, context: float) -> float:
    """FLOPs to generate one token at ``context`` tokens of history (whole model, all GPUs).

    2 × matmul_params + 4 × layers × heads × head_dim × context (QKᵀ and PV, 2 FLOPs per MAC each).
    """
    return 2 * matmul_params(geo) + 4 * geo.num_hidden_layers * geo.num_attention_heads * geo.head_dim * context


def prefill_flops(geo: ModelGeometry, isl: int) -> float:
    """FLOPs to prefill one prompt of ``isl`` tokens (whole model): 2 × matmul_params × isl +
    2 × layers × heads × head_dim × isl² (causal attention: half of the 4·L·H·d·isl² of full attention)."""
    return 2 * matmul_params(geo) * isl + 2 * geo.num_hidden_layers * geo.num_attention_heads * geo.head_dim * isl * isl


def peak_flops(gpu: hardware.GpuSpec, compute: str, dtype_bytes: int) -> float:
    """Dense tensor peak (FLOP/s) of the GEMM dtype; falls back to BF16 when the GPU lacks that path."""
    rate = {"bf16": gpu.bf16_tflops, "fp8": gpu.fp8_tflops, "fp4": gpu.fp4_tflops, "int8": gpu.int8_tops}[compute]
    if rate is None:
        rate = gpu.bf16_tflops
    if compute == "bf16" and dtype_bytes == 4:
        rate /= 2  # fp32 runs as TF32 at half the BF16 rate
    return rate * 1e12


class Roofline(BaseModel):
    """Per-GPU inputs of the roofline (bytes, bytes/s, FLOPs, FLOP/s), for one ISL/OSL scenario."""

    model_config = ConfigDict(frozen=True)

    weight_bytes: float
    kv_token_bytes: float
    bandwidth: float
    flops: float
    flops_per_token: float
    avg_context: float
    prefill_flops: float
    pp_size: int = 1
    #: MoE: the routed experts' bytes per GPU (part of ``weight_bytes``), experts per layer and per token; a decode
    #: step reads only the share its tokens select (:func:`pipeline.plan.step.expert_read_share`)
    expert_bytes: float = 0.0
    num_experts: int = 0
    experts_per_token: int = 0

    def weight_bytes_read(self, batch: int) -> float:
        """Weight bytes one decode step of ``batch`` tokens reads: ``weight_bytes``, less the routed experts no token
        of the step selected (MoE; = ``weight_bytes`` for a dense model)."""
        from pipeline.plan.step import expert_read_share

        unread = 1.0 - expert_read_share(self.num_experts, self.experts_per_token, batch) if self.num_experts else 0.0
        return self.weight_bytes - self.expert_bytes * unread

    def step_time_s(self, batch: int) -> float:
        """Seconds for one decode step of ``batch`` sequences (one token each), pipeline stages in series.

        t_mem = (weight_bytes_read(batch) + batch × avg_context × kv_token_bytes) / bandwidth
        t_cmp = batch × flops_per_token / flops
        step  = pp × max(t_mem, t_cmp)   (per-GPU bytes and FLOPs; no overlap of PP stages assumed)
        """
        t_mem = (self.weight_bytes_read(batch) + batch * self.avg_context * self.kv_token_bytes) / self.bandwidth
        t_cmp = batch * self.flops_per_token / self.flops
        return self.pp_size * max(t_mem, t_cmp)

    def bound(self, batch: int) -> str:
        """``"memory"`` or ``"compute"``: which side of the roofline a decode step at ``batch`` is on."""
        t_mem = (self.weight_bytes_read(batch) + batch * self.avg_context * self.kv_token_bytes) / self.bandwidth
        return "compute" if batch * self.flops_per_token / self.flops > t_mem else "memory"

    def decode_tokens_per_s(self, batch: int) -> float:
        """Output tokens/s of pure decode at ``batch`` concurrent sequences: batch / step_time_s(batch)."""
        return batch / self.step_time_s(batch)

    def prefill_time_s(self) -> float:
        """Seconds to prefill one prompt alone: pp × max(prefill_flops / flops, weight_bytes / bandwidth)."""
        return self.pp_size * max(self.prefill_flops / self.flops, self.weight_bytes / self.bandwidth)

    def prefill_marginal_s(self) -> float:
        """Seconds one prompt adds to a busy in-flight batch: pp × prefill_flops / flops (its weight reads
        are shared with the decode step it is batched with)."""
        return self.pp_size * self.prefill_flops / self.flops

    def output_tokens_per_s(self, batch: int, osl: int) -> float:
        """Output tokens/s at concurrency ``batch`` counting prefill (in-flight batching, steady state).

        N requests take N/batch × osl decode steps plus N prefills:
        tokens/s = osl / (osl × step_time_s(batch) / batch + prefill_marginal_s()).
        """
        return osl / (osl * self.step_time_s(batch) / batch + self.prefill_marginal_s())

    def crossover_batch(self) -> float | None:
        """Batch where decode turns compute-bound: t_mem(B) = t_cmp(B) →
        B* = (weight_bytes / bandwidth) / (flops_per_token / flops − avg_context × kv_token_bytes / bandwidth);
        ``None`` when the KV reads grow at least as fast as compute (never compute-bound)."""
        denom = self.flops_per_token / self.flops - self.avg_context * self.kv_token_bytes / self.bandwidth
        if denom <= 0:
            return None
        return (self.weight_bytes / self.bandwidth) / denom
