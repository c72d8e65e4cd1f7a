"""TUNE.yaml: the schema (:class:`TuneSpec`) and :func:`load_tune`, with one-line ``file:line field: what`` errors.

A tune names a base recipe (path relative to the tune file), the knobs to try (any recipe field by its
dotted path, with the values to try), the mode(s), overrides of the recipe's ``bench`` section, the
objective with SLOs, the accuracy gate (overrides of the recipe's ``eval`` section) and the repeats::

    recipe: ../recipes/smollm2_135m_cpu_fp8.yaml
    knobs:
      - field: build.max_batch_size
        values: [8, 64]
      - field: quantization.qformat
        values: [full_prec, {value: int4_awq, also: {quantization.awq_block_size: 64}}]
    mode: [isolation, stacked]
    objective: {metric: output_token_throughput, slo: [{metric: time_to_first_token.p99, max: 2000}]}

Every knob value is applied to the base recipe and the result re-validated at load time, so a bad value is
reported before any work, naming the knob (``tunes/x.yaml:7 knobs.0.values.1: build.max_batch_size=0: …``).
"""

from __future__ import annotations

import copy
import dataclasses
import re
from pathlib import Path
from typing import Any, Literal

from pydantic import Field, ValidationError, field_validator, model_validator

from pipeline.core.errors import RecipeError, UserError
from pipeline.recipe.base import StrictModel
from pipeline.recipe.load import (  # the recipe loader's own error helpers
    _describe,
    _line_for,
    _line_index,
    read_yaml_file,
)
from pipeline.recipe.yaml_bounded import load_bounded

Mode = Literal["isolation", "stacked", "cumulative", "grid"]
#: recipe-field stages a knob may not touch (they describe the measurement, not the deployment)
NOT_KNOBS = ("bench", "eval", "none", "deploy")
#: objective metrics: per-run throughputs of bench.json (pipeline/bench/metrics.py, AIPerf names)
OBJECTIVES = ("output_token_throughput", "output_token_throughput_per_gpu", "total_token_throughput", "request_throughput")


class KnobValue(StrictModel):
    """One value of a knob, with linked changes that must go with it (e.g. INT4 AWQ's block size)."""

    value: Any = Field(description="The value of the knob's field.")
    also: dict[str, Any] = Field(default_factory=dict, description="Other recipe fields (dotted) set together with it.")
    label: str | None = Field(default=None, description="Name in tables (default: field=value).")


class KnobSpec(StrictModel):
    """A recipe field and the values to try (in order: stacked mode applies them in this order)."""

    field: str = Field(description="Dotted recipe path, e.g. build.max_batch_size, quantization.qformat, serving.*.")
    values: list[KnobValue | bool | int | float | str | list[Any] | None] = Field(
        min_length=1, description="Values to try; a mapping {value, also, label} links other fields to a value.")

    def items(self) -> list[KnobValue]:
        """Every value as a :class:`KnobValue`."""
        return [v if isinstance(v, KnobValue) else KnobValue(value=v) for v in self.values]


class SloSpec(StrictModel):
    """A service-level bound on one bench metric (``time_to_first_token.p99`` ≤ max, in the metric's unit)."""

    metric: str = Field(description="bench.json metric, with a statistic for distributions (avg, p50, p90, p95, p99): "
                                    "time_to_first_token.p99 (ms), inter_token_latency.p50 (ms), "
                                    "output_token_throughput_per_user.avg (tokens/s/user), request_latency.p99 (ms).")
    max: float | None = Field(default=None, description="Upper bound (latencies).")
    min: float | None = Field(default=None, description="Lower bound (throughputs).")

    @field_validator("metric")
    @classmethod
    def _known(cls, v: str) -> str:
        from pipeline.bench.metrics import METRICS
        from pipeline.bench.stats import STAT_FIELDS

        name, _, stat = v.partition(".")
        if name not in METRICS:
            raise ValueError(f"unknown metric {name!r} (bench metrics: {', '.join(METRICS)})")
        if METRICS[name].distribution and stat and stat not in STAT_FIELDS:
            raise ValueError(f"unknown statistic {stat!r} (use {', '.join(STAT_FIELDS)})")
        if not METRICS[name].distribution and stat:
            raise ValueError(f"{name} is one value per load point: no statistic")
        return v if stat or not METRICS[name].distribution else f"{v}.avg"

    @model_validator(mode="after")
    def _one_bound(self) -> SloSpec:
        if (self.max is None) == (self.min is None):
            raise ValueError("give exactly one of max or min")
        return self


