"""Typer command modules; :mod:`pipeline.cli` registers them. Each keeps heavy imports inside
its command function so that ``trtpipe --help`` and ``trtpipe recipe validate`` start fast."""
