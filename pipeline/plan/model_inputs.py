"""The inputs of the achievable-throughput model (:mod:`pipeline.plan.achievable`) for a recipe.

Turns a recipe (and the planner's memory plan) into them; :func:`pipeline.plan.planner.predict` and
:func:`pipeline.plan.planner.plan_recipe` call it:

- :func:`engine_model` → :class:`StepCost` (bytes and FLOPs per step per GPU, peak rates of the GPU) and
  :class:`SchedulerLimits` (max_batch_size, max_num_tokens, chunked prefill, KV tokens, policy);
- :func:`efficiency_for` → the :class:`Efficiency` to use: the parameters fitted on published TensorRT-LLM
  throughput (``pipeline/data/plan_efficiency.yaml``, written by ``benchmarks/calibrate_plan.py`` through
  :func:`pipeline.plan.calibration.calibrate`) on a GPU, or the host's measured rates and engine overheads
  (:func:`pipeline.core.hardware.cpu_host`: this host's, measured by ``trtpipe plan measure-host``, else the
  shipped reference host's) on the cpu target;
- :func:`error_terms` → the relative error terms for conditions the calibration did not cover.

The calibration covers one GPU, the TensorRT engine path, FP8 and 16-bit GEMMs, Ampere/Ada/Hopper. Each
condition outside that adds a stated relative error in quadrature (:data:`UNCALIBRATED_ERROR`; judgment, not
fitted: the size of effects the model leaves out, e.g. tensor-parallel all-reduces are ~10–30 % of a decode
step on PCIe/NVLink systems).
"""

from __future__ import annotations

import functools
from importlib import resources

import yaml

from pipeline.core import hardware
from pipeline.core.geometry import ModelGeometry
from pipeline.plan import memory as mem
from pipeline.plan.achievable import SchedulerLimits
from pipeline.plan.perf import QFORMAT_COMPUTE, peak_flops
from pipeline.plan.step import (
    Efficiency,
    StepCost,
    activation_traffic_bytes,
    allreduce_bytes_per_token,
)
from pipeline.plan.vision import vision_step_terms
from pipeline.recipe import Recipe
from pipeline.recipe.quant import FP8_QFORMATS
from pipeline.recipe.serving_path import serving_path

#: Relative error (1 σ) added in quadrature per uncalibrated condition. Judgment, not fitted:
#: ``parallelism`` — tp all-reduce times are measured only for H100/H200 SXM at tp 2/4/8 (allreduce_measured.yaml;
#: elsewhere an uncalibrated bandwidth + latency formula) and the rest of a tp step calibrated only on the PyTorch
#: backend; pipeline bubbles not at all;
#: ``qformat`` — GEMM paths absent from the calibration (INT8 SmoothQuant, weight-only INT4/INT8 dequant
#: GEMMs, FP4) reach other fractions of peak; ``engine`` — a runtime without its own fit (the PyTorch backend before
#: plan_efficiency_pytorch.yaml exists); ``architecture`` — no Blackwell (or older) GPU was calibrated;
#: ``beam`` — beam search is not modelled.
UNCALIBRATED_ERROR: dict[str, float] = {
    "parallelism": 0.25, "qformat": 0.20, "engine": 0.15, "architecture": 0.15, "beam": 0.30,
}
#: what the calibration set covers (pipeline/data/plan_calibration.yaml)
CALIBRATED_QFORMATS = ("fp8", "full_prec")
CALIBRATED_ARCHS = ("ampere", "ada", "hopper")
#: Relative error (1 σ) of the CPU-engine prediction: its overheads are measured, not fitted against
#: served throughput, and the engine is being rewritten (judgment).
CPU_REL_ERROR = 0.5

EFFICIENCY_FILE = "data/plan_efficiency.yaml"
#: the PyTorch backend's own fit (benchmarks/calibrate_plan.py --engine pytorch)
PYTORCH_EFFICIENCY_FILE = "data/plan_efficiency_pytorch.yaml"
#: the held-out errors and the ± band per engine (benchmarks/plan_generalisation.py, pipeline/plan/generalisation.py)
GENERALISATION_FILE = "data/plan_generalisation.yaml"


@functools.cache
def held_out_band(engine: str) -> float:
    """The ± band (1 σ, relative) of ``engine``'s predictions ("tensorrt" or "pytorch"): the largest held-out RMS ln
    error of ``plan_generalisation.yaml`` (each GPU / model / TP degree / ISL/OSL pair left out of the fit); 0 before
    that file exists (the held-out fits themselves plan their points before it does)."""
    f = resources.files("pipeline").joinpath(GENERALISATION_FILE)
    if not f.is_file():
        return 0.0
    return float(yaml.safe_load(f.read_text())["engines"][engine]["band"])


