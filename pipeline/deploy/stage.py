"""Deploy stage (``trtpipe deploy k8s``): the Kubernetes deployment of one build — Helm chart, Dynamo graph or KServe.

One entry point, :func:`run`. It resolves the recipe or build directory (:func:`pipeline.deploy.spec.resolve`),
writes the chosen format into a temp dir next to ``out`` (:func:`pipeline.core.artifacts.atomic_dir`), validates
every object it wrote (:mod:`pipeline.deploy.validate`) and only then renames the directory into place with a
``manifest.json``. A failure anywhere leaves ``out`` as it was.

Formats (``out`` layout):

* ``helm`` (default): ``chart/<name>/`` (Chart.yaml, values.yaml, values.schema.json, templates/, dashboards/),
  ``prometheus-adapter-values.yaml`` and ``rendered/`` = the chart rendered by Helm's engine with its defaults.
* ``dynamo``: ``dynamographdeployment.yaml``.
* ``kserve``: ``servingruntime.yaml`` and ``inferenceservice.yaml``.

A recipe with ``serving.frontend: trtllm-serve`` renders trtllm-serve in place of Triton for ``helm`` (no Grafana
dashboard nor adapter rules) and ``kserve``; ``dynamo`` is refused (:mod:`pipeline.deploy.trtllm_serve`).
"""

from __future__ import annotations

import dataclasses
import time
from pathlib import Path
from typing import Any

from pipeline.core.artifacts import (
    atomic_dir,
    base_manifest,
    library_versions,
    sha256_tree,
    stable_hash,
    write_manifest,
)
from pipeline.core.errors import UserError

FORMATS = ("helm", "dynamo", "kserve")
STAGE = "deploy_k8s"


@dataclasses.dataclass(frozen=True)
class DeployResult:
    """What :func:`run` wrote: the output directory, the format, every file (relative paths), the objects
    validated, and facts a user should see (image, GPUs, notes)."""

    out: Path
    format: str
    files: tuple[str, ...]
    objects: int
    image: str
    name: str
    notes: tuple[str, ...] = ()
    manifest: dict[str, Any] = dataclasses.field(default_factory=dict)

    def to_manifest(self) -> dict[str, Any]:
        """The ``manifest.json`` written into ``out``."""
        return self.manifest


