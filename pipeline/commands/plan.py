"""``trtpipe plan``: placeholder until its issue lands (owned by the plan work)."""

from __future__ import annotations

from pipeline.commands.common import handle_errors
from pipeline.errors import TrtpipeError


@handle_errors
def plan() -> None:
    """Not built yet."""
    raise TrtpipeError("trtpipe plan is not built yet")
