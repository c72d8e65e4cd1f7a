"""Calibration of the PyTorch-backend model (``build.engine: pytorch``) on NVIDIA's published PyTorch-backend throughput.

``pipeline/data/plan_calibration_pytorch.yaml`` holds the H100 SXM and H200 SXM columns of TensorRT-LLM v1.0's perf
overview: Llama-3.1-8B TP1 (both), Llama-3.3-70B TP2 (H100) / TP1 (H200), Llama-3.1-405B TP8 (both), FP8, ten ISL/OSL
pairs, maximum load (60 points). Each point becomes a
recipe (:func:`point_recipe`) that goes through the same planner as users' recipes, as the engine path's calibration
(:mod:`pipeline.plan.calibration`) does; the step model is the same, with tensor parallelism's all-reduces at their measured times
(``pipeline/data/allreduce_measured.yaml``, not fitted). The
parameters are fitted separately from the engine path's, so the two runtimes keep their own efficiencies.

:func:`fit` fits :data:`FREE` (least squares on ln(predicted / published), deterministic); :func:`leave_one_model_out`
refits without each model (both GPUs) and scores it; :func:`leave_one_tp_out` the same per TP degree,
:func:`leave_one_gpu_out` per GPU, :func:`leave_one_pair_out` per ISL/OSL pair (the held-out tables and the planner's
± band: :mod:`pipeline.plan.generalisation`); :func:`calibrate` returns the document of ``pipeline/data/plan_efficiency_pytorch.yaml``
(``benchmarks/calibrate_plan.py --engine pytorch`` writes it).
"""

from __future__ import annotations

import functools
import math
from importlib import resources

import yaml
from pydantic import BaseModel, ConfigDict

from pipeline.core import hardware
from pipeline.plan.calibration import (
    FIXED,
    PointResult,
    _round,
    least_squares_fit,
    leave_one_out,
    summary,
    trtllm_bench_settings,
)
from pipeline.plan.model_inputs import PYTORCH_EFFICIENCY_FILE
from pipeline.plan.step import Efficiency
from pipeline.recipe import Recipe

CALIBRATION_FILE = "data/plan_calibration_pytorch.yaml"
#: Parameters fitted: (start, lower bound, upper bound). As the engine path's: fractions of peak DRAM bandwidth,
#: GEMM and attention tensor throughput, µs per sequence per step. Tensor parallelism's all-reduces are NOT fitted: each
#: takes its measured time (pipeline/data/allreduce_measured.yaml, AIConfigurator's TensorRT-LLM AllReduce tables for
#: H100/H200 SXM; :func:`pipeline.plan.step._allreduce_s`). The previous fit's link_frac / allreduce latencies were
#: not identifiable from max-load points (every step ~max_num_tokens tokens) and went unphysical (31 % of NVLink).
#: bw_frac's ceiling 0.895 is the HBM read rate torch measured on an H200 (4.30 of 4.8 TB/s,
#: docs/reference/published-throughput-pytorch-backend.md): no kernel streams weights faster than a plain read, so the
#: fit may not use more (assumed the same fraction on H100). On top of the measured all-reduce times a fitted sync time
#: per all-reduce (:class:`~pipeline.plan.step.Efficiency`): in decode steps ≤ 20 µs at tp 8, × (tp − 1)/7 at
#: lower tp (one more rank to wait for each). The bound is set from measured decode latency, not fitted: AIConfigurator's
#: 70B H200 ITL leaves ~0 µs at TP2 and ~15 µs at TP8 (the max-load fit alone pushes it to any bound given: 30 µs
#: over-predicts TP8 ITL by 28 %); a log2(tp)/3 growth, or the same growth on the prefill sync, fitted and scored
#: worse. Up to 500 µs (any tp > 1) in prefill-carrying steps (eager, no CUDA graph). A tensor-parallel GEMM
#: slow-down 1 + κ(tp − 1)/tp on compute-bound time was tried and dropped: alone it leaves 405B TP8 at +24 %, and next
#: to the prefill sync it fits κ = 0.
FREE: dict[str, tuple[float, float, float]] = {
    "bw_frac": (0.7, 0.2, 0.895),
    "gemm_frac": (0.6, 0.1, 1.0),
    "attn_frac": (0.5, 0.05, 0.75),
    "seq_overhead_us": (5.0, 0.0, 200.0),
    "allreduce_sync_us": (5.0, 0.0, 20.0),
    "allreduce_sync_prefill_us": (20.0, 0.0, 500.0),
}
#: How each fitted sync grows with tp (:data:`pipeline.plan.step.SYNC_SCALE`); held, written to the "fixed" section.
SYNC_SCALING: dict[str, str] = {"allreduce_sync_tp_scaling": "linear", "allreduce_sync_prefill_tp_scaling": "none"}
#: cuda_graph_config.batch_sizes of the page's llm_options.yml (perf-overview.md@00f37686, "Running the Benchmark")
CUDA_GRAPH_BATCHES = (1, 2, 4, 8, 16, 32, 64, 128, 256, 384, 512, 1024, 2048, 4096, 8192)
LABEL = {"llama31_8b": "Llama-3.1-8B TP1 H100", "llama33_70b": "Llama-3.3-70B TP2 H100", "llama31_405b": "Llama-3.1-405B TP8 H100",
         "llama31_8b_h200": "Llama-3.1-8B TP1 H200", "llama33_70b_h200": "Llama-3.3-70B TP1 H200",
         "llama31_405b_h200": "Llama-3.1-405B TP8 H200"}
