"""``trtpipe build``: run the stages of one recipe in order, reusing unchanged results.

quantize (ModelOpt) → engine (tensorrt | pytorch | cpu) → triton_repo. Each stage writes
``<build dir>/<stage>/`` atomically with a manifest; a stage whose cache key (hash of its recipe
sections, its upstream manifests and library versions) is unchanged is reused, not rebuilt.
"""

from __future__ import annotations

import dataclasses
import os
import shutil
from collections.abc import Callable
from pathlib import Path

from pipeline import artifacts
from pipeline.artifacts import StageResult
from pipeline.errors import UserError
from pipeline.recipe import Recipe, dump_recipe

#: CLI spelling of --stage → stage directory name
STAGE_ALIASES = {"quantize": "quantize", "engine": "engine", "repo": "triton_repo", "triton_repo": "triton_repo"}


@dataclasses.dataclass
class BuildResult:
    """The build directory and the result of every stage that ran (or was reused)."""

    build_dir: Path
    stages: dict[str, StageResult]


def run_build(
    recipe: Recipe,
    build_dir: Path,
    *,
    recipe_dir: Path,
    until: str | None = None,
    force: bool = False,
    dry_run: bool = False,
    on_stage: Callable[[str, StageResult], None] | None = None,
    warn: Callable[[str], None] = print,
) -> BuildResult:
    """Run quantize → engine → triton_repo for ``recipe`` into ``build_dir``.

    Args:
        recipe: the validated recipe.
        build_dir: where stage directories go (created).
        recipe_dir: directory of the recipe file; relative paths in the recipe resolve against it.
        until: stop after this stage (``quantize``, ``engine`` or ``repo``); default: all.
        force: rebuild every stage even when its cache key matches.
        dry_run: write commands and configs only (no ModelOpt run, no trtllm-build).
        on_stage: called after each stage with its name and result (for the CLI's progress lines).
        warn: receives planner warnings (one line each).

    Raises:
        UserError: unknown ``until``, or the planner (:func:`pipeline.plan.check_fits`) finds that
            the recipe cannot fit its target; any stage's own errors propagate unchanged.
    """
    from pipeline.plan import check_fits

    last = STAGE_ALIASES.get(until or "triton_repo")
    if last is None:
        raise UserError(f"--stage {until!r}: expected one of quantize, engine, repo")
    verdict = check_fits(recipe, recipe_dir=recipe_dir)
    if not verdict.ok:
        raise UserError(
            "the recipe does not fit its target (trtpipe plan): " + "; ".join(verdict.errors)
            + " — fix the recipe, or set build.allow_kv_oversubscription: true to accept KV oversubscription"
        )
    for w in verdict.warnings:
        warn(f"plan: {w}")
    build_dir = Path(build_dir)
    created = _first_missing(build_dir.absolute())
    results: dict[str, StageResult] = {}
    try:
        _run_stages(recipe, build_dir, recipe_dir, last, force, dry_run, results, on_stage)
    except BaseException:
        if created is not None and created.is_dir() and not any(p.is_file() for p in created.rglob("*")):
            shutil.rmtree(created, ignore_errors=True)  # a failed first build leaves nothing behind
        raise
    _write_text_atomic(build_dir / "recipe.yaml", dump_recipe(recipe))
    if last == "triton_repo" and not dry_run:
        artifacts.record_last_build(build_dir)
    return BuildResult(build_dir, results)


def _run_stages(
    recipe: Recipe,
    build_dir: Path,
    recipe_dir: Path,
    last: str,
    force: bool,
    dry_run: bool,
    results: dict[str, StageResult],
    on_stage: Callable[[str, StageResult], None] | None,
) -> None:
    """Run the stages in order up to ``last``, filling ``results``."""
    from pipeline import quantize, triton_repo
    from pipeline.engine import run as run_engine

    def done(name: str, res: StageResult) -> bool:
        results[name] = res
        if on_stage:
            on_stage(name, res)
        return name == last

    q = quantize.run(recipe, build_dir / "quantize", recipe_dir=recipe_dir, force=force, dry_run=dry_run)
    if done("quantize", q):
        return
    e = run_engine(recipe, build_dir / "engine", quantized=q, force=force, dry_run=dry_run)
    if done("engine", e):
        return
    r = triton_repo.run(recipe, build_dir / "triton_repo", quantized=q, engine=e, force=force, dry_run=dry_run)
    done("triton_repo", r)


def _first_missing(path: Path) -> Path | None:
    """The highest ancestor of ``path`` (or ``path`` itself) that does not exist yet, else ``None``."""
    missing = None
    for p in (path, *path.parents):
        if p.exists():
            break
        missing = p
    return missing


def _write_text_atomic(path: Path, text: str) -> None:
    """Write ``text`` to a temp file next to ``path`` and rename it into place."""
    tmp = path.with_name(f".{path.name}.tmp-{os.getpid()}")
    tmp.write_text(text)
    tmp.replace(path)
