"""Arrival schedules (seeded) and the closed/open-loop drivers with a fake send (no server)."""

from __future__ import annotations

import asyncio
import time

import numpy as np
import pytest

from pipeline.bench.loadgen import (
    ConstantSchedule,
    PoissonSchedule,
    Schedule,
    make_schedule,
    run_concurrency,
    run_request_rate,
)


def test_poisson_schedule_has_the_requested_mean_rate_and_is_seeded():
    s = PoissonSchedule(rate=5.0, seed=1)
    gaps = np.array([s.next_interval() for _ in range(20000)])
    assert 1 / gaps.mean() == pytest.approx(5.0, rel=0.03)
    assert gaps.std() / gaps.mean() == pytest.approx(1.0, rel=0.05)  # exponential: CV = 1
    again = PoissonSchedule(rate=5.0, seed=1)
    assert [again.next_interval() for _ in range(5)] == list(gaps[:5])


def test_constant_schedule_spacing_and_factory():
    s = ConstantSchedule(4.0)
    assert {s.next_interval() for _ in range(10)} == {0.25}
    assert isinstance(make_schedule("poisson", 2.0), PoissonSchedule)
    with pytest.raises(ValueError):
        make_schedule(Schedule.CONCURRENCY, 1.0)
    with pytest.raises(ValueError):
        ConstantSchedule(0)


def test_concurrency_keeps_exactly_n_in_flight():
    in_flight, peak, seen = 0, 0, []

    async def send(i):
        nonlocal in_flight, peak
        in_flight += 1
        peak = max(peak, in_flight)
        seen.append(i)
        await asyncio.sleep(0.005)
        in_flight -= 1

    n = asyncio.run(run_concurrency(send, concurrency=4, num_requests=19, first_index=3))
    assert n == 19 and peak == 4 and sorted(seen) == list(range(3, 22))


def test_request_rate_is_open_loop_on_absolute_deadlines():
    """Every request is in flight before any finishes (an open loop never waits for earlier ones), and none starts
    before its deadline t0 + k × 20 ms (a slow moment can only delay a start; no upper bound is asserted)."""
    starts, all_started = [], asyncio.Event()

    async def send(i):
        starts.append(time.perf_counter())
        if len(starts) == 6:
            all_started.set()
        await asyncio.wait_for(all_started.wait(), 60)  # a closed loop would deadlock here (→ TimeoutError)

    t0 = time.perf_counter()
    n = asyncio.run(run_request_rate(send, ConstantSchedule(50.0), num_requests=6))
    assert n == 6 and all_started.is_set()
    assert all(s - t0 >= k * 0.020 - 1e-6 for k, s in enumerate(starts)), [s - t0 for s in starts]


def test_stop_and_duration_end_a_phase_early():
    async def main():
        stop = asyncio.Event()
        count = 0

        async def send(i):
            nonlocal count
            count += 1
            if count == 3:
                stop.set()
            await asyncio.sleep(0.001)

        n = await run_concurrency(send, concurrency=1, num_requests=100, stop=stop)
        timed = await run_concurrency(lambda i: asyncio.sleep(0.01), concurrency=2, num_requests=10**6, duration_s=0.1)
        return n, timed

    n, timed = asyncio.run(main())
    assert n == 3
    # 2 workers, each request ≥ 10 ms, none started after 0.1 s: at most 2 × (10 + 1); a slow moment gives fewer
    assert timed <= 22
