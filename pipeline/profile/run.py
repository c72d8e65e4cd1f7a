"""Run one profiled load point: on CPU from the engine's step timeline, on a GPU under Nsight Systems.

GPU (documented by TensorRT-LLM, ``docs/source/developer-guide/perf-analysis.md@1aa45ba636082761c3e3c587e0530d67967f8b44``):
``TLLM_PROFILE_START_STOP=A-B`` "together with ``nsys profile -c cudaProfilerApi``" collects only executor
iterations A–B (line 34); NVIDIA's own server form (``examples/disaggregated/slurm/benchmark/start_worker.sh@
0249976575050d2c624a5f285683c66de311a3b7:62-77``) is ``nsys profile -o F -f true -t cuda,nvtx,python-gil -c
cudaProfilerApi --cuda-graph-trace node --capture-range-end=stop --gpu-metrics-devices=none trtllm-serve …``.
The same variable is read by the C++ executor that serves the engine path and Triton's ``tensorrtllm`` backend
(``cpp/tensorrt_llm/executor/executorImpl.h@1a8329fb36462ed612476a2eea91b5395bef752a``, legacy
``TLLM_GPTM_PROFILE_START_STOP``). ``--trace-fork-before-exec=true`` follows Triton's Python stubs and ``mpirun``
ranks (perf-analysis.md:83-96). The export is ``nsys export --type sqlite -o F.sqlite --force-overwrite=true
F.nsys-rep`` (NVIDIA's parse.py@0663598b ``lazy_convert_sqlite``).

Which iterations: the executor counts them from server start; before the measured phase come the readiness probe
and the bench's warmup requests (at most ``warmup × OSL`` iterations at concurrency 1), so the default range starts
after those and spans at most :data:`MAX_ITERATIONS` iterations of the measured phase (``--iterations A-B``
overrides it).
"""

from __future__ import annotations

import os
import shlex
import shutil
import subprocess
import time
import urllib.request
from pathlib import Path
from typing import Any

from pipeline.core.errors import StageError, UserError
from pipeline.profile import report as rep

NSYS_TRACE = ("-t", "cuda,nvtx", "-c", "cudaProfilerApi", "--capture-range-end=stop", "--cuda-graph-trace", "node",
              "--gpu-metrics-devices=none", "--trace-fork-before-exec=true")
MAX_ITERATIONS = 200
READY_TIMEOUT_S = 900.0
PORTS = {"http": 8000, "grpc": 8001, "metrics": 8002}


