"""A served deployment recovers by itself when its engine process dies (issue #39).

``trtpipe serve`` watches what it serves: every :data:`INTERVAL_S` it checks that the server process runs and that its
python-backend stub processes are the ones it started with (:func:`pipeline.triton.health.stub_processes`: cheap, no
request). When a stub is gone or was replaced, and in any case every :data:`PROBE_EVERY_S`, it asks every model to
answer (:func:`pipeline.triton.health.probe`: Triton's model-ready API plus a one-token inference each) — not every
check, so that a benchmark of the deployment is not disturbed by the probes (on the 2-core CPU host three one-token
requests cost about as much as a decode step of the whole batch). When the server exited, or a model answered with an
error, or a model gave no answer :data:`TIMEOUTS_TO_RESTART` probes in a row, it restarts the server on the same ports,
log kept as ``<log>.before-restart``.

Why a restart and not a reload through Triton's model-control API: on this Triton (2.51, nvidia-pytriton) a SIGKILLed
python stub either leaves its model READY with requests that fail (``Stub process 'tensorrt_llm_0_0' is not healthy``)
or never end, or makes ``tritonserver`` itself abort (``boost::interprocess::lock_exception`` on the stub's shared
memory) — a reload cannot help the second, and in the first the old model version, holding its never-ending requests,
is never unloaded. A restart handles both; the streams in flight end with ``UNAVAILABLE`` (``trtpipe bench`` then
stops, writing partial results).

Foreground ``trtpipe serve``: :func:`serve_foreground` in the serving process. ``--detach``: a watcher process
(``python -m pipeline.serve.watch STATE_FILE``, :func:`spawn`) recorded in the state file as ``watcher``; it restarts the
server detached and rewrites the record; ``trtpipe serve --stop`` stops the watcher first, then the server.
"""

from __future__ import annotations

import os
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from pipeline.serve import registry
from pipeline.triton.health import ModelProblem, probe, stub_processes

#: seconds between two checks (process and stubs)
INTERVAL_S = 5.0
#: seconds between two inference probes while the stubs are unchanged (a hang without a dead process)
PROBE_EVERY_S = 60.0
#: consecutive checks with a model that does not answer in time (not an error) before a restart
TIMEOUTS_TO_RESTART = 3


class Health:
    """Consecutive check outcomes of one server: :meth:`check` returns why to restart now, or ``None``. A new server
    (after a restart) gets a new :class:`Health`."""

    def __init__(self) -> None:
        self.timeouts = 0
        self.stubs: dict[str, int] | None = None
        self.last_probe = time.monotonic()

    def check(self, alive: bool, http_url: str, grpc_url: str, server_pid: int | None = None) -> str | None:
        if not alive:
            return "the server process exited"
        stubs = stub_processes(server_pid) if server_pid else {}
        if self.stubs is None:
            self.stubs = stubs
        changed = any(stubs.get(name) != pid for name, pid in self.stubs.items())
        if not changed and time.monotonic() - self.last_probe < PROBE_EVERY_S:
            return None
        self.last_probe = time.monotonic()
        problems: list[ModelProblem] = probe(http_url, grpc_url)
        if changed and not problems:
            self.stubs = stubs  # Triton replaced the stub itself and the model answers
        if changed and problems:
            lost = [name for name, pid in self.stubs.items() if stubs.get(name) != pid]
            return f"stub process of {', '.join(lost)} died; not answering: " + ", ".join(str(p) for p in problems)
        if any(p.definitive for p in problems):
            self.timeouts = 0
            return "not answering: " + ", ".join(str(p) for p in problems)
        self.timeouts = self.timeouts + 1 if problems else 0
        if self.timeouts >= TIMEOUTS_TO_RESTART:
            self.timeouts = 0
            return f"not answering {TIMEOUTS_TO_RESTART} checks in a row: " + ", ".join(str(p) for p in problems)
        return None


def _keep_log(log_file: Path | str | None) -> None:
    if log_file and Path(log_file).is_file():
        os.replace(log_file, f"{log_file}.before-restart")


