"""A trtllm-serve server as a child process: started in its own session, ready when ``GET /health`` answers 200,
stopped with its whole process group.

The same lifecycle serves the real ``trtllm-serve`` (GPU targets) and trtpipe's CPU stand-in
(:mod:`pipeline.cpu_runtime.openai`, cpu target): both bind ``--host``/``--port`` and answer ``/health`` with 200 only
once the model is loaded. Upstream binds its socket, then builds the ``LLM`` and only then serves
(tensorrt_llm/commands/serve.py@00209af149e7:189-230), and its ``/health`` answers 200 while the LLM is healthy,
503 otherwise (tensorrt_llm/serve/openai_server.py@00057725d9a6:484-492); so ``/health`` is the readiness signal.
With TP > 1 on one node nothing more is started here: the ``LLM`` that trtllm-serve builds with ``--tp_size N``
spawns its own N rank workers (``tensor_parallel_size`` passed to ``LLM(**llm_args)``, commands/serve.py@00209af149e7:
149, 201; the executor proxy's ``MpiPoolSession(n_workers=model_world_size)``,
tensorrt_llm/executor/proxy.py@b93e14ca093e:69), so there is no ``mpirun`` around it.
"""

from __future__ import annotations

from pathlib import Path

from pipeline.triton.process import check_ports_free, http_ok
from pipeline.triton.server_process import ServerProcess

#: seconds between two ``/health`` probes while waiting for readiness
POLL_S = 0.2


class TrtllmServeProcess(ServerProcess):
    """One trtllm-serve process (``argv``: its full command line, binding ``host``:``port``), logging to ``log_file``;
    the lifecycle is :class:`~pipeline.triton.server_process.ServerProcess`'s.

    ``exit_timeout_s``: how long :meth:`stop` lets it finish in-flight requests after SIGTERM before the process
    group is killed (plus 5 s). ``die_with_parent``: the kernel stops it when the starting thread dies (``False`` for
    ``--detach``). :attr:`pid` is kept after :meth:`detach`.
    """

    NAME = "trtllm-serve"
    POLL_S = POLL_S

    def __init__(self, argv: list[str], *, host: str, port: int, log_file: Path, exit_timeout_s: int = 5,
                 die_with_parent: bool = True) -> None:
        self.argv, self.host, self.port, self.log_file = list(argv), host, int(port), Path(log_file)
        self.exit_timeout_s, self.die_with_parent = exit_timeout_s, die_with_parent
        self._init_process()

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

    def command(self) -> list[str]:
        """The argv :meth:`start` runs (as given)."""
        return self.argv

    def _prepare(self) -> None:
        """Raises UserError: the port is already in use on ``host`` (nothing is launched)."""
        check_ports_free(self.host, {"http": self.port})

    def is_ready(self) -> bool:
        """One readiness probe: ``GET /health`` answers 200."""
        return http_ok(self.health_url)

    def _exited_message(self, rc: int) -> str:
        return (f"trtllm-serve exited with status {rc} before {self.health_url} answered 200 "
                f"(log: {self.log_file}){self._last_line()}")

    def _not_ready_message(self, timeout_s: float, pending: str) -> str:
        return (f"trtllm-serve not ready: {self.health_url} did not answer 200 within {timeout_s:g} s; "
                f"stopped it (log: {self.log_file})")

    def _last_line(self) -> str:
        assert self.log_file is not None
        try:
            lines = [ln.strip() for ln in self.log_file.read_text(errors="replace").splitlines() if ln.strip()]
        except OSError:
            return ""
        return f"; last log line: {lines[-1][:300]}" if lines else ""
