"""The recipe reference (docs/recipe-reference.md), generated from the schema's field docs.

One table per section: dotted key, type, default, description. Regenerate with
``trtpipe recipe reference -o docs/recipe-reference.md``; a test checks the file is current.
"""

from __future__ import annotations

import json
import types
import typing
from typing import Any

from pydantic import BaseModel
from pydantic_core import PydanticUndefined

from pipeline.recipe.schema import Recipe


def _bounds(metadata: list[Any]) -> str:
    """`` ≥ 1, ≤ 65536`` for annotated-types constraints (Ge/Gt/Le/Lt) in a field's or an item's metadata."""
    marks = []
    for m in metadata:
        for attr, sign in (("ge", "≥"), ("gt", ">"), ("le", "≤"), ("lt", "<")):
            value = getattr(m, attr, None)
            if value is not None and type(m).__name__.lower() == attr:
                marks.append(f"{sign} {value:g}" if isinstance(value, float) else f"{sign} {value}")
        for inner in getattr(m, "metadata", None) or []:  # a FieldInfo in Annotated[...] carries its own
            marks += [_bounds([inner]).strip()]
    return (" " + ", ".join(x for x in marks if x)) if any(marks) else ""


def _type_name(annotation: Any) -> str:
    """The type a user writes in YAML: ``int``, ``fp8 \\| int8_sq``, ``list[int ≥ 1]``, ``section``, never Python
    internals (``typing.Annotated[…FieldInfo…]``); a union of sections names the variants by their discriminator."""
    origin = typing.get_origin(annotation)
    args = typing.get_args(annotation)
    if origin is typing.Annotated:
        return _type_name(args[0]) + _bounds(list(args[1:]))
    if origin is typing.Literal:
        return " \\| ".join(str(a) for a in args)
    if origin in (typing.Union, types.UnionType):
        sections = _variants(annotation)
        if len(sections) > 1:
            key = sections[0][0].split(": ")[0] if ": " in sections[0][0] else ""
            names = ", ".join(tag.split(": ")[-1] for tag, _ in sections)
            rest = [a for a in args if a is type(None)]
            return f"section by {key}: {names}" + (" \\| null" if rest else "")
        return " \\| ".join("null" if a is type(None) else _type_name(a) for a in args)
    if origin in (list, tuple):
        return f"list[{', '.join(_type_name(a) for a in args)}]"
    if origin is dict:
        return f"map[{_type_name(args[0])} → {_type_name(args[1])}]"
    if isinstance(annotation, type):
        return annotation.__name__ if not issubclass(annotation, BaseModel) else "section"
    return str(annotation)


def _variants(annotation: Any) -> list[tuple[str, type[BaseModel]]]:
    """``[(tag, model)]`` for each section of a (possibly Annotated, possibly optional) union of sections; the tag
    is the value of the discriminator field (a one-value Literal, e.g. ``decoding_type: Eagle``), else the class."""
    if typing.get_origin(annotation) is typing.Annotated:
        annotation = typing.get_args(annotation)[0]
    out = []
    for a in typing.get_args(annotation) or (annotation,):
        if typing.get_origin(a) is typing.Annotated:
            out += _variants(a)
        elif isinstance(a, type) and issubclass(a, BaseModel):
            tag = a.__name__
            for name, f in a.model_fields.items():
                lit = typing.get_args(f.annotation) if typing.get_origin(f.annotation) is typing.Literal else ()
                if len(lit) == 1 and (f.is_required() or f.default == lit[0]):  # build.engine has a default
                    tag = f"{name}: {lit[0]}"
                    break
            out.append((tag, a))
    return out


def _default(field: Any) -> str:
    if field.default is not PydanticUndefined:
        value = field.default
    elif field.default_factory is not None:
        value = field.default_factory()
    else:
        return "**required**"
    if isinstance(value, BaseModel):
        value = value.model_dump(mode="json")
        if len(json.dumps(value)) > 60:
            return "(see below)"
    if isinstance(value, list) and value and isinstance(value[0], BaseModel):
        value = [v.model_dump(mode="json") for v in value]
    return f"`{json.dumps(value)}`"


def recipe_reference_markdown() -> str:
    """Markdown tables for every recipe section and sub-section, in schema order."""
    out = [
        "# Recipe reference",
        "",
        "Generated from `pipeline/recipe/` by `trtpipe recipe reference -o docs/recipe-reference.md`; "
        "do not edit by hand. Unknown keys are errors. The JSON Schema is `recipe.schema.json` "
        "(`trtpipe recipe schema`).",
        "",
    ]
    queue: list[tuple[str, type[BaseModel]]] = [("", Recipe)]
    seen: set[tuple[str, type[BaseModel]]] = set()
    while queue:
        title, model = queue.pop(0)
        if (title, model) in seen:  # a sub-section every variant shares (build.kv_cache_config): one table
            continue
        seen.add((title, model))
        prefix = title.split(" (")[0]
        title = title or "top level"
        doc = (model.__doc__ or "").strip().splitlines()[0] if model.__doc__ else ""
        out += [f"## `{title}`", "", doc, "", "| key | type | default | description |", "|---|---|---|---|"]
        nested = []
        for name, field in model.model_fields.items():
            key = f"{prefix}.{name}" if prefix else name
            inner = typing.get_args(field.annotation)[0] if typing.get_origin(field.annotation) is list else None
            variants = _variants(inner if inner is not None else field.annotation)
            base = f"{key}[]" if inner is not None else key
            if len(variants) == 1:
                nested.append((base, variants[0][1]))
            else:  # one table per variant, titled by its discriminator value
                nested += [(f"{base} ({tag})", sub) for tag, sub in variants]
            desc = (field.description or "").replace("|", "\\|").replace("\n", " ")
            kind, null = _type_name(field.annotation), " \\| null"
            kind = (kind[: -len(null)] + _bounds(field.metadata) + null if kind.endswith(null)
                    else kind + _bounds(field.metadata))
            out.append(f"| `{key}` | {kind} | {_default(field)} | {desc} |")
        out.append("")
        queue.extend(nested)
    return "\n".join(out).rstrip() + "\n"
