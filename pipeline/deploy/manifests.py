"""Plain manifests for the two operator formats: NVIDIA Dynamo's ``DynamoGraphDeployment`` and a KServe
``InferenceService`` with its Triton ``ServingRuntime``. Both read the build from the same volume as the
Helm chart (a PVC mounted at the path the build was made at).
"""

from __future__ import annotations

from typing import Any

import yaml

from pipeline.core.errors import UserError
from pipeline.deploy import trtllm_serve
from pipeline.deploy.spec import (
    ADMIN_APIS,
    ADMIN_HEADER,
    ADMIN_KEY_ENV,
    ADMIN_SECRET_KEY,
    PORTS,
    DeploySpec,
    shm_size,
)
from pipeline.serve.frontend import trtllm_serve_argv

#: PVC the manifests mount (the chart's default ``modelRepository.pvc.claimName``)
CLAIM = "trtpipe-builds"
#: KServe's data-plane ports for a runtime container: HTTP 8080, gRPC 9000 (kserve config/runtimes/
#: kserve-tritonserver.yaml@v0.20.0 passes --http-port=8080 --grpc-port=9000); metrics stay on Triton's 8002
KSERVE_PORTS = {"http": 8080, "grpc": 9000, "metrics": PORTS["metrics"]}
#: the InferenceService deployment mode without Knative. kserve pkg/constants/constants.go: "RawDeployment" is the
#: only raw mode at v0.15.0 (@d20d4228a8b2:417); v0.16.0 adds "Standard" and keeps "RawDeployment" as its legacy
#: alias (@5b033a402442:466-467), still accepted at v0.20.0 (@1fb781055dd1:564-565)
KSERVE_DEPLOYMENT_MODE = "RawDeployment"
#: no KServe HPA. With no autoscalerClass KServe creates a CPU-utilization HPA (hpa_reconciler.go@v0.20.0
#: getHPAMetrics, default 80 %), which a GPU LLM server's CPU load does not track. "external" is the one class
#: v0.15.0 … v0.20.0 all accept that creates none (v0.15.0 autoscaler_reconciler.go createAutoscaler: hpa|external|
#: keda; hpa_reconciler.go shouldCreateHPA: only without a class or with "hpa"); "none" first appears in v0.16.0.
#: Scale with the Helm chart's custom-metric HPA on the predictor Deployment instead (docs/deploy-k8s.md).
KSERVE_AUTOSCALER_CLASS = "external"
#: CPU cores and memory per GPU of the KServe predictor (the Helm chart's rule: max(4, GPUs) CPUs, 8 GiB per CPU)
KSERVE_MIN_CPU, KSERVE_GIB_PER_CPU = 4, 8


