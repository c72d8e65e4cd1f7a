"""A trtllm-serve server as a child process: started in its own session, ready when ``GET /health`` answers 200,
stopped with its whole process group.

The same lifecycle serves the real ``trtllm-serve`` (GPU targets) and trtpipe's CPU stand-in
(:mod:`pipeline.serve.openai_cpu`, cpu target): both bind ``--host``/``--port`` and answer ``/health`` with 200 only
once the model is loaded. Upstream binds its socket, then builds the ``LLM`` and only then serves
(tensorrt_llm/commands/serve.py@00209af149e7:189-230), and its ``/health`` answers 200 while the LLM is healthy,
503 otherwise (tensorrt_llm/serve/openai_server.py@00057725d9a6:484-492); so ``/health`` is the readiness signal.
With TP > 1 on one node nothing more is started here: the ``LLM`` that trtllm-serve builds with ``--tp_size N``
spawns its own N rank workers (``tensor_parallel_size`` passed to ``LLM(**llm_args)``, commands/serve.py@00209af149e7:
149, 201; the executor proxy's ``MpiPoolSession(n_workers=model_world_size)``,
tensorrt_llm/executor/proxy.py@b93e14ca093e:69), so there is no ``mpirun`` around it.
"""

from __future__ import annotations

import subprocess
import time
from pathlib import Path

from pipeline.core.errors import StageError
from pipeline.triton.process import (
    check_ports_free,
    client_host,
    die_with_parent,
    http_ok,
    terminate_tree,
    tree_rss,
)

#: seconds between two ``/health`` probes while waiting for readiness
POLL_S = 0.2


class TrtllmServeProcess:
    """One trtllm-serve process (``argv``: its full command line, binding ``host``:``port``), logging to ``log_file``.

    ``exit_timeout_s``: how long :meth:`stop` lets it finish in-flight requests after SIGTERM before the process
    group is killed (plus 5 s). ``die_with_parent``: the kernel stops it when the starting thread dies (``False`` for
    ``--detach``).
    """

    def __init__(self, argv: list[str], *, host: str, port: int, log_file: Path, exit_timeout_s: int = 5,
                 die_with_parent: bool = True) -> None:
        self.argv, self.host, self.port, self.log_file = list(argv), host, int(port), Path(log_file)
        self.exit_timeout_s, self.die_with_parent = exit_timeout_s, die_with_parent
        self.proc: subprocess.Popen | None = None
        self.started_at: float | None = None
        self.ready_s: float | None = None
        self._pid: int | None = None

    @property
    def pid(self) -> int | None:
        """The server's PID (also kept after :meth:`detach`)."""
        return self._pid

    @property
    def client_host(self) -> str:
        """Where a client on this machine reaches the server (a wildcard bind address becomes loopback)."""
        return client_host(self.host)

    @property
    def http_url(self) -> str:
        """``host:port`` of the HTTP endpoint."""
        return f"{self.client_host}:{self.port}"

    @property
    def health_url(self) -> str:
        """``http://host:port/health`` (200 = the model answers, 503 = it does not)."""
        return f"http://{self.http_url}/health"

    @property
    def openai_url(self) -> str:
        """The OpenAI base URL ``http://host:port/v1`` (what ``trtpipe bench --api openai --url`` takes)."""
        return f"http://{self.http_url}/v1"

    def start(self) -> TrtllmServeProcess:
        """Launch the server in a new session (its own process group), output to :attr:`log_file`; returns at once.

        Raises:
            UserError: the port is already in use on ``host`` (nothing is launched).
        """
        if self.proc is not None:
            raise RuntimeError("trtllm-serve already started")
        check_ports_free(self.host, {"http": self.port})
        self.log_file.parent.mkdir(parents=True, exist_ok=True)
        with open(self.log_file, "wb") as log:
            self.proc = subprocess.Popen(self.argv, stdin=subprocess.DEVNULL, stdout=log, stderr=subprocess.STDOUT,
                                         start_new_session=True,
                                         preexec_fn=die_with_parent if self.die_with_parent else None)
        self._pid = self.proc.pid
        self.started_at = time.monotonic()
        return self

    def is_ready(self) -> bool:
        """One readiness probe: ``GET /health`` answers 200."""
        return http_ok(self.health_url)

    def wait_ready(self, timeout_s: float) -> float:
        """Poll ``/health`` every :data:`POLL_S` s until it answers 200; returns seconds since :meth:`start`.

        Raises:
            StageError: the process exited first, or ``/health`` did not answer 200 within ``timeout_s`` seconds;
                one line naming the URL and the log file. The process group is stopped first.
        """
        if self.proc is None or self.started_at is None:
            raise RuntimeError("trtllm-serve not started")
        deadline = time.monotonic() + timeout_s
        while True:
            rc = self.proc.poll()
            if rc is not None:
                self.stop(grace_s=0)
                raise StageError(f"trtllm-serve exited with status {rc} before {self.health_url} answered 200 "
                                 f"(log: {self.log_file}){self._last_line()}")
            if self.is_ready():
                self.ready_s = time.monotonic() - self.started_at
                return self.ready_s
            if time.monotonic() >= deadline:
                self.stop(grace_s=1)
                raise StageError(f"trtllm-serve not ready: {self.health_url} did not answer 200 within {timeout_s:g} s; "
                                 f"stopped it (log: {self.log_file})")
            time.sleep(POLL_S)

    def _last_line(self) -> str:
        try:
            lines = [ln.strip() for ln in self.log_file.read_text(errors="replace").splitlines() if ln.strip()]
        except OSError:
            return ""
        return f"; last log line: {lines[-1][:300]}" if lines else ""

    def wait(self) -> int:
        """Block until the server exits; its exit status."""
        if self.proc is None:
            raise RuntimeError("trtllm-serve not started")
        return self.proc.wait()

    def stop(self, grace_s: float | None = None) -> int | None:
        """SIGTERM, wait ``grace_s`` (default ``exit_timeout_s`` + 5 s), then SIGKILL the process group.

        Returns the exit status (``None`` if not started here or detached). Idempotent."""
        if self.proc is None:
            return None
        grace = self.exit_timeout_s + 5 if grace_s is None else grace_s
        rc = terminate_tree(self.proc.pid, grace_s=grace, proc=self.proc)
        return self.proc.returncode if rc is None else rc

    def detach(self) -> None:
        """Forget the process so that nothing here stops it (``serve --detach``)."""
        self.proc = None

    def rss_bytes(self) -> int:
        """Resident memory of the server and its children now, in bytes (0 when gone)."""
        return tree_rss(self._pid) if self._pid else 0

