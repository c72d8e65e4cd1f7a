"""The recipe: one typed YAML per model × target that drives every stage.

Sections (one module each): ``model``/``target`` (:mod:`.model`), ``quantization``
(:mod:`.quant`), ``build`` (:mod:`.build`), ``serving`` (:mod:`.serve`), ``bench``
(:mod:`.bench`). :func:`load_recipe` reads a file and reports errors as ``FILE:LINE field: …``.
"""

from pipeline.recipe.bench import BenchSpec, ScenarioSpec
from pipeline.recipe.build import (
    BuildSpec,
    CpuBuild,
    CpuEngineSpec,
    KvCacheSpec,
    PluginSpec,
    PytorchBuild,
    SchedulerSpec,
    TensorrtBuild,
)
from pipeline.recipe.load import (
    dump_recipe,
    load_recipe,
    parse_overrides,
    recipe_json_schema,
)
from pipeline.recipe.model import EMBEDDED_SMOLLM2, ModelSpec, TargetSpec
from pipeline.recipe.quant import (
    KV_CACHE_QUANT_ALGO,
    QUANT_ALGO,
    CalibrationSpec,
    QuantSpec,
)
from pipeline.recipe.schema import Recipe
from pipeline.recipe.serve import ServingSpec

__all__ = [
    "EMBEDDED_SMOLLM2", "KV_CACHE_QUANT_ALGO", "QUANT_ALGO", "BenchSpec", "BuildSpec", "CalibrationSpec",
    "CpuBuild", "CpuEngineSpec", "KvCacheSpec", "ModelSpec", "PluginSpec", "PytorchBuild", "QuantSpec", "Recipe", "ScenarioSpec",
    "SchedulerSpec", "ServingSpec", "TargetSpec", "TensorrtBuild", "dump_recipe", "load_recipe", "parse_overrides",
    "recipe_json_schema",
]