NAME = "pytorch backend (fitted on TensorRT-LLM v1.0's H100 + H200 tables: 8B TP1, 70B TP1/TP2, 405B TP8)"


class PytorchPoint(BaseModel):
    """One published figure: model column, its hub id and TP degree, formats, ISL/OSL (tokens), output tokens/s."""

    model_config = ConfigDict(frozen=True)

    column: str
    model: str
    tp: int
    gpu: str
    qformat: str
    kv_cache_dtype: str
    isl: int
    osl: int
    published: float


@functools.cache
def _raw() -> dict:
    return yaml.safe_load(resources.files("pipeline").joinpath(CALIBRATION_FILE).read_text())


def points() -> list[PytorchPoint]:
    """Every published point (60: 3 models × 2 GPUs × 10 ISL/OSL pairs)."""
    raw = _raw()
    cols = list(raw["columns"].items())
    out = []
    for isl, osl, *values in raw["rows"]:
        for (name, col), v in zip(cols, values, strict=True):
            out.append(PytorchPoint(column=name, model=col["model"], tp=col["tp"], gpu=col.get("gpu", raw["gpu"]), qformat=col["qformat"],
                                    kv_cache_dtype=col["kv_cache_dtype"], isl=isl, osl=osl, published=v))
    return out


def point_recipe(p: PytorchPoint) -> Recipe:
    """The recipe that reproduces a published run's conditions (see ``plan_calibration_pytorch.yaml``)."""
    from pipeline.core.geometry import known_geometry

    raw = _raw()
    cond = raw["conditions"]
    geo = known_geometry(p.model)
    assert geo is not None, p.model
    gpu = hardware.catalog()[p.gpu]
    kv_b = 1 if p.kv_cache_dtype in ("fp8", "int8") else 2
    # tuning.py counts max(tp, KV heads) heads over all layers
    kv_tok = 2 * geo.num_hidden_layers * max(p.tp, geo.num_key_value_heads) * geo.head_dim * kv_b
    bs, tok = trtllm_bench_settings(gpu, geo.num_parameters, 1.0 if p.qformat == "fp8" else 2.0, kv_tok, p.isl, p.osl,
                                    cond["kv_cache_free_gpu_mem_fraction"], n_gpus=p.tp)
    tpb = cond["tokens_per_block"]
    return Recipe.model_validate({
        "name": f"calib-pytorch-{p.column}-{p.isl}-{p.osl}",
        "model": {"source": p.model, "dtype": "bfloat16"},
        "target": {"gpu": p.gpu, "num_gpus": p.tp, "tp_size": p.tp},
        "quantization": {"qformat": p.qformat, "kv_cache_dtype": p.kv_cache_dtype},
        "build": {
            "engine": cond["engine"], "max_batch_size": bs, "max_num_tokens": tok, "max_input_len": p.isl,
            "max_seq_len": math.ceil((p.isl + p.osl) / tpb) * tpb, "tokens_per_block": tpb,
            "enable_chunked_prefill": cond["enable_chunked_prefill"],
            "kv_cache_config": {"free_gpu_memory_fraction": cond["kv_cache_free_gpu_mem_fraction"]},
            "scheduler_config": {"capacity_scheduler_policy": cond["capacity_scheduler_policy"]},
            # the page's llm_options.yml: CUDA graphs with padding over 1, 2, 4, …, 8192 (those above the largest decode
            # batch are never captured; the recipe schema refuses them, so they are left out here)
            "pytorch": {"cuda_graph_config": {"enable_padding": True, "batch_sizes": [x for x in CUDA_GRAPH_BATCHES if x <= bs]}},
        },
        "bench": {"model": "tensorrt_llm", "scenarios": [{"isl": p.isl, "osl": p.osl}], "concurrency": [1]},
    })


@functools.cache
def _inputs(p: PytorchPoint):
    """(StepCost, SchedulerLimits) of a point, from the planner's memory plan."""
    from pipeline.plan.planner import plan_recipe

    plan = plan_recipe(point_recipe(p))
    assert plan.step_cost is not None and plan.scheduler is not None, plan.verdict.errors
    return plan.step_cost, plan.scheduler


def evaluate(eff: Efficiency, pts: list[PytorchPoint] | None = None) -> list[PointResult]:
    """Predict every point at maximum load with ``eff`` (``PointResult.gpu`` carries the model column)."""
    from pipeline.plan.achievable import predict_point

    out = []
    for p in pts if pts is not None else points():
        cost, limits = _inputs(p)
        pr = predict_point(cost, limits, eff, p.isl, p.osl, None)
        out.append(PointResult(gpu=p.column, isl=p.isl, osl=p.osl, published=p.published, predicted=pr.output_tokens_per_s,
                               error=pr.output_tokens_per_s / p.published - 1, batch=pr.batch, limited_by=pr.limited_by))
    return out