def default_iterations(warmup: int, osl: int, requests: int, concurrency: int) -> tuple[int, int]:
    """``(A, B)`` executor iterations inside the measured phase (module docstring): A = warmup × OSL + 2, B = A +
    min(measured iterations at this concurrency / 2, :data:`MAX_ITERATIONS`), at least A + 1."""
    first = warmup * osl + 2
    measured = max(requests // max(concurrency, 1), 1) * osl
    return first, first + max(1, min(measured // 2, MAX_ITERATIONS))


def parse_iterations(text: str) -> tuple[int, int]:
    """``"100-150"`` → ``(100, 150)``.

    Raises:
        UserError: not ``A-B`` with 0 ≤ A < B.
    """
    try:
        a, b = (int(v) for v in text.split("-"))
    except ValueError:
        raise UserError(f"--iterations {text!r}: expected A-B, e.g. 100-150") from None
    if not 0 <= a < b:
        raise UserError(f"--iterations {text!r}: need 0 <= A < B")
    return a, b


def gpu_commands(server_argv: list[str], out: Path, iterations: tuple[int, int], bench_argv: list[str]) -> dict[str, Any]:
    """The exact steps on a GPU host: ``env`` for the server, ``profile`` (nsys around the server), ``bench``,
    ``export`` (SQLite) and the paths of the report and the export."""
    report, sqlite = out / "profile.nsys-rep", out / "profile.sqlite"
    env = {"TLLM_PROFILE_START_STOP": f"{iterations[0]}-{iterations[1]}"}
    profile = ["nsys", "profile", "-o", str(report.with_suffix("")), "-f", "true", *NSYS_TRACE,
               "-e", f"TLLM_PROFILE_START_STOP={env['TLLM_PROFILE_START_STOP']}", *server_argv]
    export = ["nsys", "export", "--type", "sqlite", "-o", str(sqlite), "--force-overwrite=true", str(report)]
    return {"env": env, "profile": profile, "bench": bench_argv, "export": export, "report": report, "sqlite": sqlite}


def dry_run_lines(cmds: dict[str, Any]) -> list[str]:
    """The commands of :func:`gpu_commands` as shell lines, in the order they run."""
    env = " ".join(f"{k}={v}" for k, v in cmds["env"].items())
    return [f"{env} {shlex.join(cmds['profile'])} &   # server under Nsight Systems, capture = those iterations",
            "# wait until the server is ready, then:", shlex.join(cmds["bench"]),
            "# stop the server (SIGINT to nsys), then:", shlex.join(cmds["export"]),
            shlex.join([cmds["bench"][0], "profile", "--sqlite", str(cmds["sqlite"])])]  # the same trtpipe


def require_nsys() -> str:
    """The ``nsys`` on PATH.

    Raises:
        UserError: none on PATH (exit 2, one line).
    """
    path = shutil.which("nsys")
    if path is None:
        raise UserError("nsys not on PATH: install Nsight Systems (or use the image's) to profile on a GPU; "
                               "--dry-run prints the commands")
    return path


def _wait_ready(url: str, proc: subprocess.Popen, timeout_s: float) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise StageError(f"the profiled server exited (code {proc.returncode}) before it was ready ({url})")
        try:
            with urllib.request.urlopen(url, timeout=2) as r:
                if r.status == 200:
                    return
        except OSError:
            pass
        time.sleep(2)
    raise StageError(f"the profiled server was not ready in {timeout_s:g} s ({url})")


def run_gpu(cmds: dict[str, Any], ready_url: str, out: Path) -> rep.Report:
    """Run :func:`gpu_commands`' steps for real: server under nsys, bench, stop, export; the analysis of the export.

    Raises:
        UserError: no nsys. StageError: the server or the bench failed, or no export was written.
    """
    from pipeline.profile.nsys_sqlite import analyse

    require_nsys()
    out.mkdir(parents=True, exist_ok=True)
    with open(out / "nsys_server.log", "w") as log:
        proc = subprocess.Popen(cmds["profile"], env={**os.environ, **cmds["env"]}, stdout=log, stderr=subprocess.STDOUT)
        try:
            _wait_ready(ready_url, proc, READY_TIMEOUT_S)
            bench = subprocess.run(cmds["bench"], check=False)
            if bench.returncode != 0:
                raise StageError(f"the profiled load point failed (trtpipe bench exit {bench.returncode})")
        finally:
            proc.send_signal(2)  # SIGINT: nsys stops the target and writes its report
            try:
                proc.wait(timeout=600)
            except subprocess.TimeoutExpired:
                proc.kill()
    if not cmds["report"].is_file():
        raise StageError(f"nsys wrote no {cmds['report']} (see {out / 'nsys_server.log'})")
    subprocess.run(cmds["export"], check=True)
    return analyse(cmds["sqlite"])


def run_cpu(options: dict[str, Any], on_status: Any = None) -> rep.Report:
    """One load point of ``trtpipe bench`` (``options``: its parameters by name) against the served CPU engine, and
    the report of its step timeline (:mod:`pipeline.profile.cpu`).

    Raises:
        UserError / StageError: as ``trtpipe bench``; no step timeline from the server (:func:`pipeline.profile.cpu.report`).
    """
    from pipeline.bench import stage
    from pipeline.bench.options import resolve
    from pipeline.bench.results import check_outcome
    from pipeline.profile.cpu import report

    spec, target = resolve(options)
    if target.metrics_url is None:  # a detached `trtpipe serve` at this URL names its metrics endpoint
        import dataclasses

        target = dataclasses.replace(target, metrics_url=detached_metrics_url(target.url or "localhost:8001"))
    result = stage.run(spec, target, on_status=on_status)
    check_outcome(result)
    if not result.load_points:
        raise StageError("the profiled load point measured nothing")
    r = report(result.load_points[-1], result.metrics_url)
    r["bench_run"] = str(result.run_dir)
    return r


def detached_metrics_url(grpc_url: str) -> str | None:
    """The metrics URL of the detached ``trtpipe serve`` (``artifacts/serve.json``) whose gRPC endpoint has
    ``grpc_url``'s port (``localhost`` and ``127.0.0.1`` alike), else ``None`` (the bench's default applies)."""
    from pipeline.serve.registry import read_state, state_alive, state_path

    state = read_state(state_path())
    if not state or not state_alive(state) or not state.get("grpc_url"):
        return None
    return state.get("metrics_url") if state["grpc_url"].rsplit(":", 1)[-1] == grpc_url.rsplit(":", 1)[-1] else None


def bench_options(**given: Any) -> dict[str, Any]:
    """Every ``trtpipe bench`` parameter at its default, with ``given`` (by parameter name) set."""
    from pipeline.bench.options import parameters
    from pipeline.bench.target import BenchTarget
    from pipeline.recipe.bench import BenchSpec

    params = [*parameters(BenchTarget), *parameters(command=True), *parameters(BenchSpec)]
    out = {p.name: p.default for p in params}
    unknown = set(given) - set(out)
    if unknown:
        raise ValueError(f"not bench options: {sorted(unknown)}")
    return out | given
