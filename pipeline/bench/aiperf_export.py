"""AIPerf-compatible exports beside bench.json: ``profile_export.jsonl``, ``profile_export_aiperf.json`` / ``.csv``.

Schema source: ai-dynamo/aiperf@db4f6397 — ``docs/tutorials/working-with-profile-exports.md`` (the three
files), ``aiperf/common/models/record_models.py`` (``MetricRecordInfo``: ``metadata`` / ``metrics`` /
``error``; ``MetricValue``: ``value`` + ``unit``), ``aiperf/common/models/error_models.py``
(``ErrorDetails``: ``code`` / ``type`` / ``message``), ``aiperf/common/models/export_models.py``
(``JsonMetricResult``: ``unit``, ``avg``, ``p1`` … ``p99``, ``min``, ``max``, ``std``; ``JsonExportData``
keyed by metric tag) and ``aiperf/exporters/csv_exporter.py`` (a ``Metric,avg,min,max,p1,…,p99,std``
table of per-request metrics, a blank line, then a ``Metric,Value`` table of run metrics; names are
``Header (unit)``; numbers with two decimals). Units as AIPerf displays them: ``ms``, ``tokens``,
``tokens/sec/user``, ``tokens/sec``, ``requests/sec``, ``sec``, ``requests``.

AIPerf's files describe one load point; a trtpipe run may hold several. ``profile_export.jsonl`` at
the top holds every measured request of the run (``metadata`` also carries trtpipe's ``scenario`` and
``load``; AIPerf's models accept extra fields). The aggregated files are written per load point
under ``aiperf/<ISL>x<OSL>_<load>/`` and, when the run has exactly one load point, also at the top.
Timestamps are epoch ns (``t0_epoch_ns`` + the monotonic offset from the run start).
"""

from __future__ import annotations

import csv
import io
import json
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np

from pipeline.bench import metrics as bm
from pipeline.bench.images import spec_json
from pipeline.bench.records import RequestRecord
from pipeline.bench.results import BenchResult, Summary

JSONL = "profile_export.jsonl"
AGG_JSON = "profile_export_aiperf.json"
AGG_CSV = "profile_export_aiperf.csv"
#: AIPerf's STAT_KEYS order (aiperf/common/constants.py)
STAT_KEYS = ("avg", "min", "max", "p1", "p5", "p10", "p25", "p50", "p75", "p90", "p95", "p99", "std")
_PCTS = (1, 5, 10, 25, 50, 75, 90, 95, 99)

#: AIPerf's values that are counts of ours rather than trtpipe metrics (each metric's own AIPerf name, header, unit
#: and place are its ``aiperf`` :class:`~pipeline.bench.metrics.Peer`): per request, then per load point
_RECORD_ONLY = ((bm.Peer("output_token_count", 4, "Output Token Count", "tokens"), lambda r: r.output_tokens),)
_RUN_ONLY: tuple[tuple[bm.Peer, Any], ...] = (
    (bm.Peer("request_count", 2, "Request Count", "requests"), lambda s: s.counts.completed),
    (bm.Peer("error_request_count", 3, "Error Request Count", "requests"), lambda s: s.counts.failed),
    (bm.Peer("benchmark_duration", 4, "Benchmark Duration", "sec"), lambda s: s.duration_s),
    (bm.Peer("total_output_tokens", 5, "Total Output Tokens", "tokens"), lambda s: s.counts.output_tokens),
    (bm.Peer("total_osl", 6, "Total Output Sequence Length", "tokens"), lambda s: s.counts.output_tokens),
    (bm.Peer("total_isl", 7, "Total Input Sequence Length", "tokens"), lambda s: s.counts.input_tokens),
    (bm.Peer("good_request_count", 9, "Good Request Count", "requests"), lambda s: s.counts.good),
)


def _run_value(tag: str) -> Any:
    return lambda s: s.metrics[tag]


#: per-request AIPerf metrics in AIPerf's order: (AIPerf name, value of one request)
_RECORD_METRICS = sorted([(m.aiperf, m.per_request) for m in bm.METRICS.values() if m.aiperf and m.distribution]
                         + list(_RECORD_ONLY), key=lambda item: item[0].pos)
#: per-run AIPerf metrics in AIPerf's order: (AIPerf name, value of one load point's Summary)
_RUN_METRICS = sorted([(m.aiperf, _run_value(m.tag)) for m in bm.METRICS.values() if m.aiperf and not m.distribution]
                      + list(_RUN_ONLY), key=lambda item: item[0].pos)
#: an image workload's values (AIPerf@db4f6397 has no image metric — none under aiperf/metrics/types/ — so the names
#: are trtpipe's, in AIPerf's style; its ``input_sequence_length`` counts the text only, as ours):
#: per request, then per load point; only in runs that sent images
_IMAGE_RECORD = ((bm.Peer("image_count", 20, "Image Count", "images"), lambda r: r.images),
                 (bm.Peer("image_tokens", 21, "Image Tokens", "tokens"), lambda r: r.image_tokens))
_IMAGE_RUN = ((bm.Peer("total_images", 20, "Total Images", "images"), lambda im: im["total_images"]),
              (bm.Peer("total_image_tokens", 21, "Total Image Tokens", "tokens"), lambda im: im["total_image_tokens"]))
_HEADERS = {peer.name: peer.header for peer, _ in [*_RECORD_METRICS, *_RUN_METRICS, *_IMAGE_RECORD, *_IMAGE_RUN]}


