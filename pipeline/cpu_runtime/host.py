"""Process housekeeping of the CPU engine: give freed heap back to the OS, release idle OpenMP workers, and leave
busy neighbours their cores (:class:`CoreShare`)."""

from __future__ import annotations

import ctypes
import os
import time
from pathlib import Path


def release_freed_heap() -> None:
    """Return heap memory freed while loading to the OS (glibc ``malloc_trim(0)``, all arenas).

    Packing the weights frees the dense copies, but glibc keeps freed arena pages mapped, so they still count in
    RSS: SmolLM2's engine was 914 MiB after load and 860 MiB after the trim (measured on this 2-core host). A no-op
    where the C library has no ``malloc_trim`` (musl, macOS).
    """
    try:
        ctypes.CDLL(None).malloc_trim(0)
    except (OSError, AttributeError):
        pass


#: ``omp_pause_soft`` of ``omp_pause_resource_t`` (OpenMP 5.0): release the pool's threads, keep nothing else.
_OMP_PAUSE_SOFT = 1


def release_openmp_pool() -> bool:
    """Release the calling thread's OpenMP worker threads (libgomp ``omp_pause_resource_all(omp_pause_soft)``).

    Every thread that has run a parallel region (any multi-threaded torch op) keeps a pool of idle workers, and
    libgomp counts them: once it manages more threads than the process may use cores, every worker spins only briefly
    at a barrier and then sleeps in the kernel (``do_spin`` in libgomp ``config/linux/wait.h``@a1dcfe9:47-58). A
    decode step has ~150 parallel regions, so it then pays a futex sleep and wake-up for most of them. SmolLM2 at one
    sequence, 2 threads on this 2-core host, after one ``torch.sum`` on the thread that created the engine (2
    processes each way, alternated, 2 requests of 200 tokens each, 2026-11-26): 23.0–26.0 ms per step and ~130 sleeps
    of the scheduler thread per step with that thread's pool kept, 14.4–18.7 ms and none with it released. The pool is
    created again the next time the thread runs parallel work. Returns ``False`` where libgomp is not loaded (another OpenMP
    runtime) or the caller is inside a parallel region.
    """
    try:
        gomp = ctypes.CDLL("libgomp.so.1", mode=os.RTLD_NOLOAD)
        return gomp.omp_pause_resource_all(_OMP_PAUSE_SOFT) == 0
    except (OSError, AttributeError):
        return False


#: The engine re-counts its neighbours' CPU after this many seconds of stepping (:class:`CoreShare`).
SHARE_WINDOW_S = 0.5
#: Other processes must keep this much of a core busy, on average over a window, for the engine to leave them a
#: thread: the served deployment's own processes (``tritonserver``, the bench client, the other stubs) take ~0.2.
NEIGHBOUR_CORE = 0.6


def threads_beside(max_threads: int, cores: int, others_busy: float) -> int:
    """The engine's OpenMP thread count beside other processes: one thread fewer for every core they keep busy.

    ``max_threads``: the most the engine uses (its default: all ``cores``); ``cores``: the CPUs this process may run on;
    ``others_busy``: cores' worth of CPU time the other processes took on them over the last window (0 .. cores).
    Returns ``min(max_threads, cores - k)``, at least 1, where ``k`` counts the neighbours' cores with a part of a
    core from :data:`NEIGHBOUR_CORE` up counted as one (``k = floor(others_busy + 1 - NEIGHBOUR_CORE)``).

    Why: every parallel region of a decode step (~150 per step) ends at a barrier that waits for all of the team, and
    libgomp's waiters spin (not yield) for a while first. With a thread per core and one CPU-bound neighbour (under the
    kernel's autogroup scheduling a ``nice``d process of another session still gets a fair share of a core), the thread
    that shares a core with it runs only every other time slice, and its partner spins at each barrier, so a step
    waits out slices instead of microseconds: SmolLM2's default engine on 2 cores, 52 → 1.1 tok/s; with one thread
    fewer the engine keeps a core to itself (docs/cpu-engine.md, "A busy neighbour").
    """
    taken = int(max(0.0, others_busy) + 1.0 - NEIGHBOUR_CORE)
    return max(1, min(max_threads, cores - taken))


def _busy_ticks(cpus: set[int], stat: str) -> int | None:
    """Busy clock ticks (user, nice, system, irq, softirq, steal) summed over ``cpus`` from ``/proc/stat`` text;
    ``None`` when it names none of them."""
    total, seen = 0, False
    for line in stat.splitlines():
        name, _, rest = line.partition(" ")
        if not (name.startswith("cpu") and name[3:].isdigit() and int(name[3:]) in cpus):
            continue
        f = [int(v) for v in rest.split()]
        total += f[0] + f[1] + f[2] + sum(f[5:8])
        seen = True
    return total if seen else None


class CoreShare:
    """The engine's thread count, re-chosen by :func:`threads_beside` from what other processes took of this process's
    cores in the last :data:`SHARE_WINDOW_S` seconds of stepping (``/proc/stat`` minus this process's CPU time).

    Call :meth:`poll` before each step (on the thread that runs the parallel work) and :meth:`pause` when the engine
    goes idle, so a window never spans an idle engine (the neighbours may use idle cores freely). Where ``/proc/stat``
    cannot be read (not Linux), :meth:`poll` keeps ``max_threads``. ``cpus`` (default: the affinity mask),
    ``read_stat`` (``/proc/stat``'s text), ``clock`` (wall seconds) and ``cpu_clock`` (this process's CPU seconds) are
    there for tests.
    """

    def __init__(self, max_threads: int, *, cpus: set[int] | None = None, read_stat=None, clock=None, cpu_clock=None):
        self.max_threads = self.threads = max(1, int(max_threads))
        self.cpus = set(os.sched_getaffinity(0) if cpus is None else cpus)
        self._read_stat = read_stat or (lambda: Path("/proc/stat").read_text())
        self._clock, self._cpu_clock = clock or time.monotonic, cpu_clock or time.process_time
        self._hz = os.sysconf("SC_CLK_TCK") if hasattr(os, "sysconf") else 100
        self.others_busy = 0.0  # cores, last window
        self._start: tuple[float, float, int] | None = None

    def _sample(self) -> tuple[float, float, int] | None:
        try:
            ticks = _busy_ticks(self.cpus, self._read_stat())
        except OSError:
            return None
        return None if ticks is None else (self._clock(), self._cpu_clock(), ticks)

    def pause(self) -> None:
        """The engine is going idle: the next :meth:`poll` starts a new window."""
        self._start = None

    def poll(self) -> int | None:
        """The thread count to switch to, when a window has just ended and it differs from the current one; else None."""
        if self._start is None:
            self._start = self._sample()
            return None
        if self._clock() - self._start[0] < SHARE_WINDOW_S:
            return None
        now = self._sample()
        if now is None:
            return None
        (t0, c0, b0), (t1, c1, b1) = self._start, now
        self._start = now
        self.others_busy = max(0.0, ((b1 - b0) / self._hz - (c1 - c0)) / (t1 - t0))
        n = threads_beside(self.max_threads, len(self.cpus), self.others_busy)
        if n == self.threads:
            return None
        self.threads = n
        return n
