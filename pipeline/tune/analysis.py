"""Numbers of a sweep: per-load-point metrics, the objective under SLOs, speedup intervals, the Pareto front,
and the winner-or-tie rule. Pure functions over plain data (tests build the inputs by hand).

Units: throughputs in tokens/s (``output_token_throughput``, ``…_per_gpu``) or tokens/s/user; latencies in ms.

Speedup interval: percentile bootstrap of the ratio of means. Each resample draws the candidate's repeats and
the reference's repeats independently with replacement (``RESAMPLES`` draws, seed ``SEED``) and takes
mean(candidate) / mean(reference); the interval is the (α/2, 1−α/2) percentiles with α = ``ALPHA`` (95 %).
With fewer than 2 repeats on either side there is no interval (``None``): the point estimate alone decides
stacked mode, and no winner is separated from a runner-up.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from typing import Any

import numpy as np

# the speedup interval's bootstrap, shared with `bench compare` (the report names its settings as an.RESAMPLES …)
from pipeline.bench import telemetry
from pipeline.bench.stats import ALPHA, RESAMPLES, SEED, ratio_ci  # noqa: F401


def flat_metrics(summary: dict[str, Any]) -> dict[str, float]:
    """bench.json's ``summary["metrics"]`` of one load point → ``{"output_token_throughput": …,
    "time_to_first_token.p99": …}`` (AIPerf names; distributions as ``name.stat``; ``None`` values dropped)."""
    out: dict[str, float] = {}
    for name, v in summary["metrics"].items():
        if isinstance(v, dict):
            out.update({f"{name}.{k}": float(x) for k, x in v.items() if k != "count" and x is not None})
        elif v is not None:
            out[name] = float(v)
    return out


def load_points(bench_doc: dict[str, Any], gpus: int) -> list[dict[str, Any]]:
    """The load points of one bench.json as ``{scenario, load, concurrency, metrics}``; ``metrics`` gains
    ``output_token_throughput_per_gpu`` = output tok/s ÷ ``gpus`` when the bench did not know the GPU count, and the
    load point's telemetry as ``telemetry.<quantity>.<mean|peak>`` (:func:`pipeline.bench.telemetry.flat`: MLflow
    metrics of the point)."""
    out = []
    for p in bench_doc["load_points"]:
        if "summary" not in p:
            continue
        m = flat_metrics(p["summary"]) | telemetry.flat(p.get("telemetry"))
        if "output_token_throughput" in m and "output_token_throughput_per_gpu" not in m:
            m["output_token_throughput_per_gpu"] = m["output_token_throughput"] / gpus
        out.append({"scenario": p["scenario"], "load": p["load"], "concurrency": p.get("concurrency"), "metrics": m})
    return out


def meets(metrics: dict[str, float], slos: Sequence[Any]) -> list[str]:
    """The SLOs ``metrics`` violates, as ``"time_to_first_token.p99 2301 > 2000"`` (empty: all met; a missing
    metric violates)."""
    bad = []
    for s in slos:
        v = metrics.get(s.metric)
        if v is None:
            bad.append(f"{s.metric} missing")
        elif s.max is not None and v > s.max:
            bad.append(f"{s.metric} {v:.4g} > {s.max:g}")
        elif s.min is not None and v < s.min:
            bad.append(f"{s.metric} {v:.4g} < {s.min:g}")
    return bad


def objective(points: Sequence[dict[str, Any]], metric: str, slos: Sequence[Any]) -> tuple[float | None, str | None]:
    """The largest ``metric`` over the load points that meet every SLO, and that load point's
    ``scenario/load`` label; ``(None, None)`` when none meets them."""
    ok = [(p["metrics"].get(metric), f"{p['scenario']}/{p['load']}") for p in points if not meets(p["metrics"], slos)]
    ok = [(v, lbl) for v, lbl in ok if v is not None]
    if not ok:
        return None, None
    return max(ok)


def mean(values: Sequence[float]) -> float:
    """Arithmetic mean (NaN for an empty sequence)."""
    return float(np.mean(values)) if len(values) else float("nan")


@dataclasses.dataclass(frozen=True)
class Speedup:
    """mean(candidate)/mean(reference) with its interval (``None`` below 2 repeats)."""

    value: float
    ci: tuple[float, float] | None

    @property
    def better(self) -> bool:
        """The interval lies above 1; without an interval, the point estimate is above 1."""
        return self.ci[0] > 1.0 if self.ci is not None else self.value > 1.0

    def text(self) -> str:
        """``1.23× [1.10, 1.35]`` or ``1.23×``."""
        ci = f" [{self.ci[0]:.2f}, {self.ci[1]:.2f}]" if self.ci is not None else ""
        return f"{self.value:.2f}×{ci}"


def speedup(num: Sequence[float], den: Sequence[float]) -> Speedup | None:
    """:class:`Speedup` of two repeat lists; ``None`` when either is empty or the reference mean is 0."""
    if not len(num) or not len(den) or mean(den) == 0:
        return None
    return Speedup(mean(num) / mean(den), ratio_ci(num, den))


def pareto_front(pts: Sequence[tuple[float, float]]) -> list[int]:
    """Indices of the points not dominated when maximising both coordinates, sorted by the first coordinate.

    ``q`` dominates ``p`` when ``q ≥ p`` in both and ``q > p`` in one. Duplicates of a front point are all kept.
    """
    idx = []
    for i, (x, y) in enumerate(pts):
        if not any((qx >= x and qy >= y) and (qx > x or qy > y) for qx, qy in pts):
            idx.append(i)
    return sorted(idx, key=lambda i: (pts[i][0], -pts[i][1]))


@dataclasses.dataclass(frozen=True)
class Decision:
    """The best eligible point (``winner``) or a tie between the top two; ``reason`` says why."""

    best: str | None
    runner_up: str | None
    tie: bool
    ratio: Speedup | None
    reason: str


def decide(candidates: dict[str, Sequence[float]]) -> Decision:
    """Pick the best of ``candidates`` (point id → objective values over repeats, eligible points only).

    The top mean wins only when the interval of its ratio to the runner-up lies above 1; otherwise it is a tie
    (and always with 1 repeat: no interval). One candidate wins alone; none gives no best.
    """
    ranked = sorted(candidates, key=lambda k: mean(candidates[k]), reverse=True)
    if not ranked:
        return Decision(None, None, False, None, "no configuration met the SLOs and passed the gate")
    if len(ranked) == 1:
        return Decision(ranked[0], None, False, None, "the only eligible configuration")
    a, b = ranked[0], ranked[1]
    r = speedup(candidates[a], candidates[b])
    if r is None or r.ci is None:
        return Decision(a, b, True, r, "tie: no interval with fewer than 2 repeats, so the top two are not separated")
    if r.ci[0] > 1.0:
        return Decision(a, b, False, r, f"its ratio to the runner-up {r.text()} lies above 1")
    return Decision(a, b, True, r, f"tie: the ratio to the runner-up {r.text()} includes 1")
