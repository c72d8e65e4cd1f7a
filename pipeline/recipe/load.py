"""Loading a recipe YAML into a :class:`Recipe`, with one-line errors that name file:line and field.

``load_recipe(path, overrides)`` reads the file with a bounded YAML loader (no anchors/aliases, no
duplicate keys, size and depth capped: :mod:`pipeline.recipe.yaml_bounded`), applies ``--set``
overrides (``build.max_batch_size=64``) to the raw mapping, validates the whole recipe, and on
failure raises :class:`pipeline.core.errors.RecipeError` whose message is e.g.::

    recipes/x.yaml:12 quantization.qformat: 'fp9' is not one of fp8, int8_sq, int4_awq, …
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any, TypeVar

import pydantic
import yaml
from pydantic import ValidationError

from pipeline.core.errors import RecipeError
from pipeline.core.recipe_paths import recipe_path
from pipeline.recipe.schema import RECIPE_DIR, Recipe, RecipeCheckError
from pipeline.recipe.yaml_bounded import BoundedYAMLError, compose_bounded, load_bounded

S = TypeVar("S", bound="pydantic.BaseModel")


def _line_index(text: str) -> dict[tuple[str, ...], int]:
    """Map every key path in the YAML document to its 1-based line number."""
    index: dict[tuple[str, ...], int] = {}
    try:
        root = compose_bounded(text)
    except (yaml.YAMLError, BoundedYAMLError):
        return index

    def walk(node: Any, path: tuple[str, ...]) -> None:
        index.setdefault(path, node.start_mark.line + 1)
        if isinstance(node, yaml.MappingNode):
            for k, v in node.value:
                key = path + (str(k.value),)
                index[key] = k.start_mark.line + 1
                walk(v, key)
        elif isinstance(node, yaml.SequenceNode):
            for i, item in enumerate(node.value):
                walk(item, path + (str(i),))

    if root is not None:
        walk(root, ())
    return index


def _line_for(index: dict[tuple[str, ...], int], loc: tuple[str, ...]) -> int | None:
    """Line of the deepest existing prefix of ``loc`` (a missing key points at its parent)."""
    for n in range(len(loc), -1, -1):
        if loc[:n] in index:
            return index[loc[:n]]
    return None


def _describe(err: dict[str, Any]) -> str:
    """One human sentence for a pydantic error entry."""
    kind, inp, ctx = err["type"], err.get("input"), err.get("ctx") or {}
    if kind == "literal_error":
        expected = str(ctx.get("expected", "")).replace("'", "").replace(" or ", ", ")
        return f"{inp!r} is not one of {expected}"
    if kind == "extra_forbidden":
        return _foreign_knob(err) or "unknown key (not in the recipe schema; see `trtpipe recipe schema`)"
    if kind == "missing":
        return "required field is missing"
    if kind == "union_tag_invalid":  # a discriminated section's tag (vision.family, speculative_config.decoding_type)
        return f"{ctx.get('tag')!r} is not one of {str(ctx.get('expected_tags', '')).replace(chr(39), '')}"
    if kind == "union_tag_not_found":
        return "required field is missing (it chooses the section's kind)"
    msg = err["msg"]
    if inp is not None and not isinstance(inp, (dict, list)):
        return f"{inp!r}: {msg[0].lower() + msg[1:]}" if msg else repr(inp)
    return msg


def _foreign_knob(err: dict[str, Any]) -> str | None:
    """The sentence for a ``build`` knob of another engine's type (``None``: not one): the engine that reads it."""
    from pipeline.recipe.build import engines_reading

    loc = [str(p) for p in err["loc"]]
    if len(loc) != 3 or loc[0] != "build":  # build.<engine tag>.<key>
        return None
    engine, readers = loc[1], engines_reading(loc[2])
    if not readers:
        return None
    known = {("tensorrt", "cpu"): ("a TensorRT engine-build knob: the PyTorch LLM-API backend has no such setting; "
                                   "remove it (or use build.engine: tensorrt)"),
             ("pytorch",): f"PyTorch LLM-API backend knobs, but build.engine is '{engine}': remove them (or use build.engine: pytorch)"}
    return known.get(tuple(readers)) or (f"a build.engine {' / '.join(readers)} knob, but build.engine is '{engine}': "
                                         f"remove it (or use build.engine: {readers[0]})")


