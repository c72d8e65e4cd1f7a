"""Which ``build`` knobs each engine kind reads, and the recipe's frontend/engine/release rules.

A knob the chosen engine never reads is an error, not a silent no-op: the TensorRT engine-build knobs on a PyTorch
recipe (the LLM API has no plugins, KV-cache type, build workers nor opt_num_tokens:
pipeline/data/trtllm_1.2.1_llmapi_contract.yaml lists every ``LLM()`` argument), and the PyTorch-backend section
``build.pytorch`` on a TensorRT or CPU-engine recipe. Knobs are compared with their defaults, so a recipe written
out in full (every default spelled) stays valid.
"""

from __future__ import annotations

from typing import Any

from pipeline.core import engine_paths
from pipeline.recipe.serving_path import (
    PYTORCH_ONLY_KNOBS,
    TRT_ONLY_KNOBS,
    path_problem,
    unread_knobs,
)

__all__ = ["PYTORCH_ONLY_KNOBS", "TRT_ONLY_KNOBS", "knob_problems"]


def _differs(build: Any, knob: str) -> bool:
    name = knob.split(".", 1)[1]
    field = type(build).model_fields[name]
    default = field.get_default(call_default_factory=True)
    value = getattr(build, name)
    dump = (lambda v: v.model_dump() if hasattr(v, "model_dump") else v)
    return dump(value) != dump(default)


def knob_problems(recipe: Any) -> list[tuple[str, str]]:
    """``(field, message)`` for each knob the recipe's engine kind or frontend cannot honour (empty = fine).

    Rules: TRT-only knobs (:data:`TRT_ONLY_KNOBS`) differing from their defaults on ``build.engine: pytorch``;
    ``build.pytorch`` differing from its defaults on ``tensorrt``/``cpu``; ``serving.frontend: trtllm-serve`` on
    anything but ``pytorch`` (on the cpu target trtpipe serves it with its CPU stand-in for trtllm-serve,
    pipeline/cpu_runtime/openai/); ``build.engine: tensorrt`` for a ``target.tensorrt_llm`` release
    without the TensorRT-engine path (:func:`pipeline.core.engine_paths.engine_path_problem`).
    """
    b, engine = recipe.build, recipe.build.engine
    messages = {k: "a TensorRT engine-build knob: the PyTorch LLM-API backend has no such setting; remove it (or use build.engine: tensorrt)"
                for k in TRT_ONLY_KNOBS}
    messages.update({k: f"PyTorch LLM-API backend knobs, but build.engine is '{engine}': remove them (or use build.engine: pytorch)"
                     for k in PYTORCH_ONLY_KNOBS})
    out = [(k, messages[k]) for k in unread_knobs(engine, recipe.target.gpu) if _differs(b, k)]
    # a frontend that does not serve the engine (on the cpu target trtllm-serve is trtpipe's CPU stand-in)
    problem = path_problem(engine, recipe.target.gpu, recipe.serving.frontend)
    out += [problem] if problem is not None else []
    problem = engine_paths.engine_path_problem(engine, recipe.target.tensorrt_llm)
    if problem:
        out.append(("target.tensorrt_llm", problem))
    return out
