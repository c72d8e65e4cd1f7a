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
    starts = []

    async def send(i):
        starts.append(time.perf_counter())
        await asyncio.sleep(0.2)  # slower than the spacing: an open loop must not wait for it

    t0 = time.perf_counter()
    n = asyncio.run(run_request_rate(send, ConstantSchedule(50.0), num_requests=6))
    wall = time.perf_counter() - t0
    assert n == 6
    offsets = np.array(starts) - starts[0]
    assert offsets[-1] == pytest.approx(0.1, abs=0.015)  # 5 gaps × 20 ms
    assert wall < 0.2 + 0.1 + 0.1  # the sends overlapped


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
    assert 10 <= timed <= 30  # 2 in flight × ~10 requests per 0.1 s