def fit(pts: list[PytorchPoint] | None = None, fixed: dict[str, float] | None = None) -> Efficiency:
    """Least-squares fit of :data:`FREE` on ln(predicted / published) over ``pts`` (default: all), the engine
    path's :data:`~pipeline.plan.calibration.FIXED` per-step overhead and :data:`SYNC_SCALING` held
    (:func:`pipeline.plan.calibration.least_squares_fit`)."""
    return least_squares_fit(FREE, {**FIXED, **SYNC_SCALING} if fixed is None else fixed, evaluate,
                             points() if pts is None else pts)


def leave_one_model_out(pts: list[PytorchPoint] | None = None) -> dict[str, tuple[Efficiency, list[PointResult]]]:
    """For each model (hub id; all its columns, every GPU and TP degree): the fit without it and that fit's results on it."""
    return leave_one_out(points() if pts is None else pts, lambda p: p.model, fit, evaluate)


def leave_one_tp_out(pts: list[PytorchPoint] | None = None) -> dict[int, tuple[Efficiency, list[PointResult]]]:
    """For each TP degree: the fit without every column run at it and that fit's results on them."""
    return leave_one_out(points() if pts is None else pts, lambda p: p.tp, fit, evaluate)


def leave_one_gpu_out(pts: list[PytorchPoint] | None = None) -> dict[str, tuple[Efficiency, list[PointResult]]]:
    """For each GPU (h100_sxm, h200): the fit on the other GPU's columns and its results on this one's."""
    return leave_one_out(points() if pts is None else pts, lambda p: p.gpu, fit, evaluate)


def leave_one_pair_out(pts: list[PytorchPoint] | None = None) -> list[PointResult]:
    """For each ISL/OSL pair: the fit without it (all models), scored on that pair; all results together."""
    held = leave_one_out(points() if pts is None else pts, lambda p: (p.isl, p.osl), fit, evaluate)
    return [r for _, rs in held.values() for r in rs]


HEADER = """\
# Fitted parameters of the PyTorch-backend model (build.engine: pytorch; pipeline/plan/achievable.py).
# WRITTEN BY benchmarks/calibrate_plan.py --engine pytorch (pipeline.plan.calibration_pytorch.calibrate) from
# pipeline/data/plan_calibration_pytorch.yaml — rerun it, do not edit.
#
# fitted (least squares on ln(predicted / published), 60 points: H100 SXM 8B TP1 / 70B TP2 / 405B TP8 and H200 SXM
# 8B TP1 / 70B TP1 / 405B TP8, FP8):
#   bw_frac, gemm_frac, attn_frac, seq_overhead_us   as the engine path's (plan_efficiency.yaml)
#   allreduce_sync_us, allreduce_sync_prefill_us   µs per tensor-parallel all-reduce on top of its measured time,
#   in pure-decode steps (tp 8's, × (tp − 1)/7 at lower tp; bound 20) and in prefill-carrying steps (eager, any tp > 1;
#   bound 500); fixed.allreduce_sync_*tp_scaling say how each grows with tp
# not fitted: the tensor-parallel all-reduces take their measured times (pipeline/data/allreduce_measured.yaml,
#   AIConfigurator's TensorRT-LLM 1.3.0rc10 AllReduce tables, H100/H200 SXM; log-log interpolation in message size)
# fixed: step_overhead_ms 0.5 ± 0.5 ms per step (not identifiable from max-load points)
# The expected error (the ± band) is NOT here: it is the held-out error of pipeline/data/plan_generalisation.yaml
# (benchmarks/plan_generalisation.py: each model, TP degree, GPU and ISL/OSL pair left out of the fit and predicted).
"""


def calibrate() -> dict:
    """The document of ``plan_efficiency_pytorch.yaml``: the fit on every point (``fitted``, ``fixed``, ``fit`` summary,
    per-point ``points``). The held-out errors are :func:`pipeline.plan.generalisation.held_out`'s."""
    eff = fit()
    results = evaluate(eff)
    return {
        "name": NAME,
        "source": f"fit of benchmarks/calibrate_plan.py --engine pytorch on {_raw()['source']}",
        "fitted": _round({k: getattr(eff, k) for k in FREE}),
        "fixed": {**FIXED, **SYNC_SCALING},
        "fit": _round(summary(results)),
        "points": [{"model": r.gpu, "isl": r.isl, "osl": r.osl, "published": r.published, "predicted": round(r.predicted, 1),
                    "error": round(r.error, 4), "batch": r.batch, "limited_by": r.limited_by} for r in results],
    }


def dump(data: dict) -> str:
    """``data`` as the text of ``plan_efficiency_pytorch.yaml``, header first."""
    return HEADER + yaml.safe_dump(data, sort_keys=False, allow_unicode=True, width=120)


def shipped() -> dict:
    """The shipped ``plan_efficiency_pytorch.yaml`` document."""
    return yaml.safe_load(resources.files("pipeline").joinpath(PYTORCH_EFFICIENCY_FILE).read_text())