def record_line(r: RequestRecord, session_num: int, t0_ns: int, t0_epoch_ns: int) -> dict[str, Any]:
    """One ``MetricRecordInfo`` of ``profile_export.jsonl`` for a measured request."""
    def epoch(ns: int | None) -> int | None:
        return None if ns is None else t0_epoch_ns + (ns - t0_ns)

    first = r.response_ns[0] if r.response_ns else None
    meta = {
        "session_num": session_num, "x_request_id": f"{r.scenario}/{r.load}/{r.index}", "x_correlation_id": None,
        "conversation_id": None, "turn_index": 0, "request_start_ns": epoch(r.start_ns), "request_ack_ns": epoch(first),
        "request_end_ns": epoch(r.end_ns), "worker_id": "trtpipe", "record_processor_id": "trtpipe",
        "benchmark_phase": "profiling", "was_cancelled": r.error == "cancelled",
        "cancellation_time_ns": epoch(r.end_ns) if r.error == "cancelled" else None,
        "scenario": r.scenario, "load": r.load,
    }
    if r.error is not None or not r.ok:
        return {"metadata": meta, "metrics": {"error_isl": {"value": r.input_tokens, "unit": "tokens"}},
                "error": {"code": None, "type": (r.error or "no tokens").split(":")[0][:60], "message": r.error or "no output tokens"}}
    out = {}
    for peer, fn in [*_RECORD_METRICS, *(_IMAGE_RECORD if r.images else ())]:
        v = fn(r)
        if v is not None and v != []:
            out[peer.name] = {"value": v, "unit": peer.unit}
    return {"metadata": meta, "metrics": out, "error": None}


def _stats(values: Sequence[float], unit: str) -> dict[str, Any] | None:
    arr = np.asarray(values, dtype=np.float64)
    if arr.size == 0:
        return None
    pct = np.percentile(arr, _PCTS)
    out: dict[str, Any] = {"unit": unit, "avg": float(arr.mean()), "min": float(arr.min()), "max": float(arr.max())}
    out |= {f"p{p}": float(v) for p, v in zip(_PCTS, pct)}
    out["std"] = float(arr.std())
    return out


def aggregate(records: Sequence[RequestRecord], summary: Summary) -> dict[str, dict[str, Any]]:
    """``JsonExportData``-shaped metrics of one load point (measured requests; ``summary`` from
    :func:`pipeline.bench.metrics.summarize` for the run-level values)."""
    done = [r for r in records if not r.warmup and r.ok]
    out: dict[str, dict[str, Any]] = {}
    for peer, fn in _RECORD_METRICS:
        vals: list[float] = []
        for r in done:
            v = fn(r)
            if isinstance(v, list):
                vals += v
            elif v is not None:
                vals.append(float(v))
        if (s := _stats(vals, peer.unit)) is not None:
            out[peer.name] = s
    for peer, fn in _RUN_METRICS:
        if (v := fn(summary)) is not None:
            out[peer.name] = {"unit": peer.unit, "avg": v}
    if summary.images is not None:
        for peer, fn in _IMAGE_RECORD:
            if (s := _stats([fn(r) for r in done], peer.unit)) is not None:
                out[peer.name] = s
        for peer, fn in _IMAGE_RUN:
            out[peer.name] = {"unit": peer.unit, "avg": fn(summary.images)}
    return out


def aggregate_csv(agg: dict[str, dict[str, Any]]) -> str:
    """``profile_export_aiperf.csv`` text: per-request metrics table, blank line, run metrics table."""
    def name(tag: str, unit: str) -> str:
        return _HEADERS[tag] + ("" if unit in ("count", "requests") else f" ({unit})")

    def num(v: Any) -> str:
        return "" if v is None else f"{int(v)}" if isinstance(v, int) else f"{float(v):.2f}"

    buf = io.StringIO()
    w = csv.writer(buf)
    w.writerow(["Metric", *STAT_KEYS])
    for tag in sorted(t for t, s in agg.items() if "p50" in s):
        w.writerow([name(tag, agg[tag]["unit"]), *(num(agg[tag].get(k)) for k in STAT_KEYS)])
    w.writerow([])
    w.writerow(["Metric", "Value"])
    for tag in sorted(t for t, s in agg.items() if "p50" not in s):
        w.writerow([name(tag, agg[tag]["unit"]), num(agg[tag]["avg"])])
    return buf.getvalue()


def write(tmp: Path, run: BenchResult) -> None:
    """Write the AIPerf files of ``run`` into the run directory being built (``tmp``)."""
    measured = [r for r in run.records if not r.warmup]
    with open(tmp / JSONL, "w") as f:
        for i, r in enumerate(measured):
            f.write(json.dumps(record_line(r, i, run.t0_ns, run.t0_epoch_ns), separators=(",", ":")) + "\n")
    points = [p for p in run.load_points if p.summary is not None]
    for p in points:
        agg = aggregate(p.records(measured), p.summary)  # type: ignore[arg-type]
        doc = {"input_config": {"trtpipe": spec_json(run.spec), "url": run.url, "scenario": p.scenario,
                                "load": p.load}, "was_cancelled": bool(run.interrupted)} | agg
        dirs = [tmp / "aiperf" / f"{p.scenario.replace(':', 'x')}_{p.load}"] + ([tmp] if len(points) == 1 else [])
        for d in dirs:
            d.mkdir(parents=True, exist_ok=True)
            (d / AGG_JSON).write_text(json.dumps(doc, indent=2) + "\n")
            (d / AGG_CSV).write_text(aggregate_csv(agg))
