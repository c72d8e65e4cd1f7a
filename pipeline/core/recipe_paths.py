"""The one rule for a local path a recipe names (``model.source``, a calibration file, a LoRA adapter, a draft model):
relative to the recipe file's directory, never to the working directory, so a recipe copied elsewhere with its files
resolves the same. ``~`` is expanded first; an absolute path stays as given.

:func:`recipe_path` is what resolves them:

- ``model.source``: ``trtpipe recipe validate`` (:func:`pipeline.recipe.paths.classify_source`), the quantize stage
  (:func:`pipeline.quantize.sources.resolve_source`; its ``--dry-run`` command, which records the resolved directory
  in its manifest for the engine stage's dry-run geometry and the LLM-API ``max_seq_len``:
  ``QuantizeResult.source_dir``), the vision-encoder
  stage's dry run, the planner's geometry (:func:`pipeline.core.geometry.geometry_for_source`) and vision geometry
  (:func:`pipeline.recipe.vision.vision_geometry`, resolved once per plan), and the recipe's own cross-field rules
  (``Recipe`` validation, given the recipe's directory as the validation context ``recipe_dir`` by
  :func:`pipeline.recipe.load.load_recipe`);
- ``quantization.calibration.dataset``: :func:`pipeline.quantize.calib.sources.open_source` and the quantize stage's
  dataset hash;
- ``build.lora.adapters[].path``: :func:`pipeline.recipe.lora.resolve_adapters`;
- ``build.pytorch.speculative_config.speculative_model_dir``: made absolute when the recipe loads
  (``pipeline/recipe/load.py`` ``_absolute_draft``).
"""

from __future__ import annotations

from pathlib import Path


def recipe_path(value: str, recipe_dir: Path | str | None) -> Path:
    """``value`` (a path as a recipe spells it, ``~`` allowed) as the path it names: absolute as given, else relative
    to ``recipe_dir`` (the recipe file's directory); with ``recipe_dir=None``, relative to the working directory
    (a caller that has no recipe file). The path is not checked for existence nor made absolute."""
    path = Path(value).expanduser()
    return path if path.is_absolute() or recipe_dir is None else Path(recipe_dir) / path
