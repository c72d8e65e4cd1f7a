"""The serving frontend of a build: Triton (the model repository) or trtllm-serve (``serving.frontend: trtllm-serve``,
a ``build.engine: pytorch`` build).

:func:`trtllm_serve_spec` finds a build's trtllm-serve command: on GPU targets the engine stage's
``trtllm_serve.json`` (the real ``trtllm-serve``); on the cpu target the same flags for trtpipe's CPU stand-in
(:mod:`pipeline.cpu_runtime.openai`, run as ``<python> -m pipeline.cpu_runtime.openai``), made from the CPU engine's
``llm_api_config.yaml``, which is also its ``--extra_llm_api_options``. :func:`command` is the exact command line
``trtpipe serve`` starts, for ``--print-command``. :func:`serve_trtllm` runs a trtllm-serve build like a Triton one:
a readiness wait on ``/health``, then the foreground until Ctrl-C, or ``--detach`` with a record in
``artifacts/serve.json`` (:mod:`pipeline.serve.registry`). The real ``trtllm-serve`` exists where TensorRT-LLM is
installed (the ``26.04-trtllm-python-py3`` image); elsewhere :class:`~pipeline.core.errors.MissingToolError` (exit 3).
"""

from __future__ import annotations

import json
import shutil
from collections.abc import Callable
from pathlib import Path
from typing import Any

from pipeline.core.errors import MissingToolError, StageError
from pipeline.recipe import serving_path
from pipeline.serve.compat import ServeTarget, check_files

SERVE_COMMAND = "trtllm_serve.json"  # written by pipeline.engine.pytorch
CPU_OPTIONS = "llm_api_config.yaml"  # written by pipeline.engine.cpu for build.engine: pytorch on the cpu target
TRTLLM_SERVE = serving_path.TRTLLM_SERVE
#: the log of a trtllm-serve build's server: ``<build>/trtllm_serve-<port>.log``
LOG_NAME = "trtllm_serve-{port}.log"


def trtllm_serve_spec(target: ServeTarget) -> dict[str, Any] | None:
    """``{"argv", "options", "cpu"}`` of ``target``'s trtllm-serve build; ``None``: the build's frontend is Triton.

    The build's serving path is its engine manifest's (:func:`pipeline.recipe.serving_path.path_of_engine`). GPU
    targets: the engine stage's ``trtllm_serve.json`` (``cpu`` false). The cpu target (trtpipe's CPU stand-in):
    :func:`pipeline.trtllm.trtllm_serve.cpu_argv` with the CPU engine's ``llm_api_config.yaml`` (``cpu`` true).

    Raises:
        StageError: a trtllm-serve build without its command (``trtllm_serve.json``) or CPU options file.
    """
    if target.layout is None:
        return None
    from pipeline.engine.result import EngineResult
    from pipeline.recipe.serving_path import path_of_engine
    from pipeline.trtllm import trtllm_serve

    engine = EngineResult.load(target.layout.engine)
    path = path_of_engine(engine.manifest) if engine is not None else None
    if path is None or not path.trtllm_serve:
        return None
    if not path.on_cpu:
        stored = engine.path / SERVE_COMMAND
        if not stored.is_file():
            raise StageError(f"{engine.path}: no {SERVE_COMMAND} for trtllm-serve: rebuild the engine stage (trtpipe build --force)")
        return {**json.loads(stored.read_text()), "cpu": False}
    options = engine.path / CPU_OPTIONS
    kwargs = engine.manifest.get("llm_api_kwargs") or {}
    if not kwargs or not options.is_file():
        raise StageError(f"{engine.path}: no {CPU_OPTIONS} for trtllm-serve: rebuild the engine stage (trtpipe build --force)")
    return {"argv": trtllm_serve.cpu_argv(kwargs, str(options.resolve())), "options": str(options.resolve()), "cpu": True}


def trtllm_serve_argv(spec: dict[str, Any], host: str, port: int) -> list[str]:
    """The stored trtllm-serve argv with ``--host``/``--port`` set to ``host``/``port``."""
    argv = list(spec["argv"])
    for flag, value in (("--host", host), ("--port", str(int(port)))):
        i = argv.index(flag)
        argv[i + 1] = value
    return argv