def _set_dotted(data: dict[str, Any], dotted: str, raw_value: str) -> None:
    """Apply one ``a.b.c=value`` override; the value is parsed as YAML (``64``, ``true``, ``[1,2]``)."""
    if raw_value == "":
        raise RecipeError(f"--set {dotted!r}: expected KEY=VALUE, e.g. build.max_batch_size=64")
    keys = dotted.split(".")
    cur: Any = data
    for k in keys[:-1]:
        if isinstance(cur, list) and k.isdigit():
            cur = cur[int(k)]
            continue
        if not isinstance(cur, dict):
            raise RecipeError(f"--set {dotted}: {k!r} is not a section")
        cur = cur.setdefault(k, {})
    try:
        value = load_bounded(raw_value)
    except BoundedYAMLError as e:
        raise RecipeError(f"--set {dotted}: {e.message}") from None
    except yaml.YAMLError:
        value = raw_value
    if isinstance(cur, list) and keys[-1].isdigit():
        cur[int(keys[-1])] = value
    elif isinstance(cur, dict):
        cur[keys[-1]] = value
    else:
        raise RecipeError(f"--set {dotted}: parent is not a section")


def parse_overrides(overrides: list[str] | None) -> list[tuple[str, str]]:
    """``["build.max_batch_size=64"]`` → ``[("build.max_batch_size", "64")]``; bad syntax raises RecipeError."""
    out = []
    for item in overrides or []:
        key, sep, value = item.partition("=")
        if not sep or not key.strip():
            raise RecipeError(f"--set {item!r}: expected KEY=VALUE, e.g. build.max_batch_size=64")
        out.append((key.strip(), value))
    return out


def read_yaml_file(path: Path, what: str) -> tuple[str, Any]:
    """(text, parsed data) of a recipe-like YAML file, parsed by the bounded loader (no anchors/aliases, no
    duplicate keys, limited depth and size: :mod:`pipeline.recipe.yaml_bounded`).

    Raises :class:`RecipeError` with one line ``FILE[:LINE]: what is wrong`` when the file is missing,
    unreadable or not valid YAML (``what`` names the kind of file in the message, e.g. ``recipe``, ``tune``).
    """
    shown = str(path)
    try:
        text = Path(path).read_text()
    except FileNotFoundError:
        raise RecipeError(f"{shown}: no such {what} file") from None
    except OSError as e:
        raise RecipeError(f"{shown}: cannot read {what} ({e.strerror})") from None
    try:
        return text, load_bounded(text)
    except BoundedYAMLError as e:
        raise RecipeError(f"{shown}{f':{e.line}' if e.line else ''}: {e.message}") from None
    except yaml.YAMLError as e:
        mark = getattr(e, "problem_mark", None)
        where = f":{mark.line + 1}" if mark else ""
        problem = getattr(e, "problem", None) or str(e).splitlines()[0]
        raise RecipeError(f"{shown}{where}: not valid YAML ({problem})") from None


def _absolute_draft(data: dict[str, Any], recipe_dir: Path) -> None:
    """Make a relative ``build.pytorch.speculative_config.speculative_model_dir`` that exists next to the recipe
    absolute (as ``model.source`` is resolved against the recipe's directory), so that validation can read the
    draft's config.json and the LLM-API config names a path that works from anywhere. HF ids are left alone."""
    spec: Any = data
    for key in ("build", "pytorch", "speculative_config"):
        spec = spec.get(key) if isinstance(spec, dict) else None
    draft = spec.get("speculative_model_dir") if isinstance(spec, dict) else None
    if isinstance(draft, str) and draft and not Path(draft).expanduser().is_absolute():
        local = recipe_path(draft, recipe_dir)
        if local.exists():
            spec["speculative_model_dir"] = str(local.resolve())


def load_recipe(path: str | Path, overrides: list[str] | None = None) -> Recipe:
    """Read, override and validate a recipe file.

    Args:
        path: the recipe YAML.
        overrides: ``KEY=VALUE`` strings with dotted keys, applied before validation.

    Returns:
        The validated, frozen :class:`Recipe` (``name`` defaults to the file stem).

    Raises:
        RecipeError: the file is missing/unreadable/not YAML, or a field is invalid; the message
            is one line ``FILE:LINE field.path: what is wrong`` per invalid field, joined by ``; `` (every one
            shown), with ``: --set KEY=VALUE`` in place of ``:LINE`` when an override set the value.
    """
    path = Path(path)
    shown = str(path)
    text, data = read_yaml_file(path, "recipe")
    if data is None:
        data = {}
    if not isinstance(data, dict):
        raise RecipeError(f"{shown}:1: a recipe is a mapping of sections (model, target, quantization, build, serving, bench)")
    pairs = parse_overrides(overrides)
    for key, value in pairs:
        _set_dotted(data, key, value)
    data.setdefault("name", path.stem)
    _absolute_draft(data, path.parent)
    index = _line_index(text)
    try:
        return Recipe.model_validate(data, context={RECIPE_DIR: path.parent})  # local paths: core/recipe_paths.py
    except ValidationError as e:
        raise RecipeError("; ".join(_where_what(err, shown, index, pairs, data) for err in e.errors())) from None


