"""``trtpipe plan RECIPE``: GPU sizing — weights, KV-cache capacity, concurrency, throughput bounds and predictions;
``trtpipe plan [RECIPE] --against RUN_DIR``: predicted vs measured for a bench run; ``trtpipe plan measure-host``:
this host's rates for the cpu target's predictions."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated, Any

import typer
from typer.core import TyperGroup

from pipeline.commands.common import console, err_console, handle_errors

#: the (hidden) name of ``trtpipe plan RECIPE …``: what ``trtpipe plan`` runs unless a sub-command is named
DEFAULT = "recipe"


class _PlanGroup(TyperGroup):
    """``trtpipe plan WORD …`` runs the sub-command WORD when there is one (``measure-host``), else the planning
    command with every argument as given, so ``trtpipe plan RECIPE …`` and ``trtpipe plan --help`` read as before."""

    def make_context(self, info_name: str | None, args: list[str], parent: Any = None, **extra: Any) -> Any:
        if args and args[0] in self.commands and args[0] != DEFAULT:
            return super().make_context(info_name, args, parent=parent, **extra)
        return self.commands[DEFAULT].make_context(info_name, list(args), parent=parent, **extra)


app = typer.Typer(cls=_PlanGroup, help="Size a recipe: memory, KV cache, concurrency, throughput bounds and predictions; "
                                       "compare predictions with a bench run (--against); measure this host (measure-host).",
                  add_completion=False)


def _concurrency(text: str) -> list[int] | None:
    from pipeline.core.errors import UserError

    if text.strip() == "all":
        return None
    try:
        return [int(c) for c in text.split(",") if c.strip()]
    except ValueError:
        raise UserError(f"--concurrency {text!r}: expected comma-separated integers, e.g. 1,4,16 (or all)") from None


def _against(runs: list[Path], recipe_file: Path | None, gpu: list[str] | None, concurrency: str, set_: list[str] | None,
             json_out: bool, markdown: bool) -> None:
    """``--against``: predicted vs measured for every closed-loop load point of ``runs``."""
    import json

    from pipeline.calibrate.measured import compare_run, comparison_table
    from pipeline.core.errors import UserError

    if gpu and len(gpu) > 1:
        raise UserError("--against predicts on one GPU: give --gpu once")
    if json_out and markdown:
        raise UserError("--json and --markdown: give one")
    conc = _concurrency(concurrency)
    rows = [r for run in runs for r in compare_run(run, recipe_file, conc, gpu=gpu[0] if gpu else None, overrides=set_)]
    typer.echo(json.dumps([r.model_dump(mode="json") for r in rows], indent=2) if json_out
               else comparison_table(rows, markdown=markdown))


@app.command(DEFAULT, hidden=True)
@handle_errors
def plan(
    recipe_file: Annotated[Path | None, typer.Argument(metavar="RECIPE", help="Recipe YAML, e.g. recipes/llama31_8b_h200_fp8.yaml (with --against: instead of the recipe the run recorded).")] = None,
    gpu: Annotated[list[str] | None, typer.Option(
        "--gpu", help="Plan on this catalog GPU instead of target.gpu (e.g. a100_40gb, l4, cpu); repeat to compare GPUs.")] = None,
    isl: Annotated[int | None, typer.Option("--isl", min=1, help="Input sequence length in tokens (with --osl; default: the recipe's bench scenarios).")] = None,
    osl: Annotated[int | None, typer.Option("--osl", min=1, help="Output sequence length in tokens (with --isl).")] = None,
    json_out: Annotated[bool, typer.Option("--json", help="Print the plan as JSON (PlanResult; a list of them with several --gpu; with --against: PointComparison rows).")] = False,
    set_: Annotated[list[str] | None, typer.Option("--set", help="Override KEY=VALUE (dotted key), e.g. build.max_batch_size=64.")] = None,
    against: Annotated[list[Path] | None, typer.Option("--against", metavar="RUN_DIR", help="Compare the prediction with this `trtpipe bench` run directory (bench.json) per load point; repeatable.")] = None,
    concurrency: Annotated[str | None, typer.Option("--concurrency", help="Closed-loop client counts to predict, e.g. 1,8,64 (default: the recipe's bench.concurrency); with --against: the load points to compare (default 1,4,16; or all).")] = None,
    slo: Annotated[list[str] | None, typer.Option("--slo", help="Latency SLOs in ms, e.g. ttft:500,itl:50 (keys ttft, itl, tpot, e2e; TTFT and E2E checked at p99): per ISL/OSL, the largest concurrency predicted to meet them.")] = None,
    markdown: Annotated[bool, typer.Option("--markdown", help="With --against: print a Markdown table.")] = False,
    acceptance: Annotated[str | None, typer.Option("--acceptance", help="Speculative decoding: acceptance length (tokens per step incl. the target's own, e.g. 2.5) or a bench run that measured it (default: per decoding type, docs/plan.md).")] = None,
) -> None:
    """Estimate per-GPU memory, KV-cache capacity, max concurrency, throughput bounds and predicted
    throughput/latency of a recipe.

    --concurrency 1,8,64 predicts TTFT (mean, p99) and ITL at those closed-loop client counts; --slo ttft:500,itl:50
    finds, per ISL/OSL, the largest concurrency predicted to meet the SLOs.

    With --against RUN_DIR: measured vs predicted output tokens/s, TTFT and ITL per closed-loop load point of a
    bench run. `trtpipe plan measure-host`: measure this host for the cpu target's predictions.

    Exit 0 when the recipe fits (with several --gpu: when it fits at least one), 2 when it does not (errors
    printed with the numbers) or on a user mistake; with --against, 0 when every point was compared.
    """
    from pipeline.core.errors import UserError
    from pipeline.plan import plan_recipe
    from pipeline.plan.render import print_plan, render_comparison
    from pipeline.plan.speculative import parse_acceptance
    from pipeline.recipe import load_recipe
    from pipeline.recipe.bench import parse_goodput

    if against:
        if isl is not None or osl is not None or slo:
            raise UserError("--isl/--osl/--slo do not go with --against: the run's own load points are compared")
        return _against(against, recipe_file, gpu, concurrency or "1,4,16", set_, json_out, markdown)
    if recipe_file is None:
        raise UserError("missing RECIPE: trtpipe plan RECIPE (or trtpipe plan --against RUN_DIR, trtpipe plan measure-host)")
    if (isl is None) != (osl is None):
        raise UserError("--isl and --osl go together: give both, e.g. --isl 128 --osl 128")
    recipe = load_recipe(recipe_file, set_)
    scenarios = [(isl, osl)] if isl is not None and osl is not None else None
    conc = _concurrency(concurrency) if concurrency else None
    if concurrency and conc is None:
        raise UserError("--concurrency all goes with --against; give client counts, e.g. 1,8,64")
    slos = parse_goodput(slo, "--slo") if slo else None
    names = list(dict.fromkeys(gpu or [None]))
    acc = None if acceptance is None else parse_acceptance(acceptance)
    results = [plan_recipe(recipe, gpu=g, scenarios=scenarios, recipe_dir=recipe_file.resolve().parent, concurrency=conc, slo=slos,
                           acceptance=acc) for g in names]
    if json_out:
        typer.echo(results[0].model_dump_json(indent=2) if len(results) == 1
                   else "[\n" + ",\n".join(r.model_dump_json(indent=2) for r in results) + "\n]")
    elif len(results) == 1:
        print_plan(results[0], console, conc or list(recipe.bench.concurrency))
    else:
        console.print(render_comparison(results), highlight=False)
    failed = [r for r in results if not r.verdict.ok]
    if failed and len(failed) == len(results):
        if json_out:
            for r in failed:
                err_console.print(f"[bold red]error:[/] {recipe_file}: does not fit {r.target}: " + "; ".join(r.verdict.errors),
                                  highlight=False, soft_wrap=True)
        raise typer.Exit(2)


@app.command("measure-host")
@handle_errors
def measure_host(
    dry_run: Annotated[bool, typer.Option("--dry-run", help="Print the measurements; write nothing.")] = False,
    out: Annotated[Path | None, typer.Option("--out", help="Write here instead of the file the planner reads ($TRTPIPE_HOST_FILE, else cpu_host.yaml in trtpipe's cache, ~/.cache/trtpipe).")] = None,
    served: Annotated[bool, typer.Option("--served/--no-served", help="Also serve a probe model with Triton and bench it: the CPU a served deployment spends per token besides the engine (~40 s).")] = True,
) -> None:
    """Measure this host's rates, CPU-engine overheads and a served deployment's CPU per token (about two minutes, all
    cores; an idle machine) and write them to the user's cache, where `trtpipe plan` on the cpu target uses them."""
    import yaml

    from pipeline.calibrate.host import HEADER, measure
    from pipeline.core import hardware

    host = measure(log=lambda line: console.print(line, highlight=False), served=served)
    if dry_run:
        typer.echo(yaml.safe_dump(host.model_dump(), sort_keys=False, allow_unicode=True, width=120))
        return
    console.print(f"wrote {hardware.write_host(host, out or hardware.host_file(), HEADER)}", highlight=False, soft_wrap=True)
