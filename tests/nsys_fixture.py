"""A small Nsight Systems SQLite export, built to NVIDIA's documented schema — a FIXTURE, not a real trace.

Schema: "SQLite Export Schema Reference" (Nsight Systems 2021.5, docs.nvidia.com/nsight-systems/2021.5/nsys-exporter/
exported_data.html): ``StringIds (id INTEGER PRIMARY KEY, value TEXT NOT NULL)``; ``CUPTI_ACTIVITY_KIND_KERNEL``
with ``start``/``end`` in ns, ``deviceId``, ``contextId``, ``streamId``, ``correlationId``, ``globalPid`` and the
names ``demangledName``/``shortName``/``mangledName`` as ``StringIds`` ids, grid/block sizes; ``CUPTI_ACTIVITY_KIND_MEMCPY``
with ``start``/``end``/``deviceId``/``streamId``/``copyKind``/``bytes``; every field NOT NULL; tables created lazily
(a trace without copies has no MEMCPY table). Kernel names are ones TensorRT-LLM traces carry (NVIDIA's
``examples/layer_wise_benchmarks/parse.py@0663598bb32f`` ``parser_keywords``).
"""

from __future__ import annotations

import sqlite3
from pathlib import Path

KERNEL_DDL = """CREATE TABLE CUPTI_ACTIVITY_KIND_KERNEL (start INT NOT NULL, end INT NOT NULL, deviceId INT NOT NULL,
 contextId INT NOT NULL, streamId INT NOT NULL, correlationId INT NOT NULL, globalPid INT NOT NULL,
 demangledName INT NOT NULL, shortName INT NOT NULL, mangledName INT NOT NULL, gridX INT NOT NULL, gridY INT NOT NULL,
 gridZ INT NOT NULL, blockX INT NOT NULL, blockY INT NOT NULL, blockZ INT NOT NULL)"""
MEMCPY_DDL = """CREATE TABLE CUPTI_ACTIVITY_KIND_MEMCPY (start INT NOT NULL, end INT NOT NULL, deviceId INT NOT NULL,
 contextId INT NOT NULL, streamId INT NOT NULL, correlationId INT NOT NULL, globalPid INT NOT NULL,
 copyKind INT NOT NULL, bytes INT NOT NULL)"""


def build(path: Path, kernels: list[tuple[int, int, int, int, str]], memcpys: list[tuple[int, int, int]] = (),
          short_names: bool = False) -> Path:
    """Write the fixture: ``kernels`` as ``(start_ns, end_ns, device, stream, demangled name)``, ``memcpys`` as
    ``(start_ns, end_ns, device)`` (no MEMCPY table when empty); ``short_names``: a KERNEL table with ``shortName``
    only (older exports). Returns ``path``."""
    con = sqlite3.connect(path)
    con.execute("CREATE TABLE StringIds (id INTEGER PRIMARY KEY, value TEXT NOT NULL)")
    ddl = KERNEL_DDL.replace(" demangledName INT NOT NULL,", "") if short_names else KERNEL_DDL
    con.execute(ddl)
    ids: dict[str, int] = {}
    for i, (a, b, dev, stream, name) in enumerate(kernels):
        sid = ids.setdefault(name, len(ids) + 1)
        con.execute("INSERT OR IGNORE INTO StringIds VALUES (?, ?)", (sid, name))
        row = {"start": a, "end": b, "deviceId": dev, "contextId": 1, "streamId": stream, "correlationId": i + 1,
               "globalPid": 4242, "shortName": sid, "mangledName": sid, "gridX": 1, "gridY": 1, "gridZ": 1,
               "blockX": 128, "blockY": 1, "blockZ": 1} | ({} if short_names else {"demangledName": sid})
        con.execute(f"INSERT INTO CUPTI_ACTIVITY_KIND_KERNEL ({', '.join(row)}) VALUES ({', '.join('?' * len(row))})",
                    tuple(row.values()))
    if memcpys:
        con.execute(MEMCPY_DDL)
        for j, (a, b, dev) in enumerate(memcpys):
            con.execute("INSERT INTO CUPTI_ACTIVITY_KIND_MEMCPY VALUES (?, ?, ?, 1, 7, ?, 4242, 1, 4096)",
                        (a, b, dev, 10_000 + j))
    con.commit()
    con.close()
    return path
