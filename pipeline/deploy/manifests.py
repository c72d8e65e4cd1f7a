"""Plain manifests for the two operator formats: NVIDIA Dynamo's ``DynamoGraphDeployment`` and a KServe
``InferenceService`` with its Triton ``ServingRuntime``. Both read the build from the same volume as the
Helm chart (a PVC mounted at the path the build was made at).
"""

from __future__ import annotations

from typing import Any

import yaml

from pipeline.deploy.spec import PORTS, SHM_MULTI_GPU, SHM_SINGLE_GPU, DeploySpec
from pipeline.errors import UserError

#: PVC the manifests mount (the chart's default ``modelRepository.pvc.claimName``)
CLAIM = "trtpipe-builds"
#: KServe's data-plane ports for a runtime container: HTTP 8080, gRPC 9000 (kserve config/runtimes/
#: kserve-tritonserver.yaml@v0.20.0 passes --http-port=8080 --grpc-port=9000); metrics stay on Triton's 8002
KSERVE_PORTS = {"http": 8080, "grpc": 9000, "metrics": PORTS["metrics"]}


def _volume() -> dict[str, Any]:
    return {"name": "builds", "persistentVolumeClaim": {"claimName": CLAIM, "readOnly": True}}


def _mount(spec: DeploySpec) -> dict[str, Any]:
    return {"name": "builds", "mountPath": spec.mount_path, "readOnly": True}


def dynamo_objects(spec: DeploySpec, image: str) -> list[dict[str, Any]]:
    """A ``DynamoGraphDeployment``: a Frontend and one TensorRT-LLM worker (``python3 -m dynamo.trtllm``) serving
    the quantized HF checkpoint with the recipe's LLM-API arguments (``--extra-engine-args``, written from an env
    var at start: no ConfigMap). Layout after ai-dynamo/dynamo examples/backends/trtllm/deploy/agg.yaml@0044eb903566.

    Dynamo runs the LLM-API (PyTorch) engine; for a ``build.engine: tensorrt`` recipe the worker still loads the
    ``quantize/hf_ckpt`` checkpoint of the build (the TensorRT engine is not used) — said in the manifest.
    Multi-node instances use the service's ``multinode.nodeCount`` (dynamocomponentdeployment_types.go@020073063688).
    """
    served = spec.recipe.model.source
    worker_cmd = (
        'printf "%s" "$TRTPIPE_ENGINE_ARGS" > /tmp/engine_args.yaml && exec python3 -m dynamo.trtllm '
        f'--model-path {spec.hf_ckpt} --served-model-name {served} '
        "--extra-engine-args /tmp/engine_args.yaml"
    )
    worker: dict[str, Any] = {
        "componentType": "worker",
        "replicas": 1,
        "envFromSecret": "hf-token-secret",
        "resources": {"requests": {"gpu": str(spec.gpus_per_pod)}, "limits": {"gpu": str(spec.gpus_per_pod)}},
        "envs": [{"name": "TRTPIPE_ENGINE_ARGS", "value": yaml.safe_dump(spec.engine_args, sort_keys=False)}],
        "extraPodSpec": {
            "volumes": [_volume()],
            "nodeSelector": {"nvidia.com/gpu.product": spec.gpu_product},
            "mainContainer": {"name": "main", "image": image, "command": ["/bin/sh", "-c"], "args": [worker_cmd],
                              "volumeMounts": [_mount(spec)]},
        },
    }
    if spec.multi_node:
        worker["multinode"] = {"nodeCount": spec.nodes}
    dgd = {
        "apiVersion": "nvidia.com/v1alpha1",
        "kind": "DynamoGraphDeployment",
        "metadata": {"name": spec.name, "labels": {"trtpipe.dev/recipe": spec.recipe.name}},
        "spec": {
            "backendFramework": "trtllm",
            "services": {
                "Frontend": {"componentType": "frontend", "replicas": 1,
                             "extraPodSpec": {"mainContainer": {"name": "main", "image": image}}},
                "TRTLLMWorker": worker,
            },
        },
    }
    return [dgd]


def kserve_objects(spec: DeploySpec) -> list[dict[str, Any]]:
    """A namespaced Triton ``ServingRuntime`` (the release-matrix image, trtpipe's Triton argv on KServe's ports)
    and an ``InferenceService`` whose predictor mounts the build volume at the build's own path.

    Raises:
        UserError: the instance spans nodes (KServe's multi-node worker spec targets vLLM/Ray, not MPI ranks).
    """
    if spec.multi_node:
        raise UserError(
            f"--format kserve: tp_size × pp_size = {spec.world_size} spans {spec.nodes} nodes of {spec.gpus_per_node} "
            "GPUs; the KServe rendering is single-node: use --format helm (LeaderWorkerSet)"
        )
    runtime = f"{spec.name}-triton"
    argv = spec.triton_argv(KSERVE_PORTS)
    gpu = str(spec.gpus_per_pod)
    serving_runtime = {
        "apiVersion": "serving.kserve.io/v1alpha1",
        "kind": "ServingRuntime",
        "metadata": {"name": runtime, "labels": {"trtpipe.dev/recipe": spec.recipe.name}},
        "spec": {
            "annotations": {"prometheus.kserve.io/port": str(KSERVE_PORTS["metrics"]),
                            "prometheus.kserve.io/path": "/metrics"},
            "supportedModelFormats": [{"name": "triton", "version": "2", "autoSelect": False}],
            "protocolVersions": ["v2", "grpc-v2"],
            "containers": [{
                "name": "kserve-container",
                "image": spec.release.image,
                "command": argv,
                "ports": [{"name": "http", "containerPort": KSERVE_PORTS["http"], "protocol": "TCP"}],
                "readinessProbe": {"httpGet": {"path": "/v2/health/ready", "port": KSERVE_PORTS["http"]},
                                   "periodSeconds": 5, "failureThreshold": 3},
                "startupProbe": {"httpGet": {"path": "/v2/health/ready", "port": KSERVE_PORTS["http"]},
                                 "periodSeconds": 10, "failureThreshold": 180},
            }],
        },
    }
    isvc = {
        "apiVersion": "serving.kserve.io/v1beta1",
        "kind": "InferenceService",
        "metadata": {"name": spec.name, "labels": {"trtpipe.dev/recipe": spec.recipe.name},
                     "annotations": {"serving.kserve.io/deploymentMode": "Standard"}},
        "spec": {"predictor": {
            "minReplicas": 1, "maxReplicas": 4,
            "nodeSelector": {"nvidia.com/gpu.product": spec.gpu_product},
            "tolerations": [{"key": "nvidia.com/gpu", "operator": "Exists", "effect": "NoSchedule"}],
            "volumes": [_volume(), {"name": "dshm", "emptyDir": {"medium": "Memory", "sizeLimit": SHM_SINGLE_GPU if spec.gpus_per_pod == 1 else SHM_MULTI_GPU}}],
            "model": {
                "modelFormat": {"name": "triton", "version": "2"},
                "runtime": runtime,
                "protocolVersion": "v2",
                "resources": {"requests": {"nvidia.com/gpu": gpu}, "limits": {"nvidia.com/gpu": gpu}},
                "volumeMounts": [_mount(spec), {"name": "dshm", "mountPath": "/dev/shm"}],
            },
        }},
    }
    return [serving_runtime, isvc]


def dump(objs: list[dict[str, Any]]) -> str:
    """Objects as one multi-document YAML stream."""
    return "---\n".join(yaml.safe_dump(o, sort_keys=False, width=120) for o in objs)
