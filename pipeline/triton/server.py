"""The ``tritonserver`` process: where it comes from (:func:`find_triton`), its command line
(:func:`triton_command`) and its lifecycle (:class:`TritonServer`).

Two installations are supported:

* **GPU** — the Triton container of the release matrix (:func:`pipeline.trtllm.release.default_release`;
  ``/opt/tritonserver/bin/tritonserver`` with its own backends).
* **CPU** — the Triton 2.51 binary bundled in PyPI ``nvidia-pytriton==0.7.0``. It runs only when
  prepared as found in the CPU probes (docs/reference/cpu-stack.md §1): a backend directory holding
  ``python/`` = the bundled python backend + the stub of the running Python X.Y next to
  ``libtriton_python.so``; ``LD_LIBRARY_PATH`` = ``nvidia_pytriton.libs`` + the Python ``LIBDIR``;
  the venv's ``bin`` first on ``PATH`` (the stub finds its interpreter and site-packages there).

``TritonServer`` launches it in its own session with its output in a log file, waits for readiness
with a bound (a python stub that cannot start leaves the server "loading" forever), and stops it with
SIGTERM → short exit timeout → SIGKILL of the process group, leaving no stub process and no
``/dev/shm`` region behind::

    with TritonServer(repo) as srv:            # ports None: free ports are picked at start
        client = tritonclient.grpc.InferenceServerClient(srv.grpc_url)
"""

from __future__ import annotations

import dataclasses
import importlib.util
import os
import shutil
import sys
import sysconfig
import tempfile
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from pipeline.core.errors import MissingToolError, UserError
from pipeline.triton.process import (
    DEFAULT_SHM_PREFIX,
    check_ports_free,
    http_ok,
    log_tail,
    models_still_loading,
    pick_free_port,
    repository_index,
)
from pipeline.triton.server_process import ServerProcess

#: tritonserver inside the Triton container of the release matrix (pipeline/data/release_matrix.yaml)
CONTAINER_TRITONSERVER = Path("/opt/tritonserver/bin/tritonserver")
#: the model that ranks ≠ 0 load in a multi-rank launch (launch_triton_server.py --tensorrt_llm_model_name)
TRTLLM_MODEL_NAME = "tensorrt_llm"

@dataclasses.dataclass(frozen=True)
class TritonInstall:
    """One usable ``tritonserver``: its binary, extra flags it needs, and its environment.

    ``kind`` is ``"gpu"`` (container) or ``"cpu"`` (nvidia-pytriton). ``backend_dir`` and
    ``cache_dir`` are passed as ``--backend-directory``/``--cache-directory`` when set.
    ``env`` holds only the variables to override on top of ``os.environ``.
    """

    kind: str
    binary: Path
    backend_dir: Path | None = None
    cache_dir: Path | None = None
    env: dict[str, str] = dataclasses.field(default_factory=dict)

    def environ(self) -> dict[str, str]:
        """``os.environ`` with this installation's overrides applied."""
        return {**os.environ, **self.env}


def find_triton() -> TritonInstall:
    """The ``tritonserver`` to use: ``$TRTPIPE_TRITONSERVER``, the container's, or nvidia-pytriton's.

    Raises:
        MissingToolError: none is available (install ``trtpipe[cpu]`` or use the deploy image).
    """
    override = os.environ.get("TRTPIPE_TRITONSERVER")
    if override:
        return TritonInstall(kind="gpu", binary=Path(override))
    if CONTAINER_TRITONSERVER.is_file():
        return TritonInstall(kind="gpu", binary=CONTAINER_TRITONSERVER)
    return cpu_triton()


def _pytriton_root() -> Path | None:
    spec = importlib.util.find_spec("pytriton")
    if spec is None or not spec.submodule_search_locations:
        return None
    return Path(list(spec.submodule_search_locations)[0])


