"""Artifact directories, manifests, content hashes and the stage cache.

Every stage writes one directory that holds its outputs and a ``manifest.json``. Directories
are built in a sibling temp dir and renamed into place (:func:`atomic_dir`), so an interrupted
stage never leaves a half-built result. A stage is skipped only when the ``cache_key`` stored
in the existing manifest equals the key of the current inputs
(:meth:`pipeline.core.results.StageResult.load`), never merely because files exist.

The layout of one build directory is :class:`pipeline.core.layout.BuildLayout`.

The path of the last successful build is kept in ``artifacts/.last_build`` (see
:func:`record_last_build`) so that ``trtpipe serve`` without arguments finds it.
"""

from __future__ import annotations

import contextlib
import datetime as _dt
import hashlib
import json
import os
import resource
import shutil
import time
from collections.abc import Iterator
from importlib import metadata
from pathlib import Path
from typing import Any

from pipeline import __version__

MANIFEST = "manifest.json"
DEFAULT_ARTIFACTS_ROOT = Path("artifacts")
LAST_BUILD_FILE = ".last_build"

_CHUNK = 1 << 20


def sha256_file(path: Path) -> str:
    """Hex sha256 of one file's bytes, read in 1 MiB chunks."""
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(_CHUNK), b""):
            h.update(block)
    return h.hexdigest()


def sha256_tree(root: Path, exclude: tuple[str, ...] = (MANIFEST,)) -> str:
    """Hex sha256 over a directory's relative paths and file contents (sorted, stable).

    Files whose name is in ``exclude`` are skipped, so a manifest does not hash itself.
    """
    h = hashlib.sha256()
    for p in sorted(root.rglob("*")):
        if p.is_file() and p.name not in exclude:
            h.update(p.relative_to(root).as_posix().encode())
            h.update(b"\0")
            h.update(sha256_file(p).encode())
    return h.hexdigest()


def file_hashes(root: Path, exclude: tuple[str, ...] = (MANIFEST,)) -> dict[str, str]:
    """``{relative path: sha256}`` for every file under ``root`` (used for engine files)."""
    return {
        p.relative_to(root).as_posix(): sha256_file(p)
        for p in sorted(root.rglob("*"))
        if p.is_file() and p.name not in exclude
    }


def stable_hash(obj: Any) -> str:
    """Hex sha256 of ``obj`` as canonical JSON (sorted keys, no whitespace; paths as strings)."""
    data = json.dumps(obj, sort_keys=True, separators=(",", ":"), default=str)
    return hashlib.sha256(data.encode()).hexdigest()


def library_versions(*dists: str) -> dict[str, str | None]:
    """Installed versions of the given distributions (``None`` when not installed)."""
    out: dict[str, str | None] = {"trtpipe": __version__}
    for d in dists:
        try:
            out[d] = metadata.version(d)
        except metadata.PackageNotFoundError:
            out[d] = None
    return out


def peak_rss_bytes() -> int:
    """Peak resident set size of this process so far, in bytes (``ru_maxrss`` is KiB on Linux)."""
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024