def run(
    target: Path,
    out: Path,
    *,
    fmt: str = "helm",
    overrides: list[str] | None = None,
    mount_path: str | None = None,
    dynamo_image: str | None = None,
) -> DeployResult:
    """Render the Kubernetes deployment of ``target`` (a recipe YAML or a build directory) into ``out``.

    Args:
        target: recipe file or ``trtpipe build`` directory.
        out: output directory (replaced atomically).
        fmt: ``helm`` | ``dynamo`` | ``kserve``.
        overrides: recipe ``--set KEY=VALUE`` overrides.
        mount_path: where the volume holding builds is mounted in the pods (default ``/models``).
        dynamo_image: the Dynamo TensorRT-LLM runtime image (format ``dynamo``); the release matrix names none.

    Raises:
        UserError: unknown format, bad target, CPU recipe, no Dynamo image, a multi-node KServe request, Dynamo
            asked for a trtllm-serve recipe, a trtllm-serve build without its stored command.
        MissingToolError: the Helm engine (helm-python-sdk) or kubernetes-validate is not installed.
        StageError: Helm rejects the chart, or a rendered object fails schema validation.
    """
    from pipeline.deploy import spec as spec_mod
    from pipeline.deploy import validate

    if fmt not in FORMATS:
        raise UserError(f"--format {fmt!r}: expected one of {', '.join(FORMATS)}")
    t0 = time.monotonic()
    _require_validator()
    spec = spec_mod.resolve(Path(target), overrides=overrides, mount_path=mount_path)
    notes: list[str] = []
    image = spec.release.image
    if fmt == "dynamo":
        if spec.path.trtllm_serve:
            # a DynamoGraphDeployment serves through Dynamo's own Frontend and `python3 -m dynamo.trtllm` worker
            # (ai-dynamo/dynamo examples/backends/trtllm/deploy/agg.yaml@0044eb903566): no trtllm-serve to render
            raise UserError(f"--format dynamo: serving.frontend is '{spec.frontend}', but Dynamo serves with its own "
                            "frontend and dynamo.trtllm worker, not trtllm-serve; use --format helm or kserve")
        image = dynamo_image or getattr(spec.release, "dynamo_runtime_image", None)
        if not image:
            raise UserError(
                f"--format dynamo: the release matrix names no Dynamo TensorRT-LLM runtime image for TensorRT-LLM "
                f"{spec.tensorrt_llm}; pass --dynamo-image (nvcr.io/nvidia/ai-dynamo/tensorrtllm-runtime:<a Dynamo "
                f"release built on TensorRT-LLM {spec.tensorrt_llm}>)"
            )
        if not spec.path.llm_api:
            notes.append("Dynamo serves the LLM-API (PyTorch) engine: the worker loads the build's quantize/hf_ckpt, "
                         "not the TensorRT engine")
    if fmt == "helm":
        from pipeline.deploy import helm

        helm.helm_engine()  # fail before writing anything
    out = Path(out)
    with atomic_dir(out) as tmp:
        files = _write(fmt, spec, tmp, image)
        n = validate.validate_files([tmp / f for f in files])
        all_files = tuple(sorted(p.relative_to(tmp).as_posix() for p in tmp.rglob("*") if p.is_file()))
        manifest = base_manifest(
            STAGE, stable_hash({"format": fmt, "tree": sha256_tree(tmp)}), format=fmt, target=str(target),
            source=spec.source, name=spec.name, frontend=spec.frontend, image=image, release=spec.release.triton_container,
            tensorrt_llm=spec.tensorrt_llm, engine=spec.engine, tp_size=spec.tp, pp_size=spec.pp,
            gpus_per_pod=spec.gpus_per_pod, nodes_per_instance=spec.nodes, gpu_product=spec.gpu_product,
            build_dir=spec.build_dir, objects_validated=n, validated_against=_validated_against(), files=list(all_files),
            notes=notes, versions=library_versions("kubernetes-validate", "helm-python-sdk", "jsonschema"),
            timings_s={"total": round(time.monotonic() - t0, 3)},
        )
        write_manifest(tmp, manifest)
    return DeployResult(out=out, format=fmt, files=all_files, objects=n, image=image, name=spec.name,
                        notes=tuple(notes), manifest=manifest)


def _write(fmt: str, spec: Any, tmp: Path, image: str) -> list[str]:
    """Write the format's files into ``tmp``; return the manifest files to validate (relative paths)."""
    from pipeline.deploy import helm, manifests

    if fmt == "helm":
        chart = helm.write_chart(spec, tmp)
        rendered = helm.render_chart(chart, release=spec.name)
        files = helm.write_rendered(rendered, tmp / "rendered")
        return [p.relative_to(tmp).as_posix() for p in files if p.suffix == ".yaml"]
    if fmt == "dynamo":
        (tmp / "dynamographdeployment.yaml").write_text(manifests.dump(manifests.dynamo_objects(spec, image)))
        return ["dynamographdeployment.yaml"]
    runtime, isvc = manifests.kserve_objects(spec)
    (tmp / "servingruntime.yaml").write_text(manifests.dump([runtime]))
    (tmp / "inferenceservice.yaml").write_text(manifests.dump([isvc]))
    return ["servingruntime.yaml", "inferenceservice.yaml"]


def _require_validator() -> None:
    from pipeline.core.errors import MissingToolError

    try:
        import kubernetes_validate  # noqa: F401
    except ImportError:
        raise MissingToolError("validating the manifests needs kubernetes-validate: pip install 'trtpipe[deploy]'") from None


def _validated_against() -> dict[str, Any]:
    from pipeline.deploy import validate

    return {
        "kubernetes": list(validate.K8S_VERSIONS),
        "crds": {f"{k[1]} {k[0]}": validate.crd_schema(v).get("x-trtpipe-source") for k, v in validate.CRD_SCHEMAS.items()},
    }
