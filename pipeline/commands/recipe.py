"""``trtpipe recipe validate|schema|show|reference``, and ``recipe new`` (:mod:`pipeline.commands.recipe_new`)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Annotated

import typer
from rich.markup import escape

from pipeline.commands import recipe_new
from pipeline.commands.common import console, err_console, handle_errors

app = typer.Typer(help="Validate, show and document recipes; write a new one (recipe new).", no_args_is_help=True)
app.command("new")(recipe_new.new)


@app.command()
@handle_errors
def validate(
    files: Annotated[list[Path], typer.Argument(help="Recipe YAML files.")],
    set_: Annotated[list[str] | None, typer.Option("--set", help="Override KEY=VALUE (dotted key), e.g. build.max_batch_size=64.")] = None,
) -> None:
    """Validate recipe files (schema, cross-field rules, and whether it fits its GPU); one line per file. Exit 2 if any is invalid."""
    from pipeline.core.errors import RecipeError
    from pipeline.core.hardware import alias_note
    from pipeline.plan import check_fits
    from pipeline.recipe import load_recipe
    from pipeline.recipe.paths import describe, local_path_problems
    from pipeline.recipe.vision import vision_notes

    bad = 0
    for f in files:
        try:
            r = load_recipe(f, set_)
        except RecipeError as e:
            err_console.print(f"[bold red]error:[/] {escape(str(e))}", highlight=False, soft_wrap=True)
            bad += 1
            continue
        missing = local_path_problems(r, f.resolve().parent)  # local files the build would read
        if missing:
            err_console.print(f"[bold red]error:[/] {escape(describe(f, missing))}",
                              highlight=False, soft_wrap=True)
            bad += 1
            continue
        verdict = check_fits(r, recipe_dir=f.resolve().parent)  # the planner's memory fit, before any GPU time
        if not verdict.ok:
            err_console.print(f"[bold red]error:[/] {f}: does not fit {r.target.gpu}: " + "; ".join(verdict.errors),
                              highlight=False, soft_wrap=True)
            bad += 1
            continue
        q = r.quantization
        note = alias_note(r.target.gpu)
        if note:
            err_console.print(f"[yellow]note:[/] {f}: {escape(note)}", highlight=False, soft_wrap=True)
        console.print(
            f"[green]ok[/] {f}: {r.model.source} → {r.target.gpu} ({r.build.engine} engine), "
            f"qformat {q.qformat}, kv_cache_dtype {q.kv_cache_dtype}",
            highlight=False,
        )
        for note in vision_notes(r):  # the vision engine path's end-of-life (pipeline/recipe/vision.py)
            console.print(f"  note: {note}", highlight=False, soft_wrap=True)
    if bad:
        raise typer.Exit(2)


@app.command()
@handle_errors
def schema(
    output: Annotated[Path | None, typer.Option("--output", "-o", help="Write to this file instead of stdout.")] = None,
    tune: Annotated[bool, typer.Option("--tune", help="The TUNE.yaml schema of `trtpipe tune` instead (tune.schema.json).")] = False,
) -> None:
    """Print the recipe JSON Schema (for editor autocompletion via yaml-language-server); --tune: TUNE.yaml's."""
    from pipeline.recipe import recipe_json_schema

    if tune:
        from pipeline.tune.spec import tune_json_schema

        text = json.dumps(tune_json_schema(), indent=2) + "\n"
    else:
        text = json.dumps(recipe_json_schema(), indent=2) + "\n"
    if output:
        output.write_text(text)
        console.print(f"wrote {output}")
    else:
        typer.echo(text, nl=False)


@app.command()
@handle_errors
def show(
    file: Annotated[Path, typer.Argument(help="Recipe YAML file.")],
    set_: Annotated[list[str] | None, typer.Option("--set", help="Override KEY=VALUE.")] = None,
) -> None:
    """Print the fully resolved recipe, every default filled in."""
    from pipeline.recipe import dump_recipe, load_recipe

    typer.echo(dump_recipe(load_recipe(file, set_)), nl=False)


@app.command()
@handle_errors
def reference(
    output: Annotated[Path | None, typer.Option("--output", "-o", help="Write to this file instead of stdout.")] = None,
) -> None:
    """Print the recipe reference (Markdown tables generated from the schema's field docs)."""
    from pipeline.recipe.reference import recipe_reference_markdown

    text = recipe_reference_markdown()
    if output:
        output.write_text(text)
        console.print(f"wrote {output}")
    else:
        typer.echo(text, nl=False)
