"""Seed a build directory with the stages of another build whose recipe feeds them the same inputs.

``trtpipe build RECIPE --out NEW`` (a variant of a recipe already built, e.g. ``--set build.cpu.dtype=bfloat16``)
and every point of ``trtpipe tune`` start from an empty build directory, so their quantize stage (ModelOpt
calibration: the longest stage on CPU) would rerun although another build holds a result of the same inputs.
:func:`seed_build` hard-links such a donor's finished stage directories in first; :func:`pipeline.assemble.stage.run`
then reuses them only when their content keys match (library versions and upstream keys included), so a wrong
guess costs a rebuild, never a stale stage. Stage directories are only ever replaced whole (``atomic_dir``: a
new directory renamed into place), never edited in place, so a hard-linked stage cannot change under its donor.
"""

from __future__ import annotations

import os
import shutil
from pathlib import Path
from typing import Any

from pipeline.core import artifacts
from pipeline.core.layout import STAGES
from pipeline.recipe.consumers import consumed
from pipeline.recipe.serving_path import serving_path

#: build stages, in order, and the consumer classes (pipeline/recipe/consumers.py) each one hashes, upstream
#: included; the cpu and pytorch engines also hash the runtime fields (pipeline/engine/cpu.py, pytorch.py:
#: their engine holds the KV cache / LLM() arguments), the tensorrt engine does not
STAGE_CONSUMERS = {"quantize": ("quantize",), "engine": ("quantize", "engine", "engine_cpu"),
                   "triton_repo": ("quantize", "engine", "engine_cpu", "runtime")}


def stage_inputs(recipe: Any, stage: str) -> dict[str, Any]:
    """The recipe fields that feed ``stage`` (and its upstream stages) for this recipe's engine kind."""
    classes = STAGE_CONSUMERS[stage]
    if stage == "engine" and serving_path(recipe).runtime_in_engine:
        classes = (*classes, "runtime")
    return consumed(recipe, *classes)


def seed_build(build_dir: Path, recipe: Any, donors: list[Path], *, until: str = "engine") -> dict[str, Path]:
    """Hard-link the quantize and engine stage directories of a donor build whose recipe feeds them the same
    inputs into ``build_dir`` (only stages it lacks; none after ``until``, a stage name). Returns {stage: donor
    build directory} of what was seeded.

    When the quantized checkpoint was seeded but no donor's engine inputs match, the engine of a donor with the
    same quantize inputs is linked in anyway (not reported as seeded): its content key will not match, so the
    engine stage rebuilds, and the CPU builder keeps that engine's weight files when they come from the same
    checkpoint (pipeline.engine.cpu), so a runtime knob costs no new copy of the weights. A donor on another file
    system (no hard links) seeds nothing.

    First, the temp directories a killed build left next to each stage (``.<stage>.tmp-<pid>-*``, ``.old-``,
    ``.seed-``: SIGKILL / SIGTERM skip their cleanup) are removed when their process is gone
    (:func:`pipeline.core.artifacts.remove_stale_tmp`): a seeded or reused stage is never rewritten, so its writer
    would not get to them."""
    for stage in STAGES:
        artifacts.remove_stale_tmp(Path(build_dir) / stage)
    seeded: dict[str, Path] = {}
    for stage in STAGES[: min(2, STAGES.index(until) + 1)]:
        if (build_dir / stage).exists():
            continue
        d = _donor(build_dir, donors, stage, match=stage, inputs=stage_inputs(recipe, stage))
        if d is not None:
            if _link_in(d / stage, build_dir / stage):
                seeded[stage] = d
                continue
            break
        if stage == STAGES[1] and STAGES[0] in seeded:
            d = _donor(build_dir, donors, stage, match=STAGES[0], inputs=stage_inputs(recipe, STAGES[0]))
            if d is not None:
                _link_in(d / stage, build_dir / stage)
        break  # a later stage cannot be reused without its upstream
    return seeded


def local_builds(root: Path = artifacts.DEFAULT_ARTIFACTS_ROOT) -> list[Path]:
    """Donors for a plain ``trtpipe build``: the last build, then every build directory directly under ``root``
    (a directory with a ``recipe.yaml``), in name order."""
    last = artifacts.last_build(root)
    found = sorted(p for p in Path(root).glob("*/") if (p / "recipe.yaml").is_file())  # none when root is missing
    return [*([last] if last is not None else []), *(p for p in found if last is None or p.resolve() != last.resolve())]


def _donor(build_dir: Path, donors: list[Path], stage: str, *, match: str, inputs: Any) -> Path | None:
    """The first donor (other than ``build_dir``) with a finished ``stage`` directory whose recipe feeds the
    ``match`` stage ``inputs``; ``None`` when there is none."""
    for d in donors:
        if d.resolve() == build_dir.resolve() or not (d / stage / artifacts.MANIFEST).is_file():
            continue
        other = _donor_recipe(d)
        if other is not None and stage_inputs(other, match) == inputs:
            return d
    return None


def _link_in(src: Path, target: Path) -> bool:
    """Hard-link the directory ``src`` to ``target`` (through a temp dir next to it, renamed into place); False
    (nothing left behind) when the file system refuses the links."""
    tmp = target.parent / f".{target.name}.seed-{os.getpid()}"
    shutil.rmtree(tmp, ignore_errors=True)
    target.parent.mkdir(parents=True, exist_ok=True)
    try:
        shutil.copytree(src, tmp, copy_function=os.link)
    except OSError:
        shutil.rmtree(tmp, ignore_errors=True)
        return False
    tmp.rename(target)
    return True


def _donor_recipe(d: Path) -> Any:
    """The recipe a donor build was made from, or ``None`` when it is unreadable (that donor is then not used)."""
    import yaml

    from pipeline.recipe import Recipe

    try:
        return Recipe.model_validate(yaml.safe_load((d / "recipe.yaml").read_text()))
    except Exception:  # noqa: BLE001 - an unreadable donor is simply not used
        return None
