"""The CPU engine's step timeline: what every scheduler step spent and the gaps between steps, as cumulative counters.

The GPU analysis of ``trtpipe profile`` (:mod:`pipeline.profile.nsys_sqlite`) reads kernels off an Nsight Systems
trace; on CPU the engine itself is the timeline: each step of :meth:`CpuEngine._step
<pipeline.cpu_runtime.engine.CpuEngine>` (one forward pass over the batch, with scheduling before and sampling after)
is recorded here by :meth:`StepTimeline.record`, and the served model publishes :meth:`StepTimeline.stats` as
Prometheus gauges (``trtpipe_cpu_engine_step_*``, :data:`pipeline.triton_repo.models.tensorrt_llm_cpu.model.GAUGES`),
so ``trtpipe profile`` takes their difference over one load point (:mod:`pipeline.profile.cpu`).

Step kinds, as TensorRT-LLM's inflight-batching iteration stats count requests (``numContextRequests``,
``numGenRequests``): ``context`` (prompt tokens only: prefill chunks), ``generation`` (one token for each decoding
sequence only), ``mixed`` (both in one batch). Gaps: the time from one step's end to the next one's start, split into
``gap`` (sequences were still in KV slots: admission, cancellation, the scheduler's own overhead) and ``wait``
(no sequence in a slot: the engine had no work). n-gram speculative steps (:mod:`pipeline.cpu_runtime.speculative`)
are not recorded.
"""

from __future__ import annotations

import bisect
import threading
from typing import Any

#: upper bounds (ms) of the gap histogram's buckets (cumulative counts, Prometheus ``le`` style; the last is +Inf)
GAP_BUCKETS_MS = (0.1, 0.5, 1.0, 2.0, 5.0, 10.0, 50.0, 100.0, 1000.0, float("inf"))
STEP_KINDS = ("context", "generation", "mixed")


class StepTimeline:
    """Cumulative step counters of one engine (written by the scheduler thread, read by any thread).

    Units: seconds for times, counts for steps and tokens.
    """

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._steps = dict.fromkeys(STEP_KINDS, 0)
        self._seconds = dict.fromkeys(STEP_KINDS, 0.0)
        self._forward_s = 0.0
        self._tokens = {"context": 0, "generation": 0}
        self._gaps = {"gap": [0, 0.0], "wait": [0, 0.0]}  # kind → [count, seconds]
        self._hist = [0] * len(GAP_BUCKETS_MS)  # gaps with work ("gap" kind) by bucket (not cumulative here)
        self._last_end: float | None = None
        self._work_left = False

    def record(self, t0: float, forward_start: float, forward_end: float, t_end: float, context_tokens: int,
               generation_seqs: int, work_left: bool) -> None:
        """One step from ``t0`` to ``t_end`` (``time.perf_counter`` seconds) whose forward pass ran from
        ``forward_start`` to ``forward_end`` over ``context_tokens`` prompt tokens and ``generation_seqs`` decoding
        sequences; ``work_left``: sequences remain in KV slots after it (the next gap is a ``gap``, else a ``wait``)."""
        kind = "mixed" if context_tokens and generation_seqs else "context" if context_tokens else "generation"
        with self._lock:
            if self._last_end is not None:
                gap = max(t0 - self._last_end, 0.0)
                g = self._gaps["gap" if self._work_left else "wait"]
                g[0] += 1
                g[1] += gap
                if self._work_left:
                    self._hist[bisect.bisect_left(GAP_BUCKETS_MS, gap * 1e3)] += 1
            self._steps[kind] += 1
            self._seconds[kind] += t_end - t0
            self._forward_s += forward_end - forward_start
            self._tokens["context"] += context_tokens
            self._tokens["generation"] += generation_seqs
            self._last_end, self._work_left = t_end, work_left

    def stats(self) -> dict[str, Any]:
        """``{"steps": {kind: n}, "seconds": {kind: s}, "forwardSeconds": s, "tokens": {"context", "generation"},
        "gaps": {"gap"|"wait": {"count", "seconds"}}, "gapBucketsMs": {le: cumulative count of "gap" gaps}}``, all
        cumulative since the engine started (``le`` keys as strings, ``"+Inf"`` last)."""
        with self._lock:
            cum, buckets = 0, {}
            for le, n in zip(GAP_BUCKETS_MS, self._hist):
                cum += n
                buckets["+Inf" if le == float("inf") else f"{le:g}"] = cum
            return {"steps": dict(self._steps), "seconds": dict(self._seconds), "forwardSeconds": self._forward_s,
                    "tokens": dict(self._tokens),
                    "gaps": {k: {"count": c, "seconds": s} for k, (c, s) in self._gaps.items()},
                    "gapBucketsMs": buckets}


def _stat(*path: str) -> Any:
    """A reader of one value of :meth:`StepTimeline.stats` inside ``CpuEngine.iteration_stats()["stepStats"]``."""
    def read(st: dict[str, Any]) -> float:
        v = st["stepStats"]
        for k in path:
            v = v[k]
        return v
    return read


_GAPS = ("gap", "wait")
#: trtpipe's own Prometheus gauges of the step timeline (no upstream counterpart), in the CPU ``tensorrt_llm``
#: model's :data:`GAUGES` form: name → (label, {label value: reader of ``iteration_stats()``}); all cumulative
STEP_GAUGES: dict[str, tuple[str, dict[str, Any]]] = {
    "trtpipe_cpu_engine_step_count": ("step_type", {**{k: _stat("steps", k) for k in STEP_KINDS},
                                                    **{k: _stat("gaps", k, "count") for k in _GAPS}}),
    "trtpipe_cpu_engine_step_seconds": ("step_type", {**{k: _stat("seconds", k) for k in STEP_KINDS},
                                                      "forward": _stat("forwardSeconds"),
                                                      **{k: _stat("gaps", k, "seconds") for k in _GAPS}}),
    "trtpipe_cpu_engine_step_tokens": ("token_type", {k: _stat("tokens", k) for k in ("context", "generation")}),
    "trtpipe_cpu_engine_step_gap_bucket": ("le", {
        ("+Inf" if le == float("inf") else f"{le:g}"): _stat("gapBucketsMs", "+Inf" if le == float("inf") else f"{le:g}")
        for le in GAP_BUCKETS_MS}),
}
