"""Detached servers: ``trtpipe serve --detach`` records its running server in ``artifacts/serve.json``.

One record describes either frontend (``frontend``: ``triton`` or ``trtllm-serve``): the process (PID, process group
and start time, so a reused PID is not taken for ours), its endpoints (``http_url``, ``health_url``; Triton's
``grpc_url``/``metrics_url``; trtllm-serve's OpenAI ``openai_url``), what it serves (the build, Triton's model
repository or trtllm-serve's command line), its log and, for Triton, its shared-memory prefix. Records written
before the ``frontend`` field existed are Triton's. Built by :func:`triton_record` / :func:`trtllm_serve_record`,
written atomically by :func:`write_state`; ``trtpipe serve --status`` / ``--stop`` read it (:func:`read_state`,
:func:`state_alive`, :func:`state_ready`, :func:`describe`, :func:`stop_detached`); ``trtpipe bench`` takes the
served build's tokenizer and provenance from it (:func:`detached_build`).
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import TYPE_CHECKING, Any

from pipeline.core import artifacts
from pipeline.recipe.serving_path import TRITON, TRTLLM_SERVE, serves_with_triton
from pipeline.triton.process import http_ok, shm_regions, terminate_tree

if TYPE_CHECKING:
    from pipeline.serve.trtllm_process import TrtllmServeProcess
    from pipeline.triton.server import TritonServer

STATE_FILE = "serve.json"


def state_path(root: Path = artifacts.DEFAULT_ARTIFACTS_ROOT) -> Path:
    """``artifacts/serve.json``: the server started by ``trtpipe serve --detach``."""
    return Path(root) / STATE_FILE


def _process(pid: int, build: Path | None, log_file: Path | None) -> dict[str, Any]:
    import psutil

    try:
        pgid = os.getpgid(pid)
    except OSError:
        pgid = None
    return {"pid": pid, "pgid": pgid, "create_time": psutil.Process(pid).create_time(),
            "build_dir": str(build.resolve()) if build else None,
            "log_file": str(Path(log_file).resolve()) if log_file else None, "started_at": artifacts.utc_now()}


def triton_record(server: TritonServer, build: Path | None) -> dict[str, Any]:
    """The record of a ready ``tritonserver`` (``build``: its build directory, ``None`` for a bare repository)."""
    return {"frontend": TRITON, **_process(server.pid, build, server.log_file), "host": server.host,
            "http_port": server.http_port, "grpc_port": server.grpc_port, "metrics_port": server.metrics_port,
            "grpc_url": server.grpc_url, "http_url": server.http_url, "metrics_url": server.metrics_url,
            "health_url": f"http://{server.http_url}/v2/health/ready", "model_repository": str(server.model_repository),
            "shm_prefix": server.shm_prefix, "exit_timeout_s": server.exit_timeout_s, "ready_s": round(server.ready_s or 0.0, 3)}


def trtllm_serve_record(proc: TrtllmServeProcess, build: Path | None) -> dict[str, Any]:
    """The record of a ready trtllm-serve (the real binary or trtpipe's CPU stand-in, ``proc.argv`` says which)."""
    return {"frontend": TRTLLM_SERVE, **_process(proc.pid, build, proc.log_file), "host": proc.host,
            "http_port": proc.port, "grpc_port": None, "grpc_url": None, "http_url": proc.http_url, "metrics_url": None,
            "health_url": proc.health_url, "openai_url": proc.openai_url, "command": list(proc.argv),
            "shm_prefix": None, "exit_timeout_s": proc.exit_timeout_s, "ready_s": round(proc.ready_s or 0.0, 3)}


def write_state(path: Path, state: dict[str, Any]) -> dict[str, Any]:
    """Write ``state`` (a :func:`triton_record` / :func:`trtllm_serve_record`) to ``path`` atomically; returns it."""
    artifacts.write_atomic(path, json.dumps(state, indent=2) + "\n")
    return state


def read_state(path: Path) -> dict[str, Any] | None:
    """The recorded detached server, or ``None`` (no file / unreadable)."""
    try:
        return json.loads(Path(path).read_text())
    except (OSError, ValueError):
        return None


def frontend_of(state: dict[str, Any]) -> str:
    """``triton`` or ``trtllm-serve`` (records without the field are Triton's)."""
    return state.get("frontend") or TRITON


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


def detached_build(url: str, root: Path = artifacts.DEFAULT_ARTIFACTS_ROOT, *, frontend: str | None = None) -> Path | None:
    """The build directory the detached server (``trtpipe serve --detach``, ``artifacts/serve.json`` under ``root``)
    serves, when that server is still running, ``url`` (gRPC ``host:port``, ``http://host:port`` or an OpenAI base
    ``http://host:port/v1``) reaches it and, with ``frontend``, it is that frontend; else ``None``. ``trtpipe bench``
    takes its tokenizer and provenance from it: the last build need not be the one being served."""
    state = read_state(state_path(root))
    if not state or not state.get("build_dir") or not state_alive(state):
        return None
    if frontend is not None and frontend_of(state) != frontend:
        return None
    target = _host_port(url)
    ours = {_host_port(state.get("grpc_url") or ""), _host_port(f"http://{state.get('http_url') or ''}")}
    build = Path(state["build_dir"])
    return build if target is not None and target in ours and build.is_dir() else None


def state_ready(state: dict[str, Any]) -> bool:
    """One readiness probe of the recorded server: Triton's ``/v2/health/ready`` or trtllm-serve's ``/health`` is 200."""
    return http_ok(state.get("health_url") or f"http://{state['http_url']}/v2/health/ready")


def not_answering(state: dict[str, Any]) -> list[str]:
    """What does not answer on the recorded server (``[]``: all answers): for Triton every model of its repository
    (model-ready API and a one-token inference, :func:`pipeline.triton.health.probe`), for trtllm-serve ``/health``."""
    if not serves_with_triton(frontend_of(state)):
        return [] if state_ready(state) else [f"server ({state.get('health_url')} does not answer 200)"]
    from pipeline.triton.health import probe

    return [str(p) for p in probe(state["http_url"], state["grpc_url"])]


def _stop_watcher(state: dict[str, Any]) -> None:
    """Stop the watcher of a detached server (:mod:`pipeline.serve.watch`) first, so that it restarts nothing."""
    import psutil

    watcher = state.get("watcher") or {}
    if not watcher or not state_alive(watcher):
        return
    p = psutil.Process(int(watcher["pid"]))
    p.terminate()  # SIGTERM: a restart in progress stops the server it was starting
    try:
        p.wait(15)
    except psutil.TimeoutExpired:
        p.kill()


def describe(state: dict[str, Any]) -> str:
    """The recorded server's endpoints, what it serves, its log and start time: one ``name value`` line each."""
    rows = [("frontend", frontend_of(state)), ("build", state.get("build_dir") or "—")]
    if serves_with_triton(frontend_of(state)):
        rows += [("gRPC", state.get("grpc_url")), ("HTTP", f"http://{state.get('http_url')}"),
                 ("repo", state.get("model_repository"))]
    else:
        rows += [("OpenAI", state.get("openai_url")), ("health", state.get("health_url"))]
    rows += [("log", state.get("log_file")), ("since", state.get("started_at"))]
    if state.get("watcher"):
        rows.append(("watcher", f"pid {state['watcher'].get('pid')}, {state.get('restarts', 0)} restart(s), log {state['watcher'].get('log_file')}"))
    return "\n".join(f"  {name:<8} {value}" for name, value in rows)


def stop_detached(path: Path, grace_s: float | None = None) -> tuple[dict[str, Any] | None, bool]:
    """Stop the server recorded in ``path`` (SIGTERM, then SIGKILL of its process group after the grace period,
    default its exit timeout + 5 s) and remove the file.

    Returns ``(state, was_running)``; ``(None, False)`` when nothing is recorded. A stale record
    (process gone or PID reused) is just removed; Triton's shm regions are cleaned either way.
    """
    state = read_state(path)
    if state is None:
        return None, False
    _stop_watcher(state)
    state = read_state(path) or state  # the watcher may have restarted the server: its new record
    running = state_alive(state)
    if running:
        grace = float(state.get("exit_timeout_s", 5)) + 5 if grace_s is None else grace_s
        terminate_tree(int(state["pid"]), grace_s=grace, shm_prefix=state.get("shm_prefix"))
    elif state.get("shm_prefix"):
        for region in shm_regions(state["shm_prefix"]):
            region.unlink(missing_ok=True)
    Path(path).unlink(missing_ok=True)
    return state, running
