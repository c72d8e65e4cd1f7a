"""Load generation: closed-loop concurrency and open-loop request-rate schedules (one asyncio loop).

* :class:`Schedule` names the modes. Open-loop modes have one small class each with
  ``next_interval()`` (s): :class:`ConstantSchedule` (fixed spacing 1/rate) and
  :class:`PoissonSchedule` (exponential gaps, mean 1/rate, seeded). Send times are accumulated
  from the phase start (absolute deadlines), so event-loop lag never drifts the rate.
* :func:`run_concurrency` keeps exactly ``concurrency`` requests in flight (worker tasks pulling
  from a shared counter) until ``num_requests`` were sent, ``duration_s`` elapsed, or ``stop``
  was set.
* :func:`run_request_rate` sends on the schedule without waiting for earlier requests.

Both take ``send(index) -> Awaitable[None]`` that performs and records one request (it must not
raise; failures are recorded by the client) and return the number of requests started.
Warmup is a separate phase run by the caller with the same driver (aiperf's credit phases).
"""

from __future__ import annotations

import asyncio
import enum
import time
from collections.abc import Awaitable, Callable

import numpy as np

Send = Callable[[int], Awaitable[None]]


class Schedule(str, enum.Enum):
    """How requests are issued: closed loop (``concurrency``) or open loop at a request rate."""

    CONCURRENCY = "concurrency"
    CONSTANT = "constant"
    POISSON = "poisson"


class ConstantSchedule:
    """Evenly spaced arrivals: every interval is ``1 / rate`` s (``rate`` in requests/s)."""

    def __init__(self, rate: float) -> None:
        if rate <= 0:
            raise ValueError(f"request rate must be > 0 requests/s, got {rate}")
        self.rate = rate

    def next_interval(self) -> float:
        """Seconds until the next request."""
        return 1.0 / self.rate


class PoissonSchedule:
    """Poisson arrivals: exponential intervals with mean ``1 / rate`` s, from a seeded RNG."""

    def __init__(self, rate: float, seed: int = 0) -> None:
        if rate <= 0:
            raise ValueError(f"request rate must be > 0 requests/s, got {rate}")
        self.rate = rate
        self._rng = np.random.default_rng(seed)

    def next_interval(self) -> float:
        """Seconds until the next request (exponentially distributed)."""
        return float(self._rng.exponential(1.0 / self.rate))


def make_schedule(kind: Schedule | str, rate: float, seed: int = 0) -> ConstantSchedule | PoissonSchedule:
    """The open-loop schedule object for ``kind`` (``constant`` or ``poisson``) at ``rate`` requests/s."""
    kind = Schedule(kind)
    if kind is Schedule.CONSTANT:
        return ConstantSchedule(rate)
    if kind is Schedule.POISSON:
        return PoissonSchedule(rate, seed)
    raise ValueError("concurrency is a closed-loop mode, not an arrival schedule")


def _expired(deadline: float | None) -> bool:
    return deadline is not None and time.monotonic() >= deadline


async def run_concurrency(
    send: Send,
    *,
    concurrency: int,
    num_requests: int,
    duration_s: float | None = None,
    stop: asyncio.Event | None = None,
    first_index: int = 0,
) -> int:
    """Closed loop: ``concurrency`` requests always in flight.

    Stops issuing when ``num_requests`` were started, when ``duration_s`` (s, if given) has
    elapsed, or when ``stop`` is set; waits for the requests in flight. Returns requests started.
    """
    if concurrency < 1:
        raise ValueError(f"concurrency must be >= 1, got {concurrency}")
    deadline = None if duration_s is None else time.monotonic() + duration_s
    next_index = first_index
    limit = first_index + num_requests

    async def worker() -> None:
        nonlocal next_index
        while next_index < limit and not _expired(deadline) and not (stop and stop.is_set()):
            i = next_index
            next_index += 1
            await send(i)

    await asyncio.gather(*(worker() for _ in range(min(concurrency, num_requests))))
    return next_index - first_index


async def run_request_rate(
    send: Send,
    schedule: ConstantSchedule | PoissonSchedule,
    *,
    num_requests: int,
    duration_s: float | None = None,
    stop: asyncio.Event | None = None,
    first_index: int = 0,
) -> int:
    """Open loop: start request ``i`` at ``t0 + Σ intervals`` regardless of earlier requests.

    The first request goes out at once. Stops issuing on ``num_requests``, ``duration_s`` or
    ``stop``, then waits for the requests in flight. Returns requests started.
    """
    loop = asyncio.get_running_loop()
    t0 = loop.time()
    deadline = None if duration_s is None else time.monotonic() + duration_s
    due = t0
    tasks: list[asyncio.Task[None]] = []
    try:
        for k in range(num_requests):
            if k:
                due += schedule.next_interval()
            delay = due - loop.time()
            if delay > 0:
                if stop is not None:
                    try:
                        await asyncio.wait_for(stop.wait(), delay)
                    except asyncio.TimeoutError:
                        pass
                else:
                    await asyncio.sleep(delay)
            if _expired(deadline) or (stop and stop.is_set()):
                break
            tasks.append(asyncio.ensure_future(send(first_index + k)))
    finally:
        if tasks:
            await asyncio.gather(*tasks, return_exceptions=True)
    return len(tasks)
