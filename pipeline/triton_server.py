"""Where ``tritonserver`` comes from and how it is launched (pure helpers for :mod:`pipeline.serve`).

Two installations are supported (:func:`find_triton`):

* **GPU** — the pinned container ``nvcr.io/nvidia/tritonserver:25.12-trtllm-python-py3``
  (``/opt/tritonserver/bin/tritonserver``, its own backends; TensorRT-LLM 1.2.1).
* **CPU** — the Triton 2.51 binary bundled in PyPI ``nvidia-pytriton==0.7.0``. It runs only when
  prepared as found in the CPU probes (reference cpu-stack.md §1): a backend directory holding
  ``python/`` = the bundled python backend + the stub of the running Python X.Y next to
  ``libtriton_python.so``; ``LD_LIBRARY_PATH`` = ``nvidia_pytriton.libs`` + the Python ``LIBDIR``;
  the venv's ``bin`` first on ``PATH`` (the stub finds its interpreter and site-packages there).

:func:`triton_command` builds the argv, including the ``mpirun -n 1 … : -n 1 …`` form of
TensorRT-LLM's ``launch_triton_server.py`` for world size > 1 (reference
triton-model-repository.md §3.5). The rest are process helpers: port checks before launch
(:func:`check_ports_free`), stopping a server with its stubs and ``/dev/shm`` regions
(:func:`terminate_tree`), log excerpts without the harmless CPU warnings (:func:`log_tail`) and
small HTTP probes (:func:`http_ok`, :func:`repository_index`).
"""

from __future__ import annotations

import dataclasses
import errno
import importlib.util
import json
import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import sysconfig
import time
import urllib.error
import urllib.request
from collections.abc import Iterable, Sequence
from pathlib import Path
from typing import Any

from pipeline.errors import MissingToolError, UserError

#: tritonserver of the pinned GPU deploy image (Dockerfile: nvcr.io/nvidia/tritonserver:25.12-trtllm-python-py3)
CONTAINER_TRITONSERVER = Path("/opt/tritonserver/bin/tritonserver")
#: the model that ranks ≠ 0 load in a multi-rank launch (launch_triton_server.py --tensorrt_llm_model_name)
TRTLLM_MODEL_NAME = "tensorrt_llm"
#: default python-backend shared-memory region prefix of Triton (names under /dev/shm)
DEFAULT_SHM_PREFIX = "triton_python_backend_shm_region_"

#: substrings of log lines that every CPU start prints and that mean nothing there (cpu-stack.md §1)
HARMLESS_CPU_LINES = (
    "pinned memory",
    "CUDA driver",
    "cuda driver",
    "Failed to initialize NVML",
    "DCGM unable to start",
    "unable to create stream for ensemble",
    "CUDA memory pool",
    "Unable to allocate pinned system memory",
    "GPU metrics",
    "CudaDriverHelper has not been initialized",
)


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
    """The nvidia-pytriton Triton prepared for this Python (cpu-stack.md §1 steps 1–3).

    The backend directory is prepared once per (pytriton version, Python X.Y) under
    ``<cache>/triton_backends/`` (written atomically) and reused afterwards.

    Raises:
        MissingToolError: nvidia-pytriton is not installed, or lacks a stub for this Python.
    """
    from pipeline import artifacts

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


