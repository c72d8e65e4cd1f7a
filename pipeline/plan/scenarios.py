"""One ISL/OSL scenario of a plan: how many sequences fit, the predicted throughput and latency, and (on a GPU) the
roofline bound against batch size.

Per ISL/OSL (tokens): sequences that fit = KV blocks // ceil((ISL+OSL) / tokens_per_block); concurrency =
min(that, max_batch_size, max_num_tokens); the achievable-throughput model (:mod:`pipeline.plan.achievable`)
at maximum load and at the recipe's bench concurrencies; on a GPU the decode/prefill roofline
(:class:`~pipeline.plan.perf.Roofline`) → output tokens/s vs batch and the batch where it saturates
(compute-bound crossover, KV capacity, max_batch_size or max_num_tokens).
"""

from __future__ import annotations

import math
from collections.abc import Iterable
from dataclasses import dataclass, field

from pipeline.core import hardware
from pipeline.core.geometry import ModelGeometry
from pipeline.plan import memory as mem
from pipeline.plan.achievable import (
    SchedulerLimits,
    knee_batch,
    max_concurrency_within,
    predict_point,
    predicted_tps,
)
from pipeline.plan.perf import Roofline, decode_flops_per_token, prefill_flops
from pipeline.plan.result import MemoryPlan, ScenarioPlan, ThroughputPoint
from pipeline.plan.step import Efficiency, StepCost
from pipeline.recipe import Recipe


@dataclass(frozen=True)
class Target:
    """What every scenario of one plan is planned against: the recipe and model, the memory plan, the GPU
    (``spec``; None on the cpu target) with its dense peak FLOP/s of the GEMM dtype, the parallelism, and the
    achievable-throughput model's inputs (None when the KV cache or the device memory holds nothing)."""

    recipe: Recipe
    geo: ModelGeometry
    memory: MemoryPlan
    spec: hardware.GpuSpec | None
    peak_flops: float | None
    tp: int
    pp: int
    cost: StepCost | None
    scheduler: SchedulerLimits | None
    efficiency: Efficiency | None
    error_terms: dict[str, float] = field(default_factory=dict)
    #: closed-loop concurrencies to predict (default: the recipe's ``bench.concurrency``) and the latency SLO (ms) whose
    #: largest concurrency to find (none: no search)
    concurrency: tuple[int, ...] = ()
    slo: dict[str, float] = field(default_factory=dict)

    @property
    def concurrencies(self) -> list[int]:
        """The closed-loop concurrencies predicted per scenario, ascending."""
        return sorted(set(self.concurrency or self.recipe.bench.concurrency))


def batch_points(max_conc: int, extra: Iterable[int]) -> list[int]:
    """Batch sizes of a roofline curve: the powers of two up to ``max_conc``, ``max_conc`` itself and the
    ``extra`` sizes (bench concurrencies, the saturation batch) within [1, max_conc]."""
    pts = {1 << i for i in range(0, 20) if (1 << i) <= max_conc} | {max_conc}
    pts |= {b for b in extra if 1 <= b <= max_conc}
    return sorted(pts)


