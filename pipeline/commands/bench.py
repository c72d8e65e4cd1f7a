"""``trtpipe bench``: placeholder until its issue lands (owned by the bench work)."""

from __future__ import annotations

import typer

app = typer.Typer(help="Triton gRPC load test (not built yet).", invoke_without_command=True)
