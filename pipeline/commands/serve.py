"""``trtpipe serve [ARTIFACT_DIR | RECIPE]``: Triton on a built model repository, or a trtllm-serve build.

Foreground until Ctrl-C / SIGTERM (clean stop), or ``--detach`` (recorded in ``artifacts/serve.json``) with
``--status`` / ``--stop``, for both frontends. The work is :func:`pipeline.serve.stage.run` (Triton) and
:func:`pipeline.serve.frontend.serve_trtllm` (trtllm-serve; trtpipe's CPU stand-in on the cpu target).
"""

from __future__ import annotations

import shlex
import signal
from pathlib import Path
from typing import Annotated

import typer

from pipeline.commands.common import console, err_console, handle_errors


@handle_errors
def serve(
    target: Annotated[
        Path | None,
        typer.Argument(metavar="[ARTIFACT_DIR | RECIPE]", help="Build dir, model repository, or recipe (its artifacts/<name>). Default: the last build."),
    ] = None,
    http_port: Annotated[int, typer.Option("--http-port", help="HTTP port (trtllm-serve's --port).")] = 8000,
    grpc_port: Annotated[int, typer.Option("--grpc-port", help="gRPC port.")] = 8001,
    metrics_port: Annotated[int, typer.Option("--metrics-port", help="Prometheus metrics port.")] = 8002,
    host: Annotated[str, typer.Option("--host", help="Bind address of all endpoints (0.0.0.0 exposes them; then --admin-key is required).")] = "127.0.0.1",
    admin_key: Annotated[str | None, typer.Option("--admin-key", envvar="TRTPIPE_ADMIN_KEY", show_envvar=True, help="Off loopback: Triton's model-repository, shared-memory, logging and trace APIs answer only requests with the key (HTTP header triton-admin-key, gRPC metadata triton-grpc-protocol-triton-admin-key).")] = None,
    timeout: Annotated[float | None, typer.Option("--timeout", help="Seconds to wait for the server to be ready (trtllm-serve: GET /health is 200). Default: by path and size, 600 s (GPU build) or 120 s (CPU) + 10 s per GiB of weights.")] = None,
    exit_timeout: Annotated[int, typer.Option("--exit-timeout", help="Seconds Triton waits for in-flight requests on stop.")] = 5,
    log_file: Annotated[Path | None, typer.Option("--log-file", help="Server log (default: <build dir>/triton_server-<grpc port>.log, a build keeps its newest 8; trtllm-serve: <build dir>/trtllm_serve-<http port>.log).")] = None,
    detach: Annotated[bool, typer.Option("--detach", help="Run in the background once ready (state in artifacts/serve.json).")] = False,
    status: Annotated[bool, typer.Option("--status", help="Show the detached server: running/ready and endpoints.")] = False,
    stop: Annotated[bool, typer.Option("--stop", help="Stop the detached server (graceful, then kill).")] = False,
    print_command: Annotated[bool, typer.Option("--print-command", help="Print the exact command line of the build's frontend (tritonserver or trtllm-serve) and exit; nothing starts.")] = False,
) -> None:
    """Serve a build with Triton (gRPC, HTTP, metrics) or trtllm-serve (serving.frontend) until Ctrl-C; --print-command shows the command."""
    from pipeline.core.errors import UserError
    from pipeline.serve import registry, watch
    from pipeline.serve import stage as srv
    from pipeline.serve.compat import ServeTarget

    state_file = registry.state_path()
    if status or stop:
        if target is not None or detach or (status and stop):
            raise UserError("--status and --stop take no ARTIFACT_DIR and exclude each other and --detach")
        if status:
            _status(state_file)
        else:
            _stop(state_file)
        return

    resolved = ServeTarget.resolve(target)
    if detach:
        old = registry.read_state(state_file)
        if old is not None and registry.state_alive(old):
            raise UserError(f"a detached server is already running (pid {old['pid']}, {registry.frontend_of(old)} "
                            f"{old.get('grpc_url') or old.get('openai_url')}): run `trtpipe serve --stop` first")
        state_file.unlink(missing_ok=True)
    options = srv.ServeOptions(
        http_port=http_port, grpc_port=grpc_port, metrics_port=metrics_port, host=host, ready_timeout_s=timeout,
        exit_timeout_s=exit_timeout, log_file=log_file, admin_key=admin_key,
    )
    from pipeline.serve import frontend
    if print_command:
        print(shlex.join(frontend.command(resolved, options)))  # plain: one unwrapped, copyable line
        return
    if frontend.trtllm_serve_spec(resolved) is not None:  # serving.frontend: trtllm-serve (GPU: exit 3 without it)
        previous = srv.raise_on_sigterm()
        try:
            frontend.serve_trtllm(resolved, options, detach=detach, state_file=state_file,
                                  say=lambda m: console.print(m, highlight=False, soft_wrap=True))
        finally:
            for sig, handler in previous.items():
                signal.signal(sig, handler)
        return
    if options.restricted_api_args():
        console.print(f"administrative APIs ({', '.join(srv.ADMIN_APIS)}) restricted to requests with the key in HTTP header "
                      f"{srv.ADMIN_HEADER} / gRPC metadata {srv.GRPC_ADMIN_HEADER}; inference, health and metadata are open",
                      highlight=False, soft_wrap=True)

    def started(server) -> None:  # noqa: ANN001
        console.print(f"[bold]trtpipe serve[/] {resolved.repo}  ({server.install.kind} Triton, log {server.log_file}; ready wait ≤ {server.ready_timeout_s:g} s)",
                      highlight=False, soft_wrap=True)

    previous = srv.raise_on_sigterm()
    handle = None
    try:
        handle = srv.run(resolved, options, die_with_parent=not detach, on_start=started)
        for warning in handle.warnings:
            err_console.print(f"[yellow]warning:[/] {warning}", highlight=False, soft_wrap=True)
        models = ", ".join(m["name"] for m in handle.models()) or "none"
        console.print(
            f"  gRPC    {handle.grpc_url}\n  HTTP    http://{handle.http_url}\n  metrics {handle.metrics_url}\n  models  {models}",
            highlight=False, soft_wrap=True,
        )
        console.print(f"[bold green]ready[/] in {handle.ready_s:.1f} s (pid {handle.server.pid}, RSS {handle.rss_bytes() / 2**20:.0f} MiB)",
                      highlight=False, soft_wrap=True)
        if detach:
            handle.detach(state_file)
            watch.spawn(state_file, admin_key)
            console.print(f"running in the background; `trtpipe serve --status` / `trtpipe serve --stop` ({state_file})",
                          highlight=False, soft_wrap=True)
            return
        console.print("[dim]Ctrl-C to stop; a server or model that stops answering is restarted[/]")
        watch.serve_foreground(handle, lambda: srv.run(resolved, options), say=lambda m: console.print(m, highlight=False, soft_wrap=True))
    except KeyboardInterrupt:
        console.print("stopping…")
        rc = handle.stop() if handle is not None else None
        console.print(f"stopped (exit status {rc})", highlight=False, soft_wrap=True)
    finally:
        if handle is not None and handle.server.proc is not None and handle.server.proc.poll() is None:
            handle.stop(grace_s=0)  # never leave a half-started server
        for sig, handler in previous.items():
            signal.signal(sig, handler)


