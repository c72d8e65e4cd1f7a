"""``trtpipe plan``: GPU sizing of a recipe — weight memory, KV-cache capacity, concurrency, throughput bounds.

Public API:

- :func:`plan_recipe` (recipe, gpu=None, scenarios=None) → :class:`PlanResult`
- :func:`check_fits` (recipe) → :class:`FitVerdict` (``ok``, ``errors``, ``warnings``), called by
  ``trtpipe build`` before any stage.
- formulas: :mod:`pipeline.plan.memory` (bytes, tokens) and :mod:`pipeline.plan.perf` (roofline).

See docs/plan.md for the formulas, the constants and how the estimates compare with published sizing.
"""

from pipeline.plan.memory import WeightBytes, activation_bytes, kv_bytes_per_token, kv_capacity_tokens, weight_bytes
from pipeline.plan.perf import Roofline
from pipeline.plan.planner import FitVerdict, MemoryPlan, PlanResult, ScenarioPlan, ThroughputPoint, check_fits, plan_recipe

__all__ = [
    "FitVerdict", "MemoryPlan", "PlanResult", "Roofline", "ScenarioPlan", "ThroughputPoint", "WeightBytes",
    "activation_bytes", "check_fits", "kv_bytes_per_token", "kv_capacity_tokens", "plan_recipe", "weight_bytes",
]
