"""Local files a recipe names, checked where it is validated (``trtpipe recipe validate``).

``model.source`` and ``quantization.calibration.dataset`` may be local paths, resolved against the recipe file's
directory (as the quantize stage resolves them: :func:`pipeline.quantize.sources.resolve_source`,
:func:`pipeline.quantize.calib.sources.open_source`). A schema check alone passes a path that does not exist; the
build would then stop at its first stage. This module tells the same rule before any work.
"""

from __future__ import annotations

import re
from pathlib import Path

from pipeline.core.recipe_paths import recipe_path
from pipeline.recipe.model import EMBEDDED_SMOLLM2
from pipeline.recipe.schema import Recipe

HUB_ID = re.compile(r"^[A-Za-z0-9][\w.-]*/[\w.-]+$")
"""``org/name``: a Hugging Face hub id when no such local path exists (:func:`classify_source`)."""

CALIB_SUFFIXES = (".txt", ".jsonl", ".parquet")


def _resolved(value: str, recipe_dir: Path) -> Path:
    return recipe_path(value, recipe_dir)


def classify_source(src: str, recipe_dir: Path) -> tuple[str, Path, str | None]:
    """What a non-``embedded:`` ``model.source`` names, by the one rule the quantize stage and ``recipe validate``
    share: ``(kind, path, problem)`` with ``kind`` ``gguf`` (an existing ``.gguf`` file), ``dir`` (an existing HF
    checkpoint directory), ``hub`` (no such path, shaped ``org/name``) or ``bad``; ``path`` resolved against
    ``recipe_dir``; ``problem`` (for ``bad``) the reason after ``model.source``, e.g. ``'x': no such file or
    directory (/r/x)``."""
    path = _resolved(src, recipe_dir)
    if path.exists():
        if path.is_file() and path.suffix == ".gguf":
            return "gguf", path, None
        if path.is_dir():
            if not (path / "config.json").is_file():
                return "bad", path, f"{src!r}: directory {path} has no config.json (not a HF checkpoint)"
            return "dir", path, None
        return "bad", path, f"{src!r}: {path} is neither a HF checkpoint directory nor a .gguf file"
    if HUB_ID.match(src) and not src.endswith(".gguf"):
        return "hub", path, None
    return "bad", path, f"{src!r}: no such file or directory ({path})"


def local_path_problems(recipe: Recipe, recipe_dir: Path) -> list[tuple[str, str]]:
    """``[(field, what is wrong)]`` for every local path of ``recipe`` that the build could not read.

    Args:
        recipe: a validated recipe.
        recipe_dir: the recipe file's directory; relative paths resolve against it.

    Returns:
        One entry per problem: ``model.source`` that is not ``embedded:…``, not an existing HF directory (with
        config.json) or ``.gguf`` file and not shaped like a hub id; ``quantization.calibration.dataset`` naming a
        ``.txt``/``.jsonl``/``.parquet`` file that does not exist. Empty when every local path is usable.
    """
    out: list[tuple[str, str]] = []
    src = recipe.model.source.strip()
    if not src.startswith("embedded:"):
        kind, path, problem = classify_source(src, recipe_dir)
        if problem is not None:
            if not path.exists():
                problem += f"; not a hub id (org/name) nor {EMBEDDED_SMOLLM2!r}"
            out.append(("model.source", problem))
    ds = recipe.quantization.calibration.dataset
    if ds != "embedded":
        path = _resolved(ds, recipe_dir)
        if path.suffix.lower() in CALIB_SUFFIXES and not path.is_file():
            out.append(("quantization.calibration.dataset", f"{ds!r}: no such file ({path})"))
    return out


def describe(recipe_file: Path, problems: list[tuple[str, str]]) -> str:
    """``FILE:LINE field: what`` per problem (the line of the field in the file, when it is there), joined by ``; ``."""
    from pipeline.recipe.load import _line_for, _line_index

    try:
        index = _line_index(Path(recipe_file).read_text())
    except OSError:
        index = {}
    parts = []
    for field, what in problems:
        line = _line_for(index, tuple(field.split(".")))
        parts.append(f"{recipe_file}{f':{line}' if line else ''} {field}: {what}")
    return "; ".join(parts)
