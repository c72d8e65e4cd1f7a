"""Optional extras (``trtpipe[deploy]``, …): whether one is installed, and the exact command that installs it here.

The quickstart installs only the ``cpu`` extra; a command that needs another one checks for it before any work and
fails with one line naming the command for *this* install: ``<this python> -m pip install -e '<checkout>[extra]'``
for a source checkout (scripts/setup.sh installs trtpipe editable), else ``pip install 'trtpipe[extra]'``.
"""

from __future__ import annotations

import importlib
import shlex
import sys
from pathlib import Path

from pipeline.core.errors import MissingToolError


def install_command(extra: str) -> str:
    """The pip command that adds ``extra`` to the running install (one line, copy-pasteable)."""
    root = Path(__file__).resolve().parents[2]
    if (root / "pyproject.toml").is_file() and 'name = "trtpipe"' in (root / "pyproject.toml").read_text():
        return f"{shlex.quote(sys.executable)} -m pip install -e {shlex.quote(f'{root}[{extra}]')}"
    return f"pip install 'trtpipe[{extra}]'"


def require(extra: str, modules: tuple[str, ...], what: str) -> None:
    """Check that every top-level module of ``extra`` imports here.

    Args:
        extra: the optional-dependency group of pyproject.toml (e.g. ``deploy``).
        modules: its import names (e.g. ``("helm_python", "kubernetes_validate")``).
        what: the command that needs it, for the message (e.g. ``trtpipe deploy k8s``).

    Raises:
        MissingToolError: (exit 3) one line: which modules are missing, ``pip install 'trtpipe[extra]'`` and the
            exact command for this install.
    """
    missing = []
    for m in modules:
        try:
            importlib.import_module(m)
        except ImportError:
            missing.append(m)
    if missing:
        raise MissingToolError(
            f"{what} needs the '{extra}' extra ({', '.join(missing)} not installed; the quickstart installs only "
            f"'cpu'): pip install 'trtpipe[{extra}]' — for this install: {install_command(extra)}"
        )
