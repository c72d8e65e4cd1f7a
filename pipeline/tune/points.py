"""Points of a sweep: the base recipe plus a set of changes, identified by the hash of the resolved recipe.

A :class:`Point` knows its changes (dotted field → value), its resolved :class:`~pipeline.recipe.Recipe`, its id
(``stable_hash`` of the recipe's JSON without ``name``/``description``, first 12 hex digits: equal recipes are
one point, whichever mode asked for them), which build stages its fields feed
(:mod:`pipeline.recipe.consumers`), and whether it changes numerics relative to the base (any field the
quantize stage consumes differs → the accuracy gate applies).
"""

from __future__ import annotations

import dataclasses
import itertools
from typing import Any

from pipeline.assemble.seed import STAGE_CONSUMERS, stage_inputs
from pipeline.core.artifacts import stable_hash
from pipeline.recipe.consumers import consumed
from pipeline.tune.spec import KnobValue, Tune, apply_changes


@dataclasses.dataclass(frozen=True)
class Change:
    """One knob setting: ``field = value`` (plus its linked ``also`` fields); ``label`` names it in tables."""

    field: str
    value: Any
    also: tuple[tuple[str, Any], ...] = ()
    label: str = ""

    @classmethod
    def of(cls, field: str, item: KnobValue) -> Change:
        """The change a knob value asks for."""
        return cls(field, item.value, tuple(sorted(item.also.items())), item.label or f"{field}={item.value}")

    def fields(self) -> dict[str, Any]:
        """Every dotted field it sets."""
        return {self.field: self.value, **dict(self.also)}


@dataclasses.dataclass(frozen=True)
class Point:
    """The base recipe with ``changes`` applied (later changes win); ``recipe`` is validated."""

    changes: tuple[Change, ...]
    recipe: Any

    @property
    def id(self) -> str:
        """12 hex digits of the resolved recipe's hash (name and description excluded)."""
        return recipe_id(self.recipe)

    @property
    def label(self) -> str:
        """``base`` or the changes joined with ``+``."""
        return " + ".join(c.label for c in self.changes) or "base"

    def fields(self) -> dict[str, Any]:
        """Dotted field → value of all changes (later wins)."""
        out: dict[str, Any] = {}
        for c in self.changes:
            out.update(c.fields())
        return out


def recipe_id(recipe: Any) -> str:
    """Hash of what a recipe deploys: the recipe JSON without ``name`` and ``description`` (12 hex digits)."""
    data = recipe.model_dump(mode="json")
    data.pop("name", None)
    data.pop("description", None)
    return stable_hash(data)[:12]


def make_point(tune: Tune, changes: tuple[Change, ...]) -> Point:
    """The point of ``changes`` applied to the tune's base (validated at load time, so this does not fail).

    A later change of the same field replaces the earlier one (stacked mode trying a knob's next value).
    """
    last = {c.field: i for i, c in enumerate(changes)}
    changes = tuple(c for i, c in enumerate(changes) if last[c.field] == i)
    fields: dict[str, Any] = {}
    for c in changes:
        fields.update(c.fields())
    return Point(changes, apply_changes(tune.base_raw, fields, tune.recipe_dir))


def knob_changes(tune: Tune) -> list[list[Change]]:
    """Per knob, its changes that differ from the base (a value equal to the base's is no change)."""
    from pipeline.recipe.consumers import flatten

    base = flatten(tune.base.model_dump(mode="json"))
    out = []
    for k in tune.spec.knobs:
        out.append([c for c in (Change.of(k.field, it) for it in k.items())
                    if any(base.get(f, _MISSING) != v for f, v in c.fields().items())])
    return out


_MISSING = object()


def isolation_points(tune: Tune) -> list[Point]:
    """The base, then one point per knob value that differs from the base (one change at a time)."""
    return [make_point(tune, ())] + [make_point(tune, (c,)) for cs in knob_changes(tune) for c in cs]


