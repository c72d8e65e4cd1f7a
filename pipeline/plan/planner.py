"""``plan_recipe`` and ``check_fits``: memory, KV capacity, concurrency and throughput of a recipe on a GPU.

Steps (per GPU; formulas in :mod:`pipeline.plan.memory` and :mod:`pipeline.plan.perf`):

1. weights = weight_bytes(geometry, qformat) on the most loaded rank (tp/pp split);
2. reserve = activation_bytes(max_num_tokens, max_batch_size) + fixed_overhead_bytes (CUDA context…);
3. free = device memory (nvidia-smi MiB) − weights − reserve — what cudaMemGetInfo reports once the
   engine is loaded, which is what TensorRT-LLM applies ``free_gpu_memory_fraction`` to;
4. KV tokens = blocks(free × fraction) × tokens_per_block, min with ``kv_cache_config.max_tokens``;
5. per ISL/OSL: sequences that fit = KV blocks // ceil((ISL+OSL) / tokens_per_block); concurrency =
   min(that, max_batch_size, max_num_tokens); decode/prefill roofline → output tokens/s vs batch and
   the batch where it saturates (compute-bound crossover, KV capacity or max_batch_size);
6. the achievable-throughput model (:mod:`pipeline.plan.achievable`, inputs from
   :mod:`pipeline.plan.predict`): predicted output tokens/s, TTFT and ITL with their expected error at
   maximum load and at the recipe's bench concurrencies.

The cpu target is planned against host memory (psutil) with the CPU engine's KV cache sized by
``kv_cache_config.max_tokens``; its throughput is predicted from this host's measured rates
(``pipeline/data/cpu_host.yaml``), without a roofline bound.
"""

from __future__ import annotations

import math
from collections.abc import Iterable
from pathlib import Path
from typing import Literal

from pydantic import BaseModel, Field

from pipeline import gpus
from pipeline.cpu_runtime.kv import kv_slots
from pipeline.errors import UserError
from pipeline.models import ModelGeometry, geometry_for_source
from pipeline.plan import memory as mem
from pipeline.plan import predict as pred
from pipeline.plan.achievable import Efficiency, Prediction, SchedulerLimits, StepCost, knee_batch, predict_point, predicted_tps
from pipeline.plan.perf import QFORMAT_COMPUTE, Roofline, decode_flops_per_token, peak_flops, prefill_flops
from pipeline.recipe import Recipe, derived

#: bytes the CPU engine process needs besides weights/KV/activations: Python, torch, the Triton Python
#: backend stubs (estimate).
CPU_RUNTIME_BYTES = 1 * mem.GIB
#: warn when this share of device memory is left out of the KV cache by a small fraction.
UNUSED_WARN_SHARE = 0.25


class FitVerdict(BaseModel):
    """Whether a recipe fits its target. ``errors`` refuse the build; ``warnings`` leave capacity unused."""

    ok: bool
    errors: list[str] = Field(default_factory=list)
    warnings: list[str] = Field(default_factory=list)


class ThroughputPoint(BaseModel):
    """Roofline at one concurrency: decode-only and prefill-inclusive output tokens/s, step in ms."""

    batch: int
    step_ms: float
    decode_tokens_per_s: float
    output_tokens_per_s: float
    bound: Literal["memory", "compute"]
    predicted_output_tokens_per_s: float | None = None


class ScenarioPlan(BaseModel):
    """One ISL/OSL pair: how many sequences fit, and the throughput bound vs batch size."""

    isl: int
    osl: int
    blocks_per_sequence: int
    kv_max_sequences: int | None = Field(description="Sequences of ISL+OSL tokens the KV cache holds at once (None: not sized).")
    max_concurrency: int = Field(description="min(kv_max_sequences, max_batch_size, max_num_tokens).")
    concurrency_limited_by: Literal["kv_cache", "max_batch_size", "max_num_tokens"]
    prefill_ms: float | None = None
    crossover_batch: float | None = Field(default=None, description="Batch where decode turns compute-bound (None: never).")
    saturation_batch: int | None = None
    saturated_by: Literal["compute", "kv_cache", "max_batch_size", "max_num_tokens"] | None = None
    peak_output_tokens_per_s: float | None = None
    curve: list[ThroughputPoint] = Field(default_factory=list)
    predicted: Prediction | None = Field(default=None, description="Achievable-throughput prediction at maximum load.")
    predicted_by_concurrency: list[Prediction] = Field(default_factory=list, description="Predictions at the bench concurrencies.")
    knee_batch: int | None = Field(default=None, description="Smallest concurrency predicted to reach 90 % of the max-load "
                                                             "output tokens/s: a starting max_batch_size.")