def command(target: ServeTarget, options: Any) -> list[str]:
    """The argv ``trtpipe serve`` runs for ``target`` with ``options`` (a :class:`~pipeline.serve.stage.ServeOptions`):
    ``trtllm-serve …`` / ``<python> -m pipeline.cpu_runtime.openai …`` (HTTP port = ``options.http_port``) or
    ``tritonserver …`` (``mpirun`` for TP×PP > 1). Nothing is started.

    A GPU build's Triton command is the one that runs in the image, wherever trtpipe runs: the container's
    ``/opt/tritonserver/bin/tritonserver`` with its own backends (``tensorrtllm``, ``python``), never this machine's
    CPU Triton; for TP×PP > 1 the ``mpirun --allow-run-as-root -n 1 tritonserver … : -n 1 …`` rank layout of
    tensorrtllm_backend ``scripts/launch_triton_server.py@c2e65b8`` ``get_cmd`` (docs/deploy-k8s.md's contract
    table). ``$TRTPIPE_TRITONSERVER`` still names another binary. A CPU build uses
    the local Triton (:func:`~pipeline.triton.server.find_triton`)."""
    import os

    spec = trtllm_serve_spec(target)
    if spec is not None:
        return trtllm_serve_argv(spec, options.host, options.http_port)
    from pipeline.triton.server import (
        CONTAINER_TRITONSERVER,
        TritonInstall,
        TritonServer,
        find_triton,
    )

    in_image = TritonInstall(kind="gpu", binary=Path(os.environ.get("TRTPIPE_TRITONSERVER") or CONTAINER_TRITONSERVER))
    if gpu_build(target):
        install = in_image
    else:
        try:
            install = find_triton()
        except MissingToolError:
            install = in_image
    server = TritonServer(target.repo, http_port=options.http_port, grpc_port=options.grpc_port,
                          metrics_port=options.metrics_port, host=options.host, exit_timeout_s=options.exit_timeout_s,
                          world_size=target.world_size, install=install, extra_args=options.restricted_api_args())
    return server.command()


def gpu_build(target: ServeTarget) -> bool:
    """Whether ``target`` is served on a GPU: its build's recipe targets a GPU (``target.gpu`` ≠ ``cpu``), or, for a
    bare model repository, its ``tensorrt_llm`` model runs on the C++ ``tensorrtllm`` backend."""
    import re

    import yaml

    if target.layout is not None and target.layout.recipe_file.is_file():
        data = yaml.safe_load(target.layout.recipe_file.read_text()) or {}
        return str((data.get("target") or {}).get("gpu", "cpu")).strip().lower() != "cpu"
    cfg = Path(target.repo) / "tensorrt_llm" / "config.pbtxt"
    return cfg.is_file() and re.search(r'^\s*backend:\s*"tensorrtllm"', cfg.read_text(), flags=re.MULTILINE) is not None


def _runnable(spec: dict[str, Any], host: str, port: int) -> list[str]:
    """The argv to start: the CPU stand-in as it is, the real ``trtllm-serve`` at its path on PATH.

    Raises:
        MissingToolError: no ``trtllm-serve`` on PATH (TensorRT-LLM is not installed here).
    """
    argv = trtllm_serve_argv(spec, host, port)
    if spec.get("cpu"):
        return argv
    binary = shutil.which(TRTLLM_SERVE)
    if binary is None:
        from pipeline.trtllm.release import default_release

        raise MissingToolError(f"{TRTLLM_SERVE} is not installed here (it ships in the TensorRT-LLM image, e.g. "
                               f"{default_release().image}): `trtpipe serve BUILD --print-command` prints its command line")
    return [binary, *argv[1:]]


