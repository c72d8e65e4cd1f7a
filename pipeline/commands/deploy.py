"""``trtpipe deploy k8s RECIPE|BUILD_DIR``: render the Kubernetes deployment (Helm chart, Dynamo, KServe)."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated

import typer

from pipeline.commands.common import console, handle_errors

app = typer.Typer(help="Deployments of a build beyond one server.", no_args_is_help=True)


@app.command("k8s")
@handle_errors
def k8s(
    target: Annotated[Path, typer.Argument(metavar="RECIPE|BUILD_DIR", help="A recipe YAML or a `trtpipe build` directory.")],
    out: Annotated[Path | None, typer.Option("--out", help="Output directory (default: artifacts/<recipe name>/k8s/<format>).")] = None,
    fmt: Annotated[str, typer.Option("--format", help="helm (chart + rendered manifests) | dynamo (DynamoGraphDeployment) | kserve (InferenceService + ServingRuntime).")] = "helm",
    mount_path: Annotated[str | None, typer.Option("--mount-path", help="Where the volume holding builds is mounted in the pods (default /models).")] = None,
    dynamo_image: Annotated[str | None, typer.Option("--dynamo-image", help="Dynamo TensorRT-LLM runtime image (format dynamo).")] = None,
    set_: Annotated[list[str] | None, typer.Option("--set", help="Override a recipe KEY=VALUE, e.g. target.gpus_per_node=8.")] = None,
) -> None:
    """Render a Kubernetes deployment of the same build; every object is schema-validated before it is written."""
    from pipeline.core import artifacts
    from pipeline.core.extras import require

    require("deploy", ("helm_python", "kubernetes_validate", "jsonschema", "referencing") if fmt == "helm"
            else ("kubernetes_validate", "jsonschema", "referencing"), "trtpipe deploy k8s")  # before any work
    from pipeline.deploy.stage import run
    from pipeline.recipe import load_recipe

    if out is None:
        recipe_file = target / "recipe.yaml" if target.is_dir() else target
        name = load_recipe(recipe_file, set_).name or target.stem
        out = artifacts.default_build_dir(name) / "k8s" / fmt
    res = run(target, out, fmt=fmt, overrides=set_, mount_path=mount_path, dynamo_image=dynamo_image)
    m = res.manifest
    console.print(
        f"[bold green]wrote[/] {res.out} ({res.format}): {len(res.files)} files, {res.objects} objects valid "
        f"(Kubernetes {', '.join(m['validated_against']['kubernetes'])} + pinned CRDs)", highlight=False,
    )
    console.print(
        f"  image {res.image} (TensorRT-LLM {m['tensorrt_llm']}), {m['gpus_per_pod']} × {m['gpu_product']} per pod, "
        f"{m['nodes_per_instance']} pod(s) per instance, build at {m['build_dir']}", highlight=False,
    )
    for note in res.notes:
        console.print(f"  [yellow]note:[/] {note}", highlight=False)