class MemoryPlan(BaseModel):
    """Per-GPU memory budget (bytes; GiB = 2^30 B). For the cpu target: host memory."""

    device: str
    total_bytes: int
    weights: mem.WeightBytes
    activation_bytes: int
    overhead_bytes: int
    free_bytes: int = Field(description="total − weights − activations − overhead (what the KV fraction applies to).")
    kv_fraction: float
    kv_max_tokens_setting: int | None
    kv_token_bytes: int
    kv_tokens: int
    kv_pool_bytes: int
    kv_tokens_by_fraction: int | None = None
    kv_limited_by: Literal["fraction", "max_tokens", "max_batch_size"]
    unused_bytes: int = Field(description="Device memory left after weights, reserve and the KV pool.")
    tokens_per_block: int
    max_seq_len: int
    full_sequences_at_max_seq_len: int


class PlanResult(BaseModel):
    """Everything ``trtpipe plan`` shows; ``model_dump_json()`` is the ``--json`` output."""

    recipe: str
    model_source: str
    target: str
    gpu_name: str
    engine: str
    qformat: str
    kv_cache_dtype: str
    tp_size: int
    pp_size: int
    compute_dtype: str
    peak_tflops: float | None
    bandwidth_tbs: float | None
    geometry: ModelGeometry
    memory: MemoryPlan
    scenarios: list[ScenarioPlan]
    verdict: FitVerdict
    notes: list[str] = Field(default_factory=list)
    step_cost: StepCost | None = Field(default=None, description="Inputs of the achievable-throughput model (per GPU).")
    scheduler: SchedulerLimits | None = None
    efficiency: Efficiency | None = None
    error_terms: dict[str, float] = Field(default_factory=dict, description="Uncalibrated conditions and their relative error.")


# ---------------------------------------------------------------------------------------------- helpers
def _geometry(recipe: Recipe, recipe_dir: Path | None = None) -> ModelGeometry:
    geo = geometry_for_source(recipe.model.source, recipe_dir)
    if geo is None:
        raise UserError(
            f"model.source {recipe.model.source!r}: geometry unknown (not in pipeline/data/models.yaml and no local "
            "config.json): point model.source at a local checkpoint directory to plan it"
        )
    return geo


def _dtype_bytes(recipe: Recipe, geo: ModelGeometry, on_cpu: bool) -> int:
    """Bytes per element of the unquantized tensors: CPU engine → build.cpu.dtype; GPU → model.dtype,
    ``auto`` = the checkpoint's torch_dtype (float32 becomes float16 as quantize.py does; default bf16)."""
    if on_cpu:
        return mem.DTYPE_BYTES[recipe.build.cpu.dtype]
    return mem.DTYPE_BYTES.get(derived.model_dtype(recipe, geo.torch_dtype or "bfloat16"), 2)


def _format_errors(recipe: Recipe, gpu: gpus.GpuSpec) -> list[str]:
    """qformat / KV dtype the GPU cannot run (matters when ``--gpu`` overrides the recipe's target)."""
    return [f"{field} {message}" for field, message in derived.format_problems(recipe.quantization, gpu)]


def _gib(b: float) -> str:
    return f"{b / mem.GIB:.2f} GiB"


def _batch_points(max_conc: int, extra: Iterable[int]) -> list[int]:
    pts = {1 << i for i in range(0, 20) if (1 << i) <= max_conc} | {max_conc}
    pts |= {b for b in extra if 1 <= b <= max_conc}
    return sorted(pts)


