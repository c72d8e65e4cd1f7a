"""Two tests at once (pytest-xdist) on a machine whose tests mostly wait on a server (not shipped).

The suite is run with ``-n 2 --dist loadgroup`` by scripts/test.sh (``TRTPIPE_TEST_WORKERS``; 0 = one process). On a
2-core host one test module alone used ~1.1 cores (docs/measurements.md, "CI time"): a server generates while its
client waits. Three rules keep two workers correct:

- **A module is the unit of work** (:class:`ModuleScheduling`): its module-scoped servers and engines start once, on
  one worker. Modules that share a session build marked ``pytest.mark.xdist_group(name)`` (the VLM builds, the eval
  baseline) form one unit, so the build is made once; such groups and modules with ``slow`` tests are handed out
  first, so that the run does not end on one long module.
- **A session build is made once per run** (:func:`built_once`): the first worker to need it builds it under an
  exclusive ``flock`` into a directory all workers share; the others wait, then read it.
- **A test marked ``serial`` runs with nothing else at once** (:func:`host_turn`): its figures or its thread choice
  read the host's load (a busy neighbour, throughput before and after a storm). Every test holds a shared ``flock``
  for its whole protocol (fixture set-up included: that is where session builds run); a ``serial`` one holds it
  exclusively. A turnstile lock in front keeps the exclusive waiter from being starved.

Without xdist (``-n 0``, or a plain ``pytest``) every helper here is a no-op.
"""

from __future__ import annotations

import contextlib
import fcntl
import os
import tempfile
from collections.abc import Iterator
from pathlib import Path

import pytest

from pipeline.core.lock import exclusive

try:
    from xdist.scheduler import LoadGroupScheduling
except ImportError:  # pytest-xdist is a test extra; without it the suite runs in one process
    LoadGroupScheduling = object  # type: ignore[assignment,misc]

SERIAL = "serial"


def worker() -> str | None:
    """This process's xdist worker id (``gw0``, ``gw1`` …), or None when the suite runs in one process."""
    return os.environ.get("PYTEST_XDIST_WORKER")


def _lock_dir() -> Path:
    """A directory for this run's lock files (a few empty files), shared by its workers (keyed by xdist's run id)."""
    path = Path(tempfile.gettempdir()) / f"trtpipe-xdist-{os.environ['PYTEST_XDIST_TESTRUNUID']}"
    path.mkdir(parents=True, exist_ok=True)
    return path


@contextlib.contextmanager
def _flock(path: Path, mode: int) -> Iterator[None]:
    """``fcntl.flock`` of ``path`` in ``mode`` (shared or exclusive) for the block (the project's
    :func:`pipeline.core.lock.exclusive` has no shared mode)."""
    fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o644)
    try:
        fcntl.flock(fd, mode)
        yield
    finally:
        os.close(fd)  # releases the lock


@contextlib.contextmanager
def host_turn(item: pytest.Item) -> Iterator[None]:
    """Hold this worker's turn on the host for ``item``'s whole protocol: shared for an ordinary test, exclusive
    for one marked ``serial`` (no other test runs meanwhile). No-op without xdist."""
    if worker() is None:
        yield
        return
    d = _lock_dir()
    if item.get_closest_marker(SERIAL) is not None:  # hold the turnstile while waiting: new shared holders queue
        with _flock(d / "turnstile.lock", fcntl.LOCK_EX), _flock(d / "host.lock", fcntl.LOCK_EX):
            yield
        return
    with _flock(d / "turnstile.lock", fcntl.LOCK_EX):  # only passed through
        pass
    with _flock(d / "host.lock", fcntl.LOCK_SH):
        yield


@contextlib.contextmanager
def built_once(tmp_path_factory: pytest.TempPathFactory, name: str) -> Iterator[tuple[Path, bool]]:
    """``(directory, build)`` for a session build named ``name``: without xdist a fresh temp directory and
    ``build=True``; under xdist one directory shared by the run's workers, held under an exclusive lock for the
    block, ``build=True`` only for the first worker (the block must then build into it; a block that raises leaves
    ``build=True`` for the next one)."""
    if worker() is None:
        yield tmp_path_factory.mktemp(name), True
        return
    # the run's base temp dir (each worker's is a sub-directory of it): pytest removes it as it removes the workers'
    root = tmp_path_factory.getbasetemp().parent / "shared-builds" / name
    root.mkdir(parents=True, exist_ok=True)
    done = root.parent / f".{name}.done"
    with exclusive(root.parent / f".{name}.lock"):
        yield root, not done.exists()
        done.touch()


SLOW_SUFFIX = "#slow"


def group_slow_modules(items: list[pytest.Item]) -> None:
    """Mark every test of a module that has a ``slow`` test (and no ``xdist_group`` of its own) with the group
    ``<module>#slow``: the module stays one unit and :class:`ModuleScheduling` hands it out early. Call it before
    xdist reads the marks (a ``tryfirst`` ``pytest_collection_modifyitems``)."""
    modules: dict[str, list[pytest.Item]] = {}
    for item in items:
        modules.setdefault(item.nodeid.split("::", 1)[0], []).append(item)
    for module, its in modules.items():
        grouped = any(item.get_closest_marker("xdist_group") for item in its)
        if not grouped and any(item.get_closest_marker("slow") and not item.get_closest_marker("skip") for item in its):
            for item in its:
                item.add_marker(pytest.mark.xdist_group(module + SLOW_SUFFIX))


class ModuleScheduling(LoadGroupScheduling):  # type: ignore[misc,valid-type]
    """xdist's ``loadgroup`` with a module (not a test) as the unit of work and the modules of one ``xdist_group``
    as one unit. Units are handed out longest-first by a proxy (no durations are kept): declared groups (they share
    a session build), then modules with slow tests (:func:`group_slow_modules`), then by test count."""

    _ordered = False

    def _split_scope(self, nodeid: str) -> str:
        if nodeid.rfind("@") > nodeid.rfind("]"):
            return "@" + nodeid.rsplit("@", 1)[-1]
        return nodeid.split("::", 1)[0]

    def _assign_work_unit(self, node) -> None:  # noqa: ANN001 (xdist's WorkerController)
        if not self._ordered:
            def rank(unit: tuple[str, dict[str, bool]]) -> tuple[int, int]:
                scope, tests = unit
                kind = 2 if not scope.startswith("@") else 1 if scope.endswith(SLOW_SUFFIX) else 0
                return kind, -len(tests)

            ordered = sorted(self.workqueue.items(), key=rank)
            self.workqueue.clear()
            self.workqueue.update(ordered)
            self._ordered = True
        super()._assign_work_unit(node)
