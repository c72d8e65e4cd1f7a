"""``trtpipe`` console script: a thin typer shell over the stage functions.

Commands: ``build``, ``serve``, ``bench`` (+ ``bench compare``), ``eval``, ``tune``, ``plan``, ``recipe``
(``validate``/``schema``/``show``). Each lives in :mod:`pipeline.commands`; errors map to exit
codes in :func:`pipeline.commands.common.handle_errors` (user mistakes: 2, no traceback).
"""

from __future__ import annotations

import click
import typer
from typer import rich_utils

from pipeline import __version__
from pipeline.commands import bench as bench_cmd
from pipeline.commands import build as build_cmd
from pipeline.commands import deploy as deploy_cmd
from pipeline.commands import eval as eval_cmd
from pipeline.commands import plan as plan_cmd
from pipeline.commands import profile as profile_cmd
from pipeline.commands import recipe as recipe_cmd
from pipeline.commands import release as release_cmd
from pipeline.commands import serve as serve_cmd
from pipeline.commands import tune as tune_cmd


def _usage_error(exc: click.ClickException) -> None:
    """Click's usage errors (unknown option, bad value) in trtpipe's one style: the usage line, then
    ``error: <what>`` on stderr, as :func:`pipeline.commands.common.handle_errors` prints every other error (typer's
    default is a box titled ``Error``)."""
    if exc.__class__.__name__ == "NoArgsIsHelpError":
        return
    ctx = getattr(exc, "ctx", None)
    if ctx is not None:
        click.echo(ctx.get_usage(), err=True)
        click.echo(f"Try '{ctx.command_path} {ctx.help_option_names[0]}' for help.", err=True)
    click.echo(f"error: {exc.format_message()}", err=True)


rich_utils.rich_format_error = _usage_error  # typer.core calls it through the module: one error style

app = typer.Typer(
    name="trtpipe",
    help="HF checkpoint → ModelOpt quantization → TensorRT-LLM engine → Triton repo → serve → ISL/OSL benchmark.",
    no_args_is_help=True,
    pretty_exceptions_enable=False,
    add_completion=False,
)


def _version(value: bool) -> None:
    if value:
        typer.echo(f"trtpipe {__version__}")
        raise typer.Exit()


@app.callback()
def _root(
    version: bool = typer.Option(False, "--version", callback=_version, is_eager=True, help="Print the version and exit."),
) -> None:
    """trtpipe: recipe-driven TensorRT-LLM + Triton deployments, verified end to end on CPU."""


app.command("build")(build_cmd.build)
app.command("serve")(serve_cmd.serve)
app.add_typer(bench_cmd.app, name="bench")
app.add_typer(plan_cmd.app, name="plan")
app.add_typer(recipe_cmd.app, name="recipe")
app.command("release")(release_cmd.release)
app.add_typer(deploy_cmd.app, name="deploy")
app.command("eval")(eval_cmd.eval_cmd)
app.command("tune")(tune_cmd.tune)
app.command("profile")(profile_cmd.profile)


def main() -> None:
    """Console-script entry point."""
    from pipeline.core.quiet import disable_tqdm

    disable_tqdm()
    app()


if __name__ == "__main__":
    main()
