"""Which Prometheus series each Triton backend really exports, and the autoscaling signals built on them.

Sources (upstream code, file@commit):

* **Triton core, every backend** — per-model counters ``nv_inference_queue_duration_us`` (time in the
  scheduling queue), ``nv_inference_compute_infer_duration_us`` (time inside the backend's execute),
  ``nv_inference_request_success`` and ``nv_inference_pending_request_count``, labelled ``model`` and
  ``version``, on the metrics port at ``/metrics``: triton-inference-server/server
  ``docs/user_guide/metrics.md@eb04f5f2cd7d`` (tables at lines 99-202) and ``src/http_server.h@13480cbf300d:155``
  (the metrics server answers ``/metrics/?``).
* **C++ ``tensorrtllm`` backend (build.engine: tensorrt)** — adds the executor's gauges
  ``nv_trt_llm_request_metrics{request_type=active|max|scheduled|context|waiting}``,
  ``nv_trt_llm_kv_cache_block_metrics{kv_cache_block_type=max|free|used|tokens_per|reused|fraction}``,
  ``nv_trt_llm_runtime_memory_metrics``, ``nv_trt_llm_inflight_batcher_metrics``, ``nv_trt_llm_general_metrics``
  and the ``nv_llm_input_token_len``/``nv_llm_output_token_len`` histograms: NVIDIA/TensorRT-LLM
  ``triton_backend/inflight_batcher_llm/src/custom_metrics_reporter/custom_metrics_reporter.cc@0d5352f5fc5f``
  (``request_labels_``, ``kv_cache_labels_``, ``InitializeReporter``).
* **LLM-API python model (build.engine: pytorch)** — only the Triton core series. Its ``model.py`` creates no
  ``pb_utils.MetricFamily`` (NVIDIA/TensorRT-LLM ``triton_backend/all_models/llmapi/tensorrt_llm/1/model.py@044a90d209e3``;
  per-request KV/timing figures go into response tensors, not metrics), and its ``execute()`` hands each request
  to the engine's event loop and returns at once, so Triton's compute time there covers only that hand-off:
  the queue/compute ratio is a weak load signal on this path (said in docs/deploy-k8s.md).

The default signal depends on the backend (:data:`DEFAULT_SIGNALS`): for the C++ backend the executor's waiting
queue (``waiting_requests``; the ratio below barely moves there, see :data:`DEFAULT_SIGNALS`), for the LLM-API
model the queue/compute ratio of NVIDIA's Triton + TensorRT-LLM autoscaling tutorial
(triton-inference-server/tutorials ``Deployment/Kubernetes/EKS_Multinode_Triton_TRTLLM/multinode_helm_chart/
triton-metrics_prometheus-rule.yaml@66481c48dc8d``, record ``triton:queue_compute:ratio``, HPA target ``1000m`` in
``TensorRT-LLM_Autoscaling_and_Load_Balancing/chart/templates/horizontal-pod-autoscaler.yaml@d459ddd7d195``).
trtpipe restricts it to the ``tensorrt_llm`` model and sums per pod, so the HPA gets one value per pod (the
tutorial's rule keeps one series per model of the repository).
"""

from __future__ import annotations

import dataclasses

#: the Triton model every trtpipe repository serves tokens from (triton_repo layouts: C++ and llmapi)
LLM_MODEL = "tensorrt_llm"
#: Triton's metrics endpoint path (src/http_server.h@13480cbf300d:155, regex ``/metrics/?``)
METRICS_PATH = "/metrics"
#: engine kinds → the Triton backend that serves them (triton_repo/layouts.yaml)
BACKENDS = {"tensorrt": "tensorrtllm (C++)", "pytorch": "python (LLM-API model.py)"}

#: series every backend exports (Triton core), docs/user_guide/metrics.md@eb04f5f2cd7d
CORE_SERIES = (
    "nv_inference_request_success",
    "nv_inference_queue_duration_us",
    "nv_inference_compute_infer_duration_us",
    "nv_inference_pending_request_count",
)
#: extra series of the C++ tensorrtllm backend, custom_metrics_reporter.cc@0d5352f5fc5f
TRTLLM_SERIES = (
    "nv_trt_llm_request_metrics",
    "nv_trt_llm_runtime_memory_metrics",
    "nv_trt_llm_kv_cache_block_metrics",
    "nv_trt_llm_inflight_batcher_metrics",
    "nv_trt_llm_general_metrics",
    "nv_llm_input_token_len",
    "nv_llm_output_token_len",
)
EXPORTED_SERIES: dict[str, tuple[str, ...]] = {
    "tensorrt": CORE_SERIES + TRTLLM_SERIES,
    "pytorch": CORE_SERIES,
}


