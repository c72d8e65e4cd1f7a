"""``trtpipe bench``'s options, generated from the fields that declare them, and what they resolve to.

A field declares its option with a :class:`~pipeline.recipe.bench.Flag`: in its ``Annotated`` metadata on a pydantic
model (:class:`~pipeline.recipe.bench.BenchSpec`, :class:`~pipeline.bench.soak.SoakSpec`) or as ``metadata={"flag":
…}`` of a dataclass field (:class:`~pipeline.bench.target.BenchTarget`). :func:`parameters` turns them into the typer
parameters of the command; :func:`overrides` turns what the user typed back into field values; :func:`resolve` is the
whole step from options to a validated ``(BenchSpec, BenchTarget)``.
"""

from __future__ import annotations

import dataclasses
import inspect
from pathlib import Path
from typing import Annotated, Any, Optional

from pipeline.bench.target import (
    BenchTarget,
    build_tokenizer,
    detached_trtllm_serve_build,
)
from pipeline.recipe.bench import BenchSpec, Flag

#: options of the command itself (not fields): where the defaults come from, and the one-scenario shorthand
COMMAND_OPTIONS = (
    ("isl", Flag("--isl", "Input tokens per request (with --osl).", int, min=1)),
    ("osl", Flag("--osl", "Output tokens per request (with --isl).", int, min=1)),
    ("recipe", Flag("--recipe", "Take defaults from this recipe's bench section.", Path)),
)


def declared(owner: Any) -> list[tuple[str, Flag, Any]]:
    """``(field name, Flag, field default)`` of every field of ``owner`` (a pydantic model or dataclass class) that
    declares an option, in field order."""
    out = []
    if dataclasses.is_dataclass(owner):
        for f in dataclasses.fields(owner):
            if isinstance(flag := f.metadata.get("flag"), Flag):
                out.append((f.name, flag, f.default))
        return out
    for name, info in owner.model_fields.items():
        flag = next((m for m in info.metadata if isinstance(m, Flag)), None)
        if flag is not None:
            out.append((name, flag, info.get_default(call_default_factory=True)))
    return out


def flag_names(owner: Any) -> dict[str, str]:
    """Field name → its option (``{"request_timeout_s": "--timeout", …}``), so a validation error names the option."""
    return {name: flag.name for name, flag, _ in declared(owner)}


def _parameter(name: str, flag: Flag, default: Any, panel: str | None) -> inspect.Parameter:
    import typer

    kind = flag.kind
    option = typer.Option(flag.name, help=flag.help, min=flag.min, rich_help_panel=panel)
    if kind is bool:
        return inspect.Parameter(name, inspect.Parameter.KEYWORD_ONLY, default=False, annotation=Annotated[bool, option])
    value = default if flag.shows_default else None
    return inspect.Parameter(name, inspect.Parameter.KEYWORD_ONLY, default=value,
                             annotation=Annotated[kind if flag.shows_default else Optional[kind], option])  # noqa: UP045 - typer reads Optional


def parameters(owner: Any = None, *, panel: str | None = None, command: bool = False) -> list[inspect.Parameter]:
    """Typer parameters (keyword-only, ``Annotated[T, typer.Option(...)]``) of ``owner``'s declared options, or of
    :data:`COMMAND_OPTIONS` with ``command=True``; ``panel`` groups them under a heading of ``--help``."""
    items = [(n, f, None) for n, f in COMMAND_OPTIONS] if command else declared(owner)
    return [_parameter(name, flag, default, panel) for name, flag, default in items]


def given(value: Any) -> bool:
    """An option's value counts as given: not ``None``, not an unset on/off flag, not an empty repeatable option."""
    return value is not None and value is not False and not (isinstance(value, (list, tuple)) and not value)


