"""Shared CLI plumbing: consoles and the error → exit-code mapping."""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any, TypeVar

import typer
from rich.markup import escape

from pipeline.core.console import make_console
from pipeline.core.errors import TrtpipeError
from pipeline.core.quiet import debug_enabled

console = make_console()  # wide and unwrapped off a TTY (pipeline.core.console): one setting for every command
err_console = make_console(stderr=True)

F = TypeVar("F", bound=Callable[..., Any])


def handle_errors(fn: F) -> F:
    """Run a command body; a :class:`TrtpipeError` becomes one red line on stderr and its exit code.

    User mistakes never show a traceback. Ctrl-C exits 130 after the command's own cleanup ran.
    Set ``TRTPIPE_DEBUG=1`` to re-raise with the traceback.
    """

    @functools.wraps(fn)
    def wrapper(*args: Any, **kwargs: Any) -> Any:
        try:
            return fn(*args, **kwargs)
        except TrtpipeError as e:
            if debug_enabled():
                raise
            err_console.print(f"[bold red]error:[/] {escape(str(e))}", highlight=False, soft_wrap=True)  # the text, not markup
            raise typer.Exit(e.exit_code) from None
        except KeyboardInterrupt:
            err_console.print("[yellow]interrupted[/]")
            raise typer.Exit(130) from None

    return wrapper  # type: ignore[return-value]

