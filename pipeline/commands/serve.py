"""``trtpipe serve``: placeholder until its issue lands (owned by the serve work)."""

from __future__ import annotations

from pipeline.commands.common import handle_errors
from pipeline.errors import TrtpipeError


@handle_errors
def serve() -> None:
    """Not built yet."""
    raise TrtpipeError("trtpipe serve is not built yet")
