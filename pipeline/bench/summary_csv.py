"""``summary.csv`` of a bench run: one row per scenario × load point (the file plots and comparisons read).

Column names follow genai-perf's metric keys with the unit and statistic appended, e.g.
``time_to_first_token_ms_p99``, ``inter_token_latency_ms_avg``, ``output_token_throughput_tokens_per_s``,
``request_throughput_requests_per_s``; then the load point's telemetry (:data:`pipeline.bench.telemetry.CSV_COLUMNS`:
``telemetry_source``, ``gpu_util_pct_mean``, ``gpu_util_pct_peak``, … ``rss_mib_peak``; empty where the source lacks one). :mod:`pipeline.bench.exporters` writes it; :mod:`pipeline.bench.plots`
and :mod:`pipeline.bench.compare` read it back with :func:`read_summary`.
"""

from __future__ import annotations

import csv
from pathlib import Path
from typing import TYPE_CHECKING, Any

from pipeline.bench.metrics import METRICS
from pipeline.bench.stats import STAT_FIELDS
from pipeline.bench.telemetry import CSV_COLUMNS as TELEMETRY_COLUMNS
from pipeline.bench.telemetry import csv_values

if TYPE_CHECKING:
    from pipeline.bench.results import LoadPoint

SUMMARY_CSV = "summary.csv"
#: columns that identify a row (scenario × load point) and its counts
KEY_COLUMNS = (
    "scenario", "isl", "osl", "mode", "concurrency", "request_rate", "requests", "completed", "failed", "short",
    "duration_s", "client_cpu_fraction",
)
#: columns of an image workload (after the metrics; only in runs that sent images): images and image tokens per
#: completed request (ISL stays the text's, ``input_sequence_length_*``), and the load point's image-token total
IMAGE_COLUMNS = ("images_per_request_avg", "image_tokens_avg", "image_tokens_min", "image_tokens_max",
                 "total_image_tokens")
#: columns of the KV-cache prefix reuse the server reported (only in runs where it reported cached tokens): the
#: load point's cached prompt tokens and their share of its prompt tokens (0..1), :func:`pipeline.bench.metrics.prefix_cache`
PREFIX_COLUMNS = ("cached_tokens", "cached_token_share")
_UNIT_SUFFIX = {"ms": "ms", "tokens": "tokens", "tokens/s": "tokens_per_s", "requests/s": "requests_per_s"}


def column(tag: str, stat: str | None = None) -> str:
    """CSV column of a metric (``stat`` for distributions), e.g. ``time_to_first_token_ms_p99``."""
    base = f"{tag}_{_UNIT_SUFFIX[METRICS[tag].unit]}"
    return f"{base}_{stat}" if stat else base


def csv_columns(images: bool = False, prefix: bool = False) -> list[str]:
    """All CSV columns, in order (with :data:`IMAGE_COLUMNS` when the run sent ``images``, :data:`PREFIX_COLUMNS`
    when the server reported cached tokens, ``prefix``)."""
    cols = list(KEY_COLUMNS)
    for tag, spec in METRICS.items():
        cols += [column(tag, s) for s in STAT_FIELDS] if spec.distribution else [column(tag)]
    return cols + (list(IMAGE_COLUMNS) if images else []) + (list(PREFIX_COLUMNS) if prefix else []) + TELEMETRY_COLUMNS


def csv_row(point: LoadPoint) -> dict[str, Any]:
    """The CSV row of one summarized load point."""
    s = point.summary
    assert s is not None
    row: dict[str, Any] = {k: getattr(point, k) for k in ("scenario", "isl", "osl", "mode", "concurrency", "request_rate")}
    row.update({k: getattr(s.counts, k) for k in ("requests", "completed", "failed", "short")})
    row["duration_s"] = s.duration_s
    row["client_cpu_fraction"] = point.client_cpu_fraction
    for tag, spec in METRICS.items():
        value = s.metrics.get(tag)
        if spec.distribution:
            for stat in STAT_FIELDS:
                row[column(tag, stat)] = (value or {}).get(stat)
        else:
            row[column(tag)] = value
    if s.images is not None:
        img, tok = s.images["images_per_request"], s.images["image_tokens"]
        row |= {"images_per_request_avg": img["avg"], "image_tokens_avg": tok["avg"], "image_tokens_min": tok["min"],
                "image_tokens_max": tok["max"], "total_image_tokens": s.images["total_image_tokens"]}
    if s.prefix_cache is not None:
        row |= {k: s.prefix_cache[k] for k in PREFIX_COLUMNS}
    return row | csv_values(point.telemetry)


def read_summary(run_dir: Path) -> list[dict[str, Any]]:
    """Rows of ``summary.csv`` with numbers parsed (empty cells → ``None``).

    Raises:
        UserError: ``run_dir`` has no summary.csv.
    """
    from pipeline.core.errors import UserError

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