def plan_scenario(t: Target, isl: int, osl: int, warnings: list[str]) -> ScenarioPlan:
    """The :class:`ScenarioPlan` of ISL/OSL (tokens) on ``t``; problems that leave a figure out are appended to
    ``warnings`` (no prediction: a prompt no step can hold; the batch cap far below what the KV cache allows)."""
    b = t.recipe.build
    bps = mem.blocks_per_sequence(isl + osl, b.tokens_per_block, b.max_beam_width)
    kv_seqs = (t.memory.kv_tokens // b.tokens_per_block) // bps
    limits = {"kv_cache": kv_seqs, "max_batch_size": b.max_batch_size, "max_num_tokens": b.max_num_tokens}
    lim = min(limits, key=lambda k: (limits[k], k != "kv_cache"))
    conc = max(limits[lim], 0)
    sp = ScenarioPlan(isl=isl, osl=osl, blocks_per_sequence=bps, kv_max_sequences=kv_seqs,
                      max_concurrency=conc, concurrency_limited_by=lim)
    if conc >= 1:
        _predict(t, sp, warnings)
        if t.spec is not None:
            _roofline(t, sp, limits, warnings)
    return sp


def _predict(t: Target, sp: ScenarioPlan, warnings: list[str]) -> None:
    """The achievable-throughput predictions of ``sp``: at maximum load, per bench concurrency, and the knee."""
    if t.cost is None or t.scheduler is None or t.efficiency is None:
        return
    isl, osl = sp.isl, sp.osl
    try:
        sp.predicted = predict_point(t.cost, t.scheduler, t.efficiency, isl, osl, None, extra_error=t.error_terms)
        sp.predicted_by_concurrency = [predict_point(t.cost, t.scheduler, t.efficiency, isl, osl, c, extra_error=t.error_terms)
                                       for c in t.concurrencies]
        sp.knee_batch = knee_batch(t.cost, t.scheduler, t.efficiency, isl, osl)
        if t.slo:
            sp.within_slo = max_concurrency_within(t.cost, t.scheduler, t.efficiency, isl, osl, t.slo, extra_error=t.error_terms)
    except ValueError as e:
        warnings.append(f"ISL {isl}/OSL {osl}: no throughput prediction: {e}")


def _roofline(t: Target, sp: ScenarioPlan, limits: dict[str, int], warnings: list[str]) -> None:
    """The GPU roofline of ``sp`` (per GPU: weights, KV bytes, datasheet bandwidth and peak): prefill time,
    compute-bound crossover, saturation batch, the bound at it and the curve vs batch; warns when
    build.max_batch_size caps a decode that would stay memory-bound to twice the batch."""
    assert t.spec is not None and t.peak_flops is not None
    b, geo, isl, osl, conc = t.recipe.build, t.geo, sp.isl, sp.osl, sp.max_concurrency
    avg_ctx = isl + osl / 2
    roof = Roofline(
        weight_bytes=t.memory.weights.per_gpu_bytes, kv_token_bytes=t.memory.kv_token_bytes,
        bandwidth=t.spec.bandwidth_bytes_per_s, flops=t.peak_flops,
        flops_per_token=decode_flops_per_token(geo, avg_ctx) / (t.tp * t.pp), avg_context=avg_ctx,
        prefill_flops=prefill_flops(geo, isl) / (t.tp * t.pp), pp_size=t.pp,
        expert_bytes=t.memory.weights.expert_bytes / (t.tp * t.pp), num_experts=geo.num_experts,
        experts_per_token=geo.num_experts_per_tok,
    )
    cross = roof.crossover_batch()
    cands = {"compute": math.ceil(cross) if cross else None, **limits}
    sat_by = min((k for k in cands if cands[k] is not None), key=lambda k: cands[k])
    sat = max(1, min(cands[sat_by], conc))
    sp.prefill_ms = roof.prefill_time_s() * 1e3
    sp.crossover_batch = cross
    sp.saturation_batch, sp.saturated_by = sat, sat_by
    sp.peak_output_tokens_per_s = roof.output_tokens_per_s(sat, osl)
    sp.curve = [
        ThroughputPoint(batch=bb, step_ms=roof.step_time_s(bb) * 1e3, decode_tokens_per_s=roof.decode_tokens_per_s(bb),
                        output_tokens_per_s=roof.output_tokens_per_s(bb, osl), bound=roof.bound(bb),
                        predicted_output_tokens_per_s=predicted_tps(t.cost, t.scheduler, t.efficiency, isl, osl, bb))
        for bb in batch_points(conc, t.concurrencies + [sat])
    ]
    kv_seqs = limits["kv_cache"]
    potential = min(kv_seqs, math.ceil(cross) if cross else kv_seqs, b.max_num_tokens)
    if sp.concurrency_limited_by == "max_batch_size" and potential >= 2 * b.max_batch_size:
        warnings.append(
            f"ISL {isl}/OSL {osl}: build.max_batch_size {b.max_batch_size} caps concurrency; the KV cache holds "
            f"{kv_seqs} such sequences and decode stays memory-bound up to ~{potential}: bound "
            f"{roof.output_tokens_per_s(b.max_batch_size, osl):,.0f} → {roof.output_tokens_per_s(potential, osl):,.0f} output tokens/s"
        )
