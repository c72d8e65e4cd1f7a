"""``trtpipe plan RECIPE``: GPU sizing — weights, KV-cache capacity, concurrency, throughput bounds and predictions."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated

import typer

from pipeline.commands.common import console, err_console, handle_errors


@handle_errors
def plan(
    recipe_file: Annotated[Path, typer.Argument(metavar="RECIPE", help="Recipe YAML, e.g. recipes/llama31_8b_h200_fp8.yaml.")],
    gpu: Annotated[list[str] | None, typer.Option(
        "--gpu", help="Plan on this catalog GPU instead of target.gpu (e.g. a100_40gb, l4, cpu); repeat to compare GPUs.")] = None,
    isl: Annotated[int | None, typer.Option("--isl", min=1, help="Input sequence length in tokens (with --osl; default: the recipe's bench scenarios).")] = None,
    osl: Annotated[int | None, typer.Option("--osl", min=1, help="Output sequence length in tokens (with --isl).")] = None,
    json_out: Annotated[bool, typer.Option("--json", help="Print the plan as JSON (PlanResult; a list of them with several --gpu).")] = False,
    set_: Annotated[list[str] | None, typer.Option("--set", help="Override KEY=VALUE (dotted key), e.g. build.max_batch_size=64.")] = None,
) -> None:
    """Estimate per-GPU memory, KV-cache capacity, max concurrency, throughput bounds and predicted
    throughput/latency of a recipe.

    Exit 0 when the recipe fits (with several --gpu: when it fits at least one), 2 when it does not (errors
    printed with the numbers) or on a user mistake.
    """
    from pipeline.errors import UserError
    from pipeline.plan import plan_recipe
    from pipeline.plan.render import print_plan, render_comparison
    from pipeline.recipe import load_recipe

    if (isl is None) != (osl is None):
        raise UserError("--isl and --osl go together: give both, e.g. --isl 128 --osl 128")
    recipe = load_recipe(recipe_file, set_)
    scenarios = [(isl, osl)] if isl is not None and osl is not None else None
    names = list(dict.fromkeys(gpu or [None]))
    results = [plan_recipe(recipe, gpu=g, scenarios=scenarios, recipe_dir=recipe_file.resolve().parent) for g in names]
    if json_out:
        if len(results) == 1:
            typer.echo(results[0].model_dump_json(indent=2))
        else:
            typer.echo("[\n" + ",\n".join(r.model_dump_json(indent=2) for r in results) + "\n]")
    elif len(results) == 1:
        print_plan(results[0], console, list(recipe.bench.concurrency))
    else:
        console.print(render_comparison(results), highlight=False)
    failed = [r for r in results if not r.verdict.ok]
    if failed and len(failed) == len(results):
        if json_out:
            for r in failed:
                err_console.print(f"[bold red]error:[/] {recipe_file}: does not fit {r.target}: " + "; ".join(r.verdict.errors),
                                  highlight=False, soft_wrap=True)
        raise typer.Exit(2)
