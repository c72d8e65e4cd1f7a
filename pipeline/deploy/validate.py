"""Static validation of rendered Kubernetes objects (no cluster): built-in kinds against the Kubernetes OpenAPI
schemas of PyPI ``kubernetes-validate`` (strict: unknown fields refused), custom resources against the CRD
schemas in ``pipeline/deploy/crds/`` (each names its upstream repository, tag/commit and files).

What this cannot see: admission webhooks, the operators' own validation, quota, and whether the images,
node labels, GPUs and CRDs exist in a cluster (docs/deploy-k8s.md lists what only a cluster verifies).
"""

from __future__ import annotations

import functools
import json
from importlib import resources
from pathlib import Path
from typing import Any

import yaml

from pipeline.core.errors import StageError

#: Kubernetes versions every object is validated against: the chart's minimum (Chart.yaml kubeVersion
#: ``>=1.29``) and a recent one; both ship in kubernetes-validate 1.37.
K8S_VERSIONS = ("1.29.0", "1.35.0")
#: ``(apiVersion, kind)`` → CRD schema file in ``pipeline/deploy/crds/``
CRD_SCHEMAS = {
    ("leaderworkerset.x-k8s.io/v1", "LeaderWorkerSet"): "leaderworkerset.x-k8s.io_v1_LeaderWorkerSet.json",
    ("monitoring.coreos.com/v1", "PodMonitor"): "monitoring.coreos.com_v1_PodMonitor.json",
    ("monitoring.coreos.com/v1", "PrometheusRule"): "monitoring.coreos.com_v1_PrometheusRule.json",
    ("nvidia.com/v1alpha1", "DynamoGraphDeployment"): "nvidia.com_v1alpha1_DynamoGraphDeployment.json",
    ("serving.kserve.io/v1alpha1", "ServingRuntime"): "serving.kserve.io_v1alpha1_ServingRuntime.json",
    ("serving.kserve.io/v1beta1", "InferenceService"): "serving.kserve.io_v1beta1_InferenceService.json",
}


def load_objects(paths: list[Path]) -> list[tuple[Path, dict[str, Any]]]:
    """Every non-empty YAML document of ``paths`` (``.yaml`` files only), with the file it came from."""
    out = []
    for p in paths:
        if p.suffix not in (".yaml", ".yml"):
            continue
        for doc in yaml.safe_load_all(p.read_text()):
            if doc:
                out.append((p, doc))
    return out


@functools.cache
def _k8s_definitions(version: str):
    from kubernetes_validate import utils
    from referencing import Resource

    v = [x for x in utils.all_versions() if utils.major_minor(x) <= utils.major_minor(version)][-1]
    return Resource.from_contents(utils.schema_contents(f"kubernetes-json-schema/v{v}-local-strict/_definitions.json", v))


@functools.cache
def crd_schema(filename: str) -> dict[str, Any]:
    """A CRD schema of ``pipeline/deploy/crds/`` (parsed JSON)."""
    return json.loads(resources.files("pipeline.deploy").joinpath("crds", filename).read_text())


def crd_errors(obj: dict[str, Any], schema: dict[str, Any], version: str = K8S_VERSIONS[-1]) -> list[str]:
    """Errors of ``obj`` against a CRD ``schema`` whose embedded Kubernetes types refer to the OpenAPI
    definitions of ``version`` (``path: message`` each; empty when valid)."""
    import jsonschema
    from referencing import Registry

    registry = _k8s_definitions(version) @ Registry()
    validator = jsonschema.Draft202012Validator(schema, registry=registry)
    return [f"{'.'.join(str(p) for p in e.absolute_path) or '<root>'}: {e.message}" for e in validator.iter_errors(obj)]


def object_errors(obj: dict[str, Any]) -> list[str]:
    """Schema errors of one object (empty when valid), against every version of :data:`K8S_VERSIONS`.

    Raises:
        StageError: no schema is known for the object's apiVersion/kind (nothing may go out unchecked).
    """
    from kubernetes_validate import utils

    key = (obj.get("apiVersion"), obj.get("kind"))
    if key in CRD_SCHEMAS:
        return crd_errors(obj, crd_schema(CRD_SCHEMAS[key]))
    errors = []
    for version in K8S_VERSIONS:
        try:
            utils.validate(obj, version, strict=True)
        except utils.ValidationError as e:
            path = ".".join(str(p) for p in e.path) or "<root>"
            errors.append(f"[k8s {e.version}] {path}: {e.message}")
        except utils.SchemaNotFoundError:
            raise StageError(f"no schema for {key[1]} {key[0]} (Kubernetes {version}, nor a pinned CRD)") from None
    return errors


def validate_files(paths: list[Path]) -> int:
    """Validate every object in ``paths``; return how many were checked.

    Raises:
        StageError: one line per invalid object (``file kind/name: error``), or an unknown kind.
    """
    objs = load_objects(paths)
    problems = []
    for path, obj in objs:
        name = f"{obj.get('kind')}/{(obj.get('metadata') or {}).get('name')}"
        problems += [f"{path.name} {name}: {e}" for e in object_errors(obj)]
    if problems:
        raise StageError("rendered objects fail schema validation: " + "; ".join(problems[:10])
                         + (f" (and {len(problems) - 10} more)" if len(problems) > 10 else ""))
    return len(objs)
