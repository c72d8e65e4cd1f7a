"""``trtpipe serve [ARTIFACT_DIR | RECIPE]``: Triton on a built model repository.

Foreground until Ctrl-C / SIGTERM (clean stop), or ``--detach`` (recorded in
``artifacts/serve.json``) with ``--status`` / ``--stop``. The work is in :mod:`pipeline.serve`.
"""

from __future__ import annotations

import signal
from pathlib import Path
from typing import Annotated, Any

import typer

from pipeline.commands.common import console, err_console, handle_errors


@handle_errors
def serve(
    target: Annotated[
        Path | None,
        typer.Argument(metavar="[ARTIFACT_DIR | RECIPE]", help="Build dir, model repository, or recipe (its artifacts/<name>). Default: the last build."),
    ] = None,
    http_port: Annotated[int, typer.Option("--http-port", help="HTTP port.")] = 8000,
    grpc_port: Annotated[int, typer.Option("--grpc-port", help="gRPC port.")] = 8001,
    metrics_port: Annotated[int, typer.Option("--metrics-port", help="Prometheus metrics port.")] = 8002,
    host: Annotated[str, typer.Option("--host", help="Bind address of all endpoints (0.0.0.0 exposes them).")] = "127.0.0.1",
    timeout: Annotated[float, typer.Option("--timeout", help="Seconds to wait for the server to be ready.")] = 120.0,
    exit_timeout: Annotated[int, typer.Option("--exit-timeout", help="Seconds Triton waits for in-flight requests on stop.")] = 5,
    log_file: Annotated[Path | None, typer.Option("--log-file", help="Server log (default: <build dir>/triton_server-<grpc port>.log).")] = None,
    detach: Annotated[bool, typer.Option("--detach", help="Run in the background once ready (state in artifacts/serve.json).")] = False,
    status: Annotated[bool, typer.Option("--status", help="Show the detached server: running/ready and endpoints.")] = False,
    stop: Annotated[bool, typer.Option("--stop", help="Stop the detached server (graceful, then kill).")] = False,
) -> None:
    """Serve a build with Triton (gRPC, HTTP, metrics) until Ctrl-C, or in the background with --detach."""
    from pipeline import serve as srv
    from pipeline.errors import StageError, UserError

    state_file = srv.state_path()
    if status or stop:
        if target is not None or detach or (status and stop):
            raise UserError("--status and --stop take no ARTIFACT_DIR and exclude each other and --detach")
        if status:
            _status(state_file)
        else:
            _stop(state_file)
        return

    repo, build = srv.resolve_target(target)
    if detach:
        old = srv.read_state(state_file)
        if old is not None and srv.state_alive(old):
            raise UserError(f"a detached server is already running (pid {old['pid']}, gRPC {old['grpc_url']}): run `trtpipe serve --stop` first")
        state_file.unlink(missing_ok=True)
    install = srv.find_triton()
    for warning in srv.check_runtime(repo, build, install):
        err_console.print(f"[yellow]warning:[/] {warning}", highlight=False, soft_wrap=True)
    log = log_file or (build or state_file.parent) / f"triton_server-{grpc_port}.log"
    server = srv.TritonServer(
        repo, http_port=http_port, grpc_port=grpc_port, metrics_port=metrics_port, host=host, log_file=log,
        exit_timeout_s=exit_timeout, world_size=srv.build_world_size(build), install=install, die_with_parent=not detach,
    )
    previous = _raise_on_sigterm()
    try:
        server.start()  # checks the ports first: nothing is launched when one is taken
        console.print(f"[bold]trtpipe serve[/] {repo}  ({install.kind} Triton, log {log})", highlight=False, soft_wrap=True)
        ready_s = server.wait_ready(timeout)
        models = ", ".join(f"{m['name']}" for m in server.models()) or "none"
        console.print(
            f"  gRPC    {server.grpc_url}\n  HTTP    http://{server.http_url}\n  metrics {server.metrics_url}\n  models  {models}",
            highlight=False, soft_wrap=True,
        )
        console.print(f"[bold green]ready[/] in {ready_s:.1f} s (pid {server.pid}, RSS {server.rss_bytes() / 2**20:.0f} MiB)", highlight=False, soft_wrap=True)
        if detach:
            srv.write_state(state_file, server, build)
            server.detach()
            console.print(f"running in the background; `trtpipe serve --status` / `trtpipe serve --stop` ({state_file})", highlight=False, soft_wrap=True)
            return
        console.print("[dim]Ctrl-C to stop[/]")
        rc = server.proc.wait()  # type: ignore[union-attr]
        raise StageError(f"tritonserver exited on its own with status {rc} (log: {log})" + server.log_excerpt())
    except KeyboardInterrupt:
        console.print("stopping…")
        rc = server.stop()
        console.print(f"stopped (exit status {rc})", highlight=False, soft_wrap=True)
    finally:
        if server.proc is not None and server.proc.poll() is None:  # never leave a half-started server
            server.stop(grace_s=0)
        for sig, handler in previous.items():
            signal.signal(sig, handler)


def _raise_on_sigterm() -> dict[int, Any]:
    """SIGTERM/SIGHUP (``docker stop``, closed terminal) stop the server like Ctrl-C does.

    Returns the previous handlers so the caller can restore them.
    """

    def handler(signum: int, frame: Any) -> None:
        raise KeyboardInterrupt

    return {sig: signal.signal(sig, handler) for sig in (signal.SIGTERM, signal.SIGHUP)}


def _status(state_file: Path) -> None:
    from pipeline import serve as srv

    state = srv.read_state(state_file)
    if state is None:
        console.print(f"not running (no {state_file})", highlight=False, soft_wrap=True)
        raise typer.Exit(1)
    if not srv.state_alive(state):
        state_file.unlink(missing_ok=True)
        console.print(f"not running: pid {state.get('pid')} is gone (removed stale {state_file})", highlight=False, soft_wrap=True)
        raise typer.Exit(1)
    ready = srv.state_ready(state)
    console.print(
        f"running (pid {state['pid']}), {'[green]ready[/]' if ready else '[yellow]not ready[/]'}\n"
        f"  gRPC    {state['grpc_url']}\n  HTTP    http://{state['http_url']}\n"
        f"  repo    {state['model_repository']}\n  log     {state['log_file']}\n  since   {state['started_at']}",
        highlight=False,
    )
    if not ready:
        raise typer.Exit(1)


def _stop(state_file: Path) -> None:
    from pipeline import serve as srv

    state, was_running = srv.stop_detached(state_file)
    if state is None:
        console.print(f"no detached server (no {state_file})", highlight=False, soft_wrap=True)
    elif was_running:
        console.print(f"stopped pid {state['pid']} (gRPC {state['grpc_url']})", highlight=False, soft_wrap=True)
    else:
        console.print(f"pid {state['pid']} was not running; removed stale {state_file}", highlight=False, soft_wrap=True)
