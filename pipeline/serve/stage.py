"""Serve stage: Triton on a built model repository, as a typed handle.

:func:`run` resolves what to serve (a build directory, a recipe's build, a model repository, or the last
build), refuses artifacts this runtime cannot serve (:func:`~pipeline.serve.compat.check_runtime`), starts the real
``tritonserver`` (:class:`~pipeline.triton.server.TritonServer`), waits for readiness with a bound and
returns a :class:`ServeHandle`::

    with serve.run(BuildLayout(build_dir), ServeOptions(grpc_port=None, http_port=None, metrics_port=None)) as h:
        bench.run(spec, BenchTarget(url=h.grpc_url, build=h.layout))

What to serve and whether it can run here: :mod:`pipeline.serve.compat`. ``trtpipe serve --detach`` records a
running server in ``artifacts/serve.json`` (:meth:`ServeHandle.detach`; :mod:`pipeline.serve.registry`).
"""

from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import Any

from pipeline.core import artifacts
from pipeline.core.errors import UserError
from pipeline.core.layout import BuildLayout
from pipeline.serve import readiness
from pipeline.serve.compat import ServeTarget, check_runtime
from pipeline.serve.registry import triton_record, write_state
from pipeline.triton.server import TritonInstall, TritonServer, find_triton

#: Triton's administrative APIs that a non-loopback server restricts behind a key (Triton's
#: --http-restricted-api / --grpc-restricted-protocol; the API names are those `tritonserver --help` lists)
ADMIN_APIS = ("model-repository", "shared-memory", "logging", "trace")
#: the HTTP request header that carries the admin key; gRPC clients send it as metadata key
#: GRPC_ADMIN_HEADER (Triton prefixes restricted-protocol keys with "triton-grpc-protocol-": seen on Triton 2.51,
#: "This protocol is restricted, expecting header 'triton-grpc-protocol-<key>'")
ADMIN_HEADER = "triton-admin-key"
GRPC_ADMIN_HEADER = f"triton-grpc-protocol-{ADMIN_HEADER}"
LOOPBACK_HOSTS = ("127.0.0.1", "localhost", "::1")
#: server logs a build directory keeps: every start of a server on a build removes its oldest
#: ``triton_server-<port>.log`` files beyond this many (``tune``, ``eval`` and benchmarks/bench_cpu.py serve on free
#: ports, one new log each), never one that a running ``tritonserver`` still writes
SERVER_LOGS_KEPT = 8


# ---------------------------------------------------------------------- the stage
@dataclasses.dataclass(frozen=True)
class ServeOptions:
    """How to run the server (run-time choices, not recipe knobs).

    Ports ``None`` are picked free at start. ``exit_timeout_s`` is Triton's ``--exit-timeout-secs``
    (how long it waits for in-flight requests on stop); ``ready_timeout_s`` bounds the readiness wait (``None``: by
    serving path and model size, :func:`pipeline.serve.readiness.default_ready_timeout_s`).
    ``log_file`` defaults to ``<build>/triton_server-<grpc port>.log`` (the build keeps the newest
    :data:`SERVER_LOGS_KEPT` of those: :func:`prune_server_logs`). ``admin_key``: on a non-loopback
    ``host`` Triton's administrative APIs (:data:`ADMIN_APIS`) answer only requests carrying this key in the
    :data:`ADMIN_HEADER` header; inference, health and metadata stay open. Required off loopback.
    """

    http_port: int | None = 8000
    grpc_port: int | None = 8001
    metrics_port: int | None = 8002
    host: str = "127.0.0.1"
    ready_timeout_s: float | None = None
    exit_timeout_s: int = 5
    log_file: Path | None = None
    admin_key: str | None = None

    def restricted_api_args(self) -> list[str]:
        """Triton flags restricting :data:`ADMIN_APIS` behind ``admin_key`` (none on loopback).

        Raises:
            UserError: a non-loopback ``host`` without an ``admin_key``.
        """
        if self.host in LOOPBACK_HOSTS:
            return []
        if not self.admin_key:
            raise UserError(f"--host {self.host} exposes Triton's administrative APIs ({', '.join(ADMIN_APIS)}): "
                            "set --admin-key KEY (or TRTPIPE_ADMIN_KEY) to restrict them to requests carrying it")
        spec = f"{','.join(ADMIN_APIS)}:{ADMIN_HEADER}={self.admin_key}"
        return [f"--http-restricted-api={spec}", f"--grpc-restricted-protocol={spec}"]