def die_with_parent() -> None:
    """``preexec_fn``: have the kernel send SIGTERM to the child when its parent dies (Linux).

    A test or a foreground ``trtpipe serve`` that is killed outright then cannot leave an orphaned
    server behind; Triton's SIGTERM handling stops it gracefully. Not used for ``--detach``.
    """
    import ctypes

    pr_set_pdeathsig = 1
    try:
        ctypes.CDLL("libc.so.6", use_errno=True).prctl(pr_set_pdeathsig, int(signal.SIGTERM))
    except OSError:
        pass


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
) -> list[str]:
    """The argv that starts Triton on ``model_repository``.

    ``world_size == 1``: one ``tritonserver`` process. ``world_size > 1`` (TensorRT-LLM TP×PP):
    ``mpirun --allow-run-as-root -n 1 tritonserver … : -n 1 tritonserver …`` with one app context
    per rank, as ``launch_triton_server.py`` generates it: every rank gets
    ``--disable-auto-complete-config --backend-config=python,shm-region-prefix-name=<prefix>{i}_``
    and ranks ≠ 0 add ``--model-control-mode=explicit --load-model=tensorrt_llm``.
    ``host`` is passed as ``--http-address/--grpc-address/--metrics-address``.
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
            cmd += ["--model-control-mode=explicit", f"--load-model={TRTLLM_MODEL_NAME}"]
        cmd += ["--disable-auto-complete-config", f"--backend-config=python,shm-region-prefix-name={prefix}"]
        cmd += list(extra_args)
        if world_size > 1 and rank != world_size - 1:
            cmd.append(":")
    return cmd


def is_harmless(line: str) -> bool:
    """True for the log lines every CPU start prints that mean nothing (cpu-stack.md §1)."""
    return any(s in line for s in HARMLESS_CPU_LINES)


def log_tail(log_file: Path | None, lines: int = 25, *, drop_harmless: bool = True) -> str:
    """The last ``lines`` lines of a server log, or ``""``.

    Blank lines, Triton's ASCII tables (``+---``/``| …``) and, with ``drop_harmless``, the harmless
    CPU warnings are left out, so that the tail shows the error (e.g. a protobuf parse error).
    """
    if log_file is None:
        return ""
    try:
        text = Path(log_file).read_text(errors="replace")
    except OSError:
        return ""
    kept: Iterable[str] = (
        ln for ln in text.splitlines()
        if ln.strip() and ln[:1] not in "+|" and not (drop_harmless and is_harmless(ln))
    )
    return "\n".join(list(kept)[-lines:])


_LOADING = re.compile(r'"loading: ([^:"]+):\d+"')
_LOADED = re.compile(r"successfully loaded '([^']+)'|failed to load '([^']+)'")


def models_still_loading(log_file: Path | None) -> list[str]:
    """Models the log shows as ``loading`` but neither loaded nor failed (in log order).

    Before all models are loaded (model-control mode ``none``) Triton's endpoints are not up
    yet, so the log is the only place that tells which model a stuck start waits for.
    """
    try:
        text = Path(log_file).read_text(errors="replace") if log_file else ""
    except OSError:
        return []
    loading = dict.fromkeys(_LOADING.findall(text))
    for done in _LOADED.findall(text):
        for name in done:
            loading.pop(name, None)
    return list(loading)


def shm_regions(prefix: str, shm_dir: Path = Path("/dev/shm")) -> list[Path]:
    """Python-backend shared-memory regions under ``shm_dir`` whose name starts with ``prefix``."""
    try:
        return sorted(p for p in shm_dir.iterdir() if p.name.startswith(prefix))
    except OSError:
        return []


def check_ports_free(host: str, ports: dict[str, int]) -> None:
    """Refuse to launch when a port is taken (gRPC binds with SO_REUSEPORT and would not notice).

    Args:
        host: the bind address Triton will use.
        ports: ``{"http": 8000, "grpc": 8001, "metrics": 8002}``.

    Raises:
        UserError: two ports are equal, or one is already in use (one line naming it).
    """
    seen: dict[int, str] = {}
    for name, port in ports.items():
        if port in seen:
            raise UserError(f"--{name}-port {port} is the same as --{seen[port]}-port: give each endpoint its own port")
        seen[port] = name
        family = socket.AF_INET6 if ":" in host else socket.AF_INET
        with socket.socket(family, socket.SOCK_STREAM) as s:
            s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            try:
                s.bind((host, port))
            except OSError as e:
                if e.errno == errno.EADDRINUSE:
                    raise UserError(
                        f"port {port} ({name}) is already in use on {host}: stop what listens there "
                        f"(`trtpipe serve --status`) or pick another with --{name}-port"
                    ) from None
                raise UserError(f"cannot bind {name} port {port} on {host}: {e.strerror}") from None


def terminate_tree(pid: int, *, grace_s: float, proc: subprocess.Popen | None = None, shm_prefix: str | None = None) -> int | None:
    """Stop a server started in its own session: SIGTERM, wait ``grace_s``, then SIGKILL the group.

    The python-backend stubs (children of ``pid``) are recorded first and killed if they outlive
    the server; ``/dev/shm`` regions starting with ``shm_prefix`` are removed afterwards (a killed
    server cannot remove them itself). ``proc`` (when we are the parent) is used to reap the exit
    status; if it has already exited, only its leftovers are cleaned. Returns the server's exit
    status when known (negative = killed by that signal; ``None`` for a process we did not start).
    """
    import psutil

    if proc is not None and proc.poll() is not None:
        # Already exited and reaped: never signal its PID again (it may be reused), but its process
        # group cannot be reused while a member (a stray stub) still lives.
        _killpg(pid)
        _remove_shm(shm_prefix)
        return proc.returncode
    try:
        main = psutil.Process(pid)
        children = main.children(recursive=True)
    except psutil.NoSuchProcess:
        main, children = None, []
    rc: int | None = None
    if main is not None:
        try:
            main.send_signal(signal.SIGTERM)
        except psutil.NoSuchProcess:
            pass
        rc = _wait(main, proc, grace_s)
        if rc is None and main.is_running():
            _killpg(pid)
            rc = _wait(main, proc, 5.0)
    _, alive = psutil.wait_procs(children, timeout=1.0)
    for c in alive:
        try:
            c.kill()
        except psutil.NoSuchProcess:
            pass
    psutil.wait_procs(alive, timeout=2.0)
    _remove_shm(shm_prefix)
    return rc


def _remove_shm(shm_prefix: str | None) -> None:
    for region in shm_regions(shm_prefix) if shm_prefix else []:
        try:
            region.unlink()
        except OSError:
            pass


def _wait(main, proc: subprocess.Popen | None, timeout: float) -> int | None:
    import psutil

    try:
        if proc is not None:
            return proc.wait(timeout)
        return main.wait(timeout)
    except (subprocess.TimeoutExpired, psutil.TimeoutExpired):
        return None
    except psutil.NoSuchProcess:
        return None


def _killpg(pgid: int) -> None:
    try:
        os.killpg(pgid, signal.SIGKILL)
    except (ProcessLookupError, PermissionError):
        pass
    time.sleep(0.05)


def free_port(host: str = "127.0.0.1") -> int:
    """A TCP port that is free on ``host`` right now (for tests; the OS picks it)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind((host, 0))
        return s.getsockname()[1]


def http_ok(url: str, timeout: float = 1.0) -> bool:
    """True when ``GET url`` answers 200 within ``timeout`` seconds."""
    try:
        with urllib.request.urlopen(url, timeout=timeout) as r:
            return r.status == 200
    except (urllib.error.URLError, OSError, ValueError):
        return False


def repository_index(http_url: str) -> list[dict[str, Any]]:
    """Triton's ``POST /v2/repository/index`` at ``host:port``: ``[{name, version, state, reason}]``; ``[]`` on error."""
    req = urllib.request.Request(f"http://{http_url}/v2/repository/index", data=b"{}", method="POST")
    try:
        with urllib.request.urlopen(req, timeout=2.0) as r:
            return list(json.loads(r.read()))
    except (urllib.error.URLError, OSError, ValueError):
        return []


def tree_rss(pid: int) -> int:
    """Resident memory of ``pid`` and all its descendants now, in bytes (0 when gone)."""
    import psutil

    try:
        p = psutil.Process(pid)
        procs = [p, *p.children(recursive=True)]
    except psutil.NoSuchProcess:
        return 0
    total = 0
    for q in procs:
        try:
            total += q.memory_info().rss
        except psutil.NoSuchProcess:
            pass
    return total
