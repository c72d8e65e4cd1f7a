"""``trtpipe plan``: GPU sizing of a recipe — weight memory, KV-cache capacity, concurrency, throughput bounds
and predicted (achievable) throughput and latency.

Public API:

- :func:`plan_recipe` (recipe, gpu=None, scenarios=None) → :class:`PlanResult`
- :func:`check_fits` (recipe) → :class:`FitVerdict` (``ok``, ``errors``, ``warnings``), called by
  ``trtpipe build`` before any stage.
- :func:`predict` (recipe, isl, osl, concurrency=None) → :class:`Prediction`: output tokens/s, TTFT and ITL
  (ms) with the expected relative error, at a concurrency or at maximum load.
- predicted vs measured per bench load point and the host measurement live above the stages, in
  :mod:`pipeline.calibrate` (this package imports no stage, server or bench).
- formulas: :mod:`pipeline.plan.memory` (bytes, tokens), :mod:`pipeline.plan.perf` (roofline bounds),
  :mod:`pipeline.plan.achievable` (step-time model), :mod:`pipeline.plan.calibration` (its fit).

See docs/plan.md for the formulas, the constants and how the estimates compare with published figures.
"""

from pipeline.plan.achievable import Prediction, SchedulerLimits
from pipeline.plan.memory import (
    WeightBytes,
    activation_bytes,
    kv_capacity_tokens,
    weight_bytes,
)
from pipeline.plan.perf import Roofline
from pipeline.plan.planner import check_fits, plan_recipe, predict
from pipeline.plan.result import (
    FitVerdict,
    MemoryPlan,
    PlanResult,
    ScenarioPlan,
    ThroughputPoint,
)
from pipeline.plan.step import Efficiency, StepCost

__all__ = [
    "Efficiency", "FitVerdict", "MemoryPlan", "PlanResult", "Prediction", "Roofline", "ScenarioPlan",
    "SchedulerLimits", "StepCost", "ThroughputPoint", "WeightBytes", "activation_bytes", "check_fits",
    "kv_capacity_tokens", "plan_recipe", "predict", "weight_bytes",
]
