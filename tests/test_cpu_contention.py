"""The CPU engine leaves busy neighbours their cores (#44 item 5): the thread-count rule
(:func:`pipeline.cpu_runtime.host.threads_beside`), its measurement (:class:`~pipeline.cpu_runtime.host.CoreShare`
over ``/proc/stat``), and a real engine switching its OpenMP team when a neighbour comes and goes. No timings are
asserted: the figures are benchmarks/bench_contention.py's (docs/cpu-engine.md, "A busy neighbour")."""

from __future__ import annotations

import os
import threading
import time
from pathlib import Path

import pytest

from pipeline.cpu_runtime import engine as engine_mod
from pipeline.cpu_runtime import host
from pipeline.cpu_runtime.host import CoreShare, threads_beside

END_ID = 2


@pytest.mark.parametrize(("max_threads", "cores", "others", "expected"), [
    (2, 2, 0.0, 2),    # quiet 2-core host: every core
    (2, 2, 0.2, 2),    # the served deployment's own processes (tritonserver, stubs, client: ~0.2 core)
    (2, 2, 1.0, 1),    # one CPU hog beside the default: the core it shares is left to it
    (2, 2, 2.0, 1),    # never fewer than one thread
    (16, 16, 1.0, 15),  # one hog on a 16-core host
    (16, 16, 2.9, 13),  # three cores' worth of neighbours
    (4, 16, 1.0, 4),   # an engine that uses fewer threads than cores keeps them beside a neighbour
    (1, 1, 1.0, 1),
])
def test_one_thread_fewer_per_core_the_neighbours_keep_busy(max_threads, cores, others, expected) -> None:
    assert threads_beside(max_threads, cores, others) == expected


def test_a_part_of_a_core_counts_from_the_threshold() -> None:
    below, at = host.NEIGHBOUR_CORE - 0.01, host.NEIGHBOUR_CORE + 1e-9
    assert threads_beside(8, 8, below) == 8
    assert threads_beside(8, 8, at) == 7
    assert threads_beside(8, 8, 1 + below) == 7
    assert threads_beside(8, 8, 1 + at) == 6


def _stat(ticks: dict[int, tuple[int, ...]]) -> str:
    lines = ["cpu  " + " ".join("0" * 10)]
    lines += [f"cpu{c} " + " ".join(str(v) for v in f) for c, f in sorted(ticks.items())]
    return "\n".join([*lines, "intr 1 2 3", "ctxt 99"]) + "\n"


def test_busy_ticks_count_user_nice_system_irq_softirq_steal_on_the_given_cpus_only() -> None:
    # user nice system idle iowait irq softirq steal guest guest_nice
    text = _stat({0: (10, 1, 5, 1000, 7, 2, 3, 4, 9, 9), 1: (100, 0, 0, 0, 0, 0, 0, 0, 0, 0), 2: (1, 1, 1, 1, 1, 1, 1, 1, 1, 1)})
    assert host._busy_ticks({0}, text) == 10 + 1 + 5 + 2 + 3 + 4  # idle, iowait and guest (already in user) left out
    assert host._busy_ticks({0, 1}, text) == 25 + 100
    assert host._busy_ticks({7}, text) is None


@pytest.mark.skipif(not Path("/proc/stat").is_file(), reason="no /proc/stat (not Linux)")
def test_busy_ticks_read_this_hosts_proc_stat() -> None:
    ticks = host._busy_ticks(set(os.sched_getaffinity(0)), Path("/proc/stat").read_text())
    assert isinstance(ticks, int) and ticks > 0


class FakeHost:
    """A /proc/stat and clocks for :class:`CoreShare`: ``others`` cores of neighbour load, ``mine`` of this process."""

    def __init__(self, cores: int, hz: int = 100):
        self.t, self.cpu, self.busy, self.hz, self.cores = 0.0, 0.0, 0.0, hz, cores
        self.stat_reads = 0

    def run(self, seconds: float, *, mine: float, others: float) -> None:
        self.t += seconds
        self.cpu += mine * seconds
        self.busy += (mine + others) * seconds * self.hz

    def read_stat(self) -> str:
        self.stat_reads += 1
        per = int(self.busy) // self.cores
        return _stat({c: (per, 0, 0, 0, 0, 0, 0, 0, 0, 0) for c in range(self.cores)})

    def share(self, max_threads: int) -> CoreShare:
        s = CoreShare(max_threads, cpus=set(range(self.cores)), read_stat=self.read_stat, clock=lambda: self.t,
                      cpu_clock=lambda: self.cpu)
        s._hz = self.hz
        return s