class ObjectiveSpec(StrictModel):
    """What to maximise, subject to the SLOs: the best load point of a configuration that meets every SLO."""

    metric: Literal[OBJECTIVES] = Field(default="output_token_throughput", description="Per-run throughput to maximise.")  # type: ignore[valid-type]
    slo: list[SloSpec] = Field(default_factory=list, description="Bounds every counted load point must meet.")


class GateSpec(StrictModel):
    """The accuracy gate (``trtpipe eval``) for points whose numerics differ from the base: recipe ``eval`` overrides."""

    task: str | None = None
    n: int | None = Field(default=None, ge=1)
    rule: Literal["paired", "mlperf", "mlperf_high", "trtllm", "kld"] | None = None
    kld_max: float | None = Field(default=None, gt=0.0)
    same_top1_min: float | None = Field(default=None, gt=0.0, le=100.0)
    max_output_tokens: int | None = Field(default=None, ge=1)
    max_input_tokens: int | None = Field(default=None, ge=1)
    concurrency: int | None = Field(default=None, ge=1)
    seed: int | None = Field(default=None, ge=0)


class TuneSpec(StrictModel):
    """A sweep: base recipe, knobs, modes, bench overrides, objective, gate, repeats."""

    name: str | None = Field(default=None, description="Tune name (default: the file name); names artifacts/tune/<name>.")
    description: str = ""
    recipe: Path = Field(description="Base recipe, relative to this file.")
    knobs: list[KnobSpec] = Field(min_length=1, description="Fields and values to try.")
    mode: Mode | list[Mode] = Field(default="isolation", description="isolation | stacked | cumulative | grid, or a list.")
    bench: dict[str, Any] = Field(default_factory=dict, description="Overrides of the recipe's bench section (scenarios, concurrency, …).")
    objective: ObjectiveSpec = Field(default_factory=ObjectiveSpec)
    gate: GateSpec = Field(default_factory=GateSpec)
    repeats: int = Field(default=1, ge=1, le=20, description="Bench passes per point (intervals need ≥ 2).")

    @property
    def modes(self) -> list[str]:
        """The modes as a list, in order, without duplicates."""
        return list(dict.fromkeys([self.mode] if isinstance(self.mode, str) else self.mode))


@dataclasses.dataclass(frozen=True)
class Tune:
    """A loaded tune: the spec, its base recipe (validated), the raw base mapping and where things are."""

    spec: TuneSpec
    path: Path
    name: str
    base_raw: dict[str, Any]
    recipe_path: Path
    base: Any  # Recipe
    bench: Any  # BenchSpec (the recipe's with the tune's overrides)
    gate: Any  # EvalSpec (the recipe's with the gate's overrides)

    @property
    def recipe_dir(self) -> Path:
        """Directory of the base recipe (its relative paths resolve against it)."""
        return self.recipe_path.parent


def set_dotted(data: dict[str, Any], dotted: str, value: Any) -> None:
    """Set ``data[a][b][c] = value`` for ``a.b.c``, creating sections. Raises ``ValueError`` through a non-section."""
    keys = dotted.split(".")
    cur: Any = data
    for k in keys[:-1]:
        nxt = cur.setdefault(k, {}) if isinstance(cur, dict) else None
        if not isinstance(nxt, dict):
            raise ValueError(f"{k!r} is not a section")  # noqa: TRY004 - reported as a value error of the knob
        cur = nxt
    cur[keys[-1]] = copy.deepcopy(value)


