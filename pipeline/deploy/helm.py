"""The Helm chart: values from the :class:`~pipeline.deploy.spec.DeploySpec`, templates from package data, and the
chart rendered with its default values by Helm's own Go engine.

Layout written by :func:`write_chart` under ``OUT``::

    chart/<name>/Chart.yaml, values.yaml, values.schema.json, templates/…, dashboards/grafana-dashboard.json
    prometheus-adapter-values.yaml   ``rules.custom`` for the prometheus-adapter chart (one rule per signal)
    rendered/<template>.yaml         the chart rendered with its defaults (``helm template``), plain manifests

Rendering uses PyPI ``helm-python-sdk`` (``helm_python``: ctypes bindings to ``libhelm_c``, a C ABI over Helm's
Go SDK v4 — the same template engine, sprig functions and values-schema check as the ``helm`` binary, which no
registry reachable here ships). The render also checks the values against ``values.schema.json``, as
``helm install`` does.
"""

from __future__ import annotations

import json
import shutil
from importlib import resources
from pathlib import Path
from typing import Any

import yaml

from pipeline.core.errors import MissingToolError, StageError
from pipeline.deploy import metrics, trtllm_serve
from pipeline.deploy.spec import (
    ADMIN_APIS,
    ADMIN_HEADER,
    ADMIN_SECRET_KEY,
    PORTS,
    STARTUP_TIMEOUT_S,
    TRITONSERVER,
    DeploySpec,
    shm_size,
)
from pipeline.triton.process import DEFAULT_SHM_PREFIX

CHART_VERSION = "0.1.0"
#: NVIDIA's autoscaling tutorial: CPU = max(4, GPUs), memory = 8 GiB per CPU (tutorials
#: TensorRT-LLM_Autoscaling_and_Load_Balancing/chart/templates/deployment.yaml@e9c13b881148)
MIN_CPU, GIB_PER_CPU = 4, 8
#: probes: readiness/liveness periods of Triton's own k8s-onprem chart (server deploy/k8s-onprem/templates/
#: deployment.yaml@4b5445910791: readiness 5 s × 3, liveness 10 s × 3, startup every 10 s)
PROBE_PERIOD_S = {"startup": 10, "readiness": 5, "liveness": 10}
#: where the multi-node leader gets ``kubectl`` (mpirun's rsh agent is ``kubectl exec``, as in kubernetes-sigs/lws
#: docs/examples/tensorrt-llm/build/server.py@4aaf9d50f542 and its Dockerfile@64b20ff7ea7b, which installs kubectl
#: into a custom image). The stock Triton image has none (tensorrtllm_backend dockerfile/
#: Dockerfile.triton.trt_llm_backend@ce68ff5fd0a7:122-140), so an init container copies the binary out of the
#: Kubernetes project's own kubectl image: kubernetes/kubernetes build/server-image/kubectl/Dockerfile@109cf6820d2f
#: (FROM debian-base + coreutils, binary at /bin/kubectl; so /bin/cp exists). Pinned by tag; kubectl talks to the
#: API server within the ±1 minor skew of kubernetes' version-skew policy for 1.33-1.35 clusters.
KUBECTL_IMAGE = "registry.k8s.io/kubectl:v1.34.1"


def _image(ref: str) -> dict[str, str]:
    repo, _, tag = ref.rpartition(":")
    return {"repository": repo, "tag": tag, "pullPolicy": "IfNotPresent"}


def chart_values(spec: DeploySpec) -> dict[str, Any]:
    """The chart's default ``values.yaml`` for ``spec`` (every key documented in docs/deploy-k8s.md): Triton's, or
    for ``serving.frontend: trtllm-serve`` the same with ``trtllmServe`` in place of ``triton``
    (:func:`trtllm_serve_values`)."""
    values = _triton_values(spec)
    return trtllm_serve_values(spec, values) if spec.path.trtllm_serve else values