@functools.cache
def gpu_efficiency() -> Efficiency:
    """The fitted GPU :class:`Efficiency` of the TensorRT engine path, shipped in ``pipeline/data/plan_efficiency.yaml``."""
    raw = yaml.safe_load(resources.files("pipeline").joinpath(EFFICIENCY_FILE).read_text())
    return Efficiency(**raw["fitted"], **raw["fixed"], rel_error=held_out_band("tensorrt"), source=raw["source"],
                      name="tensorrt engine path (fitted on TensorRT-LLM v0.17's Llama-3.1-8B TP1 table)")


@functools.cache
def pytorch_efficiency() -> Efficiency:
    """The fitted :class:`Efficiency` of the PyTorch backend (``pipeline/data/plan_efficiency_pytorch.yaml``); the
    engine path's until that file has been written (the fit itself plans its points before it exists)."""
    f = resources.files("pipeline").joinpath(PYTORCH_EFFICIENCY_FILE)
    if not f.is_file():
        return gpu_efficiency()
    raw = yaml.safe_load(f.read_text())
    return Efficiency(**raw["fitted"], **raw["fixed"], rel_error=held_out_band("pytorch"), source=raw["source"], name=raw["name"])


def cpu_efficiency(host: hardware.HostSpec) -> Efficiency:
    """The CPU engine's :class:`Efficiency`: the host's rates are measured achievable rates (fractions 1)
    and the overheads are the engine's measured per-step and per-sequence times (``trtpipe plan measure-host``).

    What is predicted is the served deployment that ``trtpipe bench`` measures on this host: the engine's threads
    occupy every core, so the CPU time the rest of the deployment spends per streamed token (Triton, the serving
    models, the bench client: ``serving_cpu_per_token_us``) is taken from the engine's steps, one token per sequence
    in a step: it adds to the per-sequence overhead."""
    return Efficiency(
        bw_frac=1.0, gemm_frac=1.0, attn_frac=1.0,
        seq_overhead_us=host.engine_seq_overhead_us + (host.serving_cpu_per_token_us or 0.0),
        step_overhead_ms=host.engine_step_overhead_ms, rel_error=CPU_REL_ERROR,
        source=f"measured on {host.name} ({host.measured})",
    )


def _attn_peak(recipe: Recipe, spec: hardware.GpuSpec, gemm_peak: float, bf16_peak: float) -> float:
    """Dense FLOP/s of prefill attention: FP8 FMHA when the recipe quantizes to an FP8 format with
    ``use_fp8_context_fmha`` on an FP8 GPU, else the 16-bit rate."""
    q, p = recipe.quantization, recipe.build.plugins
    if spec.fp8 and q.qformat in FP8_QFORMATS and p.use_fp8_context_fmha and spec.fp8_tflops:
        return spec.fp8_tflops * 1e12
    return bf16_peak


#: measured all-reduce times (benchmarks: AIConfigurator's TensorRT-LLM tables; pipeline/data/allreduce_measured.yaml)
ALLREDUCE_FILE = "data/allreduce_measured.yaml"


@functools.cache
def allreduce_table() -> dict:
    """``allreduce_measured.yaml`` as loaded."""
    return yaml.safe_load(resources.files("pipeline").joinpath(ALLREDUCE_FILE).read_text())


@functools.cache
def measured_allreduce(gpu: str, tp: int) -> tuple[tuple[float, float], ...]:
    """Measured (message bytes, seconds) of one BF16 all-reduce on catalog GPU ``gpu`` at tensor parallelism ``tp``,
    ascending in bytes (message bytes = 2 × the table's element count); () where none was measured."""
    rows = allreduce_table()["tables"].get(gpu, [])
    return tuple(sorted((2.0 * n, lat_us * 1e-6) for t, n, lat_us, _ in rows if t == tp))


