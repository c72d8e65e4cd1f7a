"""The one console setting every command prints through: rich on a terminal, wide and unwrapped off one.

Off a TTY (piped to a file, ``| less``, CI logs) rich falls back to 80 columns and wraps every longer line and
table cell; a piped ``recipe validate`` line becomes 2–3 lines and ``plan`` tables cut numbers. Here the width
off a TTY is :data:`OFF_TTY_WIDTH` columns unless ``$COLUMNS`` is set (then that), and printed text is not
wrapped; on a TTY, the terminal's width and rich's wrapping.
"""

from __future__ import annotations

from typing import Any

from rich.console import Console, ConsoleDimensions

OFF_TTY_WIDTH = 220
"""Columns a console uses when its stream is not a terminal and ``$COLUMNS`` is unset (wide enough for the
widest table trtpipe prints: tune's dry-run plan)."""


class WideConsole(Console):
    """A :class:`rich.console.Console` whose width off a TTY is :data:`OFF_TTY_WIDTH` (or ``$COLUMNS``).

    The width is decided at every print (as rich's own is), so a test runner that swaps ``sys.stdout`` or sets
    ``COLUMNS`` per call sees its own setting.
    """

    def __init__(self, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        # rich turns $COLUMNS/$LINES present at construction into a fixed size; here they are read at every print (a
        # console made at import keeps following the environment it prints in), as rich does when they are unset
        if kwargs.get("width") is None:
            self._width = None
        if kwargs.get("height") is None:
            self._height = None

    @property
    def size(self) -> ConsoleDimensions:
        """(columns, lines): rich's own on a terminal or with ``$COLUMNS``/an explicit width; else OFF_TTY_WIDTH."""
        dims = Console.size.fget(self)  # type: ignore[attr-defined]
        if self._width is None and not self.is_terminal and not str(self._environ.get("COLUMNS", "")).isdigit():
            return ConsoleDimensions(OFF_TTY_WIDTH, dims.height)
        return dims

    @size.setter
    def size(self, new_size: tuple[int, int]) -> None:
        Console.size.fset(self, new_size)  # type: ignore[attr-defined]

    def print(self, *objects: Any, soft_wrap: bool | None = None, **kwargs: Any) -> None:
        """rich's print; off a TTY, text is not wrapped (``soft_wrap``) unless the caller says otherwise, so one
        message stays one line for ``grep``; tables still fit the width above."""
        if soft_wrap is None and not self.is_terminal:
            soft_wrap = True
        super().print(*objects, soft_wrap=soft_wrap, **kwargs)


def make_console(**kwargs: Any) -> WideConsole:
    """A console with trtpipe's setting (``stderr=True`` for the error stream); kwargs go to rich's Console."""
    return WideConsole(**kwargs)
