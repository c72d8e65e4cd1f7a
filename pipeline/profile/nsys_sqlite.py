"""Analyse any Nsight Systems SQLite export (``nsys export --type sqlite``): GPU active %, kernels, categories, gaps.

The schema read (NVIDIA, "SQLite Export Schema Reference", Nsight Systems 2021.5,
https://docs.nvidia.com/nsight-systems/2021.5/nsys-exporter/exported_data.html; the same page ships with later
releases): ``CREATE TABLE StringIds (id INTEGER PRIMARY KEY, value TEXT NOT NULL)``; CUDA kernels in
``CUPTI_ACTIVITY_KIND_KERNEL`` with ``start`` / ``end`` ("Event start/end timestamp in nanoseconds"), ``deviceId``,
``streamId`` and the names ``shortName`` / ``demangledName`` as ids into ``StringIds``; copies and sets in
``CUPTI_ACTIVITY_KIND_MEMCPY`` / ``CUPTI_ACTIVITY_KIND_MEMSET`` (``start``, ``end``, ``deviceId``). "Tables are
created lazily" (a trace without copies has no MEMCPY table) and column sets vary by version, so both are looked up
(``sqlite_master``, ``PRAGMA table_info``) rather than assumed. NVIDIA's own TensorRT-LLM trace parser reads the same
tables the same way (``examples/layer_wise_benchmarks/parse.py@0663598bb32f88dac4b22dd671182274cfddb417``: the
KERNEL ∪ MEMCPY ∪ MEMSET union, ``demangledName`` → ``StringIds``, and its "Space" loop = the gaps below).

Busy time is the union of the kernel, copy and set intervals of one device (overlapping streams counted once); a
gap is time between two busy intervals; the window is the first start to the last end (the capture range already
limits the trace to the profiled iterations, :mod:`pipeline.profile.nsys_run`) unless given.

Kernel categories by name, the first pattern that matches (case-insensitive), from kernel names TensorRT-LLM's
traces carry — NVIDIA's ``parser_keywords`` table in that parse.py (:data:`CATEGORIES`; e.g. ``nvjet`` = cuBLAS
GEMM, ``GemmUniversal`` = CUTLASS GEMM, ``fmhaSm100fKernel_Qkv`` / ``fmhaReductionKernel`` = attention,
``applyBiasRopeUpdateKVCacheV2`` = attention's RoPE + KV-cache write, ``ncclDevKernel_AllGather_`` /
``allreduce_fusion_kernel_oneshot_lamport`` / ``moeAllToAllKernel`` = communication, ``RMSNormKernel`` /
``silu_and_mul_kernel`` / ``CUDAFunctor_add`` = elementwise, ``topKPerRowDecode`` / ``gatherTopK`` /
``bitonicSortKVInPlace`` / ``distribution_elementwise_grid_stride_kernel`` = sampling); ``mmha`` /
``masked_multihead`` and ``xqa`` are TensorRT-LLM's decode-attention kernel families (cpp/tensorrt_llm/kernels/
decoderMaskedMultiheadAttention, …/xqaDispatcher). Anything else is ``other``.
"""

from __future__ import annotations

import re
import sqlite3
from pathlib import Path
from typing import Any

from pipeline.core.errors import UserError
from pipeline.profile.report import Report, gap_stats

KERNEL = "CUPTI_ACTIVITY_KIND_KERNEL"
COPIES = ("CUPTI_ACTIVITY_KIND_MEMCPY", "CUPTI_ACTIVITY_KIND_MEMSET")
#: category → name pattern (first match wins; sampling before elementwise: "distribution_elementwise" samples)
CATEGORIES: tuple[tuple[str, re.Pattern[str]], ...] = tuple((c, re.compile(p, re.IGNORECASE)) for c, p in (
    ("communication", r"nccl|allreduce|all_reduce|allgather|reducescatter|reduce_scatter|alltoall"),
    ("attention", r"fmha|mmha|masked_?multihead|xqa|flash|attention|rope|kvcache|mqa_logits"),
    ("sampling", r"topk|topp|top_k|top_p|sampl|argmax|bitonicsort|distribution_|softmax|penalt"),
    ("gemm", r"gemm|nvjet|cutlass|cublas|splitkreduce|xmma|bmm_|matmul"),
    ("elementwise", (r"norm|silu|swiglu|gelu|activation|elementwise|functor|copy|cat|fill|add|mul|quant|"
                     r"triton_poi|triton_red|triton_per|reduce_kernel|vectorized")),
))
TOP = 10


def category(name: str) -> str:
    """The :data:`CATEGORIES` name of kernel ``name`` (``other`` when none matches)."""
    return next((c for c, pat in CATEGORIES if pat.search(name)), "other")


def _tables(con: sqlite3.Connection) -> set[str]:
    return {r[0] for r in con.execute("SELECT name FROM sqlite_master WHERE type = 'table'")}


def _columns(con: sqlite3.Connection, table: str) -> set[str]:
    return {r[1] for r in con.execute(f"PRAGMA table_info({table})")}


