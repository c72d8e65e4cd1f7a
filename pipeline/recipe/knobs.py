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

#: Recipe knobs that only ``trtllm-build`` reads (TensorRT engine build; no PyTorch-backend equivalent).
TRT_ONLY_KNOBS = ("build.plugins", "build.kv_cache_type", "build.workers", "build.opt_num_tokens")
#: Recipe knobs that only the PyTorch LLM-API backend reads.
PYTORCH_ONLY_KNOBS = ("build.pytorch",)


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
    pipeline/serve/openai_cpu.py); ``build.engine: tensorrt`` for a ``target.tensorrt_llm`` release
    without the TensorRT-engine path (:func:`pipeline.core.engine_paths.engine_path_problem`).
    """
    b, engine = recipe.build, recipe.build.engine
    out: list[tuple[str, str]] = []
    if engine == "pytorch":
        out += [(k, "a TensorRT engine-build knob: the PyTorch LLM-API backend has no such setting; remove it (or use build.engine: tensorrt)")
                for k in TRT_ONLY_KNOBS if _differs(b, k)]
    else:
        out += [(k, f"PyTorch LLM-API backend knobs, but build.engine is '{engine}': remove them (or use build.engine: pytorch)")
                for k in PYTORCH_ONLY_KNOBS if _differs(b, k)]
    if recipe.serving.frontend == "trtllm-serve" and engine != "pytorch":  # on the cpu target: trtpipe's CPU stand-in
        out.append(("serving.frontend", f"trtllm-serve serves only build.engine: pytorch, not build.engine '{engine}'; use frontend triton"))
    problem = engine_paths.engine_path_problem(engine, recipe.target.tensorrt_llm)
    if problem:
        out.append(("target.tensorrt_llm", problem))
    return out
