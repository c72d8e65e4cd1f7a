"""Serve stage: Triton on a built model repository, as a typed handle.

:func:`run` resolves what to serve (a build directory, a recipe's build, a model repository, or the last
build), refuses artifacts this runtime cannot serve (:func:`check_runtime`), starts the real
``tritonserver`` (:class:`~pipeline.triton.server.TritonServer`), waits for readiness with a bound and
returns a :class:`ServeHandle`::

    with serve.run(BuildLayout(build_dir), ServeOptions(grpc_port=None, http_port=None, metrics_port=None)) as h:
        bench.run(spec, BenchTarget(url=h.grpc_url, build=h.layout))

``trtpipe serve --detach`` records a running server in ``artifacts/serve.json``
(:meth:`ServeHandle.detach`, :func:`read_state`, :func:`stop_detached`).
"""

from __future__ import annotations

import dataclasses
import json
import os
import re
from pathlib import Path
from typing import Any

from pipeline import artifacts
from pipeline.errors import IncompatibleArtifactError, UserError
from pipeline.layout import BuildLayout
from pipeline.stages.results import EngineResult
from pipeline.triton.process import http_ok, shm_regions, terminate_tree
from pipeline.triton.server import TritonInstall, TritonServer, find_triton

STATE_FILE = "serve.json"
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
#: ``triton_server-<port>.log`` files beyond this many (``tune``, ``eval`` and scripts/bench_cpu.py serve on free
#: ports, one new log each), never one that a running ``tritonserver`` still writes
SERVER_LOGS_KEPT = 8
_TRTLLM_BACKEND = re.compile(r'^\s*backend\s*:\s*"tensorrtllm"', re.M)


# ---------------------------------------------------------------------- what to serve
@dataclasses.dataclass(frozen=True)
class ServeTarget:
    """A model repository to serve and, when it belongs to one, its build."""

    repo: Path
    layout: BuildLayout | None = None

    @classmethod
    def resolve(cls, target: Path | BuildLayout | None, root: Path = artifacts.DEFAULT_ARTIFACTS_ROOT) -> ServeTarget:
        """``trtpipe serve [ARTIFACT_DIR | RECIPE]``: ``None`` → the last build; a ``.yaml`` recipe → its
        default build dir ``artifacts/<name>``; a build dir (holding stage dirs) or a model repository.

        Raises:
            UserError: nothing built yet / no model repository there (one line: run ``trtpipe build``).
        """
        if isinstance(target, BuildLayout):
            return cls(_repo_of(target, hint="RECIPE"), target)
        if target is None:
            build = artifacts.last_build(root)
            if build is None:
                raise UserError(f"no build found ({root / artifacts.LAST_BUILD_FILE}): run `trtpipe build RECIPE` first")
            layout = BuildLayout(build)
            return cls(_repo_of(layout, hint="RECIPE"), layout)
        target = Path(target)
        if target.is_file() and target.suffix in (".yaml", ".yml"):
            from pipeline.recipe import load_recipe

            recipe = load_recipe(target)
            layout = BuildLayout(artifacts.default_build_dir(recipe.name or target.stem, root))
            return cls(_repo_of(layout, hint=str(target)), layout)
        if not target.exists():
            raise UserError(f"{target} does not exist: give a build directory, a model repository or a recipe")
        if BuildLayout(target).is_build():
            layout = BuildLayout(target)
            return cls(_repo_of(layout, hint="RECIPE"), layout)
        if target.is_dir() and any(target.glob("*/config.pbtxt")):
            parent = BuildLayout(target.parent)
            return cls(target, parent if parent.is_build() and parent.triton_repo.resolve() == target.resolve() else None)
        raise UserError(f"{target} is neither a build directory nor a Triton model repository (no */config.pbtxt)")

    @property
    def world_size(self) -> int:
        """TP×PP of the build's engine (1 without a build or engine manifest)."""
        if self.layout is None:
            return 1
        engine = EngineResult.load(self.layout.engine)
        return engine.world_size if engine is not None else 1

    def log_file(self, grpc_port: int) -> Path:
        """Where the server log goes: next to the build, else next to the repository."""
        return (self.layout or BuildLayout(self.repo.parent)).server_log(grpc_port)


def _repo_of(layout: BuildLayout, hint: str) -> Path:
    if not layout.has_repository():
        raise UserError(f"no model repository at {layout.triton_repo}: run `trtpipe build {hint}` first")
    return layout.triton_repo