def _tp_terms(geo: ModelGeometry, spec: hardware.GpuSpec | None, tp: int, pp: int, act_bytes: int) -> dict:
    """The all-reduce inputs of :class:`StepCost` for tensor parallelism on ``spec`` (none at tp = 1 or on the host):
    bytes per token (:func:`allreduce_bytes_per_token` over one stage's layers), 2 all-reduces per layer of the
    stage, the catalog's GPU-to-GPU bandwidth per direction (``GpuSpec.link_bytes_per_s``) and the measured
    all-reduce times of the GPU at ``tp`` (:func:`measured_allreduce`; the all-reduces are BF16 whatever the
    checkpoint, so ``act_bytes`` only sizes the fallback's bytes)."""
    if spec is None or tp == 1:
        return {}
    measured = measured_allreduce(spec.key, tp)
    if not measured and spec.link_bytes_per_s is None:
        return {}
    layers = -(-geo.num_hidden_layers // pp)
    return {"allreduce_bytes_per_token": allreduce_bytes_per_token(geo.hidden_size, layers, tp, act_bytes),
            "allreduces_per_step": 2 * layers, "link_bandwidth": spec.link_bytes_per_s or 0.0, "tp_size": tp,
            "allreduce_measured": measured}


def engine_model(recipe: Recipe, geo: ModelGeometry, weights: mem.WeightBytes, kv_token_bytes: int, kv_tokens: int,
                 *, gemm_peak: float, bf16_peak: float, bandwidth: float, spec: hardware.GpuSpec | None,
                 vision_geo: dict | None) -> tuple[StepCost, SchedulerLimits]:
    """:class:`StepCost` and :class:`SchedulerLimits` of ``recipe`` on one GPU (``spec``) or on the host (None).

    Per GPU (tensor parallel tp, pipeline stages pp; step time = pp × per-stage time):
    weight_bytes = (decoder Linear + scales + lm_head − routed experts) / (tp·pp) — the embedding table is not
    streamed (a tied lm_head on the CPU engine reads it: its bytes count as the lm_head's); MoE: expert_weight_bytes
    = all routed experts / (tp·pp), of which a step reads the share its tokens select;
    linear FLOPs/token = 2 × layers × Linear params a token passes through (MoE: its k experts) / (tp·pp); lm_head FLOPs/token = 2 × vocab × hidden / (tp·pp);
    attention coeff = 2 × layers × heads × head_dim / (tp·pp). ``gemm_peak``/``bf16_peak`` FLOP/s,
    ``bandwidth`` B/s: the GPU's datasheet peaks or the host's measured rates. ``vision_geo``: the source's vision
    geometry (:func:`pipeline.recipe.vision.vision_geometry`; ``None``: a text model or unknown).
    """
    t = recipe.target
    tp, pp = (1, 1) if spec is None else (t.tp_size, t.pp_size)
    act_bytes = weights.model_dtype_bytes
    head = weights.lm_head_bytes or (weights.embedding_bytes if geo.tie_word_embeddings else 0)
    cost = StepCost(
        weight_bytes=(weights.linear_bytes + weights.scale_bytes - weights.expert_bytes + head) / (tp * pp),
        expert_weight_bytes=weights.expert_bytes / (tp * pp), num_experts=geo.num_experts,
        experts_per_token=geo.num_experts_per_tok,
        kv_token_bytes=kv_token_bytes,
        linear_flops_per_token=2 * geo.num_hidden_layers * geo.layer_active_linear_params / (tp * pp),
        head_flops_per_token=2 * geo.vocab_size * geo.hidden_size / (tp * pp),
        attn_flops_coeff=2 * geo.num_hidden_layers * geo.num_attention_heads * geo.head_dim / (tp * pp),
        act_bytes_per_token=activation_traffic_bytes(geo.hidden_size, geo.num_attention_heads, geo.num_key_value_heads, geo.head_dim,
                                                     geo.active_mlp_width, geo.num_hidden_layers, act_bytes, tp) / pp,
        logit_bytes_per_token=2 * mem.pad_vocab(geo.vocab_size, tp) / tp * mem.LOGITS_BYTES / pp,
        bandwidth=bandwidth, gemm_flops=gemm_peak,
        attn_flops=bf16_peak if spec is None else _attn_peak(recipe, spec, gemm_peak, bf16_peak),
        pp_size=pp,
        **_tp_terms(geo, spec, tp, pp, act_bytes),
    )
    vis = vision_step_terms(recipe, geo, vision_geo, tp_size=tp, kv_bytes=1 if recipe.quantization.kv_cache_dtype in ("fp8", "int8") else act_bytes,
                            encoder_peak_flops=bf16_peak) if spec is not None else {}
    if vis:  # vision-language (mllama): encoder + cross-attention terms (pipeline/plan/vision.py)
        cost = cost.model_copy(update={"cross_kv_bytes_per_seq": vis["cross_kv_bytes_per_seq"],
                                       "prompt_extra_flops": vis["prompt_extra_flops"],
                                       "prompt_extra_flops_rate": vis["prompt_extra_flops_rate"],
                                       "linear_flops_per_token": cost.linear_flops_per_token + vis["cross_attn_flops_per_token"]})
    b = recipe.build
    limits = SchedulerLimits(
        max_batch_size=b.max_batch_size, max_num_tokens=b.max_num_tokens, chunked_prefill=b.enable_chunked_prefill,
        kv_tokens=kv_tokens, tokens_per_block=b.tokens_per_block, policy=b.scheduler_config.capacity_scheduler_policy,
    )
    return cost, limits


def model_inputs(recipe: Recipe, geo: ModelGeometry, weights: mem.WeightBytes, kv_token_bytes: int, kv_tokens: int,
                 dtype_bytes: int, spec: hardware.GpuSpec | None,
                 *, vision_geo: dict | None) -> tuple[StepCost, SchedulerLimits, Efficiency, str | None]:
    """Everything the model needs for ``recipe`` on ``spec`` (None: the host): step cost, scheduler limits,
    efficiency, and a note for the plan (the host's measured rates on the cpu target, else None). ``vision_geo``: the
    source's vision geometry (:func:`engine_model`).

    GPU: datasheet bandwidth, the dense peak of the qformat's GEMM dtype (:data:`perf.QFORMAT_COMPUTE`) and
    of BF16, the fitted :func:`gpu_efficiency`. Host: measured bandwidth and GEMM rate in ``build.cpu.dtype``
    and the CPU engine's measured overheads (:func:`cpu_efficiency`); the CPU engine always chunks prompts
    longer than max_num_tokens (transformers' scheduler), so chunked prefill is on there.
    """
    if spec is None:
        host = hardware.cpu_host()
        rate = host.gemm_flops(dtype_bytes)
        cost, limits = engine_model(recipe, geo, weights, kv_token_bytes, kv_tokens, gemm_peak=rate, bf16_peak=rate,
                                    bandwidth=host.bandwidth_bytes_per_s, spec=None, vision_geo=vision_geo)
        note = (f"cpu throughput predicted from {host.name}'s measured rates ({host.read_bandwidth_gbs:g} GB/s, "
                f"{rate / 1e9:,.0f} GFLOP/s) and CPU-engine overheads ({host.measured}): {host.origin}")
        return cost, limits.model_copy(update={"chunked_prefill": True}), cpu_efficiency(host), note
    cost, limits = engine_model(recipe, geo, weights, kv_token_bytes, kv_tokens,
                                gemm_peak=peak_flops(spec, QFORMAT_COMPUTE[recipe.quantization.qformat], dtype_bytes),
                                bf16_peak=peak_flops(spec, "bf16", dtype_bytes), bandwidth=spec.bandwidth_bytes_per_s, spec=spec,
                                vision_geo=vision_geo)
    fitted = {"tensorrt": gpu_efficiency, "pytorch": pytorch_efficiency}  # the efficiency model of the path on a GPU
    return cost, limits, fitted[serving_path(recipe, target="gpu").efficiency](), None


def error_terms(recipe: Recipe, spec: hardware.GpuSpec | None) -> dict[str, float]:
    """The :data:`UNCALIBRATED_ERROR` terms that apply to ``recipe`` on ``spec`` (none on the cpu target,
    whose error is :data:`CPU_REL_ERROR` as a whole)."""
    if spec is None:
        return {}
    t, q, b = recipe.target, recipe.quantization, recipe.build
    fit = serving_path(recipe).gpu_fit(resources.files("pipeline").joinpath(PYTORCH_EFFICIENCY_FILE).is_file())
    pytorch_fitted = fit == "pytorch"
    on = {
        # the PyTorch fit covers tp 1/2/8 on one H100 NVLink node (its held-out error is its rel_error) and the comm
        # term is measured for the GPUs and tp degrees of allreduce_measured.yaml; pp is covered by neither
        "parallelism": t.pp_size > 1 or (t.tp_size > 1 and not (pytorch_fitted and measured_allreduce(spec.key, t.tp_size))),
        "qformat": q.qformat not in CALIBRATED_QFORMATS,
        "engine": fit is None,  # no fitted GPU efficiency model covers the recipe's own engine (the serving-path row)
        "architecture": spec.arch not in CALIBRATED_ARCHS,
        "beam": b.max_beam_width > 1,
    }
    return {k: UNCALIBRATED_ERROR[k] for k, v in on.items() if v}