def _triton_values(spec: DeploySpec) -> dict[str, Any]:
    from pipeline.recipe import dump_recipe
    from pipeline.triton_repo.vision import tritonserver_options

    r = spec.recipe
    mm = tritonserver_options(r)
    cpu = max(MIN_CPU, spec.gpus_per_pod)
    signals = metrics.signals_for(spec.engine)
    bench = r.bench
    return {
        "image": _image(spec.release.image),
        # the trtpipe image (repository Dockerfile, FROM the same Triton container) runs the build and bench Jobs
        "trtpipeImage": {"repository": "trtpipe", "tag": f"gpu-{spec.release.triton_container}", "pullPolicy": "IfNotPresent"},
        "imagePullSecrets": [],
        "model": {"recipe": r.name, "engine": spec.engine, "tensorrtLlm": spec.tensorrt_llm,
                  "servedModel": spec.bench_model},
        "parallelism": {"tp": spec.tp, "pp": spec.pp, "gpusPerNode": spec.gpus_per_node, "nodes": spec.nodes},
        "gpu": {"perPod": spec.gpus_per_pod, "product": spec.gpu_product, "resource": spec.gpu_resource},
        "modelRepository": {
            "source": "pvc",
            "mountPath": spec.mount_path,
            "buildDir": spec.build_dir,
            "pvc": {"claimName": "trtpipe-builds", "create": False, "storageClassName": "", "size": "200Gi",
                    "accessModes": ["ReadWriteMany"]},
            "objectStore": {"uri": "", "image": "", "endpointUrl": "", "credentialsSecret": ""},
            "build": {"recipe": dump_recipe(r), "hfTokenSecret": "hf-token",
                      "gpus": min(spec.world_size, spec.gpus_per_node), "activeDeadlineSeconds": 14400},
        },
        "replicas": 1,
        "nodeSelector": {},
        "tolerations": [{"key": "nvidia.com/gpu", "operator": "Exists", "effect": "NoSchedule"}],
        "affinity": {},
        "resources": {
            "requests": {"cpu": str(cpu), "memory": f"{cpu * GIB_PER_CPU}Gi"},
            "limits": {"memory": f"{cpu * GIB_PER_CPU}Gi"},
        },
        # capped at the memory limit: a memory-backed emptyDir is charged to it (spec.shm_size)
        "shm": {"sizeLimit": shm_size(spec.gpus_per_pod, f"{cpu * GIB_PER_CPU}Gi")},
        "terminationGracePeriodSeconds": 30,
        "service": {"type": "ClusterIP"},
        "triton": {"binary": TRITONSERVER, "ports": dict(PORTS), "exitTimeoutSecs": 5, "logVerbose": 0,
                   "shmRegionPrefix": DEFAULT_SHM_PREFIX,
                   # launch_triton_server.py --tensorrt_llm_model_name / --multimodal_gpu0_cuda_mem_pool_bytes as
                   # tritonserver flags (pipeline.triton_repo.vision.tritonserver_options; the multimodal repository)
                   "loadModels": list(mm["load_models"]), "cudaMemoryPoolGpu0Bytes": mm["cuda_pool_gpu0_bytes"],
                   # as `trtpipe serve` off loopback: these APIs answer only requests with header `<header>: <key>`;
                   # the key is in a Secret (created with a random key, kept across upgrades, or an existing one)
                   "adminApi": {"apis": list(ADMIN_APIS), "header": ADMIN_HEADER,
                                "secret": {"create": True, "name": "", "key": ADMIN_SECRET_KEY}}},
        "probes": {
            "startup": {"periodSeconds": PROBE_PERIOD_S["startup"],
                        "failureThreshold": STARTUP_TIMEOUT_S // PROBE_PERIOD_S["startup"]},
            "readiness": {"periodSeconds": PROBE_PERIOD_S["readiness"], "failureThreshold": 3},
            "liveness": {"periodSeconds": PROBE_PERIOD_S["liveness"], "failureThreshold": 3},
        },
        "multiNode": {"workerWaitSeconds": 600, "kubectlImage": KUBECTL_IMAGE},
        "autoscaling": {
            "enabled": True, "minReplicas": 1, "maxReplicas": 4, "metric": metrics.default_signal(spec.engine),
            "signals": {k: {"record": s.record, "expr": s.expr, "target": s.target} for k, s in signals.items()},
        },
        "monitoring": {
            # `release: prometheus` is the label kube-prometheus-stack selects by default (NVIDIA's tutorial uses it)
            "podMonitor": {"enabled": True, "interval": "6s", "labels": {"release": "prometheus"}},
            "prometheusRule": {"enabled": True, "interval": "6s", "labels": {"release": "prometheus"}},
        },
        "podDisruptionBudget": {"enabled": True, "maxUnavailable": 1},
        "bench": {
            "enabled": True,
            "scenarios": [f"{sc.isl}:{sc.osl}" for sc in bench.scenarios],
            "concurrency": ",".join(str(c) for c in bench.concurrency),
            "tokenizerDir": spec.tokenizer_dir,
            "cpu": "4", "memory": "8Gi", "activeDeadlineSeconds": 7200,
        },
    }


def _load_json(name: str) -> dict[str, Any]:
    return json.loads(resources.files("pipeline.deploy").joinpath(name).read_text())


def values_schema(spec: DeploySpec) -> dict[str, Any]:
    """``values.schema.json``: the package's schema with the backend's autoscaling signals as the metric enum
    (trtllm-serve: :func:`trtllm_serve_schema`)."""
    schema = _load_json("chart/values.schema.json")
    keys = sorted(metrics.signals_for(spec.engine))
    auto = schema["properties"]["autoscaling"]["properties"]
    auto["metric"]["enum"] = keys
    auto["signals"]["propertyNames"] = {"enum": keys}
    return trtllm_serve_schema(schema) if spec.path.trtllm_serve else schema


def trtllm_serve_values(spec: DeploySpec, values: dict[str, Any]) -> dict[str, Any]:
    """The chart values of a trtllm-serve deployment: Triton's ``values`` with ``triton`` replaced by
    ``trtllmServe`` (argv, port, health and metrics routes), the served model name, and no autoscaling (no
    TensorRT-LLM 1.2.1 Prometheus series is pinned here to scale on; docs/deploy-k8s.md)."""
    out = {k: v for k, v in values.items() if k != "triton"}
    out["model"] = {**values["model"], "servedModel": Path(spec.hf_ckpt).name}
    metrics_path = trtllm_serve.PROMETHEUS_PATH if spec.perf_metrics else ""
    serve = {"argv": list(spec.serve_argv), "port": spec.serve_port, "healthPath": trtllm_serve.HEALTH_PATH,
             "metricsPath": metrics_path}
    keys = list(out)
    at = keys.index("service") + 1
    out = {**{k: out[k] for k in keys[:at]}, "trtllmServe": serve, **{k: out[k] for k in keys[at:]}}
    out["autoscaling"] = {**values["autoscaling"], "enabled": False, "metric": "", "signals": {}}
    out["monitoring"] = {"podMonitor": {**values["monitoring"]["podMonitor"], "enabled": spec.perf_metrics},
                         "prometheusRule": {**values["monitoring"]["prometheusRule"], "enabled": False}}
    return out


def trtllm_serve_schema(schema: dict[str, Any]) -> dict[str, Any]:
    """``values.schema.json`` for trtllm-serve: no ``triton`` key, a required ``trtllmServe``, autoscaling and the
    PrometheusRule pinned off (Helm refuses ``--set autoscaling.enabled=true`` with the field's name)."""
    props = schema["properties"]
    props.pop("triton", None)
    schema["required"] = ["trtllmServe" if k == "triton" else k for k in schema["required"]]
    props["trtllmServe"] = {
        "type": "object", "additionalProperties": False, "required": ["argv", "port", "healthPath", "metricsPath"],
        "properties": {
            "argv": {"type": "array", "minItems": 2, "items": {"type": "string", "minLength": 1},
                     "contains": {"const": "--port"}},
            "port": {"type": "integer", "minimum": 1, "maximum": 65535},
            "healthPath": {"type": "string", "pattern": "^/"},
            "metricsPath": {"type": "string", "pattern": "^(/.*)?$"},
        },
    }
    auto = props["autoscaling"]["properties"]
    auto["enabled"] = {"const": False, "description": "trtllm-serve: no autoscaling signal (docs/deploy-k8s.md)"}
    auto["metric"] = {"const": ""}
    auto["signals"] = {"type": "object", "maxProperties": 0}
    props["monitoring"]["properties"]["prometheusRule"]["properties"]["enabled"] = {"const": False}
    return schema


#: the DCGM exporter's series beside Triton's (title, series, aggregation over a pod's GPUs, Grafana unit): default
#: counters of NVIDIA/dcgm-exporter@691c92762eb5 etc/default-counters.csv (SM clock :6, GPU temp :11, power W :14,
#: GPU util % :22, FB used MiB :45, GR engine / tensor pipe active ratios :89/:92, also in the GPU Operator's
#: dcp-metrics-included.csv); the exporter labels them with the pod holding the GPU (DCGM_EXPORTER_KUBERNETES=true,
#: set by the GPU Operator's DaemonSet, internal/pkg/transformation/const.go:21-24). On MIG slices DCGM_FI_DEV_GPU_UTIL
#: is not reported (NVML: utilisation unsupported on MIG): the GR-engine-active panel is the per-slice load.
DCGM_PANELS = (
    ("GPU utilisation", "DCGM_FI_DEV_GPU_UTIL", "avg", "percent"),
    ("GPU engine active", "DCGM_FI_PROF_GR_ENGINE_ACTIVE", "avg", "percentunit"),
    ("Tensor pipe active", "DCGM_FI_PROF_PIPE_TENSOR_ACTIVE", "avg", "percentunit"),
    ("GPU memory used", "DCGM_FI_DEV_FB_USED", "sum", "mbytes"),
    ("GPU power", "DCGM_FI_DEV_POWER_USAGE", "sum", "watt"),
    ("SM clock", "DCGM_FI_DEV_SM_CLOCK", "avg", "rotmhz"),
    ("GPU temperature", "DCGM_FI_DEV_GPU_TEMP", "max", "celsius"),
)


def grafana_dashboard(spec: DeploySpec) -> dict[str, Any]:
    """A Grafana dashboard (JSON model, schemaVersion 39) of the deployment's Triton series and signals, then the DCGM
    exporter's GPU series of the same pods (:data:`DCGM_PANELS`)."""
    sel = f'namespace="$namespace",pod=~"{spec.name}.*"'
    llm = f'model="{metrics.LLM_MODEL}"'
    panels: list[tuple[str, str, str]] = [
        ("Requests/s per pod", f"sum by (pod) (rate(nv_inference_request_success{{{sel},{llm}}}[1m]))", "reqps"),
        ("Pending requests (Triton queue)", f"sum by (pod) (nv_inference_pending_request_count{{{sel}}})", "short"),
    ]
    for s in metrics.signals_for(spec.engine).values():
        panels.append((f"{s.record} (HPA target {s.target})", f'{s.record}{{namespace="$namespace"}}', "short"))
    panels += [(f"{title} ({series})", f"{agg} by (pod) ({series}{{{sel}}})", unit) for title, series, agg, unit in DCGM_PANELS]
    return {
        "title": f"trtpipe {spec.name}",
        "uid": f"trtpipe-{spec.name}"[:40],
        "schemaVersion": 39,
        "time": {"from": "now-1h", "to": "now"},
        "templating": {"list": [{"name": "namespace", "type": "query", "datasource": {"type": "prometheus"},
                                 "query": "label_values(nv_inference_request_success, namespace)"}]},
        "panels": [
            {"id": i + 1, "type": "timeseries", "title": title,
             "gridPos": {"h": 8, "w": 12, "x": 12 * (i % 2), "y": 8 * (i // 2)},
             "datasource": {"type": "prometheus"}, "fieldConfig": {"defaults": {"unit": unit}},
             "targets": [{"refId": "A", "expr": expr}]}
            for i, (title, expr, unit) in enumerate(panels)
        ],
    }


def adapter_values(spec: DeploySpec) -> dict[str, Any]:
    """prometheus-adapter chart values: one ``rules.custom`` entry per signal this backend exports."""
    return {"rules": {"default": False,
                      "custom": [metrics.adapter_rule(s) for s in metrics.signals_for(spec.engine).values()]}}


def write_chart(spec: DeploySpec, out: Path) -> Path:
    """Write the chart and its companions into ``out`` (layout in the module docstring); return the chart dir.

    A trtllm-serve chart has no Grafana dashboard nor prometheus-adapter rules: both are built on Triton's series,
    and no trtllm-serve series is pinned to scale on (docs/deploy-k8s.md)."""
    triton = not spec.path.trtllm_serve
    chart = out / "chart" / spec.name
    src = resources.files("pipeline.deploy").joinpath("chart/templates")
    with resources.as_file(src) as templates:
        shutil.copytree(templates, chart / "templates", ignore=shutil.ignore_patterns("__pycache__", "*.pyc"))
    (chart / "Chart.yaml").write_text(yaml.safe_dump({
        "apiVersion": "v2",
        "name": spec.name,
        "description": (f"Triton + TensorRT-LLM serving of trtpipe recipe {spec.recipe.name}" if triton
                        else f"trtllm-serve (TensorRT-LLM OpenAI server) serving of trtpipe recipe {spec.recipe.name}"),
        "type": "application",
        "version": CHART_VERSION,
        "appVersion": spec.release.triton_container,
        "kubeVersion": ">=1.29.0-0",
        "annotations": {"trtpipe.dev/tensorrt-llm": spec.tensorrt_llm, "trtpipe.dev/engine": spec.engine},
    }, sort_keys=False))
    (chart / "values.yaml").write_text(
        "# Default values of the trtpipe chart (docs/deploy-k8s.md explains every key).\n"
        + yaml.safe_dump(chart_values(spec), sort_keys=False, width=120)
    )
    (chart / "values.schema.json").write_text(json.dumps(values_schema(spec), indent=2) + "\n")
    if triton:
        (chart / "dashboards").mkdir()
        (chart / "dashboards" / "grafana-dashboard.json").write_text(json.dumps(grafana_dashboard(spec), indent=2) + "\n")
        (out / "prometheus-adapter-values.yaml").write_text(yaml.safe_dump(adapter_values(spec), sort_keys=False))
    return chart


def helm_engine():
    """The ``helm_python`` module (Helm's Go SDK through ctypes).

    Raises:
        MissingToolError: helm-python-sdk is not installed (``pip install 'trtpipe[deploy]'``).
    """
    try:
        import helm_python
    except ImportError:
        raise MissingToolError(
            "rendering the Helm chart needs Helm's engine: pip install 'trtpipe[deploy]' (PyPI helm-python-sdk)"
        ) from None
    return helm_python


def render_chart(chart: Path, *, values: dict[str, Any] | None = None, release: str | None = None,
                 namespace: str = "default") -> dict[str, str]:
    """``helm template``: ``{template path: rendered YAML}`` of ``chart`` with ``values`` over its defaults.

    Raises:
        StageError: the values fail ``values.schema.json`` or a template fails (``fail``/``required``/syntax);
            the message is Helm's.
        MissingToolError: no Helm engine (:func:`helm_engine`).
    """
    helm = helm_engine()
    try:
        with helm.Chart.load(str(chart)) as ch:
            return ch.render(values or {}, name=release or chart.name, namespace=namespace)
    except helm.HelmError as e:
        raise StageError(f"helm template {chart.name}: {str(e).strip()}") from None


def write_rendered(rendered: dict[str, str], out: Path) -> list[Path]:
    """Write each non-empty rendered template to ``out/<file name>`` (NOTES.txt included); return the files."""
    out.mkdir(parents=True, exist_ok=True)
    written = []
    for key in sorted(rendered):
        text = rendered[key]
        if not text.strip() or (not key.endswith(".txt") and all(not d for d in yaml.safe_load_all(text))):
            continue  # a template switched off by its values
        rel = key.split("/templates/", 1)[-1]
        path = out / rel
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text if text.endswith("\n") else text + "\n")
        written.append(path)
    return written