def cpu_triton(cache_root: Path | None = None) -> TritonInstall:
    """The nvidia-pytriton Triton prepared for this Python (docs/reference/cpu-stack.md §1 steps 1–3).

    The backend directory is prepared once per (pytriton version, Python X.Y) under
    ``<cache>/triton_backends/`` (written atomically) and reused afterwards.

    Raises:
        MissingToolError: nvidia-pytriton is not installed, or lacks a stub for this Python.
    """
    from pipeline.core import artifacts

    root = _pytriton_root()
    if root is None or not (root / "tritonserver" / "bin" / "tritonserver").is_file():
        raise MissingToolError(
            "no tritonserver here: install the CPU server with `pip install 'trtpipe[cpu]'` (nvidia-pytriton 0.7.0) "
            "or run in the GPU deploy image (docs/deploy-gpu.md)"
        )
    ts = root / "tritonserver"
    pyver = f"{sys.version_info.major}.{sys.version_info.minor}"
    stub = ts / "python_backend_stubs" / pyver / "triton_python_backend_stub"
    if not stub.is_file():
        raise MissingToolError(f"nvidia-pytriton has no python-backend stub for Python {pyver} ({stub})")
    try:
        from importlib import metadata

        version = metadata.version("nvidia-pytriton")
    except Exception:  # noqa: BLE001 - only used to name the cache dir
        version = "unknown"
    cache_root = cache_root or artifacts.cache_dir()
    backend_dir = cache_root / "triton_backends" / f"pytriton-{version}-py{pyver}"
    if not (backend_dir / "python" / "triton_python_backend_stub").is_file():
        with artifacts.atomic_dir(backend_dir) as tmp:
            shutil.copytree(ts / "backends" / "python", tmp / "python", ignore=shutil.ignore_patterns("__pycache__"))
            shutil.copy2(stub, tmp / "python" / "triton_python_backend_stub")
    libs = [str(root.parent / "nvidia_pytriton.libs"), str(sysconfig.get_config_var("LIBDIR") or "")]
    if os.environ.get("LD_LIBRARY_PATH"):
        libs.append(os.environ["LD_LIBRARY_PATH"])
    path = [str(Path(sys.executable).parent), os.environ.get("PATH", "")]
    env = {"LD_LIBRARY_PATH": os.pathsep.join(p for p in libs if p), "PATH": os.pathsep.join(p for p in path if p)}
    return TritonInstall(kind="cpu", binary=ts / "bin" / "tritonserver", backend_dir=backend_dir, cache_dir=ts / "caches", env=env)


def triton_command(
    binary: Path | str,
    model_repository: Path | str,
    *,
    http_port: int = 8000,
    grpc_port: int = 8001,
    metrics_port: int = 8002,
    host: str = "127.0.0.1",
    exit_timeout_s: int = 5,
    world_size: int = 1,
    shm_prefix: str = DEFAULT_SHM_PREFIX,
    backend_dir: Path | None = None,
    cache_dir: Path | None = None,
    log_verbose: int = 0,
    extra_args: Sequence[str] = (),
    load_models: Sequence[str] = (TRTLLM_MODEL_NAME,),
    cuda_pool_gpu0_bytes: int = 0,
) -> list[str]:
    """The argv that starts Triton on ``model_repository``.

    ``world_size == 1``: one ``tritonserver`` process. ``world_size > 1`` (TensorRT-LLM TP×PP):
    ``mpirun --allow-run-as-root -n 1 tritonserver … : -n 1 tritonserver …`` with one app context
    per rank, as ``launch_triton_server.py`` generates it: every rank gets
    ``--disable-auto-complete-config --backend-config=python,shm-region-prefix-name=<prefix>{i}_``
    and ranks ≠ 0 add ``--model-control-mode=explicit --load-model=tensorrt_llm``.
    ``host`` is passed as ``--http-address/--grpc-address/--metrics-address``.
    ``load_models`` / ``cuda_pool_gpu0_bytes``: what ``launch_triton_server.py --tensorrt_llm_model_name A,B
    --multimodal_gpu0_cuda_mem_pool_bytes N`` makes of them (scripts/launch_triton_server.py@c2e65b88d852:173-182):
    ranks ≠ 0 load each of ``load_models``, rank 0 gets ``--cuda-memory-pool-byte-size=0:N`` when N ≠ 0 (the
    multimodal repository: ``pipeline.triton_repo.vision.tritonserver_options``).
    """
    if world_size < 1:
        raise ValueError(f"world_size must be >= 1, got {world_size}")
    cmd: list[str] = ["mpirun", "--allow-run-as-root"] if world_size > 1 else []
    for rank in range(world_size):
        if world_size > 1:
            cmd += ["-n", "1"]
        prefix = f"{shm_prefix}{rank}_" if world_size > 1 else shm_prefix
        cmd += [
            str(binary),
            f"--model-repository={model_repository}",
            f"--http-port={http_port}",
            f"--grpc-port={grpc_port}",
            f"--metrics-port={metrics_port}",
            f"--http-address={host}",
            f"--grpc-address={host}",
            f"--metrics-address={host}",
            f"--exit-timeout-secs={exit_timeout_s}",
            f"--log-verbose={log_verbose}",
        ]
        if backend_dir is not None:
            cmd.append(f"--backend-directory={backend_dir}")
        if cache_dir is not None:
            cmd.append(f"--cache-directory={cache_dir}")
        if rank != 0:
            cmd += ["--model-control-mode=explicit", *(f"--load-model={m}" for m in load_models)]
        elif cuda_pool_gpu0_bytes:
            cmd.append(f"--cuda-memory-pool-byte-size=0:{int(cuda_pool_gpu0_bytes)}")
        cmd += ["--disable-auto-complete-config", f"--backend-config=python,shm-region-prefix-name={prefix}"]
        cmd += list(extra_args)
        if world_size > 1 and rank != world_size - 1:
            cmd.append(":")
    return cmd


