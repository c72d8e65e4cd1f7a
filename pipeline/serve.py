"""Run Triton on a built model repository: :class:`TritonServer`, target resolution, detached state.

``TritonServer`` launches the real ``tritonserver`` (container binary on GPU, nvidia-pytriton's
on CPU; see :mod:`pipeline.triton_server`) in its own session with its output in a log file,
waits for readiness with a bound (a python stub that cannot start leaves the server "loading"
forever), and stops it with SIGTERM → short exit timeout → SIGKILL of the process group, leaving
no stub process and no ``/dev/shm`` region behind::

    with TritonServer(repo, grpc_port=free_port(), http_port=free_port(), metrics_port=free_port()) as srv:
        client = tritonclient.grpc.InferenceServerClient(srv.grpc_url)

``trtpipe serve --detach`` records a running server in ``artifacts/serve.json``
(:func:`write_state`, :func:`read_state`, :func:`stop_detached`).
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import tempfile
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from pipeline import artifacts
from pipeline.errors import IncompatibleArtifactError, StageError, UserError
from pipeline.triton_server import (
    TritonInstall,
    check_ports_free,
    die_with_parent,
    find_triton,
    free_port,
    http_ok,
    log_tail,
    models_still_loading,
    repository_index,
    shm_regions,
    terminate_tree,
    tree_rss,
    triton_command,
)

__all__ = [
    "TritonServer", "build_world_size", "check_runtime", "free_port", "read_state", "resolve_target",
    "state_alive", "state_path", "state_ready", "stop_detached", "write_state",
]

STATE_FILE = "serve.json"
_LOCAL = {"0.0.0.0": "127.0.0.1", "": "127.0.0.1", "::": "::1"}


class TritonServer:
    """One ``tritonserver`` process (or ``mpirun`` of ``world_size`` ranks) on ``model_repository``.

    Args:
        model_repository: directory with ``<model>/config.pbtxt`` entries.
        http_port, grpc_port, metrics_port: Triton's ports (defaults 8000/8001/8002).
        host: bind address of all three endpoints (``0.0.0.0`` to expose them).
        log_file: server stdout+stderr (default: a new file in the temp dir).
        exit_timeout_s: ``--exit-timeout-secs``: how long Triton waits for in-flight requests/open
            streams on SIGTERM (Triton's default 30 s is too long for a launcher).
        extra_args: appended to every rank's command line.
        world_size: TensorRT-LLM TP×PP ranks (> 1 launches through ``mpirun``).
        install: the ``tritonserver`` to use (default :func:`find_triton`).
        ready_timeout_s: the readiness bound used by ``with TritonServer(...)``.
        die_with_parent: SIGTERM the server when the thread that started it dies (no orphans
            after a crash; Linux ``PR_SET_PDEATHSIG``, so start it from a thread that lives as
            long as the server); ``False`` for a server meant to outlive us (``serve --detach``).

    Use as a context manager (start + wait_ready(ready_timeout_s) on enter, stop on exit) or call
    :meth:`start`, :meth:`wait_ready`, :meth:`stop` yourself.
    """

    def __init__(
        self,
        model_repository: Path,
        *,
        http_port: int = 8000,
        grpc_port: int = 8001,
        metrics_port: int = 8002,
        host: str = "127.0.0.1",
        log_file: Path | None = None,
        exit_timeout_s: int = 5,
        extra_args: Sequence[str] = (),
        world_size: int = 1,
        install: TritonInstall | None = None,
        ready_timeout_s: float = 120.0,
        die_with_parent: bool = True,
    ) -> None:
        self.model_repository = Path(model_repository).resolve()
        self.http_port, self.grpc_port, self.metrics_port = int(http_port), int(grpc_port), int(metrics_port)
        self.host = host
        self.log_file = Path(log_file) if log_file is not None else None
        self.exit_timeout_s = int(exit_timeout_s)
        self.extra_args = tuple(extra_args)
        self.world_size = int(world_size)
        self.install = install
        self.ready_timeout_s = ready_timeout_s
        self.die_with_parent = die_with_parent
        #: prefix of this server's python-backend regions in /dev/shm (Triton appends a UUID)
        self.shm_prefix = f"trtpipe_{os.getpid()}_{self.grpc_port}_"
        self.proc: subprocess.Popen | None = None
        self.started_at: float | None = None
        self.ready_s: float | None = None

    # ------------------------------------------------------------------ endpoints
    @property
    def pid(self) -> int | None:
        """PID of the launched process (= its process group id), or ``None`` before start."""
        return self.proc.pid if self.proc else None

    @property
    def client_host(self) -> str:
        """Address clients connect to (``127.0.0.1`` when bound to all interfaces)."""
        return _LOCAL.get(self.host, self.host)

    @property
    def grpc_url(self) -> str:
        """``host:port`` for ``tritonclient.grpc.InferenceServerClient``."""
        return f"{self.client_host}:{self.grpc_port}"

    @property
    def http_url(self) -> str:
        """``host:port`` for ``tritonclient.http.InferenceServerClient``."""
        return f"{self.client_host}:{self.http_port}"

    @property
    def metrics_url(self) -> str:
        """Prometheus metrics endpoint."""
        return f"http://{self.client_host}:{self.metrics_port}/metrics"

    # ------------------------------------------------------------------ lifecycle
    def command(self) -> list[str]:
        """The argv :meth:`start` runs."""
        inst = self.install or find_triton()
        return triton_command(
            inst.binary, self.model_repository, http_port=self.http_port, grpc_port=self.grpc_port,
            metrics_port=self.metrics_port, host=self.host, exit_timeout_s=self.exit_timeout_s,
            world_size=self.world_size, shm_prefix=self.shm_prefix, backend_dir=inst.backend_dir,
            cache_dir=inst.cache_dir, extra_args=self.extra_args,
        )

    def start(self) -> TritonServer:
        """Launch the server in a new session (its own process group); returns at once.

        Raises:
            UserError: no model repository at the path, or a port is taken.
            MissingToolError: no ``tritonserver`` on this machine.
        """
        if self.proc is not None:
            raise RuntimeError("TritonServer already started")
        if not self.model_repository.is_dir():
            raise UserError(f"no model repository at {self.model_repository}")
        check_ports_free(self.host, {"http": self.http_port, "grpc": self.grpc_port, "metrics": self.metrics_port})
        self.install = self.install or find_triton()
        cmd = self.command()
        if self.log_file is None:
            fd, name = tempfile.mkstemp(prefix=f"tritonserver-{self.grpc_port}-", suffix=".log")
            os.close(fd)
            self.log_file = Path(name)
        self.log_file.parent.mkdir(parents=True, exist_ok=True)
        with open(self.log_file, "wb") as log:
            self.proc = subprocess.Popen(
                cmd, env=self.install.environ(), stdin=subprocess.DEVNULL, stdout=log, stderr=subprocess.STDOUT,
                start_new_session=True, cwd=self.model_repository,
                preexec_fn=die_with_parent if self.die_with_parent else None,
            )
        self.started_at = time.monotonic()
        return self

    def is_ready(self) -> bool:
        """One readiness probe: ``GET /v2/health/ready`` is 200 (all models ready, strict readiness)."""
        return http_ok(f"http://{self.http_url}/v2/health/ready")

    def wait_ready(self, timeout_s: float | None = None) -> float:
        """Poll readiness every 0.1 s until ready; returns seconds since :meth:`start`.

        Raises:
            StageError: the server exited (e.g. a malformed config.pbtxt), or was not ready within
                ``timeout_s`` (then the models not yet READY are named). The message ends with the
                last lines of the server log; the whole process group is killed first.
        """
        if self.proc is None or self.started_at is None:
            raise RuntimeError("TritonServer not started")
        timeout_s = self.ready_timeout_s if timeout_s is None else timeout_s
        deadline = time.monotonic() + timeout_s
        while True:
            rc = self.proc.poll()
            if rc is not None:
                self.stop(grace_s=0)
                raise StageError(f"tritonserver exited with status {rc} before it was ready (log: {self.log_file})" + self.log_excerpt())
            if self.is_ready():
                self.ready_s = time.monotonic() - self.started_at
                return self.ready_s
            if time.monotonic() >= deadline:
                pending = [f"{m.get('name')} ({m.get('state') or 'UNKNOWN'})" for m in self.models() if m.get("state") != "READY"]
                pending = pending or [f"{name} (LOADING)" for name in models_still_loading(self.log_file)]
                self.stop(grace_s=1)
                what = f"; not ready: {', '.join(pending)}" if pending else ""
                raise StageError(f"tritonserver not ready after {timeout_s:g} s{what} (log: {self.log_file})" + self.log_excerpt())
            time.sleep(0.1)

    def models(self) -> list[dict[str, Any]]:
        """The repository index (``[{name, version, state, reason}]``); ``[]`` when unreachable."""
        return repository_index(self.http_url)

    def stop(self, grace_s: float | None = None) -> int | None:
        """SIGTERM, wait ``grace_s`` (default exit timeout + 5 s), then SIGKILL the process group.

        Returns the exit status (``None`` if never started). Idempotent.
        """
        if self.proc is None:
            return None
        grace = self.exit_timeout_s + 5 if grace_s is None else grace_s
        rc = terminate_tree(self.proc.pid, grace_s=grace, proc=self.proc, shm_prefix=self.shm_prefix)
        return self.proc.returncode if rc is None else rc

    def detach(self) -> None:
        """Forget the process so that leaving the context does not stop it (``serve --detach``)."""
        self.proc = None

    def rss_bytes(self) -> int:
        """Resident memory of the server and its stub processes now, in bytes (0 if not running)."""
        return tree_rss(self.pid) if self.pid else 0

    def log_excerpt(self) -> str:
        """``"\n--- last lines of LOG ---\n…"`` (harmless CPU warnings dropped), or ``""``."""
        tail = log_tail(self.log_file)
        return f"\n--- last lines of {self.log_file} ---\n{tail}" if tail else ""

    def __enter__(self) -> TritonServer:
        self.start()
        try:
            self.wait_ready()
        except BaseException:
            self.stop(grace_s=0)
            raise
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()


# ---------------------------------------------------------------------- what to serve
_TRTLLM_BACKEND = re.compile(r'^\s*backend\s*:\s*"tensorrtllm"', re.M)


def resolve_target(target: Path | None, root: Path = artifacts.DEFAULT_ARTIFACTS_ROOT) -> tuple[Path, Path | None]:
    """``(model repository, build dir or None)`` for ``trtpipe serve [ARTIFACT_DIR | RECIPE]``.

    ``None`` → the last build; a ``.yaml`` recipe → its default build dir ``artifacts/<name>``; a
    build dir (holding ``triton_repo/``) or a model repository directly.

    Raises:
        UserError: nothing built yet / no model repository there (one line: run ``trtpipe build``).
    """
    if target is None:
        build = artifacts.last_build(root)
        if build is None:
            raise UserError(f"no build found ({root / artifacts.LAST_BUILD_FILE}): run `trtpipe build RECIPE` first")
        return _repo_of(build, hint="RECIPE"), build
    if target.is_file() and target.suffix in (".yaml", ".yml"):
        from pipeline.recipe import load_recipe

        recipe = load_recipe(target)
        build = artifacts.default_build_dir(recipe.name or target.stem, root)
        return _repo_of(build, hint=str(target)), build
    if not target.exists():
        raise UserError(f"{target} does not exist: give a build directory, a model repository or a recipe")
    if (target / "triton_repo").is_dir() or (target / "quantize").is_dir() or (target / "engine").is_dir():
        return _repo_of(target, hint="RECIPE"), target
    if target.is_dir() and any(target.glob("*/config.pbtxt")):
        return target, (target.parent if (target.parent / "engine").is_dir() else None)
    raise UserError(f"{target} is neither a build directory nor a Triton model repository (no */config.pbtxt)")


def _repo_of(build: Path, hint: str) -> Path:
    repo = build / "triton_repo"
    if not any(repo.glob("*/config.pbtxt")):
        raise UserError(f"no model repository at {repo}: run `trtpipe build {hint}` first")
    return repo


def build_world_size(build: Path | None) -> int:
    """TP×PP of the build: the engine manifest's ``world_size``, else ``<build>/recipe.yaml``'s; 1 when unknown."""
    if build is None:
        return 1
    manifest = artifacts.read_manifest(build / "engine") or {}
    if manifest.get("world_size"):
        return int(manifest["world_size"])
    if not (build / "recipe.yaml").is_file():
        return 1
    from pipeline.recipe import load_recipe

    return load_recipe(build / "recipe.yaml").target.world_size


def check_runtime(repo: Path, build: Path | None, install: TritonInstall) -> list[str]:
    """Refuse artifacts this Triton cannot serve; returns warnings to show (may be empty).

    * CPU Triton + a repository using the C++ ``tensorrtllm`` backend → refused (GPU image needed).
    * GPU Triton + a TensorRT engine → ``pipeline.engine.tensorrt.check_engine_compatible(
      manifest, runtime_facts())``; any difference is refused.

    Raises:
        IncompatibleArtifactError: listing what differs.
    """
    uses_trtllm = any(_TRTLLM_BACKEND.search(p.read_text(errors="replace")) for p in repo.glob("*/config.pbtxt"))
    if install.kind == "cpu" and uses_trtllm:
        raise IncompatibleArtifactError(
            f"{repo} uses the tensorrtllm backend (a TensorRT-LLM GPU engine) and this machine has only the CPU "
            "Triton: serve it in the GPU deploy image (docs/deploy-gpu.md) or build a cpu recipe"
        )
    manifest = artifacts.read_manifest(build / "engine") if build is not None else None
    if install.kind != "gpu" or not uses_trtllm or manifest is None:
        return []
    try:
        from pipeline.engine.tensorrt import check_engine_compatible, runtime_facts
    except ImportError:
        return ["engine compatibility not checked: pipeline.engine.tensorrt.check_engine_compatible is missing"]
    problems = check_engine_compatible(manifest, runtime_facts(), stage_dir=build / "engine")
    if problems:
        raise IncompatibleArtifactError(
            f"engine {build / 'engine'} does not match this runtime: {'; '.join(problems)} "
            "— rebuild it here with `trtpipe build RECIPE --force`"
        )
    return []


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
