"""Calibration of the achievable-throughput model on published TensorRT-LLM throughput.

``pipeline/data/plan_calibration.yaml`` holds NVIDIA's v0.17 Llama-3.1-8B TP1 max-load output tokens/s on
H100 / L40S / A100 at nine ISL/OSL pairs and the conditions of those runs. Each point becomes a recipe
(:func:`point_recipe`: the GPU, the qformat and KV dtype of its column, trtllm-bench's max_batch_size and
max_num_tokens, KV fraction 0.95, tokens_per_block 64, chunked context) that goes through the same planner
and model as any recipe, so the fit calibrates exactly the code path users get.

:func:`fit` (scipy least squares on log errors; scipy comes with nvidia-modelopt) refits the free
parameters; :func:`evaluate` scores an :class:`Efficiency`; :func:`leave_one_gpu_out` refits without each
GPU and scores it on that GPU, :func:`leave_one_pair_out` the same per ISL/OSL pair. :func:`calibrate` runs them
all and returns the document of ``pipeline/data/plan_efficiency.yaml`` (:func:`dump` writes it, :func:`drift`
compares it with the shipped one); ``benchmarks/calibrate_plan.py`` is the command line around them.
"""

from __future__ import annotations

import functools
import math
import statistics
from collections.abc import Callable
from importlib import resources
from typing import Any

import yaml
from pydantic import BaseModel, ConfigDict

from pipeline.core import hardware
from pipeline.plan.model_inputs import EFFICIENCY_FILE
from pipeline.plan.step import Efficiency
from pipeline.recipe import Recipe

CALIBRATION_FILE = "data/plan_calibration.yaml"
#: published points of a GPU the fit never sees (the H200 column of the same v0.17 table): the out-of-fit check
HELD_OUT_FILE = "data/plan_held_out.yaml"
#: Parameters fitted: (start, lower bound, upper bound); fractions of peak, µs per sequence per step.
#: attn_frac's ceiling 0.75 is the best published FMHA forward efficiency (FlashAttention-3: ~740 TFLOPS
#: BF16 on H100 = 75 % of peak, arXiv:2407.08608; FlashAttention-2: up to 73 % of A100 peak, arXiv:2307.08691).
FREE: dict[str, tuple[float, float, float]] = {
    "bw_frac": (0.7, 0.2, 1.0),
    "gemm_frac": (0.6, 0.1, 1.0),
    "attn_frac": (0.5, 0.05, 0.75),
    "seq_overhead_us": (5.0, 0.0, 200.0),
}
#: Parameters held fixed (not identifiable from max-load throughput, where steps last 20-300 ms):
#: 0.5 ms per step ≈ 32 layers × ~10 kernels × ~1.5 µs launch each of a TensorRT engine step, ± 0.5 ms.
FIXED: dict[str, float] = {"step_overhead_ms": 0.5, "step_overhead_uncertainty_ms": 0.5}


class CalibrationPoint(BaseModel):
    """One published figure: GPU key, its column's formats, ISL/OSL (tokens) and output tokens/s."""

    model_config = ConfigDict(frozen=True)

    gpu: str
    qformat: str
    kv_cache_dtype: str
    model_dtype: str
    isl: int
    osl: int
    published: float


@functools.cache
def _raw() -> dict:
    return yaml.safe_load(resources.files("pipeline").joinpath(CALIBRATION_FILE).read_text())


def points() -> list[CalibrationPoint]:
    """Every published point of ``plan_calibration.yaml`` (27: 3 GPUs × 9 ISL/OSL pairs)."""
    raw = _raw()
    cols = list(raw["columns"].items())
    out = []
    for isl, osl, *values in raw["rows"]:
        for (gpu, col), v in zip(cols, values, strict=True):
            out.append(CalibrationPoint(gpu=gpu, qformat=col["qformat"], kv_cache_dtype=col["kv_cache_dtype"],
                                        model_dtype=col["model_dtype"], isl=isl, osl=osl, published=v))
    return out


def held_out_points() -> list[CalibrationPoint]:
    """The published points of ``plan_held_out.yaml`` (9: the H200 column of the same v0.17 table; the v0.13 and v0.14
    tables are :func:`held_out_other_versions`), under the calibration's conditions; :func:`fit` never uses them,
    :func:`evaluate` scores them like any point."""
    raw = yaml.safe_load(resources.files("pipeline").joinpath(HELD_OUT_FILE).read_text())
    assert raw["model"] == _raw()["model"], "held-out points must be of the calibrated model"
    cols = list(raw["columns"].items())
    return [CalibrationPoint(gpu=gpu, qformat=col["qformat"], kv_cache_dtype=col["kv_cache_dtype"], model_dtype=col["model_dtype"],
                             isl=isl, osl=osl, published=v)
            for isl, osl, *values in raw["rows"] for (gpu, col), v in zip(cols, values, strict=True)]


