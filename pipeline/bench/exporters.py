"""Run directory: ``bench.json`` (everything), ``summary.csv`` (one row per load point), plots.

Layout of ``artifacts/bench/<YYYYmmdd-HHMMSS>/`` (or ``--out``)::

    bench.json    config, environment/provenance, status, load points with summaries, every request
    summary.csv   one row per scenario × load point (:mod:`pipeline.bench.summary_csv`)
    profile_export.jsonl, profile_export_aiperf.json/.csv, aiperf/   AIPerf's export files
                  (:mod:`pipeline.bench.aiperf_export`)
    plots/*.png   from summary.csv only (:mod:`pipeline.bench.plots`)

The directory is written atomically (:func:`pipeline.core.artifacts.atomic_dir`).
"""

from __future__ import annotations

import csv
import json
import os
import platform
import socket
import sys
from pathlib import Path
from typing import Any

from pipeline.bench.images import spec_json
from pipeline.bench.metrics import METRICS, definitions
from pipeline.bench.results import BENCH_JSON, BenchResult, LoadPoint
from pipeline.bench.summary_csv import SUMMARY_CSV, csv_columns, csv_row
from pipeline.core import artifacts

__all__ = ["BENCH_JSON", "SCHEMA", "all_failed", "run_document", "vllm_block", "write_run"]

SCHEMA = "trtpipe.bench/1"


def environment(run: BenchResult) -> dict[str, Any]:
    """Provenance: versions, machine, server/model metadata and config, build manifests."""
    env: dict[str, Any] = {
        "versions": artifacts.library_versions("tritonclient", "grpcio", "numpy", "transformers", "tokenizers"),
        "python": sys.version.split()[0],
        "platform": platform.platform(),
        "hostname": socket.gethostname(),
        "cpu_count": os.cpu_count(),
        "tokenizer": run.tokenizer_path,
    }
    if run.info is not None:
        env["triton_server"] = run.info.server
        env["model"] = {"metadata": run.info.metadata, "config": run.info.config, "interface": run.info.interface}
    layout = run.layout
    if layout is not None:
        from pipeline.core.layout import STAGES

        env["build"] = {"dir": str(layout.root)}
        for stage in STAGES:
            env["build"][stage] = artifacts.read_manifest(layout.stage_dir(stage))
    return env


def run_document(run: BenchResult) -> dict[str, Any]:
    """The full ``bench.json`` document of a run."""
    api = run.api
    cfg = spec_json(run.spec) | {"url": run.url, "api": api.name if api is not None else "grpc",
                                             "openai_endpoint": api.endpoint if api is not None and api.name == "openai" else None,
                                             "tokenizer": run.tokenizer_path,
                                             "build_dir": str(run.layout.root) if run.layout else None}
    return {
        "schema": SCHEMA,
        "started_at": run.started_at,
        "t0_epoch_ns": run.t0_epoch_ns,
        "config": cfg,
        "environment": environment(run),
        "status": {"complete": not (run.interrupted or run.aborted), "interrupted": run.interrupted,
                   "aborted": run.aborted, "warnings": run.warnings, "notes": run.notes},
        "units": {tag: spec.unit for tag, spec in METRICS.items()} | {"times": "ns since run start (perf_counter_ns)"},
        "definitions": definitions(),
        "gpus": run.gpus,
        **({"images": run.image_plan.to_json()} if run.image_plan is not None else {}),
        "load_points": [p.to_json() | ({"vllm": vllm_block(p)} if p.summary is not None else {}) for p in run.load_points],
        "requests": [r.to_json(run.t0_ns) for r in run.records],
    }


def vllm_block(point: LoadPoint) -> dict[str, Any]:
    """One load point's summary under the keys vLLM's ``benchmark_serving.py --save-result`` writes
    (vllm-project/vllm@0049e29c benchmarks/benchmark_serving.py, ``benchmark()``'s ``result`` dict and
    ``process_one_metric``): ``duration`` s, ``completed``, token totals, the run values, and
    ``mean_/median_/std_/p90_/p95_/p99_<m>_ms`` for its latency stems (ttft, tpot, itl = our per-chunk
    ``inter_chunk_latency``, e2el) — each metric's ``vllm`` name in :data:`pipeline.bench.metrics.METRICS`.
    vLLM's ``std`` is numpy's population std like ours; its ``median`` is our p50."""
    s = point.summary
    assert s is not None
    c = s.counts
    named = sorted((m for m in METRICS.values() if m.vllm is not None), key=lambda m: m.vllm.pos)  # type: ignore[union-attr]
    out: dict[str, Any] = {"duration": s.duration_s, "completed": c.completed, "total_input_tokens": c.input_tokens,
                           "total_output_tokens": c.output_tokens}
    out |= {m.vllm.name: s.metrics[m.tag] for m in named if not m.distribution}  # type: ignore[union-attr]
    out |= {"max_concurrency": point.concurrency, "request_rate": point.request_rate or "inf"}
    for m in (m for m in named if m.distribution):
        st, short = s.metrics[m.tag], m.vllm.name  # type: ignore[union-attr]
        out |= {f"mean_{short}_ms": st["avg"], f"median_{short}_ms": st["p50"], f"std_{short}_ms": st["std"],
                f"p90_{short}_ms": st["p90"], f"p95_{short}_ms": st["p95"], f"p99_{short}_ms": st["p99"]}
    return out


def all_failed(run: BenchResult) -> bool:
    """Every measured request of ``run`` failed (and there was at least one)."""
    return run.total("requests") > 0 and run.total("failed") == run.total("requests")


def write_run(out: Path, run: BenchResult) -> Path:
    """Write ``bench.json``, ``summary.csv`` and the plots into ``out`` (atomically); returns ``out``. A run whose
    every measured request failed gets no plots (a warning says so)."""
    from pipeline.bench import aiperf_export, plots

    with artifacts.atomic_dir(Path(out)) as tmp:
        aiperf_export.write(tmp, run)
        (tmp / BENCH_JSON).write_text(json.dumps(run_document(run), default=str, separators=(",", ":")) + "\n")
        with open(tmp / SUMMARY_CSV, "w", newline="") as f:
            done = [p.summary for p in run.load_points if p.summary is not None]
            w = csv.DictWriter(f, fieldnames=csv_columns(images=any(s.images for s in done),
                                                         prefix=any(s.prefix_cache for s in done)))
            w.writeheader()
            for point in run.load_points:
                if point.summary is not None:
                    w.writerow(csv_row(point))
        if all_failed(run):  # plots of nothing but failures would read as results
            run.warnings.append("no plots: every measured request failed (see bench.json's requests for the errors)")
            return Path(out)
        try:
            plots.write_plots(tmp)
        except Exception as e:  # noqa: BLE001 - plots are a convenience; the data is already written
            run.warnings.append(f"plots not written: {e}")
    return Path(out)
