"""``trtpipe bench``: ISL/OSL load test of a Triton deployment (gRPC or HTTP) or any OpenAI-compatible server; ``bench compare A B``.

Examples::

    trtpipe bench --isl 100 --osl 2000                      # the served (else last) build's model, concurrency 1,8,64,256
    trtpipe bench --model tensorrt_llm --scenario 100:2000 --scenario 100:100 --concurrency 1,8
    trtpipe bench --request-rate 2,4 --arrival constant --duration 60 --goodput ttft:200,itl:20
    trtpipe bench --recipe recipes/smollm2.yaml              # the recipe's bench section
    trtpipe bench --api openai --url http://localhost:8000/v1 --tokenizer DIR --isl 100 --osl 200   # vLLM, TGI, …
    trtpipe bench --api triton-http --url http://localhost:8000 --isl 100 --osl 200   # Triton generate_stream
    trtpipe bench compare artifacts/bench/20261122-101500 artifacts/bench/20261122-103000

The work is :func:`pipeline.stages.bench.run`; this module turns flags into validated overrides of the
recipe's ``bench`` section (:class:`~pipeline.recipe.bench.BenchSpec`) and a
:class:`~pipeline.stages.bench.BenchTarget`.
"""

from __future__ import annotations

from pathlib import Path
from typing import Annotated, Any

import typer

from pipeline.commands.common import console, err_console, handle_errors

#: BenchSpec field → the flag that overrides it (validation errors name the flag)
FLAGS = {
    "model": "--model", "scenarios": "--scenario", "concurrency": "--concurrency", "request_rate": "--request-rate",
    "arrival": "--arrival", "num_requests": "--num-requests", "duration_s": "--duration", "warmup_requests": "--warmup",
    "goodput": "--goodput", "request_timeout_s": "--timeout", "dataset": "--dataset", "seed": "--seed",
    "allow_short": "--allow-short",
}

app = typer.Typer(
    help="Benchmark a Triton deployment or any OpenAI-compatible server (TTFT, ITL, TPOT, throughput) at exact ISL/OSL; `compare` two runs.",
    invoke_without_command=True,
    no_args_is_help=False,
)


def _ints(text: str, flag: str) -> list[int]:
    from pipeline.errors import UserError

    try:
        values = [int(v) for v in text.replace(" ", "").split(",") if v]
    except ValueError:
        raise UserError(f"{flag} {text!r}: expected comma-separated integers, e.g. 1,8,64") from None
    if not values or min(values) < 1:
        raise UserError(f"{flag} {text!r}: values must be >= 1")
    return values


def _floats(text: str, flag: str) -> list[float]:
    from pipeline.errors import UserError

    try:
        values = [float(v) for v in text.replace(" ", "").split(",") if v]
    except ValueError:
        raise UserError(f"{flag} {text!r}: expected comma-separated numbers, e.g. 0.5,2") from None
    if not values or min(values) <= 0:
        raise UserError(f"{flag} {text!r}: values must be > 0")
    return values


def parse_scenario(text: str) -> tuple[int, int]:
    """``"100:2000"`` → ``(100, 2000)`` (ISL, OSL in tokens)."""
    from pipeline.errors import UserError

    try:
        isl, osl = (int(v) for v in text.split(":"))
    except ValueError:
        raise UserError(f"--scenario {text!r}: expected ISL:OSL, e.g. 100:2000") from None
    if isl < 1 or osl < 1:
        raise UserError(f"--scenario {text!r}: ISL and OSL must be >= 1")
    return isl, osl


def parse_goodput(items: list[str]) -> dict[str, float]:
    """``["ttft:200,itl:20"]`` or ``["ttft:200", "itl:20"]`` → ``{"ttft": 200.0, "itl": 20.0}`` (ms)."""
    from pipeline.bench.metrics import SLO_KEYS
    from pipeline.errors import UserError

    out: dict[str, float] = {}
    for item in items:
        for part in item.replace(" ", ",").split(","):
            if not part:
                continue
            key, _, value = part.partition(":")
            try:
                out[key] = float(value)
            except ValueError:
                raise UserError(f"--goodput {part!r}: expected KEY:MS, e.g. ttft:200") from None
            if key not in SLO_KEYS:
                raise UserError(f"--goodput {part!r}: unknown SLO {key!r} (use {', '.join(SLO_KEYS)})")
    return out