def utc_now() -> str:
    """Current UTC time as ISO-8601 with seconds, e.g. ``2026-11-22T09:30:00Z``."""
    return _dt.datetime.now(_dt.timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ")


@contextlib.contextmanager
def atomic_dir(final: Path) -> Iterator[Path]:
    """Yield an empty temp dir next to ``final``; on success replace ``final`` with it.

    On any exception (including KeyboardInterrupt) the temp dir is removed and ``final`` is left
    exactly as it was. The swap is two renames on the same filesystem: the old directory is moved
    aside first and deleted only after the new one is in place.
    """
    final = Path(final)
    final.parent.mkdir(parents=True, exist_ok=True)
    remove_stale_tmp(final)
    tmp = final.parent / f".{final.name}.tmp-{os.getpid()}-{time.monotonic_ns()}"
    tmp.mkdir()
    try:
        yield tmp
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    old = None
    if final.exists():
        old = final.parent / f".{final.name}.old-{os.getpid()}-{time.monotonic_ns()}"
        final.rename(old)
    tmp.rename(final)
    if old is not None:
        shutil.rmtree(old, ignore_errors=True)


def write_atomic(path: Path, data: str | bytes, *, fsync: bool = False) -> Path:
    """Write a small file all at once: ``data`` goes to a temp file next to ``path`` (``.<name>.tmp-<pid>-<ns>``)
    that :func:`os.replace` then renames over ``path``, so a reader sees the old content or the new, never a part.

    ``str`` is written as UTF-8. ``fsync=True`` flushes the file to disk before the rename (survives a power cut,
    not just a killed process). Missing parent directories are created; on any error the temp file is removed and
    ``path`` is left as it was. Returns ``path``.
    """
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.tmp-{os.getpid()}-{time.monotonic_ns()}")
    try:
        with open(tmp, "wb") as f:
            f.write(data.encode() if isinstance(data, str) else data)
            if fsync:
                f.flush()
                os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise
    return path


def remove_stale_tmp(final: Path) -> list[Path]:
    """Remove the ``.<name>.tmp-<pid>-*`` / ``.<name>.old-<pid>-*`` dirs next to ``final`` whose process is gone.

    :func:`atomic_dir` removes its temp dir on any exception, but SIGKILL (or a power cut) skips that;
    the next writer of the same directory calls this first. Directories of live processes are kept
    (another build may be writing). Returns the removed paths.
    """
    final = Path(final)
    removed: list[Path] = []
    if not final.parent.is_dir():
        return removed
    for p in final.parent.glob(f".{final.name}.*-*"):
        kind, _, rest = p.name[len(final.name) + 2:].partition("-")
        if kind not in ("tmp", "old"):
            continue
        try:
            pid = int(rest.split("-")[0])
        except ValueError:
            continue
        try:
            os.kill(pid, 0)
        except ProcessLookupError:
            shutil.rmtree(p, ignore_errors=True)
            removed.append(p)
        except PermissionError:
            continue
    return removed


def write_manifest(directory: Path, manifest: dict[str, Any]) -> Path:
    """Write ``manifest.json`` (indented, sorted keys) into ``directory`` and return its path."""
    path = Path(directory) / MANIFEST
    path.write_text(json.dumps(manifest, indent=2, sort_keys=True, default=str) + "\n")
    return path


def read_manifest(directory: Path) -> dict[str, Any] | None:
    """The manifest of an artifact directory, or ``None`` when there is none (or it is unreadable)."""
    path = Path(directory) / MANIFEST
    try:
        return json.loads(path.read_text())
    except (OSError, ValueError):
        return None


def base_manifest(stage: str, cache_key: str, **fields: Any) -> dict[str, Any]:
    """The fields every stage manifest starts with: stage, cache key, trtpipe version, time."""
    return {
        "stage": stage,
        "cache_key": cache_key,
        "trtpipe_version": __version__,
        "created_at": utc_now(),
        **fields,
    }


def default_build_dir(recipe_name: str, root: Path = DEFAULT_ARTIFACTS_ROOT) -> Path:
    """``artifacts/<recipe name>``: where ``trtpipe build`` writes when ``--out`` is not given."""
    return Path(root) / recipe_name


def record_last_build(build_dir: Path, root: Path = DEFAULT_ARTIFACTS_ROOT) -> None:
    """Remember ``build_dir`` (absolute) as the last successful build under ``root``."""
    write_atomic(Path(root) / LAST_BUILD_FILE, str(Path(build_dir).resolve()) + "\n")


def last_build(root: Path = DEFAULT_ARTIFACTS_ROOT) -> Path | None:
    """The last successful build directory recorded under ``root``, or ``None``."""
    try:
        p = Path((Path(root) / LAST_BUILD_FILE).read_text().strip())
    except OSError:
        return None
    return p if p.is_dir() else None


@contextlib.contextmanager
def last_build_kept(root: Path = DEFAULT_ARTIFACTS_ROOT) -> Iterator[None]:
    """Builds made inside this block (a tune's points, an eval baseline, a peer script's build) do not
    become the last build that ``trtpipe serve`` / ``bench`` default to: the marker under ``root`` is
    put back as it was (removed if there was none), also when the block raises."""
    marker = Path(root) / LAST_BUILD_FILE
    before = marker.read_text() if marker.is_file() else None
    try:
        yield
    finally:
        if before is not None:
            write_atomic(marker, before)
        else:
            marker.unlink(missing_ok=True)


def cache_dir() -> Path:
    """trtpipe's cache (converted model checkpoints, downloaded data): ``$TRTPIPE_CACHE_DIR``
    or ``$XDG_CACHE_HOME/trtpipe`` (default ``~/.cache/trtpipe``). Created on first use."""
    env = os.environ.get("TRTPIPE_CACHE_DIR")
    if env:
        p = Path(env)
    else:
        p = Path(os.environ.get("XDG_CACHE_HOME", Path.home() / ".cache")) / "trtpipe"
    p.mkdir(parents=True, exist_ok=True)
    return p