def _where_what(err: Any, shown: str, index: dict[tuple[str, ...], int], pairs: list[tuple[str, str]],
                data: Any = None) -> str:
    """``FILE:LINE field: what`` for one pydantic error; ``FILE: --set KEY=VALUE field: what`` when a ``--set``
    override put the value there (the file's line would blame text the user did not write)."""
    loc = _user_loc(err["loc"], data)
    if err["type"] in ("union_tag_invalid", "union_tag_not_found"):
        loc += (str((err.get("ctx") or {}).get("discriminator", "")).strip("'"),)
    exc = (err.get("ctx") or {}).get("error")  # errors raised inside the "after" model validator carry RecipeCheckError
    if isinstance(exc, RecipeCheckError):
        loc = tuple(exc.loc.split("."))
        what = exc.message
    else:
        what = _describe(err)
    dotted = ".".join(loc)
    flag = next((f"{k}={v}" for k, v in reversed(pairs) if dotted == k or dotted.startswith(k + ".")), None)
    line = _line_for(index, loc)
    where = f": --set {flag}" if flag is not None else (f":{line}" if line else "")
    return f"{shown}{where} {dotted or '<root>'}: {what}"


def _user_loc(loc: tuple[Any, ...], data: Any) -> tuple[str, ...]:
    """``loc`` as the user's keys: pydantic puts a discriminated union's tag (``Eagle``, ``mllama``) into the error
    path after the field; a step that is not a key of the mapping the user wrote there is that tag, and is dropped."""
    out: list[str] = []
    for i, part in enumerate(loc):
        if isinstance(data, dict) and isinstance(part, str) and out and i < len(loc) - 1 and (
                part not in data or part in data.values() and str(loc[i + 1]) in data):
            continue  # a union tag (a missing field is the last step; a tag that is also a key, build's ``cpu``, is
            # the value of its discriminator with the next step a key beside it): the user wrote the fields there
        out.append(str(part))
        if isinstance(data, dict):
            data = data.get(part)
        elif isinstance(data, list) and isinstance(part, int) and 0 <= part < len(data):
            data = data[part]
        else:
            data = None
    return tuple(out)


def override_section(spec: S, overrides: dict[str, Any], *, section: str, flags: dict[str, str] | None = None) -> S:
    """``spec`` (one recipe section) with ``overrides`` (field → value; ``None`` values skipped), re-validated whole.

    Args:
        spec: the section to start from (e.g. the recipe's ``bench``).
        overrides: new values by field name of ``type(spec)``.
        section: the section's name in a recipe, for messages (``bench``).
        flags: field → the CLI flag that set it, so an error names what the user typed.

    Raises:
        UserError: a value the section rejects (one line naming the flag, else ``section.field``).
    """
    from pipeline.core.errors import UserError

    data = spec.model_dump()
    data.update({k: v for k, v in overrides.items() if v is not None})
    try:
        return type(spec).model_validate(data)
    except ValidationError as e:
        err = e.errors()[0]
        field = str(err["loc"][0]) if err["loc"] else ""
        where = (flags or {}).get(field) or f"{section}.{'.'.join(str(p) for p in err['loc'])}"
        raise UserError(f"{where}: {err['msg']}") from None


def recipe_json_schema() -> dict[str, Any]:
    """JSON Schema of the recipe (draft 2020-12), for editors (yaml-language-server) and docs."""
    schema = Recipe.model_json_schema()
    schema["$schema"] = "https://json-schema.org/draft/2020-12/schema"
    schema["title"] = "trtpipe recipe"
    return schema


def dump_recipe(recipe: Recipe) -> str:
    """The fully resolved recipe (every default filled in) as YAML."""
    return yaml.safe_dump(json.loads(recipe.model_dump_json()), sort_keys=False)
