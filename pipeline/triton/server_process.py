"""One server process's lifecycle, shared by ``tritonserver`` (:class:`pipeline.triton.server.TritonServer`) and
``trtllm-serve`` / its CPU stand-in (:class:`pipeline.serve.trtllm_process.TrtllmServeProcess`).

:class:`ServerProcess` starts the server in its own session (its own process group, output to a log file, SIGTERM'd by
the kernel when the starting thread dies unless ``die_with_parent`` is False), polls one readiness probe until it
answers or the process exits or a deadline passes (the group is stopped first, then one :class:`StageError` line),
and stops the whole group (SIGTERM, a grace period, SIGKILL; :func:`pipeline.triton.process.terminate_tree`). A
subclass says what differs: :meth:`command`, the checks before launch (:meth:`_prepare`), the environment and working
directory, :meth:`is_ready`, and the wording of the two failures.
"""

from __future__ import annotations

import subprocess
import time
from pathlib import Path
from typing import Any, Self

from pipeline.core.errors import StageError
from pipeline.triton.process import (
    client_host,
    die_with_parent,
    terminate_tree,
    tree_rss,
)


class ServerProcess:
    """A server child process: :meth:`start`, :meth:`wait_ready`, :meth:`stop`, :meth:`detach`, :meth:`wait`, and the
    context-manager form (start + ``wait_ready(ready_timeout_s)`` on enter, stop on exit).

    Attributes a subclass sets in its ``__init__`` before calling :meth:`_init_process`: ``host`` (bind address),
    ``log_file`` (``Path``; ``None`` until :meth:`_prepare` picks one), ``exit_timeout_s`` (s the server may finish
    in-flight work after SIGTERM; :meth:`stop` waits that + 5 s), ``die_with_parent``, ``ready_timeout_s`` (s),
    ``shm_prefix`` (``/dev/shm`` regions removed after stopping, or ``None``).
    """

    #: what the messages call the server (``tritonserver``, ``trtllm-serve``)
    NAME = "server"
    #: seconds between two readiness probes
    POLL_S = 0.1

    host: str
    log_file: Path | None
    exit_timeout_s: float
    die_with_parent: bool
    ready_timeout_s: float = 120.0
    shm_prefix: str | None = None

    def _init_process(self) -> None:
        """The process state (not started)."""
        self.proc: subprocess.Popen | None = None
        self.started_at: float | None = None
        self.ready_s: float | None = None
        self._pid: int | None = None

    # ------------------------------------------------------------------ what a subclass says
    def command(self) -> list[str]:
        """The argv :meth:`start` runs."""
        raise NotImplementedError

    def _prepare(self) -> None:
        """Checks before launch (ports free, inputs present), and ``log_file`` when none was given.

        Raises:
            UserError: (subclasses) a port is taken or an input is missing; nothing is launched.
        """

    def _popen_kwargs(self) -> dict[str, Any]:
        """Extra ``subprocess.Popen`` arguments (``env``, ``cwd``)."""
        return {}

    def is_ready(self) -> bool:
        """One readiness probe."""
        raise NotImplementedError

    def _exited_message(self, rc: int) -> str:
        """The error line when the process exited (status ``rc``) before it was ready (after it was stopped)."""
        return f"{self.NAME} exited with status {rc} before it was ready (log: {self.log_file})"

    def _pending(self) -> str:
        """What the server still waits for, asked at the deadline while it still runs (``""``: nothing to say)."""
        return ""

    def _not_ready_message(self, timeout_s: float, pending: str) -> str:
        """The error line when it was not ready within ``timeout_s`` s (after it was stopped; ``pending``: what
        :meth:`_pending` said)."""
        return f"{self.NAME} not ready after {timeout_s:g} s{pending} (log: {self.log_file})"

    # ------------------------------------------------------------------ the lifecycle
    @property
    def pid(self) -> int | None:
        """The server's PID (= its process group id), or ``None`` before start."""
        return self._pid

    @property
    def client_host(self) -> str:
        """Where a client on this machine reaches the server (a wildcard bind address becomes loopback)."""
        return client_host(self.host)

    def start(self) -> Self:
        """Launch the server in a new session (its own process group), output to :attr:`log_file`; returns at once.

        Raises:
            RuntimeError: already started.
            UserError / MissingToolError: from :meth:`_prepare` (nothing is launched).
        """
        if self.proc is not None:
            raise RuntimeError(f"{type(self).__name__} already started")
        self._prepare()
        cmd = self.command()
        assert self.log_file is not None
        self.log_file.parent.mkdir(parents=True, exist_ok=True)
        with open(self.log_file, "wb") as log:
            self.proc = subprocess.Popen(cmd, stdin=subprocess.DEVNULL, stdout=log, stderr=subprocess.STDOUT,
                                         start_new_session=True,
                                         preexec_fn=die_with_parent if self.die_with_parent else None,
                                         **self._popen_kwargs())
        self._pid = self.proc.pid
        self.started_at = time.monotonic()
        return self

    def wait_ready(self, timeout_s: float | None = None) -> float:
        """Probe readiness every :attr:`POLL_S` s until ready; returns seconds since :meth:`start`
        (``timeout_s`` default: ``ready_timeout_s``).

        Raises:
            StageError: the process exited first, or was not ready within ``timeout_s`` seconds (one line, naming the
                log; :meth:`_exited_message` / :meth:`_not_ready_message`); the process group is stopped first.
        """
        if self.proc is None or self.started_at is None:
            raise RuntimeError(f"{type(self).__name__} not started")
        timeout_s = self.ready_timeout_s if timeout_s is None else timeout_s
        deadline = time.monotonic() + timeout_s
        while True:
            rc = self.proc.poll()
            if rc is not None:
                self.stop(grace_s=0)
                raise StageError(self._exited_message(rc))
            if self.is_ready():
                self.ready_s = time.monotonic() - self.started_at
                return self.ready_s
            if time.monotonic() >= deadline:
                pending = self._pending()
                self.stop(grace_s=1)
                raise StageError(self._not_ready_message(timeout_s, pending))
            time.sleep(self.POLL_S)

    def wait(self) -> int:
        """Block until the server exits; its exit status."""
        if self.proc is None:
            raise RuntimeError(f"{type(self).__name__} not started")
        return self.proc.wait()

    def stop(self, grace_s: float | None = None) -> int | None:
        """SIGTERM, wait ``grace_s`` (default ``exit_timeout_s`` + 5 s), then SIGKILL the process group; the
        ``/dev/shm`` regions of ``shm_prefix`` are removed.

        Returns the exit status (``None`` if not started here or detached). Idempotent."""
        if self.proc is None:
            return None
        grace = self.exit_timeout_s + 5 if grace_s is None else grace_s
        rc = terminate_tree(self.proc.pid, grace_s=grace, proc=self.proc, shm_prefix=self.shm_prefix)
        return self.proc.returncode if rc is None else rc

    def detach(self) -> None:
        """Forget the process so that nothing here stops it (``serve --detach``)."""
        self.proc = None

    def rss_bytes(self) -> int:
        """Resident memory of the server and its children now, in bytes (0 when gone or unknown)."""
        return tree_rss(self.pid) if self.pid else 0

    def __enter__(self) -> Self:
        self.start()
        try:
            self.wait_ready()
        except BaseException:
            self.stop(grace_s=0)
            raise
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()