def analyse(path: Path, *, device: int | None = None, window_ns: tuple[int, int] | None = None) -> Report:
    """The report (:mod:`pipeline.profile.report`) of the export at ``path``: kernels of ``device`` (default: the
    device with the most kernel time) within ``window_ns`` (``(start, end)`` ns; default: the kernels' span).

    Raises:
        UserError: not an SQLite file, no ``CUPTI_ACTIVITY_KIND_KERNEL`` / ``StringIds`` table or a column the
            analysis needs, or no kernel in the window (one line naming the file).
    """
    path = Path(path)
    if not path.is_file():
        raise UserError(f"{path}: no such Nsight Systems SQLite export")
    try:
        con = sqlite3.connect(f"file:{path}?mode=ro", uri=True)
        tables = _tables(con)
    except sqlite3.DatabaseError as e:
        raise UserError(f"{path}: not an SQLite export ({e})") from None
    try:
        return _analyse(con, tables, path, device, window_ns)
    finally:
        con.close()


def _analyse(con: sqlite3.Connection, tables: set[str], path: Path, device: int | None,
             window_ns: tuple[int, int] | None) -> Report:
    missing = {KERNEL, "StringIds"} - tables
    if missing:
        raise UserError(f"{path}: no {' / '.join(sorted(missing))} table — not a CUDA trace (nsys profile -t cuda)")
    cols = _columns(con, KERNEL)
    name_col = next((c for c in ("demangledName", "shortName") if c in cols), None)
    if name_col is None or not {"start", "end", "deviceId"} <= cols:
        raise UserError(f"{path}: {KERNEL} lacks start/end/deviceId/demangledName|shortName (columns: {sorted(cols)})")
    if device is None:
        row = con.execute(f'SELECT deviceId FROM {KERNEL} GROUP BY deviceId ORDER BY SUM("end" - start) DESC LIMIT 1').fetchone()
        device = row[0] if row else 0
    lo, hi = window_ns if window_ns else (-(1 << 62), 1 << 62)
    kernels = con.execute(
        f'SELECT k.start, k."end", s.value FROM {KERNEL} k JOIN StringIds s ON s.id = k.{name_col} '
        f'WHERE k.deviceId = ? AND k.start >= ? AND k."end" <= ? AND k."end" > k.start ORDER BY k.start', (device, lo, hi)).fetchall()
    if not kernels:
        raise UserError(f"{path}: no kernel of device {device} in the window")
    intervals = [(a, b) for a, b, _ in kernels]
    for table in COPIES:
        if table in tables and {"start", "end", "deviceId"} <= _columns(con, table):
            intervals += con.execute(f'SELECT start, "end" FROM {table} WHERE deviceId = ? AND start >= ? AND "end" <= ? '
                                     f'AND "end" > start', (device, lo, hi)).fetchall()
    return _report(kernels, sorted(intervals), window_ns, f"{path} (device {device})")


def _report(kernels: list[tuple[int, int, str]], intervals: list[tuple[int, int]], window_ns: tuple[int, int] | None,
            label: str) -> Report:
    busy, gaps, last = 0, [], None
    for a, b in intervals:  # union of the intervals (sorted by start): parse.py's "Space" loop
        if last is None or a > last:
            if last is not None:
                gaps.append((a - last) / 1e9)
            busy += b - a
            last = b
        elif b > last:
            busy += b - last
            last = b
    t0, t1 = window_ns if window_ns else (intervals[0][0], max(b for _, b in intervals))
    window_s, busy_s = (t1 - t0) / 1e9, busy / 1e9
    total = sum(b - a for a, b, _ in kernels)
    by_name: dict[str, list[int]] = {}
    for a, b, name in kernels:
        n = by_name.setdefault(name, [0, 0])
        n[0] += 1
        n[1] += b - a
    cats: dict[str, list[int]] = {}
    for name, (n, t) in by_name.items():
        c = cats.setdefault(category(name), [0, 0])
        c[0] += n
        c[1] += t
    pct = (lambda t: 100.0 * t / total) if total else (lambda t: 0.0)
    return {
        "source": "nsys-sqlite", "unit": "kernel", "input": label, "window_s": window_s, "busy_s": busy_s,
        "active_pct": 100.0 * busy_s / window_s if window_s > 0 else None,
        "count": len(kernels), "mean_ms": total / len(kernels) / 1e6,
        "categories": [{"name": c, "count": n, "time_s": t / 1e9, "share_pct": pct(t)}
                       for c, (n, t) in sorted(cats.items(), key=lambda kv: -kv[1][1])],
        "gaps": gap_stats(gaps, window_s, busy_s),
        "top": [{"name": k, "count": n, "time_s": t / 1e9, "mean_ms": t / n / 1e6, "share_pct": pct(t)}
                for k, (n, t) in sorted(by_name.items(), key=lambda kv: -kv[1][1])[:TOP]],
        "notes": [("kernel time summed per kernel (streams that overlap count each); active % = union of kernel, "
                   "memcpy and memset intervals over the window; categories: pipeline/profile/nsys_sqlite.py")],
    }


def summary_line(report: Report) -> str:
    """One line: active %, kernels and their mean, idle %."""
    g: dict[str, Any] = report["gaps"]
    return (f"GPU active {report['active_pct']:.1f} % of {report['window_s']:.3f} s; {report['count']} kernels, mean "
            f"{report['mean_ms']:.3f} ms; {g['count']} gaps, idle {g['idle_pct']:.1f} %")