def serve_trtllm(target: ServeTarget, options: Any, *, detach: bool, state_file: Path,
                 say: Callable[[str], None]) -> None:
    """Serve ``target``'s trtllm-serve build: start it (log ``options.log_file``, default
    ``<build>/trtllm_serve-<port>.log``), wait until ``/health`` answers 200 (``options.ready_timeout_s``; ``None``:
    :func:`pipeline.serve.readiness.default_ready_timeout_s`, by path and model size), then run
    in the foreground until Ctrl-C / SIGTERM (stopped cleanly), or with ``detach`` record it in ``state_file`` and
    return. ``say`` prints one status message.

    Raises:
        MissingToolError: a GPU build and no ``trtllm-serve`` here (nothing starts).
        IncompatibleArtifactError: the build's served files changed since the build (:func:`check_files`).
        UserError: the port is in use.
        StageError: the build has no trtllm-serve command; the server exited or was not ready in time (one line
            naming ``/health`` and the log; it is stopped); it exited on its own in the foreground.
    """
    from pipeline.serve.readiness import ready_timeout_s
    from pipeline.serve.registry import trtllm_serve_record, write_state
    from pipeline.serve.trtllm_process import TrtllmServeProcess

    spec = trtllm_serve_spec(target)
    if spec is None:
        raise StageError(f"{target.layout}: no {SERVE_COMMAND}: the build's frontend is triton")
    check_files(target)
    wait_s = ready_timeout_s(target, options.ready_timeout_s)
    argv = _runnable(spec, options.host, options.http_port)
    root = target.layout.root if target.layout is not None else target.repo.parent
    log_file = options.log_file or Path(root) / LOG_NAME.format(port=options.http_port)
    proc = TrtllmServeProcess(argv, host=options.host, port=options.http_port, log_file=log_file,
                              exit_timeout_s=options.exit_timeout_s, die_with_parent=not detach)
    what = "trtpipe's CPU stand-in for trtllm-serve" if spec["cpu"] else TRTLLM_SERVE
    proc.start()
    if options.log_file is None:  # this server's log is now the newest
        prune_logs(Path(root))
    try:
        say(f"[bold]trtpipe serve[/] {root}  ({what}, pid {proc.pid}, log {log_file}; ready wait ≤ {wait_s:g} s)")
        ready_s = proc.wait_ready(wait_s)
        say(f"  OpenAI  {proc.openai_url}\n  health  {proc.health_url}")
        say(f"[bold green]ready[/] in {ready_s:.1f} s (pid {proc.pid}, RSS {proc.rss_bytes() / 2**20:.0f} MiB)")
        if detach:
            write_state(state_file, trtllm_serve_record(proc, target.layout.root if target.layout else None))
            proc.detach()
            say(f"running in the background; `trtpipe serve --status` / `trtpipe serve --stop` ({state_file})")
            return
        say("[dim]Ctrl-C to stop[/]")
        rc = proc.wait()
        raise StageError(f"{what} exited on its own with status {rc} (log: {log_file})")
    except KeyboardInterrupt:
        say("stopping…")
        say(f"stopped (exit status {proc.stop()})")
    finally:
        if proc.proc is not None and proc.proc.poll() is None:
            proc.stop(grace_s=0)  # never leave a half-started server


def prune_logs(root: Path, keep: int = 8) -> list[Path]:
    """Remove ``root``'s ``trtllm_serve-<port>.log`` files beyond the ``keep`` most recently written (servers on free
    ports leave one each), except one that a running trtllm-serve or CPU stand-in holds open. Returns the removed."""
    import psutil

    def mtime(p: Path) -> float:
        try:
            return p.stat().st_mtime
        except OSError:
            return 0.0

    old = sorted(root.glob(LOG_NAME.format(port="*")), key=mtime, reverse=True)[keep:]
    held: set[Path] = set()
    for proc in psutil.process_iter(["cmdline"]) if old else ():
        cmd = " ".join(proc.info["cmdline"] or [])
        if TRTLLM_SERVE in cmd or "pipeline.cpu_runtime.openai" in cmd:
            try:
                held.update(Path(f.path) for f in proc.open_files())
            except psutil.Error:
                pass
    removed = [p for p in old if p.resolve() not in held]
    for p in removed:
        p.unlink(missing_ok=True)
    return removed
