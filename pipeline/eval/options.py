"""``trtpipe eval``'s options, declared on the fields they set, and what they resolve to.

As ``trtpipe bench``'s (:mod:`pipeline.bench.options`, which generates the typer parameters and reads them back):
the gate's knobs are fields of :class:`~pipeline.recipe.eval.EvalSpec` (the recipe's ``eval`` section), the
candidate's ``--url`` is :attr:`~pipeline.eval.stage.EvalTarget.url`, and what one run compares against and
where it writes are the fields of :class:`EvalRun`. :func:`resolve` is the whole step from options to a
validated :class:`Resolved`, before any work.
"""

from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import Any

from pipeline.bench.options import declared, flag_names, overrides, parameters
from pipeline.eval.stage import EvalTarget
from pipeline.recipe.bench import Flag
from pipeline.recipe.eval import EvalSpec


def _reference(value: str, flag: str) -> str:
    """A published reference's name (:data:`pipeline.eval.stats.PUBLISHED`), else a UserError naming ``flag``."""
    from pipeline.core.errors import UserError
    from pipeline.eval.stats import PUBLISHED

    if value not in PUBLISHED:
        raise UserError(f"{flag} {value!r}: known references are {', '.join(PUBLISHED)}")
    return value


def _flag(name: str, help: str, kind: Any = str, **kw: Any) -> dict[str, Flag]:
    return {"flag": Flag(name, help, kind, **kw)}


@dataclasses.dataclass(frozen=True)
class EvalRun:
    """What one ``trtpipe eval`` compares the candidate with and where it writes (run-time facts, not recipe knobs);
    every field is an option. Without ``baseline``/``baseline_recipe`` the baseline is the candidate's recipe at
    full precision."""

    baseline: Path | None = dataclasses.field(default=None, metadata=_flag("--baseline", (
        "Baseline build directory (default: the recipe at full precision, built next to the candidate)."), Path))
    baseline_recipe: Path | None = dataclasses.field(default=None, metadata=_flag(
        "--baseline-recipe", "Baseline recipe: built (or reused) into its artifacts/<name>.", Path,
        excludes=("baseline",)))
    reference: str | None = dataclasses.field(default=None, metadata=_flag("--reference", (
        "Published reference for mlperf/trtllm instead of the baseline's scores: llama3.1-8b."), parse=_reference))
    out: Path | None = dataclasses.field(default=None, metadata=_flag(
        "--out", "Run directory (default artifacts/eval/<YYYYmmdd-HHMMSS>).", Path))


#: every class whose fields declare ``trtpipe eval`` options, in the order ``--help`` lists them
OWNERS = (EvalRun, EvalTarget, EvalSpec)


def all_parameters() -> list[Any]:
    """The typer parameters of every declared option (:func:`pipeline.bench.options.parameters`), in :data:`OWNERS` order."""
    return [p for owner in OWNERS for p in parameters(owner)]


def all_declared() -> list[tuple[str, Flag, Any]]:
    """``(field name, Flag, field default)`` of every declared option, in :data:`OWNERS` order."""
    return [d for owner in OWNERS for d in declared(owner)]


@dataclasses.dataclass(frozen=True)
class Resolved:
    """A checked ``trtpipe eval``: the gate's ``spec``, the ``candidate``, a ``baseline`` deployment (``None``: built
    from ``run.baseline_recipe``, else from the candidate's recipe at full precision), the ``recipe`` (or ``None``)
    and its directory (relative task paths)."""

    spec: EvalSpec
    candidate: EvalTarget
    baseline: EvalTarget | None
    run: EvalRun
    recipe: Any
    recipe_dir: Path


def resolve(target: Path | None, options: dict[str, Any]) -> Resolved:
    """What ``trtpipe eval [target] options…`` (options by field name) asks for, checked before any work.

    The spec starts from the recipe's ``eval`` section (``target`` a recipe, or the build's recipe.yaml), else
    defaults, and takes the given options as validated overrides; a ``--task`` path is relative to the working
    directory, the recipe's own relative to the recipe.

    Raises:
        UserError: an invalid or inconsistent option, a candidate or baseline that is not there, a broken baseline
            recipe, or a build without a recipe and no baseline given (one line naming what is at fault).
    """
    from pipeline.core.errors import UserError
    from pipeline.core.layout import BuildLayout
    from pipeline.eval import stage, tasks
    from pipeline.recipe import load_recipe

    run = EvalRun(**overrides(EvalRun, options))
    layout, recipe, recipe_dir = stage.resolve_candidate(target)
    spec = stage.with_overrides(recipe.eval if recipe is not None else EvalSpec(), overrides(EvalSpec, options),
                                flags=flag_names(EvalSpec))
    tasks.check(spec.task, recipe_dir if options.get("task") is None else Path("."))
    base = None
    if run.baseline is not None:
        if not BuildLayout(run.baseline).has_repository():
            raise UserError(f"--baseline {run.baseline}: not a build directory with a model repository")
        base = EvalTarget(layout=BuildLayout(run.baseline))
    elif run.baseline_recipe is not None:
        if not run.baseline_recipe.is_file():
            raise UserError(f"--baseline-recipe {run.baseline_recipe}: no such recipe")
        load_recipe(run.baseline_recipe)  # a broken recipe is a user mistake: before any work
    elif recipe is None:
        raise UserError(f"{layout.root} has no recipe.yaml: give --baseline BUILD_DIR or --baseline-recipe RECIPE")
    candidate = EvalTarget(layout=layout, **overrides(EvalTarget, options))
    return Resolved(spec, candidate, base, run, recipe, recipe_dir)