def _wide(con: Any) -> Any:
    """``con`` on a terminal; else a 200-column console, so piped tables are not squeezed to 80."""
    if con.is_terminal:
        return con
    from rich.console import Console

    return Console(width=200)


@app.callback(invoke_without_command=True)
@handle_errors
def bench(
    ctx: typer.Context,
    url: Annotated[str | None, typer.Option("--url", help="Server endpoint: grpc host:port (default localhost:8001); triton-http http://host:port (default :8000); openai http://host:port/v1 (default :8000/v1).")] = None,
    api: Annotated[str, typer.Option("--api", help="grpc (Triton ModelStreamInfer) | triton-http (Triton generate_stream, SSE) | openai (any OpenAI-compatible server: vLLM, TGI, trtllm-serve, Triton's OpenAI frontend).")] = "grpc",
    openai_endpoint: Annotated[str, typer.Option("--openai-endpoint", help="With --api openai: completions (exact-ISL prompt text, default) | chat (chat/completions; the chat template adds tokens, ISL = the server's prompt_tokens).")] = "completions",
    model: Annotated[str | None, typer.Option("--model", help="ensemble | tensorrt_llm | tensorrt_llm_bls (default: recipe/last build, else ensemble); the LLM-API (build.engine: pytorch) repository has only tensorrt_llm. With --api openai: the served model name (default: the only one GET /v1/models lists).")] = None,
    isl: Annotated[int | None, typer.Option("--isl", min=1, help="Input tokens per request (with --osl).")] = None,
    osl: Annotated[int | None, typer.Option("--osl", min=1, help="Output tokens per request (with --isl).")] = None,
    scenario: Annotated[list[str] | None, typer.Option("--scenario", help="ISL:OSL, repeatable (e.g. --scenario 100:2000 --scenario 100:100).")] = None,
    recipe: Annotated[Path | None, typer.Option("--recipe", help="Take defaults from this recipe's bench section.")] = None,
    concurrency: Annotated[str | None, typer.Option("--concurrency", help="Closed-loop load points, e.g. 1,8,64,256.")] = None,
    request_rate: Annotated[str | None, typer.Option("--request-rate", help="Open-loop load points in requests/s, e.g. 0.5,2.")] = None,
    arrival: Annotated[str | None, typer.Option("--arrival", help="poisson | constant (with --request-rate).")] = None,
    num_requests: Annotated[int | None, typer.Option("--num-requests", min=1, help="Measured requests per load point (default: the recipe's max(requests_per_load × load, min_requests), 4 and 16 unless set).")] = None,
    duration: Annotated[float | None, typer.Option("--duration", min=0.1, help="Measure each load point for this many seconds instead.")] = None,
    warmup: Annotated[int | None, typer.Option("--warmup", min=0, help="Warmup requests per load point (excluded).")] = None,
    goodput: Annotated[list[str] | None, typer.Option("--goodput", help="SLOs in ms: ttft:200,itl:20 (keys ttft, itl, tpot, e2e; repeatable).")] = None,
    timeout: Annotated[float | None, typer.Option("--timeout", min=0.001, help="Per-request timeout in seconds.")] = None,
    tokenizer: Annotated[Path | None, typer.Option("--tokenizer", help="HF tokenizer dir (default: the last build's).")] = None,
    dataset: Annotated[Path | None, typer.Option("--dataset", help="JSONL prompts (text/prompt/input_ids) instead of synthetic ones; the ISL of --isl/--scenario is then only a label (each request records its own input tokens).")] = None,
    out: Annotated[Path | None, typer.Option("--out", help="Run directory (default artifacts/bench/<YYYYmmdd-HHMMSS>).")] = None,
    seed: Annotated[int | None, typer.Option("--seed", help="Seed of the synthetic prompts and Poisson arrivals.")] = None,
    server_timestamps: Annotated[bool, typer.Option("--server-timestamps", help="Also request the server's perf timestamps (return_perf_metrics).")] = False,
    metrics_url: Annotated[str | None, typer.Option("--metrics-url", help="Triton's Prometheus endpoint (default http://<--url host>:8002/metrics when it answers); queue/compute deltas per load point.")] = None,
    allow_short: Annotated[bool, typer.Option("--allow-short", help="Do not fail when requests return fewer than OSL tokens although min_tokens forced it.")] = False,
) -> None:
    """Benchmark TTFT / ITL / TPOT / throughput at exact ISL/OSL: Triton over gRPC or HTTP, or any OpenAI-compatible server."""
    if ctx.invoked_subcommand is not None:
        return
    from pipeline import artifacts
    from pipeline.bench.console import progress_bar, scenario_tables
    from pipeline.bench.run import check_outcome
    from pipeline.errors import UserError
    from pipeline.layout import BuildLayout
    from pipeline.stages import bench as stage

    if (isl is None) != (osl is None):
        raise UserError("--isl and --osl go together (or use --scenario ISL:OSL)")
    if concurrency and request_rate:
        raise UserError("--concurrency and --request-rate exclude each other")
    from pipeline.bench.apis import API_NAMES
    from pipeline.bench.http_client import OPENAI_ENDPOINTS

    if api not in API_NAMES:
        raise UserError(f"--api {api!r}: use one of {', '.join(API_NAMES)}")
    if openai_endpoint not in OPENAI_ENDPOINTS:
        raise UserError(f"--openai-endpoint {openai_endpoint!r}: use {' or '.join(OPENAI_ENDPOINTS)}")
    served_model = None
    if api == "openai":  # --model names the served model, not a Triton model of the recipe
        served_model, model = model, None
    build = artifacts.last_build()
    if recipe is not None:
        candidate = artifacts.default_build_dir(recipe.stem)
        build = candidate if candidate.is_dir() else build
    elif api != "openai":  # the build a detached `trtpipe serve` runs at this URL, rather than the last one built
        from pipeline.bench.apis import DEFAULT_URLS
        from pipeline.stages import serve as srv

        build = srv.detached_build(url or DEFAULT_URLS[api]) or build
    layout = BuildLayout(build) if build is not None else None
    scenarios = [parse_scenario(s) for s in scenario or []]
    if isl is not None and osl is not None:
        scenarios.append((isl, osl))
    overrides = {
        "model": model,
        "scenarios": [{"isl": i, "osl": o} for i, o in scenarios] or None,
        "concurrency": _ints(concurrency, "--concurrency") if concurrency else None,
        "request_rate": _floats(request_rate, "--request-rate") if request_rate else None,
        "arrival": arrival,
        "num_requests": num_requests,
        "duration_s": duration,
        "warmup_requests": warmup,
        "goodput": parse_goodput(goodput) if goodput else None,
        "request_timeout_s": timeout,
        "dataset": dataset,
        "seed": seed,
        "server_timestamps": server_timestamps or None,
        "allow_short": allow_short or None,
    }
    if concurrency:  # explicit concurrency wins over a recipe's request_rate
        overrides["request_rate"] = []
    spec = stage.with_overrides(stage.spec_for(recipe, layout), overrides, flags=FLAGS)
    if api == "openai" and layout is not None:  # not our deployment: keep only the last build's tokenizer, no provenance
        tokenizer = tokenizer or layout.tokenizer_dir()
        layout = None
    target = stage.BenchTarget(url=url, layout=layout, tokenizer=tokenizer, out=out, metrics_url=metrics_url, api=api,
                               openai_endpoint=openai_endpoint, served_model=served_model)
    with progress_bar(err_console) as start:
        result = stage.run(spec, target, on_progress=start, on_status=lambda s: err_console.print(s, highlight=False))
    con = _wide(console)
    for table in scenario_tables(result.load_points, goodput=bool(spec.goodput)):
        con.print(table)
    for w in result.warnings:
        err_console.print(f"[yellow]warning:[/] {w}", highlight=False)
    con.print(f"results: {result.run_dir}", highlight=False)
    check_outcome(result)


@app.command("compare")
@handle_errors
def compare(
    run_a: Annotated[Path, typer.Argument(help="Baseline run directory (A).")],
    run_b: Annotated[Path, typer.Argument(help="New run directory (B).")],
) -> None:
    """Per scenario × load point: A, B, change in % and better/worse by each metric's direction."""
    from pipeline.bench.compare import compare_runs, compare_table

    rows = compare_runs(run_a, run_b)
    _wide(console).print(compare_table(rows, f"B = {run_b}  vs  A = {run_a}"))