def _resolve_gpu(recipe: Recipe, gpu: str | gpus.GpuSpec | None) -> gpus.GpuSpec | None:
    if isinstance(gpu, gpus.GpuSpec):
        return gpu
    if gpu is None:
        return recipe.gpu
    if gpu.strip().lower() == gpus.CPU_TARGET:
        return None
    spec = gpus.lookup(gpu)
    if spec is None:
        raise UserError(f"--gpu {gpu!r}: not in the GPU catalog ({', '.join(sorted(gpus.catalog()))}) nor 'cpu'")
    return spec


# ---------------------------------------------------------------------------------------------- planner
def plan_recipe(
    recipe: Recipe,
    gpu: str | gpus.GpuSpec | None = None,
    scenarios: Iterable[tuple[int, int]] | None = None,
    *,
    recipe_dir: Path | None = None,
    allow_kv_oversubscription: bool | None = None,
) -> PlanResult:
    """Plan ``recipe`` on ``gpu`` (default: the recipe's target) for ``scenarios`` ((ISL, OSL) pairs in
    tokens; default: ``recipe.bench.scenarios``).

    ``allow_kv_oversubscription`` turns the KV-capacity errors into warnings; default: the recipe's
    ``build.allow_kv_oversubscription``.

    Raises:
        UserError: unknown GPU name, unknown model geometry, no max_seq_len, a scenario longer than
            max_seq_len.
    """
    spec = _resolve_gpu(recipe, gpu)
    on_cpu = spec is None
    geo = _geometry(recipe, recipe_dir)
    b, q, t = recipe.build, recipe.quantization, recipe.target
    if allow_kv_oversubscription is None:
        allow_kv_oversubscription = b.allow_kv_oversubscription
    max_seq_len = b.max_seq_len or geo.max_position_embeddings
    if not max_seq_len:
        raise UserError("build.max_seq_len is unset and the model has no max_position_embeddings: set build.max_seq_len")
    pairs = [(s.isl, s.osl) for s in recipe.bench.scenarios] if scenarios is None else [tuple(p) for p in scenarios]
    for isl, osl in pairs:
        if isl < 1 or osl < 1:
            raise UserError(f"ISL {isl} / OSL {osl}: both must be at least 1 token")
        if isl > b.max_input_len:
            raise UserError(f"ISL {isl} exceeds build.max_input_len {b.max_input_len}")
        if isl + osl > max_seq_len:
            raise UserError(f"ISL {isl} + OSL {osl} = {isl + osl} tokens exceeds build.max_seq_len {max_seq_len}")

    dtype_b = _dtype_bytes(recipe, geo, on_cpu)
    tp, pp = (1, 1) if on_cpu else (t.tp_size, t.pp_size)
    notes: list[str] = []
    errors: list[str] = []
    warnings: list[str] = []

    if on_cpu:
        import psutil

        vm = psutil.virtual_memory()
        total, device, gpu_name = int(vm.total), "host", "cpu (host memory)"
        weights = mem.weight_bytes(geo, "full_prec", dtype_b, tp_size=1, pp_size=1, lm_head_copy=False)
        ckpt = mem.weight_bytes(geo, q.qformat, 2, awq_block_size=q.awq_block_size, lm_head_copy=False)
        notes.append(
            f"cpu target: assumed the CPU engine holds weights and KV cache in build.cpu.dtype {b.cpu.dtype} "
            f"(the {q.qformat} checkpoint itself is {_gib(ckpt.total_bytes)}); no roofline bound on CPU"
        )
        kv_tok = mem.kv_bytes_per_token(geo, dtype_b)  # the CPU engine keeps K and V in build.cpu.dtype
        act = mem.activation_bytes(geo, max_num_tokens=b.max_num_tokens, max_batch_size=b.max_batch_size,
                                   max_beam_width=b.max_beam_width, act_dtype_bytes=dtype_b)
        overhead = CPU_RUNTIME_BYTES
        free = total - weights.per_gpu_bytes - act - overhead
        kvc = b.kv_cache_config  # the CPU engine's own rule (pipeline.cpu_runtime.kv.kv_slots)
        try:
            slots, kv_tokens = kv_slots(max_batch_size=b.max_batch_size, max_seq_len=max_seq_len, bytes_per_token=kv_tok,
                                                    available_bytes=int(vm.available) - weights.per_gpu_bytes,
                                                    max_tokens=kvc.max_tokens, free_memory_fraction=kvc.free_gpu_memory_fraction)
        except ValueError as e:
            errors.append(str(e))
            slots, kv_tokens = 0, 0
        limited_by = ("max_batch_size" if slots == b.max_batch_size else
                      "max_tokens" if kvc.max_tokens is not None and kv_tokens + max_seq_len > kvc.max_tokens else "fraction")
        notes.append(f"the CPU engine's KV cache: {slots} slots × max_seq_len {max_seq_len} (min of max_tokens and "
                     f"free_gpu_memory_fraction × host memory available after the weights)")
        kv_pool = kv_tokens * kv_tok
        by_fraction = None
        if weights.per_gpu_bytes + act + overhead + kv_pool > total:
            errors.append(
                f"weights {_gib(weights.per_gpu_bytes)} + KV {kv_tokens} tokens × {kv_tok} B = {_gib(kv_pool)} + reserve "
                f"{_gib(act + overhead)} exceed host memory {_gib(total)}"
            )
        elif weights.per_gpu_bytes + act + overhead + kv_pool > vm.available:
            warnings.append(f"needs {_gib(weights.per_gpu_bytes + act + overhead + kv_pool)}; only {_gib(vm.available)} of host memory is available now")
        frac = b.kv_cache_config.free_gpu_memory_fraction
    else:
        assert spec is not None
        total, device, gpu_name = spec.memory_bytes, spec.key, spec.name
        errors += _format_errors(recipe, spec)
        weights = mem.weight_bytes(geo, q.qformat, dtype_b, awq_block_size=q.awq_block_size, tp_size=tp, pp_size=pp,
                                   lm_head_copy=b.engine == "tensorrt")
        kv_b = 1 if q.kv_cache_dtype in ("fp8", "int8") else dtype_b
        kv_tok = mem.kv_bytes_per_token(geo, kv_b, tp_size=tp, pp_size=pp)
        act = mem.activation_bytes(geo, max_num_tokens=b.max_num_tokens, max_batch_size=b.max_batch_size,
                                   max_beam_width=b.max_beam_width, act_dtype_bytes=dtype_b, tp_size=tp)
        overhead = mem.fixed_overhead_bytes(t.world_size)
        free = total - weights.per_gpu_bytes - act - overhead
        frac = b.kv_cache_config.free_gpu_memory_fraction
        by_fraction, _ = mem.kv_capacity_tokens(free, frac, kv_tok, b.tokens_per_block)
        kv_tokens, kv_pool = mem.kv_capacity_tokens(free, frac, kv_tok, b.tokens_per_block, b.kv_cache_config.max_tokens)
        limited_by = "max_tokens" if kv_tokens < by_fraction else "fraction"
        if free <= 0:
            errors.append(
                f"weights {_gib(weights.per_gpu_bytes)} + activations {_gib(act)} + runtime {_gib(overhead)} = "
                f"{_gib(weights.per_gpu_bytes + act + overhead)} exceed {spec.key}'s {_gib(total)} per GPU: use a smaller "
                "qformat (int4_awq, fp8), more tensor parallelism, or a larger GPU"
            )
        notes.append(
            f"device memory {spec.memory_mib} MiB (nvidia-smi total; datasheet {spec.memory_gb:g} GB); activation and "
            f"runtime reserve are estimates ({_gib(act)} + {_gib(overhead)}); 'bound' figures are datasheet-peak rooflines, "
            "'predicted' ones the achievable-throughput model calibrated on published TensorRT-LLM throughput"
        )

    seq_blocks = mem.blocks_per_sequence(max_seq_len, b.tokens_per_block, b.max_beam_width)
    full_seqs = (kv_tokens // b.tokens_per_block) // seq_blocks
    unused = max(total - weights.per_gpu_bytes - act - overhead - kv_pool, 0)
    mem_plan = MemoryPlan(
        device=device, total_bytes=total, weights=weights, activation_bytes=act, overhead_bytes=overhead,
        free_bytes=free, kv_fraction=frac, kv_max_tokens_setting=b.kv_cache_config.max_tokens, kv_token_bytes=kv_tok,
        kv_tokens=kv_tokens, kv_pool_bytes=kv_pool, kv_tokens_by_fraction=by_fraction, kv_limited_by=limited_by,
        unused_bytes=unused, tokens_per_block=b.tokens_per_block, max_seq_len=max_seq_len, full_sequences_at_max_seq_len=full_seqs,
    )

    # --- inputs of the achievable-throughput model
    cost = sched = eff = None
    if kv_tokens > 0 and (on_cpu or free > 0):
        cost, sched, eff, note = pred.model_inputs(recipe, geo, weights, kv_tok, kv_tokens, dtype_b, spec)
        notes += [note] if note else []
    terms = pred.error_terms(recipe, spec)

    # --- KV capacity checks (refuse unless the user accepts oversubscription)
    if free > 0 or on_cpu:
        kv_msgs: list[str] = []
        if full_seqs < 1:
            kv_msgs.append(
                f"KV cache holds {kv_tokens} tokens ({_gib(kv_pool)} at {kv_tok} B/token) but one build.max_seq_len "
                f"sequence needs {seq_blocks * b.tokens_per_block} (TensorRT-LLM refuses: maxTokensInPagedKvCache must "
                "hold at least one sequence); lower max_seq_len, raise kv_cache_config.free_gpu_memory_fraction, or quantize the KV cache"
            )
        mt = b.kv_cache_config.max_tokens
        if not on_cpu and mt is not None and by_fraction is not None and mt > by_fraction:
            kv_msgs.append(
                f"kv_cache_config.max_tokens {mt} exceeds the {by_fraction} tokens that fit in {_gib(free)} free × "
                f"{frac} ({kv_tok} B/token); TensorRT-LLM would silently use {by_fraction}"
            )
        if allow_kv_oversubscription:
            warnings += [m + " (accepted: allow_kv_oversubscription)" for m in kv_msgs]
        else:
            errors += kv_msgs

    # --- leaving memory on the table
    if not on_cpu and free > 0:
        if unused > UNUSED_WARN_SHARE * total and unused > 4 * mem.GIB:
            why = (f"kv_cache_config.max_tokens {b.kv_cache_config.max_tokens} caps the KV cache at {kv_tokens} tokens "
                   f"({by_fraction} would fit)") if limited_by == "max_tokens" else f"free_gpu_memory_fraction {frac}"
            warnings.append(f"{why} leaves {_gib(unused)} of {_gib(total)} unused per GPU")

    # --- scenarios
    compute = QFORMAT_COMPUTE[q.qformat]
    peak = None if on_cpu else peak_flops(spec, compute, dtype_b)
    plans: list[ScenarioPlan] = []
    for isl, osl in pairs:
        bps = mem.blocks_per_sequence(isl + osl, b.tokens_per_block, b.max_beam_width)
        kv_seqs = (kv_tokens // b.tokens_per_block) // bps
        limits = {"kv_cache": kv_seqs, "max_batch_size": b.max_batch_size, "max_num_tokens": b.max_num_tokens}
        lim = min(limits, key=lambda k: (limits[k], k != "kv_cache"))
        conc = max(limits[lim], 0)
        sp = ScenarioPlan(isl=isl, osl=osl, blocks_per_sequence=bps, kv_max_sequences=kv_seqs,
                          max_concurrency=conc, concurrency_limited_by=lim)
        if cost is not None and sched is not None and eff is not None and conc >= 1:
            try:
                sp.predicted = predict_point(cost, sched, eff, isl, osl, None, extra_error=terms)
                sp.predicted_by_concurrency = [predict_point(cost, sched, eff, isl, osl, c, extra_error=terms)
                                               for c in sorted(set(recipe.bench.concurrency))]
                sp.knee_batch = knee_batch(cost, sched, eff, isl, osl)
            except ValueError as e:
                warnings.append(f"ISL {isl}/OSL {osl}: no throughput prediction: {e}")
        if not on_cpu and conc >= 1:
            assert spec is not None and peak is not None
            avg_ctx = isl + osl / 2
            roof = Roofline(
                weight_bytes=weights.per_gpu_bytes, kv_token_bytes=kv_tok, bandwidth=spec.bandwidth_bytes_per_s,
                flops=peak, flops_per_token=decode_flops_per_token(geo, avg_ctx) / (tp * pp), avg_context=avg_ctx,
                prefill_flops=prefill_flops(geo, isl) / (tp * pp), pp_size=pp,
            )
            cross = roof.crossover_batch()
            cands = {"compute": math.ceil(cross) if cross else None, **{k: v for k, v in limits.items()}}
            sat_by = min((k for k in cands if cands[k] is not None), key=lambda k: cands[k])
            sat = max(1, min(cands[sat_by], conc))
            sp.prefill_ms = roof.prefill_time_s() * 1e3
            sp.crossover_batch = cross
            sp.saturation_batch, sp.saturated_by = sat, sat_by
            sp.peak_output_tokens_per_s = roof.output_tokens_per_s(sat, osl)
            sp.curve = [
                ThroughputPoint(batch=bb, step_ms=roof.step_time_s(bb) * 1e3, decode_tokens_per_s=roof.decode_tokens_per_s(bb),
                                output_tokens_per_s=roof.output_tokens_per_s(bb, osl), bound=roof.bound(bb),
                                predicted_output_tokens_per_s=predicted_tps(cost, sched, eff, isl, osl, bb))
                for bb in _batch_points(conc, list(recipe.bench.concurrency) + [sat])
            ]
            potential = min(kv_seqs, math.ceil(cross) if cross else kv_seqs, b.max_num_tokens)
            if lim == "max_batch_size" and potential >= 2 * b.max_batch_size:
                warnings.append(
                    f"ISL {isl}/OSL {osl}: build.max_batch_size {b.max_batch_size} caps concurrency; the KV cache holds "
                    f"{kv_seqs} such sequences and decode stays memory-bound up to ~{potential}: bound "
                    f"{roof.output_tokens_per_s(b.max_batch_size, osl):,.0f} → {roof.output_tokens_per_s(potential, osl):,.0f} output tokens/s"
                )
        plans.append(sp)

    return PlanResult(
        recipe=recipe.name or "", model_source=recipe.model.source, target=device, gpu_name=gpu_name,
        engine="cpu" if on_cpu else ("tensorrt" if b.engine == "cpu" else b.engine), qformat=q.qformat,
        kv_cache_dtype=q.kv_cache_dtype, tp_size=tp, pp_size=pp, compute_dtype=compute,
        peak_tflops=None if peak is None else peak / 1e12, bandwidth_tbs=None if on_cpu else spec.memory_bandwidth_tbs,
        geometry=geo, memory=mem_plan, scenarios=plans,
        verdict=FitVerdict(ok=not errors, errors=errors, warnings=warnings), notes=notes,
        step_cost=cost, scheduler=sched, efficiency=eff, error_terms=terms,
    )


def check_fits(recipe: Recipe, *, recipe_dir: Path | None = None, allow_kv_oversubscription: bool | None = None) -> FitVerdict:
    """The fit verdict ``trtpipe build`` checks before any stage runs.

    ``ok`` is False with one message per problem (numbers included) when the weights and runtime reserve
    exceed device memory, when the KV cache cannot hold one build.max_seq_len sequence, when
    ``kv_cache_config.max_tokens`` asks for more tokens than fit, or when the GPU lacks the qformat's
    tensor cores. The KV-capacity ones become warnings with ``allow_kv_oversubscription``. ``warnings``
    name capacity left unused. A recipe whose geometry is unknown gets ``ok=True`` and a warning that it
    was not checked (the build itself reads the checkpoint).
    """
    try:
        return plan_recipe(recipe, recipe_dir=recipe_dir, allow_kv_oversubscription=allow_kv_oversubscription).verdict
    except UserError as e:
        return FitVerdict(ok=True, warnings=[f"fit not checked: {e}"])
