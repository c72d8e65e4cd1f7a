"""``trtpipe recipe new MODEL --gpu GPU …``: search the space the planner can judge and write the best as a recipe."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated

import typer

from pipeline.commands.common import console, handle_errors


@handle_errors
def new(
    model: Annotated[str | None, typer.Argument(metavar="MODEL", help="A known model (pipeline/data/models.yaml) or a local directory with a config.json; default on --gpu cpu: the embedded SmolLM2.")] = None,
    gpu: Annotated[str, typer.Option("--gpu", help="Catalog GPU (h200, h100_sxm, a100_80gb, l40s, b200, …) or cpu.")] = "",
    num_gpus: Annotated[int, typer.Option("--num-gpus", min=1, max=64, help="GPUs in all (one instance is TP × PP ≤ 8 of them; the rest are replicas).")] = 1,
    isl: Annotated[int | None, typer.Option("--isl", min=1, help="Input tokens per request (default 1024 on a GPU, 64 on cpu).")] = None,
    osl: Annotated[int | None, typer.Option("--osl", min=1, help="Output tokens per request (default 1024 on a GPU, 32 on cpu).")] = None,
    slo: Annotated[list[str] | None, typer.Option("--slo", help="Latency SLO in ms, e.g. ttft:500,itl:30 (TTFT at p99); default: maximum load.")] = None,
    engine: Annotated[str | None, typer.Option("--engine", help="Search one serving path only: pytorch or tensorrt (GPU targets).")] = None,
    out: Annotated[Path | None, typer.Option("--out", help="Recipe file to write (default recipe-new-<model>-<gpu>.yaml here).")] = None,
    json_out: Annotated[bool, typer.Option("--json", help="Print the result as JSON instead of the table.")] = False,
    top: Annotated[int, typer.Option("--top", min=1, max=100, help="Candidates shown.")] = 5,
    verify: Annotated[bool, typer.Option("--verify", help="cpu: run `trtpipe tune` on the top 3 and compare predicted with measured ranks; GPU: write that tune file.")] = False,
) -> None:
    """Search engine path, qformat, KV dtype, TP×PP(×EP), max_num_tokens (and the batch / CUDA-graph sizes the SLO
    allows) with the planner; rank by predicted output tok/s per GPU within the SLO (ties within its error band); write
    the best as a commented recipe that validates. Exit 2: unknown GPU or model, nothing fits N GPUs (the smallest N
    is named), no configuration meets the SLO (the closest is named)."""
    import json
    import sys

    from pipeline.advise import render
    from pipeline.advise import space as sp
    from pipeline.advise import workflow as wf
    from pipeline.core.errors import UserError
    from pipeline.recipe.bench import parse_goodput
    from pipeline.recipe.serving_path import builder_paths

    if not gpu:
        raise UserError("--gpu: missing; name a catalog GPU (e.g. h200) or cpu")
    spec = sp.resolve_gpu(gpu)
    paths = builder_paths(spec.key if spec else gpu.strip().lower())  # the serving-path table's rows for the target
    if engine is not None:
        chosen = [p for p in paths if p.engine == engine]
        if not chosen:
            raise UserError(f"--engine {engine!r}: on {gpu} use {' or '.join(p.engine for p in paths)}"
                            + ("; leave --engine out" if len(paths) == 1 else ""))
        paths = chosen
    if spec is None and num_gpus != 1:
        raise UserError(f"--num-gpus {num_gpus}: the cpu target is this host; leave --num-gpus out")
    if (isl is None) != (osl is None):
        raise UserError("--isl and --osl go together: give both, e.g. --isl 1000 --osl 1000")
    source, geo = sp.resolve_model(model, spec is None)
    default = (64, 32) if spec is None else (1024, 1024)
    req = sp.Request(source=source, geo=geo, gpu=spec, num_gpus=num_gpus, isl=isl or default[0], osl=osl or default[1],
                     slo=parse_goodput(slo, "--slo") if slo else {}, paths=tuple(paths))
    command = "trtpipe recipe new " + " ".join(sys.argv[3:] if sys.argv[1:3] == ["recipe", "new"] else sys.argv[1:])
    res = wf.run(req, out or wf.default_out(source, req.target), command=command, verify=verify)
    if json_out:
        doc = render.as_json(res.search, top, res.written, str(res.path))
        typer.echo(json.dumps(doc | {"verify": res.verify}, indent=2, default=str))
        return
    console.print(render.table(res.search, top), highlight=False)
    for line in res.lines:
        console.print(line, highlight=False, soft_wrap=True)
