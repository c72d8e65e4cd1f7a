"""The planner's two memory models (GPU device memory, CPU host memory) and its KV-capacity checks.

Each memory model turns a recipe and a geometry into a :class:`~pipeline.plan.result.MemoryPlan` (bytes; GiB =
2^30 B; tokens) and adds its findings (errors that refuse the build, warnings, notes) to a :class:`Findings`.
The formulas are :mod:`pipeline.plan.memory`'s; the KV bytes per token are
:meth:`pipeline.core.geometry.ModelGeometry.kv_bytes_per_token`'s (the one rule); the CPU engine's KV slots are
:func:`pipeline.cpu_runtime.kv.kv_slots`'s (the one slots rule, shared with the engine).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Literal

from pipeline.core import hardware
from pipeline.core.geometry import ModelGeometry
from pipeline.cpu_runtime.kv import kv_slots
from pipeline.plan import memory as mem
from pipeline.plan.kv_runtime import pytorch_kv_tokens, pytorch_reserve
from pipeline.plan.result import MemoryPlan
from pipeline.plan.speculative import spec_draft
from pipeline.plan.vision import split_kv_pool, vision_reserve
from pipeline.plan.vision_tokens import vision_tokens
from pipeline.recipe import BuildSpec, Recipe
from pipeline.recipe.serving_path import serving_path

#: bytes the CPU engine process needs besides weights/KV/activations: Python, torch, the Triton Python
#: backend stubs (estimate, not measured per host).
CPU_RUNTIME_BYTES = 1 * mem.GIB
#: warn when this share of device memory is left out of the KV cache by a small fraction (judgment).
UNUSED_WARN_SHARE = 0.25
#: ... and only when the unused memory is also larger than this (bytes; judgment).
UNUSED_WARN_MIN_BYTES = 4 * mem.GIB


@dataclass
class Findings:
    """What the plan tells the user besides numbers: ``errors`` refuse the build, ``warnings`` do not, ``notes``
    say how a figure was obtained. Filled in order by the memory models, the checks and the scenarios."""

    errors: list[str] = field(default_factory=list)
    warnings: list[str] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)


def gib(b: float) -> str:
    """``b`` bytes as ``'1.23 GiB'`` (2^30 B)."""
    return f"{b / mem.GIB:.2f} GiB"


def _memory_plan(b: BuildSpec, *, device: str, total: int, weights: mem.WeightBytes, act: int, overhead: int,
                 kv_tok: int, kv_tokens: int, by_fraction: int | None,
                 limited_by: Literal["fraction", "max_tokens", "max_batch_size"], max_seq_len: int) -> MemoryPlan:
    """The :class:`MemoryPlan` of both memory models: free = total − weights − activations − overhead; the KV
    pool = kv_tokens × kv_tok; unused = what is left after the pool (≥ 0); full sequences of max_seq_len that
    the pool holds in paged blocks of build.tokens_per_block (× beam)."""
    seq_blocks = mem.blocks_per_sequence(max_seq_len, b.tokens_per_block, b.max_beam_width)
    pool = kv_tokens * kv_tok
    return MemoryPlan(
        device=device, total_bytes=total, weights=weights, activation_bytes=act, overhead_bytes=overhead,
        free_bytes=total - weights.per_gpu_bytes - act - overhead, kv_fraction=b.kv_cache_config.free_gpu_memory_fraction,
        kv_max_tokens_setting=b.kv_cache_config.max_tokens, kv_token_bytes=kv_tok, kv_tokens=kv_tokens, kv_pool_bytes=pool,
        kv_tokens_by_fraction=by_fraction, kv_limited_by=limited_by,
        unused_bytes=max(total - weights.per_gpu_bytes - act - overhead - pool, 0), tokens_per_block=b.tokens_per_block,
        max_seq_len=max_seq_len, full_sequences_at_max_seq_len=(kv_tokens // b.tokens_per_block) // seq_blocks,
    )


def gpu_memory(recipe: Recipe, spec: hardware.GpuSpec, geo: ModelGeometry, max_seq_len: int, dtype_bytes: int,
               out: Findings, *, vision_geo: dict | None) -> MemoryPlan:
    """Per-GPU memory of ``recipe`` on ``spec`` (bytes; tokens); ``vision_geo`` the source's vision geometry
    (:func:`pipeline.recipe.vision.vision_geometry`, ``None``: a text model or unknown).

    weights on the most loaded rank (tp/pp split; a TensorRT engine holds a tied lm_head as its own copy);
    reserve = activation_bytes(max_num_tokens, max_batch_size) + fixed_overhead_bytes (CUDA context…);
    free = device memory (nvidia-smi MiB) − weights − reserve, what cudaMemGetInfo reports once the engine is
    loaded and what TensorRT-LLM applies ``free_gpu_memory_fraction`` to; KV tokens = blocks(free × fraction) ×
    tokens_per_block, min with ``kv_cache_config.max_tokens``. KV bytes per token in 1 B for an fp8/int8 KV
    cache, else ``dtype_bytes`` (the model dtype). Adds an error when weights + reserve exceed the GPU.
    """
    b, q, t = recipe.build, recipe.quantization, recipe.target
    tp, pp = t.tp_size, t.pp_size
    weights = mem.weight_bytes(geo, q.qformat, dtype_bytes, awq_block_size=q.awq_block_size, tp_size=tp, pp_size=pp,
                               lm_head_copy=serving_path(recipe).lm_head_copy)
    kv_tok = geo.kv_bytes_per_token(1 if q.kv_cache_dtype in ("fp8", "int8") else dtype_bytes, tp_size=tp, pp_size=pp)
    pytorch = serving_path(recipe, target="gpu").efficiency == "pytorch"
    draft = spec_draft(recipe, geo, dtype_bytes, tp_size=tp, pp_size=pp)
    if pytorch:  # the PyTorch executor's estimation pass (pipeline/plan/kv_runtime.py, _util.py@d8ae02ca)
        act = pytorch_reserve(geo, b, max_seq_len=max_seq_len, act_dtype_bytes=dtype_bytes, tp_size=tp,
                              max_draft_len=draft.max_draft_len if draft else 0).total_bytes
    else:
        act = mem.activation_bytes(geo, max_num_tokens=b.max_num_tokens, max_batch_size=b.max_batch_size,
                                   max_beam_width=b.max_beam_width, act_dtype_bytes=dtype_bytes, tp_size=tp)
    overhead = mem.fixed_overhead_bytes(t.world_size) + (draft.weight_bytes if draft else 0)
    vis = vision_reserve(recipe, geo, vision_geo)  # vision encoder + multimodal pool on GPU 0; KV split (pipeline/plan/vision.py)
    overhead += vis[1] if vis else 0
    tokens = vision_tokens(recipe, geo, vision_geo)  # a token family's vision tower, on every rank (pipeline/plan/vision_tokens.py)
    overhead += tokens.tower_bytes if tokens else 0
    total = spec.memory_bytes
    free = total - weights.per_gpu_bytes - act - overhead
    frac = b.kv_cache_config.free_gpu_memory_fraction * (1 - recipe.vision.cross_kv_cache_fraction if vis else 1)
    if pytorch:  # (total − peak) × fraction // (target + draft KV bytes per token), whole blocks, min max_tokens
        pool_tok = kv_tok + (draft.kv_token_bytes if draft else 0)
        by_fraction = pytorch_kv_tokens(total, total - free, pool_tok, frac, b.tokens_per_block)
        kv_tokens = pytorch_kv_tokens(total, total - free, pool_tok, frac, b.tokens_per_block, b.kv_cache_config.max_tokens)
    else:
        by_fraction, _ = mem.kv_capacity_tokens(free, frac, kv_tok, b.tokens_per_block)
        kv_tokens, _ = mem.kv_capacity_tokens(free, frac, kv_tok, b.tokens_per_block, b.kv_cache_config.max_tokens)
    if free <= 0:
        out.errors.append(
            f"weights {gib(weights.per_gpu_bytes)} + activations {gib(act)} + runtime {gib(overhead)} = "
            f"{gib(weights.per_gpu_bytes + act + overhead)} exceed {spec.key}'s {gib(total)} per GPU: use a smaller "
            "qformat (int4_awq, fp8), more tensor parallelism, or a larger GPU"
        )
    out.notes.append(
        f"device memory {spec.memory_mib} MiB (nvidia-smi total; datasheet {spec.memory_gb:g} GB); activation and "
        f"runtime reserve are estimates ({gib(act)} + {gib(overhead)}); 'bound' figures are datasheet-peak rooflines, "
        "'predicted' ones the achievable-throughput model calibrated on published TensorRT-LLM throughput"
    )
    plan = _memory_plan(b, device=spec.key, total=total, weights=weights, act=act, overhead=overhead, kv_tok=kv_tok,
                        kv_tokens=kv_tokens, by_fraction=by_fraction,
                        limited_by="max_tokens" if kv_tokens < by_fraction else "fraction", max_seq_len=max_seq_len)
    if vis is None:
        return plan
    vm = split_kv_pool(vis[0], free=free, fraction=b.kv_cache_config.free_gpu_memory_fraction, kv_token_bytes=kv_tok,
                       tokens_per_block=b.tokens_per_block)
    out.notes.append(f"vision ({vm.family}): encoder + projector {gib(vm.encoder_bytes)} in {vm.encoder_dtype} + multimodal "
                     f"pool {gib(vm.multimodal_pool_bytes)} in GPU 0's reserve; {vm.formula}; {vm.cross_kv_tokens} cross-attention KV tokens "
                     f"hold {vm.image_requests_in_cross_pool} requests with images; throughput per request with "
                     f"{recipe.vision.max_images_per_request} image(s) (vision.max_images_per_request) counts the vision encoder "
                     f"({vm.encoder_gflops_per_image:,.0f} GFLOP per image), the cross-attention K/V projections and attention "
                     f"over {vm.max_encoder_input_len} encoder tokens, and each decode step's cross-KV reads")
    if free > 0 and vm.image_requests_in_cross_pool < 1:
        out.errors.append(f"the cross-attention KV pool ({vm.cross_kv_tokens} tokens) holds no request with an image "
                          f"({vm.max_encoder_input_len} encoder tokens): raise vision.cross_kv_cache_fraction")
    elif free > 0 and vm.image_requests_in_cross_pool < b.max_batch_size:
        out.warnings.append(f"the cross-attention KV pool holds {vm.image_requests_in_cross_pool} requests with images "
                            f"at once, below build.max_batch_size {b.max_batch_size}")
    return plan.model_copy(update={"vision": vm, "unused_bytes": max(plan.unused_bytes - vm.cross_kv_pool_bytes, 0)})


def cpu_memory(recipe: Recipe, geo: ModelGeometry, max_seq_len: int, dtype_bytes: int, out: Findings) -> MemoryPlan:
    """Host memory of ``recipe`` on the CPU engine (bytes from psutil; tokens).

    The CPU engine holds weights and K/V in build.cpu.dtype (``dtype_bytes``); its KV cache is
    :func:`~pipeline.cpu_runtime.kv.kv_slots` of the memory available now after the weights; the runtime
    reserve is activations + :data:`CPU_RUNTIME_BYTES`. Adds an error when not one max_seq_len sequence fits
    or when weights + KV + reserve exceed host memory, a warning when they exceed what is available now.
    """
    import psutil

    b, q = recipe.build, recipe.quantization
    vm = psutil.virtual_memory()
    total = int(vm.total)
    weights = mem.weight_bytes(geo, "full_prec", dtype_bytes, tp_size=1, pp_size=1, lm_head_copy=False)
    ckpt = mem.weight_bytes(geo, q.qformat, 2, awq_block_size=q.awq_block_size, lm_head_copy=False)
    out.notes.append(
        f"cpu target: assumed the CPU engine holds weights and KV cache in build.cpu.dtype {b.cpu.dtype} "
        f"(the {q.qformat} checkpoint itself is {gib(ckpt.total_bytes)}); no roofline bound on CPU"
    )
    kv_tok = geo.kv_bytes_per_token(dtype_bytes)  # the CPU engine keeps K and V in build.cpu.dtype
    act = mem.activation_bytes(geo, max_num_tokens=b.max_num_tokens, max_batch_size=b.max_batch_size,
                               max_beam_width=b.max_beam_width, act_dtype_bytes=dtype_bytes)
    kvc = b.kv_cache_config
    try:
        slots, kv_tokens = kv_slots(max_batch_size=b.max_batch_size, max_seq_len=max_seq_len, bytes_per_token=kv_tok,
                                    available_bytes=int(vm.available) - weights.per_gpu_bytes,
                                    max_tokens=kvc.max_tokens, free_memory_fraction=kvc.free_gpu_memory_fraction)
    except ValueError as e:
        out.errors.append(str(e))
        slots, kv_tokens = 0, 0
    limited_by = ("max_batch_size" if slots == b.max_batch_size else
                  "max_tokens" if kvc.max_tokens is not None and kv_tokens + max_seq_len > kvc.max_tokens else "fraction")
    out.notes.append(f"the CPU engine's KV cache: {slots} slots × max_seq_len {max_seq_len} (min of max_tokens and "
                     f"free_gpu_memory_fraction × host memory available after the weights)")
    needed = weights.per_gpu_bytes + act + CPU_RUNTIME_BYTES + kv_tokens * kv_tok
    if needed > total:
        out.errors.append(
            f"weights {gib(weights.per_gpu_bytes)} + KV {kv_tokens} tokens × {kv_tok} B = {gib(kv_tokens * kv_tok)} + reserve "
            f"{gib(act + CPU_RUNTIME_BYTES)} exceed host memory {gib(total)}"
        )
    elif needed > vm.available:
        out.warnings.append(f"needs {gib(needed)}; only {gib(vm.available)} of host memory is available now")
    return _memory_plan(b, device="host", total=total, weights=weights, act=act, overhead=CPU_RUNTIME_BYTES, kv_tok=kv_tok,
                        kv_tokens=kv_tokens, by_fraction=None, limited_by=limited_by, max_seq_len=max_seq_len)


def kv_checks(b: BuildSpec, m: MemoryPlan, *, on_cpu: bool, allow_oversubscription: bool, out: Findings) -> None:
    """The KV-capacity refusals: the cache holds less than one build.max_seq_len sequence (TensorRT-LLM refuses:
    maxTokensInPagedKvCache must hold one), or, on a GPU, ``kv_cache_config.max_tokens`` asks for more tokens
    than ``free × fraction`` holds (TensorRT-LLM would silently use fewer). Errors, or warnings with
    ``allow_oversubscription``. Skipped on a GPU whose weights and reserve already do not fit (free ≤ 0)."""
    if m.free_bytes <= 0 and not on_cpu:
        return
    msgs: list[str] = []
    if m.full_sequences_at_max_seq_len < 1:
        seq_tokens = mem.blocks_per_sequence(m.max_seq_len, b.tokens_per_block, b.max_beam_width) * b.tokens_per_block
        msgs.append(
            f"KV cache holds {m.kv_tokens} tokens ({gib(m.kv_pool_bytes)} at {m.kv_token_bytes} B/token) but one build.max_seq_len "
            f"sequence needs {seq_tokens} (TensorRT-LLM refuses: maxTokensInPagedKvCache must "
            "hold at least one sequence); lower max_seq_len, raise kv_cache_config.free_gpu_memory_fraction, or quantize the KV cache"
        )
    mt, by_fraction = m.kv_max_tokens_setting, m.kv_tokens_by_fraction
    if not on_cpu and mt is not None and by_fraction is not None and mt > by_fraction:
        msgs.append(
            f"kv_cache_config.max_tokens {mt} exceeds the {by_fraction} tokens that fit in {gib(m.free_bytes)} free × "
            f"{m.kv_fraction} ({m.kv_token_bytes} B/token); TensorRT-LLM would silently use {by_fraction}"
        )
    if allow_oversubscription:
        out.warnings += [msg + " (accepted: allow_kv_oversubscription)" for msg in msgs]
    else:
        out.errors += msgs


def unused_memory_warning(m: MemoryPlan, out: Findings) -> None:
    """Warn (GPU) when more than :data:`UNUSED_WARN_SHARE` of device memory and :data:`UNUSED_WARN_MIN_BYTES`
    stay outside the KV cache, naming the setting that leaves it (max_tokens or the fraction)."""
    if m.free_bytes <= 0 or not (m.unused_bytes > UNUSED_WARN_SHARE * m.total_bytes and m.unused_bytes > UNUSED_WARN_MIN_BYTES):
        return
    why = (f"kv_cache_config.max_tokens {m.kv_max_tokens_setting} caps the KV cache at {m.kv_tokens} tokens "
           f"({m.kv_tokens_by_fraction} would fit)") if m.kv_limited_by == "max_tokens" else f"free_gpu_memory_fraction {m.kv_fraction}"
    out.warnings.append(f"{why} leaves {gib(m.unused_bytes)} of {gib(m.total_bytes)} unused per GPU")