def held_out_other_versions() -> dict[str, list[CalibrationPoint]]:
    """``other_versions`` of ``plan_held_out.yaml`` by version: the H200 (held out) and H100 (a fitted GPU, measured by
    that version) FP8 columns of the v0.13 and v0.14 engine-path tables, under the calibration's conditions. A check of
    the fitted model on other releases, never fitted: the H100 column gives the version offset, the H200/H100 ratio
    (published over model) the bandwidth scaling, free of it."""
    raw = yaml.safe_load(resources.files("pipeline").joinpath(HELD_OUT_FILE).read_text())
    out = {}
    for t in raw["other_versions"]:
        cols = list(t["columns"].items())
        out[t["version"]] = [CalibrationPoint(gpu=gpu, qformat=col["qformat"], kv_cache_dtype=col["kv_cache_dtype"],
                                              model_dtype=col["model_dtype"], isl=isl, osl=osl, published=v)
                             for isl, osl, *values in t["rows"] for (gpu, col), v in zip(cols, values, strict=True)]
    return out


def trtllm_bench_settings(gpu: hardware.GpuSpec, param_count: int, weight_bytes_per_param: float, kv_bytes_per_token: int,
                          isl: int, osl: int, kv_fraction: float = 0.95, n_gpus: int = 1) -> tuple[int, int]:
    """``(max_batch_size, max_num_tokens)`` that ``trtllm-bench build --dataset`` picks (TensorRT-LLM
    tensorrt_llm/bench/build/tuning.py: calc_engine_setting + finetune_setting).

    requests = (n_gpus × GPU GiB − params × bytes/param GiB) × fraction / (KV GiB per token of the whole model ×
    (ISL + OSL)) (``kv_bytes_per_token``: all layers, max(tp, KV heads) heads, as tuning.py counts them);
    raw_bs = min(requests, 4096); raw_tokens = min(raw_bs × (1 + ISL/OSL), 32768);
    batch rounded up to 32 (min 64) below 256, to 128 below 1024, else to 256;
    tokens rounded up to 256 (min 2048) below 4096, to 512 below 8192, else to 1024.
    """
    gib = 1 << 30
    available = n_gpus * gpu.memory_bytes / gib - param_count * weight_bytes_per_param / gib
    requests = available * kv_fraction / (kv_bytes_per_token / gib * (isl + osl))
    raw_bs = min(requests, 4096)
    raw_tok = min(raw_bs * (1 + isl / osl), 32768)
    if raw_bs < 256:
        bs = max(64, 32 * math.ceil(raw_bs / 32))
    elif raw_bs < 1024:
        bs = 128 * math.ceil(raw_bs / 128)
    else:
        bs = 256 * math.ceil(raw_bs / 256)
    if raw_tok < 4096:
        tok = max(2048, 256 * math.ceil(raw_tok / 256))
    elif raw_tok < 8192:
        tok = 512 * math.ceil(raw_tok / 512)
    else:
        tok = 1024 * math.ceil(raw_tok / 1024)
    return bs, tok


def point_recipe(p: CalibrationPoint) -> Recipe:
    """The recipe that reproduces a published run's conditions (see ``plan_calibration.yaml``)."""
    from pipeline.core.geometry import known_geometry

    raw = _raw()
    cond = raw["conditions"]
    geo = known_geometry(raw["model"])
    assert geo is not None
    gpu = hardware.catalog()[p.gpu]
    kv_b = 1 if p.kv_cache_dtype in ("fp8", "int8") else 2
    kv_tok = geo.kv_bytes_per_token(kv_b)
    bs, tok = trtllm_bench_settings(gpu, geo.num_parameters, 1.0 if p.qformat == "fp8" else 2.0, kv_tok, p.isl, p.osl,
                                    cond["kv_cache_free_gpu_mem_fraction"])
    tpb = cond["tokens_per_block"]
    seq = math.ceil((p.isl + p.osl) / tpb) * tpb
    return Recipe.model_validate({
        "name": f"calib-{p.gpu}-{p.isl}-{p.osl}",
        "model": {"source": raw["model"], "dtype": p.model_dtype},
        "target": {"gpu": p.gpu},
        "quantization": {"qformat": p.qformat, "kv_cache_dtype": p.kv_cache_dtype},
        "build": {
            "engine": cond["engine"], "max_batch_size": bs, "max_num_tokens": tok, "max_input_len": p.isl,
            "max_seq_len": seq, "tokens_per_block": tpb, "enable_chunked_prefill": cond["enable_chunked_prefill"],
            "plugins": {"use_paged_context_fmha": True, "use_fp8_context_fmha": cond["use_fp8_context_fmha"]},
            "kv_cache_config": {"free_gpu_memory_fraction": cond["kv_cache_free_gpu_mem_fraction"]},
            "scheduler_config": {"capacity_scheduler_policy": cond["capacity_scheduler_policy"]},
        },
        "bench": {"scenarios": [{"isl": p.isl, "osl": p.osl}], "concurrency": [1]},
    })


