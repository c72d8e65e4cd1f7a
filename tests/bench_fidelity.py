"""What the bench's timing must satisfy against a model with known timing (``tests/data/timed_llm_repo``) — checks
that hold on any machine, however loaded.

The timed model sleeps until absolute deadlines on ``time.monotonic_ns`` (token ``i`` no earlier than
``arrival + first_token_ms + i × itl_ms``) and, when asked (``return_perf_metrics``), returns on its final response
``first_token_time_ns`` and ``last_token_time_ns`` (``time.time_ns`` taken just before each send). The bench stamps its
send and receipts with ``perf_counter_ns`` (the same CLOCK_MONOTONIC) and maps them to CLOCK_REALTIME with the offset
taken at run start; ``t0_epoch_ns`` is read after ``t0_ns``, so mapped client times can be late, never early.
Hence, for every measured request, whatever the load or a slow moment does to the numbers:

* ``TTFT ≥ first_token_ms`` and ``E2E ≥ first_token_ms + (tokens − 1) × itl_ms`` — the bench never reports less than
  the model's schedule (a receipt stamped early, or a send stamped late, would break it);
* mapped first receipt ≥ the model's first-token send and mapped last receipt ≥ its last-token send — no receipt
  before the server sent it;
* the reported averages are the bench's own timestamps: TTFT, E2E and ITL recomputed from ``bench.json``'s requests.

How close the bench gets to the server's truth (its error in ms) is a measurement of the machine as much as of the
bench; ``benchmarks/check_bench_fidelity.py`` measures it (docs figure there).
"""

from __future__ import annotations

from typing import Any

import numpy as np

#: float tolerance of a recomputed mean against the reported one (ms): rounding only, no time
_EPS_MS = 1e-6


def timelines(doc: dict[str, Any]) -> list[dict[str, Any]]:
    """Per measured, completed request of a ``bench.json`` run with ``--server-timestamps``: its ``load``, ``tokens``
    and times in ms — ``ttft``/``e2e`` (the client's), ``first_rx``/``last_rx`` (client receipts mapped to
    CLOCK_REALTIME), ``first_tx``/``last_tx`` (the model's sends).

    Raises:
        ValueError: a completed request without server timestamps (run without ``server_timestamps``).
    """
    off = doc["t0_epoch_ns"]
    out = []
    for r in doc["requests"]:
        if r["warmup"] or r["error"] is not None:
            continue
        if not r.get("server"):
            raise ValueError(f"request {r['scenario']} {r['load']} #{r['index']} carries no server timestamps")
        got = [t for t, n in zip(r["response_ns"], r["response_tokens"]) if n > 0]
        out.append({"load": r["load"], "tokens": r["output_tokens"], "ttft": (got[0] - r["start_ns"]) / 1e6,
                    "e2e": (r["end_ns"] - r["start_ns"]) / 1e6, "first_rx": (got[0] + off) / 1e6,
                    "last_rx": (got[-1] + off) / 1e6, "first_tx": r["server"]["first_token_time_ns"] / 1e6,
                    "last_tx": r["server"]["last_token_time_ns"] / 1e6})
    return out


def violations(doc: dict[str, Any], first_token_ms: float = 50.0, itl_ms: float = 10.0) -> list[str]:
    """Every broken rule of the module docstring in a ``bench.json`` run against the timed model (empty: all hold)."""
    bad = []
    for t in timelines(doc):
        schedule = first_token_ms + (t["tokens"] - 1) * itl_ms
        if t["ttft"] < first_token_ms:
            bad.append(f"{t['load']}: TTFT {t['ttft']:.3f} ms < the model's {first_token_ms} ms")
        if t["e2e"] < schedule:
            bad.append(f"{t['load']}: E2E {t['e2e']:.3f} ms < the model's schedule {schedule} ms")
        if t["first_rx"] < t["first_tx"] or t["last_rx"] < t["last_tx"]:
            bad.append(f"{t['load']}: a token received before the server sent it ({t})")
    for lp in doc["load_points"]:
        mine = [r for r in doc["requests"] if r["load"] == lp["load"] and r["scenario"] == lp["scenario"]
                and not r["warmup"] and r["error"] is None]
        got = [[t for t, n in zip(r["response_ns"], r["response_tokens"]) if n > 0] for r in mine]
        ttft = np.mean([g[0] - r["start_ns"] for g, r in zip(got, mine)]) / 1e6
        e2e = np.mean([r["end_ns"] - r["start_ns"] for r in mine]) / 1e6
        itl = np.mean([(r["end_ns"] - g[0]) / (r["output_tokens"] - 1) for g, r in zip(got, mine)]) / 1e6
        m = lp["summary"]["metrics"]
        for tag, ours in (("time_to_first_token", ttft), ("request_latency", e2e), ("inter_token_latency", itl)):
            if abs(m[tag]["avg"] - ours) > _EPS_MS:
                bad.append(f"{lp['load']}: reported {tag} avg {m[tag]['avg']} ms is not its timestamps' {ours} ms")
    return bad
