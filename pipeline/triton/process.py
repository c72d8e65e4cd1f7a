"""Process, port and log helpers for a ``tritonserver`` (used by :mod:`pipeline.triton.server`).

Port checks before launch (:func:`check_ports_free`), stopping a server with its python stubs and
``/dev/shm`` regions (:func:`terminate_tree`), log excerpts without the harmless CPU warnings
(:func:`log_tail`, :func:`models_still_loading`), small HTTP probes (:func:`http_ok`,
:func:`repository_index`) and the processes and memory of a process tree (:func:`tree_processes`, :func:`tree_rss`).
"""

from __future__ import annotations

import errno
import json
import os
import re
import signal
import socket
import subprocess
import time
import urllib.error
import urllib.request
from collections.abc import Iterable
from pathlib import Path
from typing import Any

from pipeline.core.errors import UserError

#: default python-backend shared-memory region prefix of Triton (names under /dev/shm)
DEFAULT_SHM_PREFIX = "triton_python_backend_shm_region_"

#: substrings of log lines that every CPU start prints and that mean nothing there (docs/reference/cpu-stack.md §1)
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


#: a wildcard bind address → the loopback address a client on this machine connects to
_WILDCARD = {"0.0.0.0": "127.0.0.1", "": "127.0.0.1", "::": "::1"}


def client_host(bind_host: str) -> str:
    """Where a client on this machine reaches a server bound to ``bind_host`` (a wildcard becomes loopback)."""
    return _WILDCARD.get(bind_host, bind_host)


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


def is_harmless(line: str) -> bool:
    """True for the log lines every CPU start prints that mean nothing (docs/reference/cpu-stack.md §1)."""
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


def pick_free_port(host: str = "127.0.0.1") -> int:
    """A TCP port the OS reports free on ``host`` right now (for a server started with ports unset).

    Another process may take it before the server binds; :func:`check_ports_free` then refuses the
    launch with one line, so a collision is loud, never silent.
    """
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    with socket.socket(family, socket.SOCK_STREAM) as s:
        s.bind((host, 0))
        return int(s.getsockname()[1])


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


def tree_processes(pid: int) -> list[Any]:
    """``psutil.Process`` of ``pid`` and all its descendants now (empty when ``pid`` is gone); a member may
    still exit before it is read."""
    import psutil

    try:
        p = psutil.Process(pid)
        return [p, *p.children(recursive=True)]
    except psutil.NoSuchProcess:
        return []


def tree_rss(pid: int) -> int:
    """Resident memory of ``pid`` and all its descendants now, in bytes (0 when gone)."""
    import psutil

    total = 0
    for q in tree_processes(pid):
        try:
            total += q.memory_info().rss
        except psutil.NoSuchProcess:
            pass
    return total