class ServeHandle:
    """A ready deployment: the :class:`TritonServer`, what it serves, how long it took to be ready.

    A context manager (stops the server on exit). :meth:`stop` stops it; :meth:`detach` records it in a
    state file and lets it outlive this process (``trtpipe serve --detach``).
    """

    def __init__(self, server: TritonServer, target: ServeTarget, *, ready_s: float, warnings: list[str]):
        self.server = server
        self.target = target
        self.ready_s = ready_s
        self.warnings = warnings

    @property
    def layout(self) -> BuildLayout | None:
        """The build being served (``None`` for a bare model repository)."""
        return self.target.layout

    @property
    def grpc_url(self) -> str:
        """``host:port`` of the gRPC endpoint."""
        return self.server.grpc_url

    @property
    def http_url(self) -> str:
        """``host:port`` of the HTTP endpoint."""
        return self.server.http_url

    @property
    def metrics_url(self) -> str:
        """The Prometheus metrics URL."""
        return self.server.metrics_url

    def models(self) -> list[dict[str, Any]]:
        """Triton's repository index (``[{name, version, state, reason}]``)."""
        return self.server.models()

    def rss_bytes(self) -> int:
        """Resident memory of the server and its python stubs now, in bytes."""
        return self.server.rss_bytes()

    def stop(self, grace_s: float | None = None) -> int | None:
        """Stop the server (SIGTERM, then SIGKILL after the grace period); its exit status."""
        return self.server.stop(grace_s)

    def detach(self, state_file: Path) -> dict[str, Any]:
        """Record the server in ``state_file`` and let it run on after this process exits."""
        state = write_state(state_file, triton_record(self.server, self.layout.root if self.layout else None))
        self.server.detach()
        return state

    def __enter__(self) -> ServeHandle:
        return self

    def __exit__(self, *exc: object) -> None:
        if self.server.proc is not None:
            self.stop()


def run(
    target: Path | BuildLayout | ServeTarget | None,
    options: ServeOptions = ServeOptions(),
    *,
    install: TritonInstall | None = None,
    die_with_parent: bool = True,
    root: Path = artifacts.DEFAULT_ARTIFACTS_ROOT,
    on_start: Any = None,
) -> ServeHandle:
    """Serve ``target`` with Triton until the returned handle is stopped.

    Args:
        target: a build directory / :class:`BuildLayout`, a recipe file (its default build), a model
            repository, a resolved :class:`ServeTarget`, or ``None`` for the last build under ``root``.
        options: ports, bind address, timeouts, log file.
        install: the ``tritonserver`` to use (default :func:`~pipeline.triton.server.find_triton`).
        die_with_parent: SIGTERM the server when the starting thread dies (``False`` to detach it).
        root: the artifacts root (last build, default build dirs).
        on_start: called with the :class:`TritonServer` once its process runs (before readiness), e.g.
            to print where its log goes.

    Returns:
        A ready :class:`ServeHandle` (``warnings`` holds what the runtime check noted).

    Raises:
        UserError: nothing to serve there, or a port is taken.
        IncompatibleArtifactError: the artifacts cannot run on this Triton (e.g. a GPU engine on CPU), or a file the
            server loads no longer has the sha256 its build recorded (:func:`~pipeline.serve.compat.check_files`).
        MissingToolError: no ``tritonserver`` here.
        StageError: the server exited or was not ready within ``options.ready_timeout_s`` (``None``: the
            :mod:`pipeline.serve.readiness` rule) (it is killed).
    """
    resolved = target if isinstance(target, ServeTarget) else ServeTarget.resolve(target, root)
    ready_timeout_s = readiness.ready_timeout_s(resolved, options.ready_timeout_s)
    extra_args = options.restricted_api_args()
    install = install or find_triton()
    warnings = check_runtime(resolved, install)
    server = TritonServer(
        resolved.repo, http_port=options.http_port, grpc_port=options.grpc_port, metrics_port=options.metrics_port,
        host=options.host, exit_timeout_s=options.exit_timeout_s, world_size=resolved.world_size, install=install,
        ready_timeout_s=ready_timeout_s, die_with_parent=die_with_parent, extra_args=extra_args,
        launch=resolved.launch_options,
    )
    server.log_file = options.log_file or resolved.log_file(server.grpc_port)
    server.start()  # checks the ports first: nothing is launched when one is taken
    try:
        if options.log_file is None:  # this server's log is now the newest
            prune_server_logs(BuildLayout(server.log_file.parent))
        if on_start is not None:
            on_start(server)
        ready_s = server.wait_ready(ready_timeout_s)
    except BaseException:
        server.stop(grace_s=0)
        raise
    return ServeHandle(server, resolved, ready_s=ready_s, warnings=warnings)


def prune_server_logs(layout: BuildLayout, keep: int = SERVER_LOGS_KEPT) -> list[Path]:
    """Remove the build's server logs beyond the ``keep`` most recently written, except any that a running
    ``tritonserver`` process holds open (a long-running server's log may be old). Returns the removed paths."""
    def mtime(p: Path) -> float:
        try:
            return p.stat().st_mtime
        except OSError:
            return 0.0

    old = sorted(layout.server_logs(), key=mtime, reverse=True)[keep:]
    if not old:
        return []
    import psutil

    held: set[Path] = set()
    for proc in psutil.process_iter(["name"]):
        if proc.info["name"] == "tritonserver":
            try:
                held.update(Path(f.path) for f in proc.open_files())
            except psutil.Error:
                pass
    removed = []
    for p in old:
        if p.resolve() not in held:
            try:
                p.unlink(missing_ok=True)
            except OSError:  # not ours to remove: left as it is
                continue
            removed.append(p)
    return removed


def raise_on_sigterm() -> dict[int, Any]:
    """SIGTERM/SIGHUP (``docker stop``, closed terminal) stop the server like Ctrl-C does.

    Returns the previous handlers so the caller can restore them.
    """
    import signal

    def handler(signum: int, frame: Any) -> None:
        raise KeyboardInterrupt

    return {sig: signal.signal(sig, handler) for sig in (signal.SIGTERM, signal.SIGHUP)}

