"""One writer at a time per build directory: an exclusive ``fcntl.flock`` on its lock file.

Two ``trtpipe build`` runs of one recipe (two terminals, a CI retry, a tune point and a manual build) write the same
stage directories and the last-build marker. :func:`exclusive` makes the second wait, saying who holds the lock,
until the first is done; it then finds the first's stages in place and reuses them by their cache keys
(:meth:`pipeline.core.results.StageResult.load`). The lock is the kernel's: a holder that dies (SIGKILL included)
releases it with its file descriptor, so a stale lock file never blocks anything.
"""

from __future__ import annotations

import contextlib
import fcntl
import json
import os
import sys
from collections.abc import Callable, Iterator
from pathlib import Path

from pipeline.core.artifacts import utc_now


def _holder(fd: int) -> str:
    """Who holds the lock, from what its holder wrote into the file (``pid N since T``), best effort."""
    try:
        info = json.loads(os.pread(fd, 4096, 0) or b"{}")
        return f"pid {int(info['pid'])}, since {info['since']}"
    except (OSError, ValueError, KeyError, TypeError):
        return "another process"


@contextlib.contextmanager
def exclusive(path: Path, *, on_wait: Callable[[str], None] | None = None) -> Iterator[None]:
    """Hold an exclusive ``flock`` on ``path`` (created, with its parent directories) for the block.

    When another process holds it, ``on_wait`` receives one line naming the holder and ``path`` and this process
    blocks until the holder releases it (Ctrl-C interrupts the wait). The holder writes its pid and start time into
    the file. A lock file removed while this process waited (a failed first build removes its new build directory)
    is not trusted: the lock is taken again on the file now at ``path``.
    """
    path = Path(path)
    while True:
        path.parent.mkdir(parents=True, exist_ok=True)
        fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o644)
        try:
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:
                if on_wait is not None:
                    on_wait(f"waiting for another build of {path.parent} ({_holder(fd)}; lock {path})")
                fcntl.flock(fd, fcntl.LOCK_EX)
            try:
                same = os.stat(path).st_ino == os.fstat(fd).st_ino
            except FileNotFoundError:
                same = False
        except BaseException:
            os.close(fd)
            raise
        if same:
            break
        os.close(fd)
    try:
        with contextlib.suppress(OSError):  # who holds it is for the waiters' message only (a full disk refuses it)
            os.ftruncate(fd, 0)
            os.pwrite(fd, json.dumps({"pid": os.getpid(), "since": utc_now(), "argv": sys.argv}).encode(), 0)
        yield
    finally:
        os.close(fd)  # releases the lock