def apply_changes(base_raw: dict[str, Any], changes: dict[str, Any], recipe_dir: Path | None = None) -> Any:
    """The :class:`Recipe` of ``base_raw`` with ``changes`` (dotted field → value), validated; its local paths
    (``model.source``) against ``recipe_dir``, the base recipe file's directory (:mod:`pipeline.core.recipe_paths`).

    Raises:
        ValueError: a change goes through a non-section. ``pydantic.ValidationError``: the recipe rejects it.
    """
    from pipeline.recipe import Recipe
    from pipeline.recipe.build import BUILD_TYPES, for_engine
    from pipeline.recipe.schema import RECIPE_DIR

    data = copy.deepcopy(base_raw)
    for k, v in changes.items():
        set_dotted(data, k, v)
    engine = changes.get("build.engine")
    if isinstance(engine, str) and engine in BUILD_TYPES:  # the section's type follows the engine knob
        data["build"] = for_engine(data["build"], engine)
    return Recipe.model_validate(data, context={RECIPE_DIR: recipe_dir} if recipe_dir is not None else None)


def _recipe_error(e: ValidationError) -> str:
    from pipeline.recipe.schema import RecipeCheckError

    err = e.errors()[0]
    exc = (err.get("ctx") or {}).get("error")
    if isinstance(exc, RecipeCheckError):
        return f"{exc.loc}: {exc.message}"
    return f"{'.'.join(str(p) for p in err['loc'])}: {_describe(err)}"


def load_tune(path: str | Path) -> Tune:
    """Read and validate TUNE.yaml, its base recipe, and every knob value applied to the base.

    Raises:
        RecipeError: one line ``FILE:LINE field: what`` (exit 2) for a bad tune file, a bad recipe, a knob
            that is not a deployment field, or a value the recipe rejects.
    """
    from pipeline.recipe import load_recipe
    from pipeline.recipe.consumers import stage_of
    from pipeline.recipe.load import override_section

    path = Path(path)
    shown = str(path)
    text, data = read_yaml_file(path, "tune")
    if not isinstance(data, dict):
        raise RecipeError(f"{shown}:1: a tune file is a mapping (recipe, knobs, mode, bench, objective, gate, repeats)")
    index = _line_index(text)

    def fail(loc: tuple[str, ...], what: str) -> RecipeError:
        line = _line_for(index, loc)
        return RecipeError(f"{shown}{f':{line}' if line else ''} {'.'.join(loc) or '<root>'}: {what}")

    try:
        spec = TuneSpec.model_validate(data)
    except ValidationError as e:
        err = e.errors()[0]
        loc = tuple(str(p) for p in err["loc"])
        # a union of value shapes reports the branch name in loc (e.g. "KnobValue"); drop it
        loc = tuple(p for p in loc if re.fullmatch(r"[a-z_][a-z0-9_]*|[0-9]+", p))
        raise fail(loc, _describe(err)) from None
    recipe_path = (path.parent / spec.recipe)
    base = load_recipe(recipe_path)
    base_raw = load_bounded(recipe_path.read_text()) or {}
    base_raw.setdefault("name", recipe_path.stem)
    for i, knob in enumerate(spec.knobs):
        try:
            stage = stage_of(knob.field)
        except KeyError:
            raise fail(("knobs", str(i), "field"), f"{knob.field!r} is not a recipe field") from None
        if stage in NOT_KNOBS:
            raise fail(("knobs", str(i), "field"), f"{knob.field} is a {stage} setting, not a deployment knob "
                                                   "(set the tune's bench/gate sections instead)")
        for j, item in enumerate(knob.items()):
            changes = {knob.field: item.value, **item.also}
            try:
                apply_changes(base_raw, changes, recipe_path.parent)
            except ValueError as e:  # ValidationError is a ValueError
                what = _recipe_error(e) if isinstance(e, ValidationError) else str(e)
                raise fail(("knobs", str(i), "values", str(j)), f"{knob.field}={item.value!r}: {what}") from None
    try:
        bench = override_section(base.bench, spec.bench, section="bench")
    except UserError as e:
        raise fail(("bench",), str(e)) from None
    try:
        gate = override_section(base.eval, spec.gate.model_dump(exclude_none=True), section="gate")
    except UserError as e:
        raise fail(("gate",), str(e)) from None
    return Tune(spec, path, spec.name or path.stem, base_raw, recipe_path, base, bench, gate)


def tune_json_schema() -> dict[str, Any]:
    """JSON Schema of TUNE.yaml (draft 2020-12), for editors and docs."""
    schema = TuneSpec.model_json_schema()
    schema["$schema"] = "https://json-schema.org/draft/2020-12/schema"
    schema["title"] = "trtpipe tune"
    return schema