def test_core_share_follows_a_neighbour_that_comes_and_goes() -> None:
    h = FakeHost(cores=4)
    s = h.share(4)
    assert s.poll() is None  # the first poll starts a window
    h.run(0.2, mine=4.0, others=0.0)
    assert s.poll() is None and h.stat_reads == 1  # window not over: /proc/stat not read again
    h.run(0.4, mine=3.0, others=1.0)  # a hog arrives
    assert s.poll() == 3 and s.threads == 3
    assert abs(s.others_busy - 1.0 / 1.5) < 0.05
    h.run(0.6, mine=3.0, others=1.0)
    assert s.poll() is None and s.threads == 3  # unchanged: nothing to switch
    h.run(0.6, mine=4.0, others=0.0)  # it left
    assert s.poll() == 4


def test_an_idle_engine_does_not_count_its_neighbours_use_of_idle_cores() -> None:
    h = FakeHost(cores=2)
    s = h.share(2)
    s.poll()
    h.run(0.1, mine=2.0, others=0.0)
    s.pause()  # the engine waits for requests; a neighbour takes both idle cores meanwhile
    h.run(5.0, mine=0.0, others=2.0)
    assert s.poll() is None  # a new window starts here
    h.run(0.6, mine=2.0, others=0.0)
    assert s.poll() is None and s.threads == 2


def test_core_share_keeps_its_threads_where_proc_stat_cannot_be_read() -> None:
    def unreadable() -> str:
        raise OSError("no /proc")

    t = [0.0]
    s = CoreShare(2, cpus={0, 1}, read_stat=unreadable, clock=lambda: t[0], cpu_clock=lambda: 0.0)
    for _ in range(3):
        t[0] += 1.0
        assert s.poll() is None
    assert s.threads == 2


def _generate(eng, n: int) -> list[int]:
    got, done = [], threading.Event()

    def cb(toks, fin):
        got.extend(toks)
        if fin:
            done.set()

    eng.add_request([1, 4093, 314, 253, 1205], max_new_tokens=n, min_tokens=n, end_id=END_ID, on_tokens=cb)
    assert done.wait(120)
    return got


@pytest.mark.serial  # an engine at its default threads (every core)
@pytest.mark.skipif(len(os.sched_getaffinity(0)) < 2, reason="one core: nothing to leave a neighbour")
def test_engine_gives_a_busy_neighbour_a_core_and_takes_it_back(engine_dir: Path, monkeypatch) -> None:
    """A real engine at its default threads, its CoreShare fed a /proc/stat where a neighbour keeps one core busy,
    then none: its OpenMP team (``runtime['threads_now']``) shrinks by one and grows back, and every request still
    gets its tokens; with ``num_threads`` given there is no CoreShare."""
    cores = len(os.sched_getaffinity(0))
    neighbour = {"cores": 1.0, "ticks": 0.0, "t": time.monotonic()}
    made: list[CoreShare] = []

    def read_stat() -> str:  # this process's real CPU time plus the neighbour's so far, in ticks, on the first CPU
        now = time.monotonic()
        neighbour["ticks"] += neighbour["cores"] * (now - neighbour["t"]) * 100
        neighbour["t"] = now
        busy = int(time.process_time() * 100 + neighbour["ticks"])
        return _stat({c: (busy if i == 0 else 0, 0, 0, 0, 0, 0, 0, 0, 0, 0)
                      for i, c in enumerate(sorted(os.sched_getaffinity(0)))})

    def fake_share(max_threads: int) -> CoreShare:
        s = CoreShare(max_threads, read_stat=read_stat)
        s._hz = 100
        made.append(s)
        return s

    monkeypatch.setattr(host, "SHARE_WINDOW_S", 0.05)
    monkeypatch.setattr(engine_mod, "CoreShare", fake_share)
    with engine_mod.CpuEngine(engine_dir) as eng:
        assert eng.runtime["threads"] == cores and len(made) == 1
        assert len(_generate(eng, 24)) == 24
        assert eng.runtime["threads_now"] == cores - 1
        read_stat()
        neighbour["cores"] = 0.0  # it left
        assert len(_generate(eng, 24)) == 24
        assert eng.runtime["threads_now"] == cores
    made.clear()
    with engine_mod.CpuEngine(engine_dir, num_threads=cores) as eng:
        assert not made and eng.runtime["threads_now"] == cores
