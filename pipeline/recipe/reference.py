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


def _type_name(annotation: Any) -> str:
    origin = typing.get_origin(annotation)
    args = typing.get_args(annotation)
    if origin is typing.Literal:
        return " \\| ".join(str(a) for a in args)
    if origin in (typing.Union, types.UnionType):
        return " \\| ".join("null" if a is type(None) else _type_name(a) for a in args)
    if origin in (list, tuple):
        return f"list[{', '.join(_type_name(a) for a in args)}]"
    if origin is dict:
        return f"map[{_type_name(args[0])} → {_type_name(args[1])}]"
    if isinstance(annotation, type):
        return annotation.__name__ if not issubclass(annotation, BaseModel) else "section"
    return str(annotation)


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


def _section_model(annotation: Any) -> type[BaseModel] | None:
    for a in (annotation, *typing.get_args(annotation)):
        if isinstance(a, type) and issubclass(a, BaseModel):
            return a
    return None


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
    while queue:
        prefix, model = queue.pop(0)
        title = prefix or "top level"
        doc = (model.__doc__ or "").strip().splitlines()[0] if model.__doc__ else ""
        out += [f"## `{title}`", "", doc, "", "| key | type | default | description |", "|---|---|---|---|"]
        nested = []
        for name, field in model.model_fields.items():
            key = f"{prefix}.{name}" if prefix else name
            sub = _section_model(field.annotation)
            if sub is not None and typing.get_origin(field.annotation) is not list:
                nested.append((key, sub))
            elif sub is not None:
                nested.append((f"{key}[]", sub))
            desc = (field.description or "").replace("|", "\\|").replace("\n", " ")
            out.append(f"| `{key}` | {_type_name(field.annotation)} | {_default(field)} | {desc} |")
        out.append("")
        queue.extend(nested)
    return "\n".join(out).rstrip() + "\n"
