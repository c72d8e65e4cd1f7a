"""Process housekeeping of the CPU engine: give freed heap back to the OS, release idle OpenMP workers."""

from __future__ import annotations

import ctypes
import os


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
