"""Distribution summaries: avg, min, max, std, p50, p90, p95, p99 (numpy percentiles).

Percentiles use :func:`numpy.percentile` with its default linear interpolation, as
TensorRT-LLM's ``PercentileStats`` and genai-perf do.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Iterable

import numpy as np

#: the summary fields, in display/CSV order
STAT_FIELDS = ("avg", "min", "max", "std", "p50", "p90", "p95", "p99")
_PCTS = (50, 90, 95, 99)


@dataclasses.dataclass(frozen=True)
class Stats:
    """Summary of one distribution, in the unit of its values; ``count`` is the number of values.

    ``std`` is the population standard deviation (``numpy.std``, ddof=0). An empty input gives
    ``count == 0`` and NaN everywhere (exported as empty CSV cells / JSON null).
    """

    count: int
    avg: float
    min: float
    max: float
    std: float
    p50: float
    p90: float
    p95: float
    p99: float

    @classmethod
    def of(cls, values: Iterable[float]) -> Stats:
        """Summarize ``values`` (any iterable of numbers)."""
        arr = np.fromiter(values, dtype=np.float64)
        if arr.size == 0:
            nan = math.nan
            return cls(0, nan, nan, nan, nan, nan, nan, nan, nan)
        p50, p90, p95, p99 = np.percentile(arr, _PCTS)
        return cls(
            count=int(arr.size),
            avg=float(arr.mean()),
            min=float(arr.min()),
            max=float(arr.max()),
            std=float(arr.std()),
            p50=float(p50),
            p90=float(p90),
            p95=float(p95),
            p99=float(p99),
        )

    def as_dict(self) -> dict[str, float | int | None]:
        """``{count, avg, …, p99}`` with NaN as ``None`` (valid JSON)."""
        out: dict[str, float | int | None] = {"count": self.count}
        for f in STAT_FIELDS:
            v = getattr(self, f)
            out[f] = None if math.isnan(v) else v
        return out


#: bootstrap settings of :func:`ratio_ci` (tune's speedup intervals and ``bench compare`` with repeats)
RESAMPLES = 4000
SEED = 0
ALPHA = 0.05


def ratio_ci(num: Iterable[float], den: Iterable[float], *, alpha: float = ALPHA, resamples: int = RESAMPLES,
             seed: int = SEED) -> tuple[float, float] | None:
    """Percentile-bootstrap interval of mean(num)/mean(den): each resample draws ``num``'s and ``den``'s repeats
    independently with replacement (``resamples`` draws, ``seed``) and takes the ratio of their means; the interval is
    the (α/2, 1−α/2) percentiles (α = ``alpha``, 95 % by default). ``None`` below 2 repeats a side."""
    a, b = np.asarray(list(num), dtype=float), np.asarray(list(den), dtype=float)
    if a.size < 2 or b.size < 2:
        return None
    rng = np.random.default_rng(seed)
    ra = a[rng.integers(0, a.size, (resamples, a.size))].mean(axis=1)
    rb = b[rng.integers(0, b.size, (resamples, b.size))].mean(axis=1)
    lo, hi = np.percentile(ra / rb, [100 * alpha / 2, 100 * (1 - alpha / 2)])
    return float(lo), float(hi)
