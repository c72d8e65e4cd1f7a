"""A bounded YAML reader for recipes and ``--set`` values.

``yaml.safe_load`` expands anchors and aliases: a 1 KB "billion laughs" document (nested aliases) takes
minutes and gigabytes. Recipes never need them, so :class:`BoundedLoader` refuses any anchor or alias, any
duplicate key (PyYAML keeps the last one silently), and nesting deeper than :data:`MAX_DEPTH`;
:func:`load_bounded` also refuses files larger than :data:`MAX_BYTES` before parsing. Each refusal is a
:class:`BoundedYAMLError` carrying the 1-based line.
"""

from __future__ import annotations

from typing import Any

import yaml

#: largest recipe file read (bytes): the shipped recipes are ~2 KB; a recipe with every field is ~6 KB
MAX_BYTES = 256 * 1024
#: deepest nesting of mappings/sequences (the recipe schema is 4 levels deep)
MAX_DEPTH = 16


class BoundedYAMLError(ValueError):
    """A document the bounded loader refuses; ``line`` is 1-based (``None`` when not known)."""

    def __init__(self, message: str, line: int | None = None):
        super().__init__(message)
        self.message = message
        self.line = line


class BoundedLoader(yaml.SafeLoader):
    """``yaml.SafeLoader`` without anchors, aliases or duplicate keys, and with a nesting bound."""

    def __init__(self, stream: Any) -> None:
        super().__init__(stream)
        self._depth = 0

    def compose_node(self, parent: Any, index: Any) -> Any:  # noqa: D102 - PyYAML hook
        event = self.peek_event()
        line = event.start_mark.line + 1
        if isinstance(event, yaml.AliasEvent):
            raise BoundedYAMLError(f"YAML alias '*{event.anchor}' refused (anchors and aliases are not allowed in recipes)", line)
        if getattr(event, "anchor", None):
            raise BoundedYAMLError(f"YAML anchor '&{event.anchor}' refused (anchors and aliases are not allowed in recipes)", line)
        self._depth += 1
        try:
            if self._depth > MAX_DEPTH:
                raise BoundedYAMLError(f"nesting deeper than {MAX_DEPTH} levels refused", line)
            return super().compose_node(parent, index)
        finally:
            self._depth -= 1

    def construct_mapping(self, node: Any, deep: bool = False) -> Any:  # noqa: D102 - PyYAML hook
        seen: set[Any] = set()
        for key_node, _ in node.value:
            key = self.construct_object(key_node, deep=True)
            if isinstance(key, (list, dict)):
                raise BoundedYAMLError("a mapping key must be a scalar", key_node.start_mark.line + 1)
            if key in seen:
                raise BoundedYAMLError(f"duplicate key {key!r} refused (YAML would silently keep the last one)",
                                       key_node.start_mark.line + 1)
            seen.add(key)
        return super().construct_mapping(node, deep=deep)


def load_bounded(text: str) -> Any:
    """Parse one YAML document with :class:`BoundedLoader`.

    Raises:
        BoundedYAMLError: larger than :data:`MAX_BYTES`, an anchor/alias, a duplicate key, too deep.
        yaml.YAMLError: not valid YAML.
    """
    if len(text.encode("utf-8", errors="replace")) > MAX_BYTES:
        raise BoundedYAMLError(f"larger than {MAX_BYTES // 1024} KiB refused (a recipe is a few KiB)", None)
    return yaml.load(text, Loader=BoundedLoader)  # noqa: S506 - BoundedLoader is a SafeLoader


def compose_bounded(text: str) -> Any:
    """The node tree of a document (for line numbers), with the same refusals as :func:`load_bounded`."""
    if len(text.encode("utf-8", errors="replace")) > MAX_BYTES:
        raise BoundedYAMLError(f"larger than {MAX_BYTES // 1024} KiB refused (a recipe is a few KiB)", None)
    return yaml.compose(text, Loader=BoundedLoader)
