"""``trtpipe profile``: what the device does during one load point — active %, kernels (GPU) or engine steps (CPU),
their categories, the idle gaps, the top ones — as a table, ``profile.png`` and ``profile.json``.

Examples::

    trtpipe profile                                   # CPU: the served CPU engine's step timeline over one load point
    trtpipe profile recipes/llama31_8b_h200_fp8.yaml --dry-run   # GPU: the nsys / bench / export commands
    trtpipe profile --sqlite trace.sqlite             # analyse any Nsight Systems SQLite export

The work is :mod:`pipeline.profile` (GPU: :mod:`pipeline.profile.run`, analysis :mod:`pipeline.profile.nsys_sqlite`;
CPU: :mod:`pipeline.profile.cpu`).
"""

from __future__ import annotations

import time
from pathlib import Path
from typing import Annotated, Any, Optional

import typer

from pipeline.commands.common import console, err_console, handle_errors


@handle_errors
def profile(
    artifact: Annotated[Optional[Path], typer.Argument(  # noqa: UP045 - typer reads Optional
        metavar="[BUILD_DIR|RECIPE]", help="The build to profile (default: the last build).", show_default=False)] = None,
    concurrency: Annotated[int, typer.Option("--concurrency", min=1, help="Concurrent streams of the load point.")] = 4,
    isl: Annotated[int, typer.Option("--isl", min=1, help="Prompt tokens per request.")] = 100,
    osl: Annotated[int, typer.Option("--osl", min=1, help="Output tokens per request.")] = 64,
    num_requests: Annotated[int, typer.Option("--num-requests", min=1, help="Measured requests.")] = 16,
    warmup: Annotated[int, typer.Option("--warmup", min=0, help="Warmup requests (excluded).")] = 2,
    url: Annotated[Optional[str], typer.Option("--url", help="CPU: the served deployment's gRPC host:port (default: the bench's).")] = None,  # noqa: UP045
    iterations: Annotated[Optional[str], typer.Option("--iterations", help="GPU: executor iterations A-B to capture (default: after the warmup).")] = None,  # noqa: UP045
    sqlite: Annotated[Optional[Path], typer.Option("--sqlite", help="Only analyse this Nsight Systems SQLite export.")] = None,  # noqa: UP045
    device: Annotated[Optional[int], typer.Option("--device", help="With --sqlite: the CUDA device (default: the busiest).")] = None,  # noqa: UP045
    out: Annotated[Optional[Path], typer.Option("--out", help="Output directory (default artifacts/profile/<time>).")] = None,  # noqa: UP045
    dry_run: Annotated[bool, typer.Option("--dry-run", help="GPU: print the exact commands and exit; nothing runs.")] = False,
) -> None:
    """Profile one load point: GPU active % (Nsight Systems) or the CPU engine's step timeline; table, plot, JSON."""
    from pipeline.profile import report as rep
    from pipeline.profile import run

    out = out or Path("artifacts") / "profile" / time.strftime("%Y%m%d-%H%M%S")
    if sqlite is not None:
        from pipeline.profile.nsys_sqlite import analyse

        result = analyse(sqlite, device=device)
    else:
        from pipeline.serve import frontend
        from pipeline.serve.compat import ServeTarget

        target = ServeTarget.resolve(artifact)
        if frontend.gpu_build(target):
            result = _gpu(target, out, concurrency, isl, osl, num_requests, warmup, iterations, dry_run)
            if result is None:
                return
        else:
            if dry_run:
                console.print("# CPU: no nsys; the served CPU engine's step timeline over one `trtpipe bench` load point",
                              highlight=False)
                return
            opts = run.bench_options(concurrency=str(concurrency), isl=isl, osl=osl, num_requests=num_requests,
                                     warmup_requests=warmup, out=out / "bench", **({"url": url} if url else {}))
            result = run.run_cpu(opts, on_status=lambda s: err_console.print(s, highlight=False))
    rep.write(result, out)
    for table in rep.tables(result):
        console.print(table)
    console.print(f"results: {out}", highlight=False)


def _gpu(target: Any, out: Path, concurrency: int, isl: int, osl: int, num_requests: int, warmup: int,
         iterations: str | None, dry_run: bool) -> Any:
    """The GPU path: the commands (printed with ``dry_run``), else run under nsys and analyse."""
    import sys

    from pipeline.profile import run
    from pipeline.serve import frontend
    from pipeline.serve.stage import ServeOptions

    p = run.PORTS
    server = frontend.command(target, ServeOptions(http_port=p["http"], grpc_port=p["grpc"], metrics_port=p["metrics"]))
    openai = frontend.trtllm_serve_spec(target) is not None
    api = ["--api", "openai", "--url", f"http://127.0.0.1:{p['http']}/v1"] if openai else ["--url", f"localhost:{p['grpc']}"]
    bench = [str(Path(sys.executable).parent / "trtpipe"), "bench", *api, "--scenario", f"{isl}:{osl}",
             "--concurrency", str(concurrency), "--num-requests", str(num_requests), "--warmup", str(warmup),
             "--out", str(out / "bench")]
    span = run.parse_iterations(iterations) if iterations else run.default_iterations(warmup, osl, num_requests, concurrency)
    cmds = run.gpu_commands(server, out, span, bench)
    if dry_run:
        for line in run.dry_run_lines(cmds):
            console.print(line, highlight=False, soft_wrap=True)
        return None
    ready = f"http://127.0.0.1:{p['http']}" + ("/health" if openai else "/v2/health/ready")
    return run.run_gpu(cmds, ready, out)
