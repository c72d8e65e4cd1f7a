"""``trtpipe eval``: an accuracy gate on a deployment — candidate vs baseline, PASS / FAIL / INCONCLUSIVE.

Examples::

    trtpipe eval                                             # last build vs its full-precision baseline, embedded task
    trtpipe eval artifacts/smollm2_135m_cpu_fp8 --n 20 --rule paired
    trtpipe eval recipes/smollm2_135m_cpu_fp8.yaml --baseline artifacts/other_build
    trtpipe eval BUILD --url localhost:8001 --task agreement # a running deployment of BUILD

Exit status: 0 PASS, 1 FAIL, 3 INCONCLUSIVE, 2 a user mistake (nothing written). The work is
:func:`pipeline.eval.stage.run`. The options are declared on the fields they set (the recipe's ``eval`` section
:class:`~pipeline.recipe.eval.EvalSpec`, :class:`~pipeline.eval.stage.EvalTarget`,
:class:`~pipeline.eval.options.EvalRun`) and generated here by :mod:`pipeline.eval.options`; their values are
validated overrides of the recipe's ``eval`` section.
"""

from __future__ import annotations

import inspect
from pathlib import Path
from typing import Annotated, Any

import typer

from pipeline.commands.common import console, err_console, handle_errors

EXIT = {"PASS": 0, "FAIL": 1, "INCONCLUSIVE": 3}


def _signature() -> inspect.Signature:
    """``eval_cmd(target, **options)`` as typer sees it: the argument, then one keyword parameter per declared option."""
    from pipeline.eval.options import all_parameters

    target = inspect.Parameter("target", inspect.Parameter.POSITIONAL_OR_KEYWORD, default=None, annotation=Annotated[
        Path | None, typer.Argument(metavar="[BUILD_DIR | RECIPE]", help=(
            "The candidate build, or a recipe (its artifacts/<name>). Default: the last build."))])
    return inspect.Signature([target, *all_parameters()])


@handle_errors
def eval_cmd(target: Path | None = None, **options: Any) -> None:
    """Accuracy gate: generate on the candidate and a baseline, score (ROUGE, agreement), decide PASS/FAIL/INCONCLUSIVE."""
    from pipeline.bench.console import progress_bar
    from pipeline.eval import stage
    from pipeline.eval.options import resolve
    from pipeline.eval.report import result_tables

    r = resolve(target, options)
    status = lambda s: err_console.print(s, highlight=False)
    base_target = r.baseline
    if r.run.baseline_recipe is not None:
        base_target = stage.EvalTarget(layout=stage.build_recipe_baseline(r.run.baseline_recipe, status))
    bar: dict[str, Any] = {}

    with progress_bar(err_console) as start:
        def on_progress(description: str, total: int):  # one bar for both deployments
            if "advance" not in bar:
                bar["advance"] = start("generate: candidate, then baseline", 2 * total)
            return bar["advance"]

        result = stage.run(r.spec, r.candidate, base_target, recipe=r.recipe, recipe_dir=r.recipe_dir,
                           reference=r.run.reference, out=r.run.out, on_progress=on_progress, on_status=status)
    for table in result_tables(result):
        console.print(table)
    for reason in result.rule.reasons:
        console.print(f"  {reason}", highlight=False)
    color = {"PASS": "green", "FAIL": "red", "INCONCLUSIVE": "yellow"}[result.verdict]
    console.print(f"[bold {color}]{result.verdict}[/] ({result.rule.rule}); results: {result.run_dir}", highlight=False)
    raise typer.Exit(EXIT[result.verdict])


eval_cmd.__signature__ = _signature()  # type: ignore[attr-defined]
