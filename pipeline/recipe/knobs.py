"""The recipe's frontend/engine/release rules (a knob section of another engine is refused by type).

A knob the chosen engine never reads is an error, not a silent no-op. Since issue #45 that is the type of ``build``:
one type per ``build.engine`` (:data:`pipeline.recipe.build.BuildSpec`), so ``build.pytorch`` on a TensorRT or
CPU-engine recipe, or ``build.plugins`` on a PyTorch one, is an unknown key of the section's type (one line naming
the field, :func:`pipeline.recipe.load.load_recipe`). What is left here is the path check (engine × target ×
frontend, the serving-path table) and the release check.
"""

from __future__ import annotations

from typing import Any

from pipeline.core import engine_paths
from pipeline.recipe.serving_path import (
    PYTORCH_ONLY_KNOBS,
    TRT_ONLY_KNOBS,
    path_problem,
)

__all__ = ["PYTORCH_ONLY_KNOBS", "TRT_ONLY_KNOBS", "knob_problems"]


def knob_problems(recipe: Any) -> list[tuple[str, str]]:
    """``(field, message)`` for each knob the recipe's engine kind or frontend cannot honour (empty = fine).

    Rules: ``serving.frontend: trtllm-serve`` on
    anything but ``pytorch`` (on the cpu target trtpipe serves it with its CPU stand-in for trtllm-serve,
    pipeline/cpu_runtime/openai/); ``build.engine: tensorrt`` for a ``target.tensorrt_llm`` release
    without the TensorRT-engine path (:func:`pipeline.core.engine_paths.engine_path_problem`).
    """
    engine = recipe.build.engine
    out: list[tuple[str, str]] = []
    # a frontend that does not serve the engine (on the cpu target trtllm-serve is trtpipe's CPU stand-in)
    problem = path_problem(engine, recipe.target.gpu, recipe.serving.frontend)
    out += [problem] if problem is not None else []
    problem = engine_paths.engine_path_problem(engine, recipe.target.tensorrt_llm)
    if problem:
        out.append(("target.tensorrt_llm", problem))
    return out
