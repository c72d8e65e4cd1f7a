"""Triton's Prometheus metrics around each load point: scrape before and after, report the deltas.

Triton serves Prometheus text at ``http://HOST:8002/metrics`` by default (Triton docs ``docs/user_guide/metrics.md``,
triton-inference-server/server: per-model counters ``nv_inference_request_success``,
``nv_inference_request_failure``, ``nv_inference_count``, ``nv_inference_exec_count`` and cumulative
microsecond counters ``nv_inference_request_duration_us``, ``nv_inference_queue_duration_us``,
``nv_inference_compute_input_duration_us``, ``nv_inference_compute_infer_duration_us``,
``nv_inference_compute_output_duration_us``, labelled ``model``/``version``). TensorRT-LLM's backend adds
``nv_trt_llm_*`` gauges (request, KV-cache and inflight-batching statistics; tensorrtllm_backend
``docs/model_config.md`` / ``inflight_batcher_llm`` metrics), reported here as their values after the load point.

Parsing is ``prometheus_client.parser.text_string_to_metric_families``; the HTTP GET is ``requests``
(both pure Python, outside the measured loop: one scrape before and one after each load point's measured phase).

The metrics URL: ``--metrics-url`` when given; else ``http://<gRPC host>:8002/metrics`` when that answers.
"""

from __future__ import annotations

from typing import Any
from urllib.parse import urlsplit

#: Triton per-model cumulative counters whose deltas are reported (name → short key)
COUNTERS = {
    "nv_inference_request_success": "request_success",
    "nv_inference_request_failure": "request_failure",
    "nv_inference_count": "inference_count",
    "nv_inference_exec_count": "exec_count",
    "nv_inference_request_duration_us": "request_duration_us",
    "nv_inference_queue_duration_us": "queue_duration_us",
    "nv_inference_compute_input_duration_us": "compute_input_duration_us",
    "nv_inference_compute_infer_duration_us": "compute_infer_duration_us",
    "nv_inference_compute_output_duration_us": "compute_output_duration_us",
}
DEFAULT_PORT = 8002
_TIMEOUT_S = 2.0

Sample = tuple[str, tuple[tuple[str, str], ...]]


def default_url(grpc_url: str) -> str:
    """``http://<host of grpc_url>:8002/metrics`` (Triton's default metrics port)."""
    host = urlsplit("//" + grpc_url.split("://")[-1]).hostname or "localhost"
    return f"http://{host}:{DEFAULT_PORT}/metrics"


def scrape(url: str) -> dict[Sample, float]:
    """Every sample of the endpoint: ``{(name, sorted labels): value}``, names as the server wrote them
    (prometheus_client's parser reports counter samples as ``<name>_total``; that suffix is dropped again).

    Raises:
        OSError: the endpoint does not answer or answers with an HTTP error (``requests`` errors are OSErrors).
        ValueError: the body is not Prometheus text.
    """
    import requests
    from prometheus_client.parser import text_string_to_metric_families

    resp = requests.get(url, timeout=_TIMEOUT_S)
    resp.raise_for_status()
    out: dict[Sample, float] = {}
    for fam in text_string_to_metric_families(resp.text):
        for s in fam.samples:
            name = s.name
            if fam.type == "counter" and name == fam.name + "_total":  # the parser adds OpenMetrics' suffix
                name = fam.name
            out[(name, tuple(sorted(s.labels.items())))] = float(s.value)
    return out


def probe(url: str | None, grpc_url: str) -> tuple[str | None, str | None]:
    """``(url to use, note)``: the given URL must answer; the default one is used only when it answers.

    Returns ``(None, reason)`` when there is nothing to scrape (the bench runs on without server metrics).
    """
    target = url or default_url(grpc_url)
    try:
        scrape(target)
    except (OSError, ValueError) as e:
        why = " ".join(str(e).split())[:200]
        return None, f"server metrics not scraped: {target}: {why}"
    return target, None


def delta(before: dict[Sample, float], after: dict[Sample, float], model: str) -> dict[str, Any]:
    """Server-side view of one load point for ``model``.

    Returns:
        ``counters`` (Δ of :data:`COUNTERS` summed over the model's versions), per successful request
        ``queue_ms_per_request``, ``compute_infer_ms_per_request``, ``request_ms_per_request`` (Δ µs / Δ
        successes / 1000; ``None`` without successes), and ``trt_llm`` — every ``nv_trt_llm_*`` sample after the
        load point as ``{"name{label=value,…}": value}`` (empty when the server has none), and ``trtpipe`` — the
        change over the load point of every ``trtpipe_*`` sample (the CPU engine's cumulative step timeline,
        :mod:`pipeline.cpu_runtime.timeline`; read by ``trtpipe profile``), same keys; empty when the server has none.
    """
    counters: dict[str, float] = {}
    for (name, labels), v in after.items():
        key = COUNTERS.get(name)
        if key is None or dict(labels).get("model") != model:
            continue
        counters[key] = counters.get(key, 0.0) + v - before.get((name, labels), 0.0)
    ok = counters.get("request_success", 0.0)

    def per_request_ms(key: str) -> float | None:
        return counters[key] / ok / 1000.0 if ok > 0 and key in counters else None

    def key(n: str, labels: tuple) -> str:
        return f"{n}{{{','.join(f'{k}={v}' for k, v in labels)}}}"

    trt = {key(n, labels): v for (n, labels), v in sorted(after.items()) if n.startswith("nv_trt_llm_")}
    own = {key(n, labels): v - before.get((n, labels), 0.0) for (n, labels), v in sorted(after.items())
           if n.startswith("trtpipe_")}
    return {
        "counters": counters,
        "queue_ms_per_request": per_request_ms("queue_duration_us"),
        "compute_infer_ms_per_request": per_request_ms("compute_infer_duration_us"),
        "request_ms_per_request": per_request_ms("request_duration_us"),
        "trt_llm": trt,
        "trtpipe": own,
    }
