"""``trtpipe eval``: an accuracy gate on a deployment — candidate vs baseline, PASS / FAIL / INCONCLUSIVE.

Examples::

    trtpipe eval                                             # last build vs its full-precision baseline, embedded task
    trtpipe eval artifacts/smollm2_135m_cpu_fp8 --n 20 --rule paired
    trtpipe eval recipes/smollm2_135m_cpu_fp8.yaml --baseline artifacts/other_build
    trtpipe eval BUILD --url localhost:8001 --task agreement # a running deployment of BUILD

Exit status: 0 PASS, 1 FAIL, 3 INCONCLUSIVE, 2 a user mistake (nothing written). The work is
:func:`pipeline.stages.eval.run`; flags are validated overrides of the recipe's ``eval`` section.
"""

from __future__ import annotations

from pathlib import Path
from typing import Annotated, Any

import typer

from pipeline.commands.common import console, err_console, handle_errors

#: EvalSpec field → the flag that overrides it (validation errors name the flag)
FLAGS = {"task": "--task", "n": "--n", "rule": "--rule", "seed": "--seed", "max_output_tokens": "--max-output-tokens",
         "concurrency": "--concurrency"}
EXIT = {"PASS": 0, "FAIL": 1, "INCONCLUSIVE": 3}


def _resolve(target: Path | None) -> tuple[Any, Any, Path]:
    """``(layout, recipe or None, recipe_dir)`` of ``[BUILD_DIR | RECIPE]`` (default: the last build).

    Raises:
        UserError: nothing built / not a build directory.
    """
    from pipeline import artifacts
    from pipeline.errors import UserError
    from pipeline.layout import BuildLayout
    from pipeline.recipe import load_recipe

    if target is not None and target.suffix in (".yaml", ".yml"):
        if not target.is_file():
            raise UserError(f"{target}: no such recipe")
        recipe = load_recipe(target)
        layout = BuildLayout(artifacts.default_build_dir(recipe.name or target.stem))
        if not layout.has_repository():
            raise UserError(f"{target} is not built ({layout.root}): run `trtpipe build {target}` first")
        return layout, recipe, target.parent
    build = target if target is not None else artifacts.last_build()
    if build is None:
        raise UserError("no build found: give BUILD_DIR or RECIPE, or run `trtpipe build RECIPE` first")
    layout = BuildLayout(build)
    if not layout.has_repository():
        raise UserError(f"{build} is not a build directory with a model repository: run `trtpipe build RECIPE` first")
    recipe = load_recipe(layout.recipe_file) if layout.recipe_file.is_file() else None
    return layout, recipe, Path(".")


def result_tables(result: Any) -> list[Any]:
    """The scores table (per metric: candidate, baseline, delta, CI, threshold, verdict) and the power table."""
    from rich.table import Table

    m, rule = result.means, result.rule
    t = Table(title=f"trtpipe eval — task {result.task}, n={result.n}, rule {rule.rule}", title_justify="left")
    for col in ("metric", "candidate", "baseline", "delta", "CI of delta", "threshold", "verdict"):
        t.add_column(col, justify="right" if col != "metric" else "left")
    checked = {c.metric: c for c in rule.checks}
    for k in [*m["candidate"]]:
        c = checked.get(k)
        cand, base = m["candidate"][k], m["baseline"].get(k)
        ci = "-" if c is None else f"[{c.ci[0] - (c.reference if rule.rule.startswith('mlperf') else 0):+.2f}, " \
                                   f"{c.ci[1] - (c.reference if rule.rule.startswith('mlperf') else 0):+.2f}]"
        if c is not None and rule.rule == "trtllm":
            ci = "-"
        thr = "-" if c is None else f"{c.threshold:+.2f}" if rule.rule == "paired" else f"{c.threshold:.2f}"
        t.add_row(k, f"{cand:.2f}", "-" if base is None else f"{base:.2f}", "-" if base is None else f"{cand - base:+.2f}",
                  ci, thr, "-" if c is None else c.verdict)
    a = m["agreement"]
    t.caption = (f"ROUGE F x100, gen_len in characters; agreement with the baseline: exact {a['exact_match_pct']:.0f} %, "
                 f"ROUGE-L {a['rougeL_vs_baseline']:.1f}, median first divergent token "
                 f"{'-' if a['median_first_divergent_token'] is None else int(a['median_first_divergent_token'])}")
    p = Table(title="power analysis", title_justify="left")
    for col in ("metric", "n", "threshold", "margin", "std error", "min detectable effect", "n for MDE <= margin", "supported"):
        p.add_column(col, justify="right" if col != "metric" else "left")
    for row in rule.power:
        p.add_row(row.metric, str(row.n), f"{row.threshold:.2f}", f"{row.margin:.3f}", f"{row.se:.3f}", f"{row.mde:.3f}",
                  "-" if row.n_required is None else f"{row.n_required:,}", "yes" if row.supported else "no")
    p.caption = "one-sided alpha %g, beta %g (power %g)" % (result.spec.alpha, result.spec.beta, 1 - result.spec.beta)
    return [t, p] if rule.power else [t]