def check_runtime(target: ServeTarget, install: TritonInstall) -> list[str]:
    """Refuse artifacts this Triton cannot serve; returns warnings to show (may be empty).

    * CPU Triton + a repository using the C++ ``tensorrtllm`` backend → refused (GPU image needed).
    * GPU Triton + a TensorRT engine → ``pipeline.engine.tensorrt.check_engine_compatible(
      manifest, runtime_facts())``; any difference is refused.
    * GPU Triton whose TensorRT-LLM is not the release matrix's target → a warning naming the image.

    Raises:
        IncompatibleArtifactError: listing what differs.
    """
    repo = target.repo
    uses_trtllm = any(_TRTLLM_BACKEND.search(p.read_text(errors="replace")) for p in repo.glob("*/config.pbtxt"))
    if install.kind == "cpu" and uses_trtllm:
        raise IncompatibleArtifactError(
            f"{repo} uses the tensorrtllm backend (a TensorRT-LLM GPU engine) and this machine has only the CPU "
            "Triton: serve it in the GPU deploy image (docs/deploy-gpu.md) or build a cpu recipe"
        )
    if install.kind != "gpu":
        return []
    from pipeline.engine.tensorrt import check_engine_compatible, runtime_facts
    from pipeline.release import default_release

    facts = runtime_facts()
    target_release = default_release()
    warnings = []
    if facts["tensorrt_llm"] and facts["tensorrt_llm"] != target_release.tensorrt_llm:
        warnings.append(f"this runtime has TensorRT-LLM {facts['tensorrt_llm']}; trtpipe targets "
                        f"{target_release.tensorrt_llm} ({target_release.image}, `trtpipe release`)")
    engine = EngineResult.load(target.layout.engine) if target.layout is not None else None
    if not uses_trtllm or engine is None:
        return warnings
    problems = check_engine_compatible(engine.manifest, facts, stage_dir=engine.path)
    if problems:
        raise IncompatibleArtifactError(
            f"engine {engine.path} does not match this runtime: {'; '.join(problems)} "
            "— rebuild it here with `trtpipe build RECIPE --force`"
        )
    return warnings


