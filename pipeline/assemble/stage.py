"""``trtpipe build``: run the build stages of one recipe in order, reusing unchanged results.

quantize (ModelOpt) → [vision: the encoder's ONNX / TensorRT, for a recipe with a ``vision`` section] → engine
(tensorrt | pytorch | cpu) → triton_repo. Each stage writes its directory
of the :class:`~pipeline.core.layout.BuildLayout` atomically with a manifest; a stage whose cache key (hash
of what it consumes: its recipe fields, its upstream results' keys and library versions) is unchanged
is reused, not rebuilt.
"""

from __future__ import annotations

import dataclasses
import shutil
from collections.abc import Callable, Sequence
from pathlib import Path

from pipeline.core import artifacts, lock
from pipeline.core.errors import UserError
from pipeline.core.layout import STAGES, BuildLayout
from pipeline.core.results import StageResult
from pipeline.engine.result import EngineResult
from pipeline.quantize.result import QuantizeResult
from pipeline.recipe import Recipe, dump_recipe
from pipeline.recipe.serving_path import serving_path
from pipeline.recipe.vision import cross_attention
from pipeline.triton_repo.result import RepoResult

#: CLI spelling of --stage → stage name
STAGE_ALIASES = {"quantize": "quantize", "vision": "vision", "engine": "engine", "repo": "triton_repo",
                 "triton_repo": "triton_repo"}


@dataclasses.dataclass
class BuildResult:
    """The build directory and the result of every stage that ran (or was reused), in order."""

    layout: BuildLayout
    stages: dict[str, StageResult]
    #: for each stage that was rebuilt over an earlier result: the consumed recipe fields that changed
    #: (``["build.max_batch_size 2048 → 512"]``; empty when only an upstream stage or a library changed)
    changes: dict[str, list[str]] = dataclasses.field(default_factory=dict)
    #: stages hard-linked in from another build before the run ({stage: that build directory},
    #: :func:`pipeline.assemble.seed.seed_build`); a seeded stage whose content key matched shows ``cached``
    seeded: dict[str, Path] = dataclasses.field(default_factory=dict)

    @property
    def build_dir(self) -> Path:
        """The build directory (``layout.root``)."""
        return self.layout.root

    @property
    def quantize(self) -> QuantizeResult:
        """The quantize stage's result."""
        return self.stages["quantize"]  # type: ignore[return-value]

    @property
    def engine(self) -> EngineResult | None:
        """The engine stage's result (``None`` when the build stopped before it)."""
        return self.stages.get("engine")  # type: ignore[return-value]

    @property
    def repo(self) -> RepoResult | None:
        """The repository stage's result (``None`` when the build stopped before it)."""
        return self.stages.get("triton_repo")  # type: ignore[return-value]


def run(
    recipe: Recipe,
    build_dir: Path,
    *,
    recipe_dir: Path,
    until: str | None = None,
    force: bool = False,
    dry_run: bool = False,
    on_stage: Callable[[str, StageResult, list[str]], None] | None = None,
    warn: Callable[[str], None] = print,
    donors: Sequence[Path] = (),
) -> BuildResult:
    """Run quantize → engine → triton_repo for ``recipe`` into ``build_dir``.

    Args:
        recipe: the validated recipe.
        build_dir: where stage directories go (created).
        recipe_dir: directory of the recipe file; relative paths in the recipe resolve against it.
        until: stop after this stage (``quantize``, ``vision``, ``engine`` or ``repo``); default: all.
        force: rebuild every stage even when its cache key matches.
        dry_run: write commands and configs only (no ModelOpt run, no trtllm-build).
        on_stage: called after each stage with its name, result and the consumed recipe fields that changed
            since the stage's previous result (for the CLI's progress lines).
        warn: receives planner warnings and, when another build holds this directory, the line saying so (one line
            each).
        donors: other build directories whose finished quantize/engine stages may be hard-linked in when this
            build lacks them and their recipes feed those stages the same inputs
            (:func:`pipeline.assemble.seed.seed_build`; not with ``force`` or ``dry_run``); reused only when
            their content keys match, else rebuilt.

    Raises:
        UserError: ``--stage vision`` for a text recipe, unknown ``until``, a LoRA adapter that cannot be served (:func:`pipeline.recipe.lora.resolve_adapters`), the planner (:func:`pipeline.plan.check_fits`) finds that
            the recipe cannot fit its target, or a CPU recipe meets a bad ``$TRTPIPE_CPU_KERNELS``
            (before any stage runs); any stage's own errors propagate unchanged.
        StageError: the disk under ``build_dir`` is full or has less free than a stage needs (one line naming the
            stage directory and the space needed, :func:`pipeline.core.artifacts.atomic_dir`).

    Another build of the same ``build_dir`` (another terminal, a CI retry) holds the directory's lock
    (:mod:`pipeline.core.lock`): this one waits, telling ``warn`` who holds it, then reuses what the other built.
    The temp dirs a killed build left next to any stage directory (:func:`pipeline.core.artifacts.remove_stale_tmp`)
    are removed, also for stages this build reuses.
    """
    from pipeline.plan import check_fits

    last = STAGE_ALIASES.get(until or "triton_repo")
    if last is None:
        raise UserError(f"--stage {until!r}: expected one of quantize, vision, engine, repo")
    if last == "vision" and not cross_attention(recipe.vision):
        raise UserError("--stage vision: this recipe has no vision section (a text model has no vision encoder stage)")
    from pipeline.recipe.lora import resolve_adapters

    recipe = resolve_adapters(recipe, recipe_dir)  # adapter files checked (rank, modules), paths absolute
    verdict = check_fits(recipe, recipe_dir=recipe_dir)
    if not verdict.ok:
        raise UserError(
            "the recipe does not fit its target (trtpipe plan): " + "; ".join(verdict.errors)
            + " — fix the recipe, or set build.allow_kv_oversubscription: true to accept KV oversubscription"
        )
    for w in verdict.warnings:
        warn(f"plan: {w}")
    if serving_path(recipe).native_cpu_kernels and not dry_run:
        from pipeline.cpu_runtime import native

        native.checked_choice()  # a bad $TRTPIPE_CPU_KERNELS fails here, not after quantize
    layout = BuildLayout(Path(build_dir))
    created = _first_missing(layout.root.absolute())
    results: dict[str, StageResult] = {}
    changes: dict[str, list[str]] = {}
    seeded: dict[str, Path] = {}
    linked: set[tuple[Path, int]] = set()  # (file, inode) hard-linked in from another build
    try:
        with lock.exclusive(layout.lock_file, on_wait=warn):  # a second build of this directory waits here
            if created is not None:
                linked = _files(created)  # the lock file
            if donors and not (force or dry_run):
                from pipeline.assemble.seed import seed_build

                seeded = seed_build(layout.root, recipe, list(donors), until=last)
                linked = _files(created) if created is not None else set()
            for stage in STAGES:  # a killed build's temp dirs, also of the stages this one reuses or seeds
                artifacts.remove_stale_tmp(layout.stage_dir(stage))
            _run_stages(recipe, layout, recipe_dir, last, force, dry_run, results, changes, on_stage)
            _write_final(layout, recipe, record=last == "triton_repo" and not dry_run)
    except BaseException:
        if created is not None and created.is_dir() and not _files(created) - linked:
            shutil.rmtree(created, ignore_errors=True)  # a failed first build leaves nothing behind (nor links)
        raise
    return BuildResult(layout, results, changes, seeded)