class TritonServer(ServerProcess):
    """One ``tritonserver`` process (or ``mpirun`` of ``world_size`` ranks) on ``model_repository``.

    Args:
        model_repository: directory with ``<model>/config.pbtxt`` entries.
        http_port, grpc_port, metrics_port: Triton's ports (defaults 8000/8001/8002); ``None`` picks a port
            the OS reports free (:func:`~pipeline.triton.process.pick_free_port`).
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
    :meth:`start`, :meth:`wait_ready`, :meth:`stop` yourself (:class:`~pipeline.triton.server_process.ServerProcess`).
    """

    NAME = "tritonserver"
    POLL_S = 0.1

    def __init__(
        self,
        model_repository: Path,
        *,
        http_port: int | None = 8000,
        grpc_port: int | None = 8001,
        metrics_port: int | None = 8002,
        host: str = "127.0.0.1",
        log_file: Path | None = None,
        exit_timeout_s: int = 5,
        extra_args: Sequence[str] = (),
        world_size: int = 1,
        install: TritonInstall | None = None,
        ready_timeout_s: float = 120.0,
        die_with_parent: bool = True,
        launch: dict | None = None,
    ) -> None:
        #: ``load_models`` / ``cuda_pool_gpu0_bytes`` of :func:`triton_command` (the multimodal repository's)
        self.launch = dict(launch or {})
        self.model_repository = Path(model_repository).resolve()
        self.host = host
        self.http_port, self.grpc_port, self.metrics_port = (
            int(p) if p is not None else pick_free_port(host) for p in (http_port, grpc_port, metrics_port)
        )
        self.log_file = Path(log_file) if log_file is not None else None
        self.exit_timeout_s = int(exit_timeout_s)
        self.extra_args = tuple(extra_args)
        self.world_size = int(world_size)
        self.install = install
        self.ready_timeout_s = ready_timeout_s
        self.die_with_parent = die_with_parent
        #: prefix of this server's python-backend regions in /dev/shm (Triton appends a UUID)
        self.shm_prefix = f"trtpipe_{os.getpid()}_{self.grpc_port}_"
        self._init_process()

    # ------------------------------------------------------------------ endpoints
    @property
    def pid(self) -> int | None:
        """PID of the launched process (= its process group id), or ``None`` before start and after :meth:`detach`."""
        return self.proc.pid if self.proc else None

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
            cache_dir=inst.cache_dir, extra_args=self.extra_args, **self.launch,
        )

    def _prepare(self) -> None:
        """The repository exists, the three ports are free, the install is found, and a log file is named (a new
        file in the temp dir when none was given).

        Raises:
            UserError: no model repository at the path, or a port is taken.
            MissingToolError: no ``tritonserver`` on this machine.
        """
        if not self.model_repository.is_dir():
            raise UserError(f"no model repository at {self.model_repository}")
        check_ports_free(self.host, {"http": self.http_port, "grpc": self.grpc_port, "metrics": self.metrics_port})
        self.install = self.install or find_triton()
        if self.log_file is None:
            fd, name = tempfile.mkstemp(prefix=f"tritonserver-{self.grpc_port}-", suffix=".log")
            os.close(fd)
            self.log_file = Path(name)

    def _popen_kwargs(self) -> dict[str, Any]:
        assert self.install is not None
        return {"env": self.install.environ(), "cwd": self.model_repository}

    def is_ready(self) -> bool:
        """One readiness probe: ``GET /v2/health/ready`` is 200 (all models ready, strict readiness)."""
        return http_ok(f"http://{self.http_url}/v2/health/ready")

    def _exited_message(self, rc: int) -> str:
        return f"tritonserver exited with status {rc} before it was ready (log: {self.log_file})" + self.log_excerpt()

    def _pending(self) -> str:
        """The models not yet READY (the repository index, else the log's ``loading`` lines)."""
        pending = [f"{m.get('name')} ({m.get('state') or 'UNKNOWN'})" for m in self.models() if m.get("state") != "READY"]
        pending = pending or [f"{name} (LOADING)" for name in models_still_loading(self.log_file)]
        return f"; not ready: {', '.join(pending)}" if pending else ""

    def _not_ready_message(self, timeout_s: float, pending: str) -> str:
        return f"tritonserver not ready after {timeout_s:g} s{pending} (log: {self.log_file})" + self.log_excerpt()

    def models(self) -> list[dict[str, Any]]:
        """The repository index (``[{name, version, state, reason}]``); ``[]`` when unreachable."""
        return repository_index(self.http_url)

    def log_excerpt(self) -> str:
        """``"\n--- last lines of LOG ---\n…"`` (harmless CPU warnings dropped), or ``""``."""
        tail = log_tail(self.log_file)
        return f"\n--- last lines of {self.log_file} ---\n{tail}" if tail else ""
