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