@handle_errors
def eval_cmd(
    target: Annotated[Path | None, typer.Argument(metavar="[BUILD_DIR | RECIPE]", help="The candidate build, or a recipe (its artifacts/<name>). Default: the last build.")] = None,
    baseline: Annotated[Path | None, typer.Option("--baseline", help="Baseline build directory (default: the recipe at full precision, built next to the candidate).")] = None,
    baseline_recipe: Annotated[Path | None, typer.Option("--baseline-recipe", help="Baseline recipe: built (or reused) into its artifacts/<name>.")] = None,
    url: Annotated[str | None, typer.Option("--url", help="gRPC host:port of a running deployment of the candidate (not served here).")] = None,
    task: Annotated[str | None, typer.Option("--task", help="embedded | agreement | cnn_dailymail | path/to.jsonl (article, highlights).")] = None,
    n: Annotated[int | None, typer.Option("--n", help="Samples (capped by the task's size).")] = None,
    rule: Annotated[str | None, typer.Option("--rule", help="paired | mlperf | mlperf_high | trtllm.")] = None,
    reference: Annotated[str | None, typer.Option("--reference", help="Published reference for mlperf/trtllm instead of the baseline's scores: llama3.1-8b.")] = None,
    max_output_tokens: Annotated[int | None, typer.Option("--max-output-tokens", help="max_tokens per request.")] = None,
    concurrency: Annotated[int | None, typer.Option("--concurrency", help="Requests in flight.")] = None,
    seed: Annotated[int | None, typer.Option("--seed", help="Sample selection and bootstrap seed.")] = None,
    out: Annotated[Path | None, typer.Option("--out", help="Run directory (default artifacts/eval/<YYYYmmdd-HHMMSS>).")] = None,
) -> None:
    """Accuracy gate: generate on the candidate and a baseline, score (ROUGE, agreement), decide PASS/FAIL/INCONCLUSIVE."""
    from pipeline.bench.console import progress_bar
    from pipeline.errors import UserError
    from pipeline.eval.stats import PUBLISHED
    from pipeline.layout import BuildLayout
    from pipeline.recipe import load_recipe
    from pipeline.recipe.eval import EvalSpec
    from pipeline.stages import eval as stage

    if baseline is not None and baseline_recipe is not None:
        raise UserError("--baseline and --baseline-recipe exclude each other")
    if reference is not None and reference not in PUBLISHED:
        raise UserError(f"--reference {reference!r}: known references are {', '.join(PUBLISHED)}")
    layout, recipe, recipe_dir = _resolve(target)
    overrides = {"task": task, "n": n, "rule": rule, "seed": seed, "max_output_tokens": max_output_tokens,
                 "concurrency": concurrency}
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
        from pipeline import artifacts
        from pipeline.stages import build

        br = load_recipe(baseline_recipe)
        status(f"baseline: building {baseline_recipe} (reused when unchanged)")
        last = artifacts.last_build()
        res = build.run(br, artifacts.default_build_dir(br.name or baseline_recipe.stem), recipe_dir=baseline_recipe.parent, warn=status)
        if last is not None:
            artifacts.record_last_build(last)
        base_target = stage.EvalTarget(layout=res.layout)
    bar: dict[str, Any] = {}

    with progress_bar(err_console) as start:
        def on_progress(description: str, total: int):  # noqa: ANN202 - one bar for both deployments
            if "advance" not in bar:
                bar["advance"] = start("generate: candidate, then baseline", 2 * total)
            return bar["advance"]

        result = stage.run(spec, candidate, base_target, recipe=recipe, recipe_dir=recipe_dir, reference=reference,
                           out=out, on_progress=on_progress, on_status=status)
    from rich.console import Console

    con = console if console.is_terminal else Console(width=160)
    for table in result_tables(result):
        con.print(table)
    for r in result.rule.reasons:
        console.print(f"  {r}", highlight=False)
    color = {"PASS": "green", "FAIL": "red", "INCONCLUSIVE": "yellow"}[result.verdict]
    console.print(f"[bold {color}]{result.verdict}[/] ({result.rule.rule}); results: {result.run_dir}", highlight=False)
    raise typer.Exit(EXIT[result.verdict])