def _write_final(layout: BuildLayout, recipe: Recipe, *, record: bool) -> None:
    """The build's resolved recipe and (``record``) the last-build marker; a full disk is one line."""
    try:
        artifacts.write_atomic(layout.recipe_file, dump_recipe(recipe))
        if record:
            artifacts.record_last_build(layout.root)
    except OSError as e:
        if artifacts.is_no_space(e):
            raise artifacts.no_space_error(layout.recipe_file, None, during=True) from e
        raise


def _files(root: Path) -> set[tuple[Path, int]]:
    """(path, inode) of every file under ``root`` (a rebuilt stage's files are new inodes)."""
    return {(p, p.stat().st_ino) for p in root.rglob("*") if p.is_file()}


def _run_stages(
    recipe: Recipe,
    layout: BuildLayout,
    recipe_dir: Path,
    last: str,
    force: bool,
    dry_run: bool,
    results: dict[str, StageResult],
    changes: dict[str, list[str]],
    on_stage: Callable[[str, StageResult, list[str]], None] | None,
) -> None:
    """Run the stages in order up to ``last``, filling ``results`` and ``changes``."""
    from pipeline.engine import stage as engine
    from pipeline.quantize import stage as quantize
    from pipeline.recipe.consumers import changed
    from pipeline.triton_repo import stage as triton_repo

    dirs = {"quantize": layout.quantize, "vision": layout.vision, "engine": layout.engine, "triton_repo": layout.triton_repo}
    before = {s: (artifacts.read_manifest(d) or {}).get("consumed") for s, d in dirs.items()}

    def done(res: StageResult) -> bool:
        results[res.stage] = res
        diff = [] if res.cached else changed(before[res.stage], res.manifest.get("consumed") or {})
        changes[res.stage] = diff
        if on_stage:
            on_stage(res.stage, res, diff)
        return res.stage == last

    q = quantize.run(recipe, layout, recipe_dir=recipe_dir, force=force, dry_run=dry_run)
    if done(q):
        return
    if cross_attention(recipe.vision):  # the image path: the encoder from the source checkpoint (issue #46 item 3)
        from pipeline.vision_encoder import stage as vision

        if done(vision.run(recipe, layout, recipe_dir=recipe_dir, force=force, dry_run=dry_run)):
            return
    e = engine.run(recipe, layout, quantized=q, force=force, dry_run=dry_run)
    if done(e):
        return
    done(triton_repo.run(recipe, layout, quantized=q, engine=e, force=force, dry_run=dry_run))


def _first_missing(path: Path) -> Path | None:
    """The highest ancestor of ``path`` (or ``path`` itself) that does not exist yet, else ``None``."""
    missing = None
    for p in (path, *path.parents):
        if p.exists():
            break
        missing = p
    return missing