@dataclasses.dataclass(frozen=True)
class AutoscalingSignal:
    """One per-pod autoscaling signal: a PrometheusRule record, the adapter rule exposing it, the HPA target.

    ``record`` is the recorded series name, which is also the custom-metrics API name the prometheus-adapter
    rule exposes (``as: "${1}"``) and the HPA ``pods.metric.name``. ``expr`` yields one series per
    (namespace, pod). ``target`` is the HPA ``AverageValue`` (a Kubernetes quantity). ``series`` are the
    exported series it reads (each must be in :data:`EXPORTED_SERIES` of a backend for it to apply there).
    """

    key: str
    record: str
    expr: str
    target: str
    unit: str
    description: str
    series: tuple[str, ...]

    def available_for(self, engine: str) -> bool:
        """True when the backend serving ``engine`` (``tensorrt``/``pytorch``) exports every series it reads."""
        return all(s in EXPORTED_SERIES.get(engine, ()) for s in self.series)


_SEL = f'model="{LLM_MODEL}"'

SIGNALS: dict[str, AutoscalingSignal] = {
    "queue_compute_ratio": AutoscalingSignal(
        key="queue_compute_ratio",
        record="triton:queue_compute:ratio",
        expr=(
            f"sum by (namespace, pod) (rate(nv_inference_queue_duration_us{{{_SEL}}}[1m]))"
            f" / clamp_min(sum by (namespace, pod) (rate(nv_inference_compute_infer_duration_us{{{_SEL}}}[1m])), 1)"
        ),
        # NVIDIA's tutorial HPA target (horizontal-pod-autoscaler.yaml@d459ddd7d195: averageValue 1000m)
        target="1000m",
        unit="ratio",
        description="time requests wait in Triton's queue per unit of compute time (NVIDIA's tutorial signal)",
        series=("nv_inference_queue_duration_us", "nv_inference_compute_infer_duration_us"),
    ),
    "waiting_requests": AutoscalingSignal(
        key="waiting_requests",
        record="triton:trtllm_waiting:requests",
        expr=f'sum by (namespace, pod) (nv_trt_llm_request_metrics{{{_SEL},request_type="waiting"}})',
        # chosen: scale out once more than 8 requests wait for a batch slot on average; tune with `trtpipe bench`
        target="8",
        unit="requests",
        description="requests the TensorRT-LLM executor has queued but not scheduled (C++ backend only)",
        series=("nv_trt_llm_request_metrics",),
    ),
    "kv_cache_utilization": AutoscalingSignal(
        key="kv_cache_utilization",
        record="triton:trtllm_kv_cache:utilization",
        expr=f'max by (namespace, pod) (nv_trt_llm_kv_cache_block_metrics{{{_SEL},kv_cache_block_type="fraction"}})',
        # chosen: scale out at 80 % of the paged KV blocks in use; tune with `trtpipe bench`
        target="800m",
        unit="fraction",
        description="fraction of the paged KV-cache blocks in use (C++ backend only)",
        series=("nv_trt_llm_kv_cache_block_metrics",),
    ),
}
#: the signal the chart scales on by default, per engine kind. C++ backend (tensorrt): the executor's waiting
#: queue. Its execute() only enqueues: the backend stamps compute start when execute() hands the request to the
#: executor and compute end at the final response (triton-inference-server/tensorrtllm_backend
#: inflight_batcher_llm/src/model_instance_state.cc@c2e65b8:924-956,1334-1395), so nv_inference_queue_duration_us counts only Triton's
#: queue in front of a non-blocking execute and the ratio stays near 0 under load; the requests waiting for a
#: batch slot are nv_trt_llm_request_metrics{request_type="waiting"} (same repository,
#: inflight_batcher_llm/src/custom_metrics_reporter/custom_metrics_reporter.cc@c2e65b8:38-40,169).
#: LLM-API python model (pytorch): only Triton's core series exist, so the tutorial's ratio is all there is.
DEFAULT_SIGNALS = {"tensorrt": "waiting_requests", "pytorch": "queue_compute_ratio"}
#: the fallback (every backend exports its series)
DEFAULT_SIGNAL = "queue_compute_ratio"


def default_signal(engine: str) -> str:
    """The autoscaling signal the chart uses for ``engine`` unless ``autoscaling.metric`` says otherwise."""
    key = DEFAULT_SIGNALS.get(engine, DEFAULT_SIGNAL)
    return key if SIGNALS[key].available_for(engine) else DEFAULT_SIGNAL


def signals_for(engine: str) -> dict[str, AutoscalingSignal]:
    """The signals whose series the backend serving ``engine`` exports (:data:`DEFAULT_SIGNAL` always applies)."""
    return {k: s for k, s in SIGNALS.items() if s.available_for(engine)}


def adapter_rule(signal: AutoscalingSignal) -> dict:
    """The prometheus-adapter ``rules.custom`` entry that exposes ``signal.record`` as a per-pod custom metric.

    Format: kubernetes-sigs/prometheus-adapter docs/config.md (seriesQuery / resources.overrides / name /
    metricsQuery); the record already carries ``namespace`` and ``pod`` labels (PodMonitor target labels).
    """
    return {
        "seriesQuery": f'{signal.record}{{namespace!="",pod!=""}}',
        "resources": {"overrides": {"namespace": {"resource": "namespace"}, "pod": {"resource": "pod"}}},
        "name": {"matches": f"^{signal.record}$", "as": signal.record},
        "metricsQuery": "sum(<<.Series>>{<<.LabelMatchers>>}) by (<<.GroupBy>>)",
    }