def grid_points(tune: Tune) -> list[Point]:
    """The base, then every combination of one value per knob (the base's value included as 'unchanged')."""
    per_knob = [[None, *cs] for cs in knob_changes(tune)]
    pts = [make_point(tune, tuple(c for c in combo if c is not None)) for combo in itertools.product(*per_knob)]
    seen: dict[str, Point] = {}
    for p in pts:
        seen.setdefault(p.id, p)
    return list(seen.values())


def steps(tune: Tune) -> list[Change]:
    """The stacked/cumulative sequence: every differing knob value, knobs in order, values in order."""
    return [c for cs in knob_changes(tune) for c in cs]


def numerics_changed(recipe: Any, base: Any) -> bool:
    """True when a field the quantize stage consumes differs from the base (qformat, KV dtype, calibration…), or,
    on the CPU engine, its compute dtype (``build.cpu.dtype``)."""
    own = recipe.build.engine_compute_dtype  # None: the engine's numerics do not follow a build knob
    cpu_dtype = own is not None and own != base.build.cpu.dtype
    return cpu_dtype or consumed(recipe, "quantize") != consumed(base, "quantize")


def is_full_precision(recipe: Any) -> bool:
    """``recipe`` has the eval baseline's numerics: those of :func:`pipeline.eval.stage.baseline_recipe` (qformat
    full_prec, kv_cache_dtype none, float32 on the CPU engine), which alone defines the reference."""
    from pipeline.eval.stage import baseline_recipe

    return not numerics_changed(recipe, baseline_recipe(recipe))


def rebuilds(recipe: Any, earlier: list[Any]) -> list[str]:
    """The build stages ``recipe`` must build, given the recipes already built (stages with identical inputs are
    reused across points): ``["quantize", "engine", "triton_repo"]``, ``["engine", "triton_repo"]``,
    ``["triton_repo"]`` or ``[]`` (an identical recipe). On the tensorrt engine a runtime knob (KV cache,
    scheduler, chunked prefill, ``serving.*``) rebuilds only the repository."""
    out = []
    for stage in STAGE_CONSUMERS:
        mine = stage_inputs(recipe, stage)
        if not any(stage_inputs(r, stage) == mine for r in earlier):
            out.append(stage)
    return out


@dataclasses.dataclass(frozen=True)
class PlanCheck:
    """The planner's verdict on a point: fits or not (``reason``), and predicted output tok/s per load point."""

    fits: bool
    reason: str = ""
    warnings: tuple[str, ...] = ()
    #: (isl, osl, concurrency) → predicted output tokens/s (total, all GPUs)
    predicted: dict[tuple[int, int, int], float] = dataclasses.field(default_factory=dict)


def plan_point(recipe: Any, bench: Any, recipe_dir: Any) -> PlanCheck:
    """Run ``trtpipe plan``'s fit check and its prediction at every scenario × concurrency of ``bench``.

    No GPU time: memory arithmetic and the calibrated step model (:mod:`pipeline.plan`).
    """
    from pipeline.core.errors import UserError
    from pipeline.plan.planner import plan_recipe, predict

    try:
        plan = plan_recipe(recipe, recipe_dir=recipe_dir)
    except UserError as e:
        return PlanCheck(True, warnings=(f"fit not checked: {e}",))
    if not plan.verdict.ok:
        return PlanCheck(False, "; ".join(plan.verdict.errors), tuple(plan.verdict.warnings))
    pred: dict[tuple[int, int, int], float] = {}
    for s in bench.scenarios:
        for c in bench.concurrency:
            try:
                pred[(s.isl, s.osl, c)] = predict(recipe, s.isl, s.osl, c, recipe_dir=recipe_dir).output_tokens_per_s
            except UserError as e:
                return PlanCheck(False, f"ISL {s.isl}/OSL {s.osl} at concurrency {c}: {e}", tuple(plan.verdict.warnings))
    return PlanCheck(True, "", tuple(plan.verdict.warnings), pred)
