"""``trtpipe release``: the release matrix (Triton container ↔ TensorRT-LLM ↔ TensorRT ↔ CUDA ↔ torch ↔
transformers ↔ ModelOpt ↔ Python), the image to build on, and checks run inside that image."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated

import typer

from pipeline.commands.common import console, handle_errors


@handle_errors
def release(
    tensorrt_llm: Annotated[str | None, typer.Option("--tensorrt-llm", help="TensorRT-LLM version (default: trtpipe's target).")] = None,
    image: Annotated[bool, typer.Option("--image", help="Print only the Triton image for that TensorRT-LLM (e.g. for docker build --build-arg).")] = False,
    check_image: Annotated[str | None, typer.Option("--check-image", help="Inside an image: check the installed TensorRT-LLM/torch/transformers/ModelOpt against the matrix entry of this image.")] = None,
    unchanged_since: Annotated[Path | None, typer.Option("--unchanged-since", help="With --check-image: a `pip list --format=freeze` taken before installing trtpipe; fail if any of those packages moved.")] = None,
) -> None:
    """Show the release matrix, print the image for a TensorRT-LLM version, or check an image's packages."""
    from rich.table import Table

    from pipeline.core.errors import UserError
    from pipeline.trtllm import release as rel

    if check_image is not None:
        matches = [r for r in rel.releases() if r.image == check_image or r.triton_container == check_image]
        if not matches:
            raise UserError(f"--check-image {check_image}: not an image of the release matrix")
        problems = rel.image_problems(matches[0], rel.installed_versions())
        if unchanged_since is not None:
            import subprocess
            import sys

            after = subprocess.run([sys.executable, "-m", "pip", "list", "--format=freeze"], capture_output=True, text=True,
                                   check=True).stdout
            problems += [f"the install moved an image package: {m}" for m in rel.moved_packages(unchanged_since.read_text(), after)]
        if problems:
            raise UserError(f"{matches[0].image}: " + "; ".join(problems))
        console.print(f"{matches[0].image}: packages match the release matrix", highlight=False)
        return
    try:
        chosen = rel.for_tensorrt_llm(tensorrt_llm)
    except KeyError as e:
        raise UserError(f"--tensorrt-llm {tensorrt_llm}: {e.args[0]}") from None
    if image:
        typer.echo(chosen.image)
        return
    table = Table(title="release matrix (pipeline/data/release_matrix.yaml)")
    for col in ("container", "TensorRT-LLM", "TensorRT", "CUDA", "torch", "transformers", "ModelOpt", "Python", "env"):
        table.add_column(col)
    for r in rel.releases():
        mark = " ←" if r.image == chosen.image else ""
        table.add_row(r.triton_container + mark, r.tensorrt_llm, r.tensorrt or "?", r.cuda or "?", r.torch or "?",
                      r.transformers or "?", r.nvidia_modelopt or "?", r.python or "?", r.python_env or "system")
    console.print(table)
