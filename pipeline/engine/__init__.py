"""Engine stage: dispatch on ``build.engine`` to the TensorRT-LLM, PyTorch LLM-API or CPU builder.

Every builder has the signature ``run(recipe, out_dir, *, quantized, force, dry_run) ->
StageResult`` and writes ``out_dir`` atomically with a manifest (``engine_kind``, versions,
per-file sha256) that ``trtpipe serve`` checks before starting.
"""

from __future__ import annotations

from pathlib import Path

from pipeline.artifacts import StageResult
from pipeline.recipe import Recipe


def run(recipe: Recipe, out_dir: Path, *, quantized: StageResult, force: bool = False, dry_run: bool = False) -> StageResult:
    """Build the engine (or engine configuration) for ``recipe.build.engine`` into ``out_dir``."""
    kind = recipe.build.engine
    if kind == "tensorrt":
        from pipeline.engine import tensorrt as builder
    elif kind == "pytorch":
        from pipeline.engine import pytorch as builder
    else:
        from pipeline.engine import cpu as builder
    return builder.run(recipe, Path(out_dir), quantized=quantized, force=force, dry_run=dry_run)
