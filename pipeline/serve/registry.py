"""Detached servers: ``trtpipe serve --detach`` records its running server in ``artifacts/serve.json``.

The record (:func:`write_state`, written atomically) names the process (PID + start time, so a reused PID is
not taken for ours), its endpoints, its model repository and build, its log and its shared-memory prefix.
``trtpipe serve --status`` / ``--stop`` read it (:func:`read_state`, :func:`state_alive`, :func:`state_ready`,
:func:`stop_detached`); ``trtpipe bench`` takes the served build's tokenizer and provenance from it
(:func:`detached_build`).
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import TYPE_CHECKING, Any

from pipeline.core import artifacts
from pipeline.triton.process import http_ok, shm_regions, terminate_tree

if TYPE_CHECKING:
    from pipeline.triton.server import TritonServer

STATE_FILE = "serve.json"


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
    artifacts.write_atomic(path, json.dumps(state, indent=2) + "\n")
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