@functools.cache
def _inputs(p: CalibrationPoint):
    """(StepCost, SchedulerLimits) of a point, from the planner's memory plan."""
    from pipeline.plan.planner import plan_recipe

    plan = plan_recipe(point_recipe(p))
    assert plan.step_cost is not None and plan.scheduler is not None, plan.verdict.errors
    return plan.step_cost, plan.scheduler


class PointResult(BaseModel):
    """A point's published and predicted output tokens/s, the relative error (pred/pub − 1), the batch."""

    gpu: str
    isl: int
    osl: int
    published: float
    predicted: float
    error: float
    batch: int
    limited_by: str


def evaluate(eff: Efficiency, pts: list[CalibrationPoint] | None = None) -> list[PointResult]:
    """Predict every calibration point at maximum load with ``eff``."""
    from pipeline.plan.achievable import predict_point

    out = []
    for p in pts if pts is not None else points():
        cost, limits = _inputs(p)
        pr = predict_point(cost, limits, eff, p.isl, p.osl, None)
        out.append(PointResult(gpu=p.gpu, isl=p.isl, osl=p.osl, published=p.published, predicted=pr.output_tokens_per_s,
                               error=pr.output_tokens_per_s / p.published - 1, batch=pr.batch, limited_by=pr.limited_by))
    return out


def summary(results: list[PointResult]) -> dict[str, float]:
    """``median_abs_error``, ``worst_abs_error`` (relative, pred/pub − 1) and ``rms_log_error`` (ln units)."""
    errs = [abs(r.error) for r in results]
    return {
        "median_abs_error": statistics.median(errs),
        "worst_abs_error": max(errs),
        "rms_log_error": math.sqrt(statistics.fmean(math.log(r.predicted / r.published) ** 2 for r in results)),
    }


def least_squares_fit(free: dict[str, tuple[float, float, float]], fixed: dict, evaluate_fn: Callable[[Efficiency, list], list[PointResult]],
                      pts: list) -> Efficiency:
    """Least-squares fit of the ``free`` parameters (name → (start, lower, upper)) on ln(predicted / published) over
    ``pts``, ``fixed`` held, each point predicted by ``evaluate_fn(efficiency, pts)``. Deterministic (scipy
    ``least_squares``, trust-region reflective, fixed start). Shared by the engine path's fit and the PyTorch
    backend's (:mod:`pipeline.plan.calibration_pytorch`)."""
    from scipy.optimize import least_squares

    def eff_of(x) -> Efficiency:
        return Efficiency(**dict(zip(free, (float(v) for v in x), strict=True)), **fixed, rel_error=0.0)

    def resid(x):
        return [math.log(r.predicted / r.published) for r in evaluate_fn(eff_of(x), pts)]

    res = least_squares(resid, [v[0] for v in free.values()], bounds=([v[1] for v in free.values()], [v[2] for v in free.values()]),
                        x_scale=[v[0] or 1 for v in free.values()], diff_step=1e-4)
    return eff_of(res.x)


def leave_one_out(pts: list, key: Callable[[Any], Any], fit_fn: Callable[[list], Efficiency],
                  evaluate_fn: Callable[[Efficiency, list], list[PointResult]]) -> dict[Any, tuple[Efficiency, list[PointResult]]]:
    """For each value of ``key`` over ``pts`` (a GPU, a model, an ISL/OSL pair), in order of appearance: the fit
    (``fit_fn``) without the points that have it, and that fit's results on them."""
    out = {}
    for k in dict.fromkeys(key(p) for p in pts):
        eff = fit_fn([p for p in pts if key(p) != k])
        out[k] = (eff, evaluate_fn(eff, [p for p in pts if key(p) == k]))
    return out


def fit(pts: list[CalibrationPoint] | None = None, fixed: dict[str, float] | None = None) -> Efficiency:
    """Least-squares fit of :data:`FREE` on ln(predicted / published) over ``pts`` (default: all points),
    :data:`FIXED` held (:func:`least_squares_fit`)."""
    return least_squares_fit(FREE, FIXED if fixed is None else fixed, evaluate, points() if pts is None else pts)


