"""``trtpipe build RECIPE``: quantize → engine → Triton model repository."""

from __future__ import annotations

import time
from pathlib import Path
from typing import Annotated

import typer

from pipeline.commands.common import console, handle_errors


@handle_errors
def build(
    recipe_file: Annotated[Path, typer.Argument(metavar="RECIPE", help="Recipe YAML, e.g. recipes/smollm2_135m_cpu_fp8.yaml.")],
    out: Annotated[Path | None, typer.Option("--out", help="Build directory (default: artifacts/<recipe name>).")] = None,
    stage: Annotated[str | None, typer.Option("--stage", help="Stop after this stage: quantize | engine | repo (default: all).")] = None,
    force: Annotated[bool, typer.Option("--force", help="Rebuild every stage even if its inputs are unchanged.")] = False,
    dry_run: Annotated[bool, typer.Option("--dry-run", help="Write commands and configs only (no ModelOpt run, no trtllm-build).")] = False,
    set_: Annotated[list[str] | None, typer.Option("--set", help="Override KEY=VALUE (dotted key), e.g. build.max_batch_size=64.")] = None,
) -> None:
    """Build a deployment from a recipe. Reruns reuse every stage whose inputs did not change."""
    from pipeline.assemble import stage as build_stage
    from pipeline.assemble.seed import local_builds
    from pipeline.core import artifacts
    from pipeline.core.results import StageResult
    from pipeline.recipe import load_recipe

    recipe = load_recipe(recipe_file, set_)
    build_dir = out or artifacts.default_build_dir(recipe.name or recipe_file.stem)
    console.print(
        f"[bold]trtpipe build[/] {recipe_file} → {build_dir}  ({recipe.model.source} on {recipe.target.gpu}, "
        f"qformat {recipe.quantization.qformat}, engine {recipe.build.engine}{', dry run' if dry_run else ''})",
        highlight=False,
    )
    from pipeline.core.hardware import alias_note

    if note := alias_note(recipe.target.gpu):
        console.print(f"  [yellow]note:[/] {note}", highlight=False, soft_wrap=True)
    t0 = time.perf_counter()

    def on_stage(name: str, res: StageResult, changes: list[str]) -> None:
        status = res.status
        if res.cached:
            how = "[dim]reused (inputs unchanged)[/]"
        elif status in ("dry_run", "not_built"):
            how = f"[yellow]{status.replace('_', ' ')}[/]: commands and configs written"
        else:
            how = f"built in {res.manifest.get('timings_s', {}).get('total', 0):.1f} s"
        console.print(f"  [green]✓[/] {name:<12} {res.path}  {how}", highlight=False)
        if changes:
            console.print(f"    [dim]changed:[/] {'; '.join(changes)}", highlight=False, soft_wrap=True)

    def warn(msg: str) -> None:
        console.print(f"  [yellow]warning:[/] {msg}", highlight=False, soft_wrap=True)

    result = build_stage.run(
        recipe, build_dir, recipe_dir=recipe_file.resolve().parent, until=stage, force=force, dry_run=dry_run,
        on_stage=on_stage, warn=warn, donors=local_builds(),
    )
    for name, donor in result.seeded.items():
        if result.stages.get(name) is not None and result.stages[name].cached:
            console.print(f"  [dim]{name} hard-linked from {donor} (same inputs)[/]", highlight=False)
    console.print(f"[bold green]done[/] in {time.perf_counter() - t0:.1f} s: {result.build_dir}", highlight=False)
