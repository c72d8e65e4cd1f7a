"""The one rule for a local path a recipe names (``model.source``, a calibration file): relative to the recipe file's
directory, never to the working directory, so a recipe copied elsewhere with its files resolves the same.

:func:`recipe_path` is what ``trtpipe recipe validate`` (:func:`pipeline.recipe.paths.classify_source`), the quantize
stage (:func:`pipeline.quantize.sources.resolve_source` and its ``--dry-run`` command), the planner's geometry
(:func:`pipeline.core.geometry.geometry_for_source`) and the vision geometry
(:func:`pipeline.recipe.vision.vision_geometry`) resolve ``model.source`` with.
"""

from __future__ import annotations

from pathlib import Path


def recipe_path(value: str, recipe_dir: Path | str | None) -> Path:
    """``value`` (a path as a recipe spells it, ``~`` allowed) as the path it names: absolute as given, else relative
    to ``recipe_dir`` (the recipe file's directory); with ``recipe_dir=None``, relative to the working directory
    (a caller that has no recipe file). The path is not checked for existence nor made absolute."""
    path = Path(value).expanduser()
    return path if path.is_absolute() or recipe_dir is None else Path(recipe_dir) / path