def leave_one_gpu_out(pts: list[CalibrationPoint] | None = None) -> dict[str, tuple[Efficiency, list[PointResult]]]:
    """For each calibration GPU: the fit without it and that fit's results on it."""
    return leave_one_out(points() if pts is None else pts, lambda p: p.gpu, fit, evaluate)


def leave_one_pair_out(pts: list[CalibrationPoint] | None = None) -> list[PointResult]:
    """For each ISL/OSL pair: the fit without it (all GPUs), scored on that pair; all results together."""
    held = leave_one_out(points() if pts is None else pts, lambda p: (p.isl, p.osl), fit, evaluate)
    return [r for _, rs in held.values() for r in rs]


EFFICIENCY_HEADER = """\
# Fitted efficiency parameters of the achievable-throughput model (pipeline/plan/achievable.py).
# WRITTEN BY benchmarks/calibrate_plan.py (pipeline.plan.calibration.calibrate) from pipeline/data/plan_calibration.yaml
# — rerun it, do not edit.
#
# fitted (least squares on ln(predicted / published), 27 points):
#   bw_frac          achieved fraction of peak DRAM bandwidth streaming weights, activations, logits and KV
#   gemm_frac        achieved fraction of the dense tensor-core peak of the GEMM dtype
#   attn_frac        achieved fraction of the dense tensor-core peak in prefill attention (ceiling 0.75 = FA3)
#   seq_overhead_us  time per sequence per step outside the GEMM/attention roofline (runtime, sampling)
# fixed (not identifiable from max-load points, whose steps last 20-300 ms):
#   step_overhead_ms 0.5 ± 0.5 ms per step: ~32 layers x ~10 kernels x ~1.5 us launch each
# The expected error (the ± band) is NOT here: it is the held-out error of pipeline/data/plan_generalisation.yaml
#   (benchmarks/plan_generalisation.py: each GPU of the v0.17 table, H200 included, and each ISL/OSL pair left out of
#   the fit and predicted); predictions add terms for uncalibrated conditions (pipeline/plan/model_inputs.py).
"""


def _round(d: dict, n: int = 4) -> dict:
    return {k: round(v, n) if isinstance(v, float) else v for k, v in d.items()}


def calibrate() -> dict:
    """The document of ``plan_efficiency.yaml``: :func:`fit` on every point (``fitted``, ``fixed``, ``fit``
    summary, ``points``), :func:`leave_one_gpu_out` (per GPU: its parameters, summary and per-point errors) and
    :func:`leave_one_pair_out` (summary). The ± band is :mod:`pipeline.plan.generalisation`'s. Deterministic: same table → same parameters (to the optimizer's tolerance);
    thirteen least-squares fits, a few seconds."""
    eff = fit()
    results = evaluate(eff)
    logo_out = {}
    for g, (e, rs) in leave_one_gpu_out().items():
        logo_out[g] = {"params": _round({k: getattr(e, k) for k in FREE}), **_round(summary(rs)),
                       "errors": [round(r.error, 4) for r in rs]}
    lopo_summ = summary(leave_one_pair_out())
    return {
        "source": f"fit of benchmarks/calibrate_plan.py on {_raw()['source']}",
        "fitted": _round({k: getattr(eff, k) for k in FREE}),
        "fixed": dict(FIXED),
        "fit": _round(summary(results)),
        "leave_one_gpu_out": logo_out,
        "leave_one_pair_out": _round(lopo_summ),
        "points": [{"gpu": r.gpu, "isl": r.isl, "osl": r.osl, "published": r.published, "predicted": round(r.predicted, 1),
                    "error": round(r.error, 4), "batch": r.batch, "limited_by": r.limited_by} for r in results],
    }


def dump(data: dict) -> str:
    """``data`` (:func:`calibrate`'s document) as the text of ``plan_efficiency.yaml``, header first."""
    return EFFICIENCY_HEADER + yaml.safe_dump(data, sort_keys=False, allow_unicode=True, width=120)


def shipped() -> dict:
    """The shipped ``plan_efficiency.yaml`` document."""
    return yaml.safe_load(resources.files("pipeline").joinpath(EFFICIENCY_FILE).read_text())


def drift(old: dict, new: dict, rel_tol: float = 1e-3, abs_tol: float = 1e-3) -> dict[str, tuple[float, float]]:
    """The fitted parameters that differ between two documents beyond the tolerances: ``{name: (old, new)}``;
    empty when ``new`` reproduces ``old``."""
    return {k: (old["fitted"][k], new["fitted"][k]) for k in new["fitted"]
            if not math.isclose(old["fitted"][k], new["fitted"][k], rel_tol=rel_tol, abs_tol=abs_tol)}