def serve_foreground(handle: Any, restart: Callable[[], Any], say: Callable[[str], None],
                     interval_s: float = INTERVAL_S) -> None:
    """Watch ``handle`` (a ready :class:`~pipeline.serve.stage.ServeHandle`) until Ctrl-C / SIGTERM
    (``KeyboardInterrupt``), replacing its server through ``restart()`` (a new ready handle) whenever it fails."""
    health = Health()
    while True:
        proc = handle.server.proc
        try:
            proc.wait(timeout=interval_s)
        except subprocess.TimeoutExpired:
            pass
        why = health.check(proc.poll() is None, handle.http_url, handle.grpc_url, handle.server.pid)
        if why is None:
            continue
        t0 = time.monotonic()
        say(f"[yellow]restarting[/]: {why}")
        handle.stop(grace_s=float(handle.server.exit_timeout_s) + 1)
        _keep_log(handle.server.log_file)
        new = restart()
        handle.server, handle.ready_s = new.server, new.ready_s
        health = Health()
        say(f"[green]recovered[/] in {time.monotonic() - t0:.1f} s (pid {handle.server.pid})")


def spawn(state_file: Path, admin_key: str | None) -> dict[str, Any]:
    """Start the watcher of the detached server recorded in ``state_file`` (its own session, output appended to
    ``<log>.watch``) and record it there as ``watcher``; returns the updated record. The admin key travels in its
    environment, never in the state file."""
    import psutil

    state = registry.read_state(state_file) or {}
    env = {**os.environ, "TRTPIPE_ADMIN_KEY": admin_key} if admin_key else dict(os.environ)
    log = Path(state.get("log_file") or state_file.with_suffix(".log")).with_suffix(".watch.log")
    with open(log, "ab") as out:
        proc = subprocess.Popen([sys.executable, "-m", "pipeline.serve.watch", str(state_file.resolve())], env=env,
                                stdin=subprocess.DEVNULL, stdout=out, stderr=subprocess.STDOUT, start_new_session=True,
                                cwd=os.getcwd())
    state["watcher"] = {"pid": proc.pid, "create_time": psutil.Process(proc.pid).create_time(), "log_file": str(log)}
    return registry.write_state(state_file, state)


def _restart_detached(state_file: Path, state: dict[str, Any]) -> dict[str, Any]:
    """Stop the recorded server (what is left of it), start it again detached with the same options, record it."""
    from pipeline.serve import stage as srv
    from pipeline.serve.compat import ServeTarget
    from pipeline.triton.process import terminate_tree

    if registry.state_alive(state):
        terminate_tree(int(state["pid"]), grace_s=float(state.get("exit_timeout_s", 5)) + 1, shm_prefix=state.get("shm_prefix"))
    _keep_log(state.get("log_file"))
    target = ServeTarget.resolve(Path(state.get("build_dir") or state["model_repository"]))
    options = srv.ServeOptions(http_port=state["http_port"], grpc_port=state["grpc_port"], metrics_port=state["metrics_port"],
                               host=state["host"], exit_timeout_s=int(state.get("exit_timeout_s", 5)),
                               log_file=Path(state["log_file"]) if state.get("log_file") else None,
                               admin_key=os.environ.get("TRTPIPE_ADMIN_KEY"), ready_timeout_s=600)
    handle = srv.run(target, options, die_with_parent=False)
    new = handle.detach(state_file)
    return registry.write_state(state_file, {**new, "watcher": state.get("watcher"),
                                             "restarts": int(state.get("restarts", 0)) + 1})


def watch_detached(state_file: Path, interval_s: float = INTERVAL_S) -> None:
    """The watcher process: check the recorded server every ``interval_s`` and restart it when it fails; ends when the
    state file is gone or names another watcher (``trtpipe serve --stop``, a new ``--detach``)."""
    health = Health()
    me = os.getpid()
    while True:
        time.sleep(interval_s)
        state = registry.read_state(state_file)
        if state is None or (state.get("watcher") or {}).get("pid") != me:
            return
        why = health.check(registry.state_alive(state), state["http_url"], state["grpc_url"], int(state["pid"]))
        if why is None:
            continue
        t0 = time.monotonic()
        print(f"{time.strftime('%Y-%m-%dT%H:%M:%S')} restarting pid {state['pid']}: {why}", flush=True)
        try:
            state = _restart_detached(state_file, state)
            health = Health()
            print(f"{time.strftime('%Y-%m-%dT%H:%M:%S')} recovered in {time.monotonic() - t0:.1f} s: pid {state['pid']}", flush=True)
        except Exception as e:  # noqa: BLE001 - keep watching: the next check tries again
            print(f"{time.strftime('%Y-%m-%dT%H:%M:%S')} restart failed: {' '.join(str(e).split())[:500]}", flush=True)


if __name__ == "__main__":
    from pipeline.serve.stage import raise_on_sigterm

    raise_on_sigterm()  # `serve --stop`: a restart in progress stops the server it was starting (serve.run)
    try:
        watch_detached(Path(sys.argv[1]))
    except KeyboardInterrupt:
        pass
