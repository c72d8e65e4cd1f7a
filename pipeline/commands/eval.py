"""``trtpipe eval``: an accuracy gate on a deployment — candidate vs baseline, PASS / FAIL / INCONCLUSIVE.

Examples::

    trtpipe eval                                             # last build vs its full-precision baseline, embedded task
    trtpipe eval artifacts/smollm2_135m_cpu_fp8 --n 20 --rule paired
    trtpipe eval recipes/smollm2_135m_cpu_fp8.yaml --baseline artifacts/other_build
    trtpipe eval BUILD --url localhost:8001 --task agreement # a running deployment of BUILD

Exit status: 0 PASS, 1 FAIL, 3 INCONCLUSIVE, 2 a user mistake (nothing written). The work is
:func:`pipeline.eval.stage.run`; flags are validated overrides of the recipe's ``eval`` section.
"""

from __future__ import annotations

from pathlib import Path
from typing import Annotated, Any

import typer

from pipeline.commands.common import console, err_console, handle_errors

#: EvalSpec field → the flag that overrides it (validation errors name the flag)
FLAGS = {"task": "--task", "n": "--n", "rule": "--rule", "seed": "--seed", "max_output_tokens": "--max-output-tokens",
         "concurrency": "--concurrency", "kld_max": "--kld-max", "same_top1_min": "--same-top1-min"}
EXIT = {"PASS": 0, "FAIL": 1, "INCONCLUSIVE": 3}


@handle_errors
def eval_cmd(
    target: Annotated[Path | None, typer.Argument(metavar="[BUILD_DIR | RECIPE]", help="The candidate build, or a recipe (its artifacts/<name>). Default: the last build.")] = None,
    baseline: Annotated[Path | None, typer.Option("--baseline", help="Baseline build directory (default: the recipe at full precision, built next to the candidate).")] = None,
    baseline_recipe: Annotated[Path | None, typer.Option("--baseline-recipe", help="Baseline recipe: built (or reused) into its artifacts/<name>.")] = None,
    url: Annotated[str | None, typer.Option("--url", help="gRPC host:port of a running deployment of the candidate (not served here).")] = None,
    task: Annotated[str | None, typer.Option("--task", help="embedded | agreement | cnn_dailymail | path/to.jsonl (article, highlights).")] = None,
    n: Annotated[int | None, typer.Option("--n", help="Samples (capped by the task's size).")] = None,
    rule: Annotated[str | None, typer.Option("--rule", help="paired | mlperf | mlperf_high | trtllm | kld (token-level KL divergence on the served context logits).")] = None,
    reference: Annotated[str | None, typer.Option("--reference", help="Published reference for mlperf/trtllm instead of the baseline's scores: llama3.1-8b.")] = None,
    max_output_tokens: Annotated[int | None, typer.Option("--max-output-tokens", help="max_tokens per request.")] = None,
    concurrency: Annotated[int | None, typer.Option("--concurrency", help="Requests in flight.")] = None,
    seed: Annotated[int | None, typer.Option("--seed", help="Sample selection and bootstrap seed.")] = None,
    kld_max: Annotated[float | None, typer.Option("--kld-max", help="kld rule: largest acceptable mean KLD (nats/token; eval.kld_max).")] = None,
    same_top1_min: Annotated[float | None, typer.Option("--same-top1-min", help="kld rule: smallest acceptable same-top-1 % (eval.same_top1_min).")] = None,
    out: Annotated[Path | None, typer.Option("--out", help="Run directory (default artifacts/eval/<YYYYmmdd-HHMMSS>).")] = None,
) -> None:
    """Accuracy gate: generate on the candidate and a baseline, score (ROUGE, agreement), decide PASS/FAIL/INCONCLUSIVE."""
    from pipeline.bench.console import progress_bar
    from pipeline.core.errors import UserError
    from pipeline.core.layout import BuildLayout
    from pipeline.eval import stage as stage
    from pipeline.eval.report import result_tables
    from pipeline.eval.stats import PUBLISHED
    from pipeline.recipe import load_recipe
    from pipeline.recipe.eval import EvalSpec

    if baseline is not None and baseline_recipe is not None:
        raise UserError("--baseline and --baseline-recipe exclude each other")
    if reference is not None and reference not in PUBLISHED:
        raise UserError(f"--reference {reference!r}: known references are {', '.join(PUBLISHED)}")
    layout, recipe, recipe_dir = stage.resolve_candidate(target)
    overrides = {"task": task, "n": n, "rule": rule, "seed": seed, "max_output_tokens": max_output_tokens,
                 "concurrency": concurrency, "kld_max": kld_max, "same_top1_min": same_top1_min}
    spec = stage.with_overrides(recipe.eval if recipe is not None else EvalSpec(), overrides, flags=FLAGS)
    from pipeline.eval import tasks

    tasks.check(spec.task, recipe_dir if task is None else Path("."))
    base_target = None
    if baseline is not None:
        if not BuildLayout(baseline).has_repository():
            raise UserError(f"--baseline {baseline}: not a build directory with a model repository")
        base_target = stage.EvalTarget(layout=BuildLayout(baseline))
    elif baseline_recipe is not None:
        if not baseline_recipe.is_file():
            raise UserError(f"--baseline-recipe {baseline_recipe}: no such recipe")
        load_recipe(baseline_recipe)  # a broken recipe is a user mistake: before any work
    elif recipe is None:
        raise UserError(f"{layout.root} has no recipe.yaml: give --baseline BUILD_DIR or --baseline-recipe RECIPE")
    candidate = stage.EvalTarget(layout=layout, url=url)
    status = lambda s: err_console.print(s, highlight=False)  # noqa: E731
    if baseline_recipe is not None:
        base_target = stage.EvalTarget(layout=stage.build_recipe_baseline(baseline_recipe, status))
    bar: dict[str, Any] = {}

    with progress_bar(err_console) as start:
        def on_progress(description: str, total: int):  # noqa: ANN202 - one bar for both deployments
            if "advance" not in bar:
                bar["advance"] = start("generate: candidate, then baseline", 2 * total)
            return bar["advance"]

        result = stage.run(spec, candidate, base_target, recipe=recipe, recipe_dir=recipe_dir, reference=reference,
                           out=out, on_progress=on_progress, on_status=status)
    con = console
    for table in result_tables(result):
        con.print(table)
    for r in result.rule.reasons:
        console.print(f"  {r}", highlight=False)
    color = {"PASS": "green", "FAIL": "red", "INCONCLUSIVE": "yellow"}[result.verdict]
    console.print(f"[bold {color}]{result.verdict}[/] ({result.rule.rule}); results: {result.run_dir}", highlight=False)
    raise typer.Exit(EXIT[result.verdict])
