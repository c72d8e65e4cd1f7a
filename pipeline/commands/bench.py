"""``trtpipe bench``: ISL/OSL load test of a Triton deployment (gRPC or HTTP) or any OpenAI-compatible server; ``bench compare A B``.

Examples::

    trtpipe bench --isl 100 --osl 2000                      # the served (else last) build's model, concurrency 1,8,64,256
    trtpipe bench --model tensorrt_llm --scenario 100:2000 --scenario 100:100 --concurrency 1,8
    trtpipe bench --request-rate 2,4 --arrival constant --duration 60 --goodput ttft:200,itl:20
    trtpipe bench --recipe recipes/smollm2.yaml              # the recipe's bench section
    trtpipe bench --api openai --url http://localhost:8000/v1 --tokenizer DIR --isl 100 --osl 200   # vLLM, TGI, …
    trtpipe bench --api triton-http --url http://localhost:8000 --isl 100 --osl 200   # Triton generate_stream
    trtpipe bench --soak 10 --concurrency 32 --isl 100 --osl 64 --server-pid PID   # long run: failures, OSL, RSS growth
    trtpipe bench compare artifacts/bench/20261122-101500 artifacts/bench/20261122-103000

The options are declared on the fields they set (:class:`~pipeline.recipe.bench.BenchSpec`,
:class:`~pipeline.bench.target.BenchTarget`, :class:`~pipeline.bench.soak.SoakSpec`) and generated here by
:mod:`pipeline.bench.options`; the work is :func:`pipeline.bench.stage.run` (or :func:`pipeline.bench.soak.soak`).
"""

from __future__ import annotations

import inspect
from pathlib import Path
from typing import Annotated, Any

import typer

from pipeline.commands.common import console, err_console, handle_errors

app = typer.Typer(
    help="Benchmark a Triton deployment or any OpenAI-compatible server (TTFT, ITL, TPOT, throughput) at exact ISL/OSL; `compare` two runs.",
    invoke_without_command=True,
    no_args_is_help=False,
)


def _wide(con: Any) -> Any:
    """``con``: every command's console is already wide off a TTY (:mod:`pipeline.core.console`)."""
    return con


def _signature() -> inspect.Signature:
    """``bench(ctx, **options)`` as typer sees it: one keyword parameter per declared option."""
    from pipeline.bench.options import parameters
    from pipeline.bench.soak import SoakSpec
    from pipeline.bench.target import BenchTarget
    from pipeline.recipe.bench import BenchSpec

    ctx = inspect.Parameter("ctx", inspect.Parameter.POSITIONAL_OR_KEYWORD, annotation=typer.Context)
    return inspect.Signature([ctx, *parameters(BenchTarget), *parameters(command=True), *parameters(BenchSpec),
                              *parameters(SoakSpec, panel="Soak (--soak MINUTES)")])


def _bench(spec: Any, target: Any) -> None:
    from pipeline.bench import stage
    from pipeline.bench.console import progress_bar, scenario_tables
    from pipeline.bench.results import check_outcome

    with progress_bar(err_console) as start:
        result = stage.run(spec, target, on_progress=start, on_status=lambda s: err_console.print(s, highlight=False))
    from pipeline.bench.exporters import all_failed

    con, failed = _wide(console), all_failed(result)
    for table in [] if failed else scenario_tables(result.load_points, goodput=bool(spec.goodput)):
        con.print(table)
    for w in result.warnings:
        err_console.print(f"[yellow]warning:[/] {w}", highlight=False)
    if not failed:  # no results to claim: check_outcome names the directory with the errors
        con.print(f"results: {result.run_dir}", highlight=False)
    check_outcome(result)


def _soak(spec: Any, target: Any, options: dict[str, Any]) -> None:
    from pipeline.bench.options import overrides
    from pipeline.bench.soak import SoakSpec, soak
    from pipeline.core.errors import StageError

    report = soak(spec, SoakSpec(**overrides(SoakSpec, options)), target,
                  on_status=lambda s: err_console.print(s, highlight=False))
    console.print(report.line(), highlight=False)
    console.print(f"results: {report.path}", highlight=False)
    if not report.passed:
        raise StageError(f"soak FAIL (see {report.path})")


@handle_errors
def bench(ctx: typer.Context, **options: Any) -> None:
    """Benchmark TTFT / ITL / TPOT / throughput at exact ISL/OSL: Triton over gRPC or HTTP, or any OpenAI-compatible server."""
    if ctx.invoked_subcommand is not None:
        return
    from pipeline.bench.options import resolve
    from pipeline.core.errors import UserError

    if options["minutes"] is None and (options["serve"] is not None or options["server_pid"] is not None):
        raise UserError("--serve and --server-pid go with --soak MINUTES")
    spec, target = resolve(options)
    if options["minutes"] is None:
        _bench(spec, target)
    else:
        _soak(spec, target, options)


bench.__signature__ = _signature()  # type: ignore[attr-defined]
app.callback(invoke_without_command=True)(bench)


@app.command("compare")
@handle_errors
def compare(
    run_a: Annotated[Path, typer.Argument(help="Baseline run directory, or a directory of repeated runs (A).")],
    run_b: Annotated[Path, typer.Argument(help="New run directory, or a directory of repeated runs (B).")],
) -> None:
    """Per scenario × load point: A, B, change in %, and better/worse only beyond the noise (2+ repeats a side: their
    95 % bootstrap interval; else a ±10 % band, perf_analyzer's stability criterion)."""
    from pipeline.bench.compare import compare_runs, compare_table

    rows = compare_runs(run_a, run_b)
    _wide(console).print(compare_table(rows, f"B = {run_b}  vs  A = {run_a}"))