def overrides(owner: Any, options: dict[str, Any]) -> dict[str, Any]:
    """Field values of ``owner`` from the ``options`` the user gave (by field name), parsed by each :class:`Flag`.

    Raises:
        UserError: two options that exclude each other, or a value its ``parse`` rejects (names the option).
    """
    from pipeline.core.errors import UserError

    names = flag_names(owner)
    out: dict[str, Any] = {}
    cleared: dict[str, Any] = {}
    for name, flag, _ in declared(owner):
        value = options.get(name)
        if not given(value):
            continue
        for other in flag.excludes:
            if given(options.get(other)):
                raise UserError(f"{names[other]} and {flag.name} exclude each other")
        out[name] = flag.parse(value, flag.name) if flag.parse else value
        cleared.update(flag.clears)
    return cleared | out


def resolve(options: dict[str, Any]) -> tuple[BenchSpec, BenchTarget]:
    """The benchmark the command's ``options`` (by parameter name) ask for: ``(spec, target)``.

    The spec starts from ``--recipe``'s bench section, else the build's (the detached ``trtpipe serve`` at ``--url``,
    else the last build), else defaults, and takes the given options as validated overrides. With ``--api openai``,
    ``--model`` names the served model and only the build's tokenizer is kept (not our deployment).

    Raises:
        UserError: inconsistent or invalid options (one line naming the option).
    """
    from pipeline.bench import stage
    from pipeline.bench.apis import API_NAMES, DEFAULT_URLS
    from pipeline.bench.http_client import OPENAI_ENDPOINTS
    from pipeline.core import artifacts
    from pipeline.core.errors import UserError
    from pipeline.core.layout import BuildLayout

    o = dict(options)
    if (o["isl"] is None) != (o["osl"] is None):
        raise UserError("--isl and --osl go together (or use --scenario ISL:OSL)")
    api = o["api"]
    if api not in API_NAMES:
        raise UserError(f"--api {api!r}: use one of {', '.join(API_NAMES)}")
    if o["openai_endpoint"] is not None and o["openai_endpoint"] not in OPENAI_ENDPOINTS:
        raise UserError(f"--openai-endpoint {o['openai_endpoint']!r}: use {' or '.join(OPENAI_ENDPOINTS)}")
    served_model = o.pop("model") if api == "openai" else None  # the served model, not a Triton model of the recipe
    build = artifacts.last_build()
    # a detached `trtpipe serve` of a trtllm-serve build at this OpenAI URL is our deployment (the real server or the
    # CPU stand-in): its bench section, tokenizer and provenance, as for a detached Triton
    served = detached_trtllm_serve_build(api, o["url"])
    if o["recipe"] is not None:
        candidate = artifacts.default_build_dir(o["recipe"].stem)
        build = candidate if candidate.is_dir() else build
    elif served is not None:
        build = served.root
    elif api != "openai":  # the build a detached `trtpipe serve` runs at this URL, rather than the last one built
        from pipeline.serve.registry import detached_build

        build = detached_build(o["url"] or DEFAULT_URLS[api]) or build
    layout = BuildLayout(build) if build is not None else None
    values = overrides(BenchSpec, o)
    if o["isl"] is not None:
        values["scenarios"] = values.get("scenarios", []) + [{"isl": o["isl"], "osl": o["osl"]}]
    spec = stage.with_overrides(stage.spec_for(o["recipe"], layout), values, flags=flag_names(BenchSpec))
    target_values = {k: o[k] for k in flag_names(BenchTarget)}
    if target_values["openai_endpoint"] is None:  # images go as chat content parts; text as exact-ISL completions
        with_images = spec.image_width_mean > 0 and spec.image_height_mean > 0
        target_values["openai_endpoint"] = "chat" if with_images else "completions"
    if served is not None and layout is not None and layout.root == served.root:
        target_values["tokenizer"] = target_values["tokenizer"] or build_tokenizer(layout)
    elif api == "openai" and layout is not None:  # not our deployment: keep only the last build's tokenizer
        target_values["tokenizer"] = target_values["tokenizer"] or build_tokenizer(layout)
        layout = None
    return spec, BenchTarget(**target_values, layout=layout, served_model=served_model)