# ---------------------------------------------------------------------- the stage
@dataclasses.dataclass(frozen=True)
class ServeOptions:
    """How to run the server (run-time choices, not recipe knobs).

    Ports ``None`` are picked free at start. ``exit_timeout_s`` is Triton's ``--exit-timeout-secs``
    (how long it waits for in-flight requests on stop); ``ready_timeout_s`` bounds the readiness wait.
    ``log_file`` defaults to ``<build>/triton_server-<grpc port>.log`` (the build keeps the newest
    :data:`SERVER_LOGS_KEPT` of those: :func:`prune_server_logs`). ``admin_key``: on a non-loopback
    ``host`` Triton's administrative APIs (:data:`ADMIN_APIS`) answer only requests carrying this key in the
    :data:`ADMIN_HEADER` header; inference, health and metadata stay open. Required off loopback.
    """

    http_port: int | None = 8000
    grpc_port: int | None = 8001
    metrics_port: int | None = 8002
    host: str = "127.0.0.1"
    ready_timeout_s: float = 120.0
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
        state = write_state(state_file, self.server, self.layout.root if self.layout else None)
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
        IncompatibleArtifactError: the artifacts cannot run on this Triton (e.g. a GPU engine on CPU).
        MissingToolError: no ``tritonserver`` here.
        StageError: the server exited or was not ready within ``options.ready_timeout_s`` (it is killed).
    """
    resolved = target if isinstance(target, ServeTarget) else ServeTarget.resolve(target, root)
    extra_args = options.restricted_api_args()
    install = install or find_triton()
    warnings = check_runtime(resolved, install)
    server = TritonServer(
        resolved.repo, http_port=options.http_port, grpc_port=options.grpc_port, metrics_port=options.metrics_port,
        host=options.host, exit_timeout_s=options.exit_timeout_s, world_size=resolved.world_size, install=install,
        ready_timeout_s=options.ready_timeout_s, die_with_parent=die_with_parent, extra_args=extra_args,
    )
    server.log_file = options.log_file or resolved.log_file(server.grpc_port)
    server.start()  # checks the ports first: nothing is launched when one is taken
    try:
        if options.log_file is None:  # this server's log is now the newest
            prune_server_logs(BuildLayout(server.log_file.parent))
        if on_start is not None:
            on_start(server)
        ready_s = server.wait_ready(options.ready_timeout_s)
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


# ---------------------------------------------------------------------- detached servers
def state_path(root: Path = artifacts.DEFAULT_ARTIFACTS_ROOT) -> Path:
    """``artifacts/serve.json``: the server started by ``trtpipe serve --detach``."""
    return Path(root) / STATE_FILE


def write_state(path: Path, server: TritonServer, build: Path | None) -> dict[str, Any]:
    """Record a ready, detached ``server`` in ``path`` (atomically) and return the record."""
    import psutil

    state = {
        "pid": server.pid,
        "create_time": psutil.Process(server.pid).create_time(),
        "host": server.host,
        "http_port": server.http_port,
        "grpc_port": server.grpc_port,
        "metrics_port": server.metrics_port,
        "grpc_url": server.grpc_url,
        "http_url": server.http_url,
        "model_repository": str(server.model_repository),
        "build_dir": str(build.resolve()) if build else None,
        "log_file": str(Path(server.log_file).resolve()) if server.log_file else None,
        "shm_prefix": server.shm_prefix,
        "exit_timeout_s": server.exit_timeout_s,
        "started_at": artifacts.utc_now(),
        "ready_s": round(server.ready_s or 0.0, 3),
    }
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.tmp-{os.getpid()}")
    tmp.write_text(json.dumps(state, indent=2) + "\n")
    tmp.replace(path)
    return state


def read_state(path: Path) -> dict[str, Any] | None:
    """The recorded detached server, or ``None`` (no file / unreadable)."""
    try:
        return json.loads(Path(path).read_text())
    except (OSError, ValueError):
        return None


def state_alive(state: dict[str, Any]) -> bool:
    """True when the recorded PID is still the process we started (PID + start time match)."""
    import psutil

    try:
        p = psutil.Process(int(state["pid"]))
        return abs(p.create_time() - float(state["create_time"])) < 1.0 and p.status() != psutil.STATUS_ZOMBIE
    except (psutil.NoSuchProcess, KeyError, TypeError, ValueError):
        return False


_LOCAL_HOSTS = {"localhost", "127.0.0.1", "::1", "0.0.0.0"}


def _host_port(url: str) -> tuple[str, int] | None:
    """(host, port) of ``host:port`` or ``scheme://host:port/…``, local names folded into ``localhost``; None when
    it names no port."""
    from urllib.parse import urlsplit

    parts = urlsplit(url if "://" in url else f"//{url}")
    try:
        port = parts.port
    except ValueError:
        return None
    if port is None or not parts.hostname:
        return None
    return ("localhost" if parts.hostname in _LOCAL_HOSTS else parts.hostname), port


def detached_build(url: str, root: Path = artifacts.DEFAULT_ARTIFACTS_ROOT) -> Path | None:
    """The build directory the detached server (``trtpipe serve --detach``, ``artifacts/serve.json`` under ``root``)
    serves, when that server is still running and ``url`` (gRPC ``host:port`` or ``http://host:port``) reaches it;
    else ``None``. ``trtpipe bench`` takes its tokenizer and provenance from it: the last build need not be the one
    being served."""
    state = read_state(state_path(root))
    if not state or not state.get("build_dir") or not state_alive(state):
        return None
    target = _host_port(url)
    ours = {_host_port(state.get("grpc_url") or ""), _host_port(f"http://{state.get('http_url') or ''}")}
    build = Path(state["build_dir"])
    return build if target is not None and target in ours and build.is_dir() else None


def state_ready(state: dict[str, Any]) -> bool:
    """One readiness probe of the recorded server's HTTP endpoint."""
    return http_ok(f"http://{state['http_url']}/v2/health/ready")


def stop_detached(path: Path, grace_s: float | None = None) -> tuple[dict[str, Any] | None, bool]:
    """Stop the server recorded in ``path`` and remove the file.

    Returns ``(state, was_running)``; ``(None, False)`` when nothing is recorded. A stale record
    (process gone or PID reused) is just removed; its shm regions are cleaned either way.
    """
    state = read_state(path)
    if state is None:
        return None, False
    running = state_alive(state)
    if running:
        grace = float(state.get("exit_timeout_s", 5)) + 5 if grace_s is None else grace_s
        terminate_tree(int(state["pid"]), grace_s=grace, shm_prefix=state.get("shm_prefix"))
    elif state.get("shm_prefix"):
        for region in shm_regions(state["shm_prefix"]):
            region.unlink(missing_ok=True)
    Path(path).unlink(missing_ok=True)
    return state, running