def _status(state_file: Path) -> None:
    from pipeline.serve import registry

    state = registry.read_state(state_file)
    build = state and (state.get("build_dir") or state.get("model_repository"))
    if state is None or not registry.state_alive(state):
        if state is not None and registry.state_alive(state.get("watcher") or {}):
            console.print(f"not ready: pid {state.get('pid')} ({build}) is gone, its watcher is restarting it", highlight=False, soft_wrap=True)
        else:
            console.print(f"not running: pid {state.get('pid')} ({build}) is gone (removed stale {state_file})" if state
                          else f"not running (no {state_file})", highlight=False, soft_wrap=True)
            state_file.unlink(missing_ok=True)
        raise typer.Exit(1)
    problems = registry.not_answering(state)  # every model must answer, not only the process run
    console.print(f"running (pid {state['pid']}), {'[yellow]not ready[/]: ' + '; '.join(problems) if problems else '[green]ready[/]'}\n"
                  f"{registry.describe(state)}", highlight=False, soft_wrap=True)
    if problems:
        raise typer.Exit(1)


def _stop(state_file: Path) -> None:
    from pipeline.serve import registry

    state, was_running = registry.stop_detached(state_file)
    if state is None:
        console.print(f"no detached server (no {state_file})", highlight=False, soft_wrap=True)
    elif was_running:
        console.print(f"stopped pid {state['pid']} ({registry.frontend_of(state)}, {state.get('build_dir') or state.get('grpc_url')})",
                      highlight=False, soft_wrap=True)
    else:
        console.print(f"pid {state['pid']} was not running; removed stale {state_file}", highlight=False, soft_wrap=True)
