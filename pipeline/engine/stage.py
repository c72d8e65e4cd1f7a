"""Engine stage: dispatch on ``build.engine`` to the TensorRT-LLM, PyTorch LLM-API or CPU builder.

``build.engine: pytorch`` with ``target.gpu: cpu`` goes to the CPU builder: the CPU engine directory plus the
``LLM()`` kwargs that trtpipe's ``llmapi`` Triton model passes to :class:`pipeline.cpu_runtime.llm.LLM`.

Every builder has the signature ``run(recipe, layout, *, quantized, force, dry_run) -> EngineResult``
and writes ``layout.engine`` atomically with a manifest (``engine_kind``, ``serving_path``: the key of
:func:`pipeline.recipe.serving_path.serving_path`, ``status``, versions, ``world_size``, per-file sha256) that ``trtpipe serve`` checks before starting.
"""

from __future__ import annotations

from pipeline.core.layout import BuildLayout
from pipeline.engine.result import EngineResult
from pipeline.quantize.result import QuantizeResult
from pipeline.recipe import Recipe
from pipeline.recipe.serving_path import serving_path

STAGE = EngineResult.STAGE


def run(recipe: Recipe, layout: BuildLayout, *, quantized: QuantizeResult, force: bool = False, dry_run: bool = False) -> EngineResult:
    """Build the engine (or engine configuration) for ``recipe.build.engine`` into ``layout.engine``.

    Raises whatever the builder raises: :class:`~pipeline.core.errors.UserError` for recipe values the
    model cannot take, :class:`~pipeline.core.errors.StageError` for a failed build,
    :class:`~pipeline.core.errors.MissingToolError` when ``trtllm-build`` is absent (after writing the command).
    """
    import importlib

    # cpu, and pytorch on the cpu target: the CPU engine directory (+ the LLM() kwargs of its LLM facade)
    builder = importlib.import_module(f"pipeline.engine.{serving_path(recipe).builder}")
    return builder.run(recipe, layout, quantized=quantized, force=force, dry_run=dry_run)