def admin_secret_name(spec: DeploySpec) -> str:
    """The Secret holding the Triton admin key of the KServe runtime (created by the user: docs/deploy-k8s.md)."""
    return f"{spec.name}-triton-admin"


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
        # no envFromSecret: the operator turns it into a non-optional envFrom.secretRef (ai-dynamo/dynamo
        # deploy/cloud/operator/internal/dynamo/graph.go@52c2429d3511 GenerateBasePodSpec), so a missing Secret stops the pod;
        # the worker loads the build's local checkpoint and needs no Hugging Face token
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
    annotations = {}
    dyn = spec.release.dynamo_runtime
    if dyn and image == dyn.image:
        annotations = {"trtpipe.dev/dynamo-release": dyn.dynamo, "trtpipe.dev/dynamo-tensorrt-llm": dyn.tensorrt_llm}
    dgd = {
        "apiVersion": "nvidia.com/v1alpha1",
        "kind": "DynamoGraphDeployment",
        "metadata": {"name": spec.name, "labels": {"trtpipe.dev/recipe": spec.recipe.name},
                     **({"annotations": annotations} if annotations else {})},
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
    and an ``InferenceService`` whose predictor mounts the build volume at the build's own path. For
    ``serving.frontend: trtllm-serve`` the runtime runs the build's trtllm-serve command on KServe's HTTP port
    (:func:`trtllm_serve_runtime`) and the predictor names its model format.

    Raises:
        UserError: the instance spans nodes (KServe's multi-node worker spec targets vLLM/Ray, not MPI ranks).
    """
    if spec.multi_node:
        raise UserError(
            f"--format kserve: tp_size × pp_size = {spec.world_size} spans {spec.nodes} nodes of {spec.gpus_per_node} "
            "GPUs; the KServe rendering is single-node: use --format helm (LeaderWorkerSet)"
        )
    if spec.path.trtllm_serve:
        serving_runtime = trtllm_serve_runtime(spec, spec.release.image, KSERVE_PORTS["http"])
        model = {"modelFormat": {"name": trtllm_serve.KSERVE_FORMAT}, "runtime": serving_runtime["metadata"]["name"]}
        return [serving_runtime, _kserve_isvc(spec, model)]
    runtime = f"{spec.name}-triton"
    admin = f"{','.join(ADMIN_APIS)}:{ADMIN_HEADER}=$({ADMIN_KEY_ENV})"
    argv = spec.triton_argv(KSERVE_PORTS, extra_args=[f"--http-restricted-api={admin}", f"--grpc-restricted-protocol={admin}"])
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
                # Triton's admin APIs answer only requests carrying this key (the kubelet expands $(TRITON_ADMIN_KEY))
                "env": [{"name": ADMIN_KEY_ENV, "valueFrom": {"secretKeyRef": {
                    "name": admin_secret_name(spec), "key": ADMIN_SECRET_KEY}}}],
                "ports": [{"name": "http", "containerPort": KSERVE_PORTS["http"], "protocol": "TCP"}],
                "readinessProbe": {"httpGet": {"path": "/v2/health/ready", "port": KSERVE_PORTS["http"]},
                                   "periodSeconds": 5, "failureThreshold": 3},
                "startupProbe": {"httpGet": {"path": "/v2/health/ready", "port": KSERVE_PORTS["http"]},
                                 "periodSeconds": 10, "failureThreshold": 180},
            }],
        },
    }
    model = {"modelFormat": {"name": "triton", "version": "2"}, "runtime": runtime, "protocolVersion": "v2"}
    return [serving_runtime, _kserve_isvc(spec, model)]


def _kserve_isvc(spec: DeploySpec, model: dict[str, Any]) -> dict[str, Any]:
    """The InferenceService of ``spec``: ``model`` (format, runtime, protocol) plus GPUs, memory and the volumes."""
    gpu = str(spec.gpus_per_pod)
    cpu = max(KSERVE_MIN_CPU, spec.gpus_per_pod)
    memory = f"{cpu * KSERVE_GIB_PER_CPU}Gi"
    return {
        "apiVersion": "serving.kserve.io/v1beta1",
        "kind": "InferenceService",
        "metadata": {"name": spec.name, "labels": {"trtpipe.dev/recipe": spec.recipe.name},
                     "annotations": {"serving.kserve.io/deploymentMode": KSERVE_DEPLOYMENT_MODE,
                                     "serving.kserve.io/autoscalerClass": KSERVE_AUTOSCALER_CLASS}},
        "spec": {"predictor": {
            "minReplicas": 1, "maxReplicas": 1,
            "nodeSelector": {"nvidia.com/gpu.product": spec.gpu_product},
            "tolerations": [{"key": "nvidia.com/gpu", "operator": "Exists", "effect": "NoSchedule"}],
            "volumes": [_volume(), {"name": "dshm", "emptyDir": {"medium": "Memory",
                                                                   "sizeLimit": shm_size(spec.gpus_per_pod, memory)}}],
            "model": {
                **model,
                "resources": {"requests": {spec.gpu_resource: gpu, "cpu": str(cpu), "memory": memory},
                              "limits": {spec.gpu_resource: gpu, "memory": memory}},
                "volumeMounts": [_mount(spec), {"name": "dshm", "mountPath": "/dev/shm"}],
            },
        }},
    }


def dump(objs: list[dict[str, Any]]) -> str:
    """Objects as one multi-document YAML stream."""
    return "---\n".join(yaml.safe_dump(o, sort_keys=False, width=120) for o in objs)


def trtllm_serve_runtime(spec: DeploySpec, image: str, port: int) -> dict[str, Any]:
    """A namespaced ``ServingRuntime`` running ``trtllm-serve`` on KServe's HTTP port ``port``.

    Shaped after KServe's own OpenAI-server runtime (kserve config/runtimes/kserve-vllmserver.yaml@1fb781055dd1:
    8-10 Prometheus annotations, 16-29 one ``kserve-container`` running the server with ``--port=8080``, 52-69
    readiness/startup probes): no ``protocolVersions``, which KServe then does not check
    (pkg/apis/serving/v1alpha1/servingruntime_types.go@1fb781055dd1:304-307). The Prometheus annotations are
    set only where the route exists (``return_perf_metrics``).
    """
    argv = trtllm_serve_argv({"argv": list(spec.serve_argv)}, spec.serve_host, port)
    def probe(period_s: int, failures: int) -> dict[str, Any]:
        return {"httpGet": {"path": trtllm_serve.HEALTH_PATH, "port": port}, "periodSeconds": period_s, "failureThreshold": failures}

    runtime_spec: dict[str, Any] = {}
    if spec.perf_metrics:
        runtime_spec["annotations"] = {"prometheus.kserve.io/port": str(port), "prometheus.kserve.io/path": trtllm_serve.PROMETHEUS_PATH}
    runtime_spec["supportedModelFormats"] = [{"name": trtllm_serve.KSERVE_FORMAT, "autoSelect": False}]
    runtime_spec["containers"] = [{
        "name": "kserve-container",
        "image": image,
        "command": argv,
        "ports": [{"name": "http", "containerPort": port, "protocol": "TCP"}],
        # the Triton runtime's periods and budget (:func:`kserve_objects`); /health for all three
        "readinessProbe": probe(5, 3),
        "livenessProbe": probe(10, 3),
        "startupProbe": probe(10, 180),
    }]
    return {
        "apiVersion": "serving.kserve.io/v1alpha1",
        "kind": "ServingRuntime",
        "metadata": {"name": f"{spec.name}-{trtllm_serve.FRONTEND}", "labels": {"trtpipe.dev/recipe": spec.recipe.name}},
        "spec": runtime_spec,
    }
