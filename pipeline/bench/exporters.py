"""Run directory: ``bench.json`` (everything), ``summary.csv`` (one row per load point), plots.

Layout of ``artifacts/bench/<YYYYmmdd-HHMMSS>/`` (or ``--out``)::

    bench.json    config, environment/provenance, status, load points with summaries, every request
    summary.csv   one row per scenario × load point; columns from :func:`csv_columns`
    plots/*.png   from summary.csv only (:mod:`pipeline.bench.plots`)

CSV column names follow genai-perf's metric keys with the unit and statistic appended, e.g.
``time_to_first_token_ms_p99``, ``inter_token_latency_ms_avg``,
``output_token_throughput_tokens_per_s``, ``request_throughput_requests_per_s``.
The directory is written atomically (:func:`pipeline.artifacts.atomic_dir`).
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

from pipeline import artifacts
from pipeline.bench.metrics import METRICS
from pipeline.bench.stats import STAT_FIELDS

SCHEMA = "trtpipe.bench/1"
BENCH_JSON = "bench.json"
SUMMARY_CSV = "summary.csv"
#: columns that identify a row (scenario × load point) and its counts
KEY_COLUMNS = (
    "scenario", "isl", "osl", "mode", "concurrency", "request_rate", "requests", "completed", "failed", "short",
    "duration_s", "client_cpu_fraction",
)
_UNIT_SUFFIX = {"ms": "ms", "tokens": "tokens", "tokens/s": "tokens_per_s", "requests/s": "requests_per_s"}


def column(tag: str, stat: str | None = None) -> str:
    """CSV column of a metric (``stat`` for distributions), e.g. ``time_to_first_token_ms_p99``."""
    base = f"{tag}_{_UNIT_SUFFIX[METRICS[tag].unit]}"
    return f"{base}_{stat}" if stat else base


def csv_columns() -> list[str]:
    """All CSV columns, in order."""
    cols = list(KEY_COLUMNS)
    for tag, spec in METRICS.items():
        cols += [column(tag, s) for s in STAT_FIELDS] if spec.distribution else [column(tag)]
    return cols


def csv_row(point: dict[str, Any]) -> dict[str, Any]:
    """The CSV row of one load point (``point`` as stored in bench.json)."""
    s = point["summary"]
    row: dict[str, Any] = {k: point.get(k) for k in ("scenario", "isl", "osl", "mode", "concurrency", "request_rate")}
    row.update({k: s["counts"][k] for k in ("requests", "completed", "failed", "short")})
    row["duration_s"] = s["duration_s"]
    row["client_cpu_fraction"] = point.get("client_cpu_fraction")
    for tag, spec in METRICS.items():
        value = s["metrics"].get(tag)
        if spec.distribution:
            for stat in STAT_FIELDS:
                row[column(tag, stat)] = (value or {}).get(stat)
        else:
            row[column(tag)] = value
    return row


def environment(run: Any) -> dict[str, Any]:
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
        from pipeline.layout import STAGES

        env["build"] = {"dir": str(layout.root)}
        for stage in STAGES:
            env["build"][stage] = artifacts.read_manifest(layout.stage_dir(stage))
    return env


def run_document(run: Any) -> dict[str, Any]:
    """The full ``bench.json`` document of a run."""
    cfg = run.spec.model_dump(mode="json") | {"url": run.url, "tokenizer": run.tokenizer_path,
                                             "build_dir": str(run.layout.root) if run.layout else None}
    return {
        "schema": SCHEMA,
        "started_at": run.started_at,
        "t0_epoch_ns": run.t0_epoch_ns,
        "config": cfg,
        "environment": environment(run),
        "status": {"complete": not (run.interrupted or run.aborted), "interrupted": run.interrupted,
                   "aborted": run.aborted, "warnings": run.warnings, "notes": getattr(run, "notes", [])},
        "units": {tag: spec.unit for tag, spec in METRICS.items()} | {"times": "ns since run start (perf_counter_ns)"},
        "load_points": run.load_points,
        "requests": [r.to_json(run.t0_ns) for r in run.records],
    }


def write_run(out: Path, run: Any) -> Path:
    """Write ``bench.json``, ``summary.csv`` and the plots into ``out`` (atomically); returns ``out``."""
    from pipeline.bench import plots

    with artifacts.atomic_dir(Path(out)) as tmp:
        (tmp / BENCH_JSON).write_text(json.dumps(run_document(run), default=str, separators=(",", ":")) + "\n")
        with open(tmp / SUMMARY_CSV, "w", newline="") as f:
            w = csv.DictWriter(f, fieldnames=csv_columns())
            w.writeheader()
            for point in run.load_points:
                if "summary" in point:
                    w.writerow(csv_row(point))
        try:
            plots.write_plots(tmp)
        except Exception as e:  # noqa: BLE001 - plots are a convenience; the data is already written
            run.warnings.append(f"plots not written: {e}")
    return Path(out)


def read_summary(run_dir: Path) -> list[dict[str, Any]]:
    """Rows of ``summary.csv`` with numbers parsed (empty cells → ``None``).

    Raises:
        UserError: ``run_dir`` has no summary.csv.
    """
    from pipeline.errors import UserError

    path = Path(run_dir) / SUMMARY_CSV
    if not path.is_file():
        raise UserError(f"{run_dir}: not a bench run directory (no {SUMMARY_CSV})")
    rows = []
    with open(path, newline="") as f:
        for row in csv.DictReader(f):
            rows.append({k: _num(v) for k, v in row.items()})
    return rows


def _num(v: str | None) -> Any:
    if v is None or v == "":
        return None
    try:
        f = float(v)
    except ValueError:
        return v
    return int(f) if f.is_integer() and "." not in v and "e" not in v.lower() else f
