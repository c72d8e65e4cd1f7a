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
import errno
import hashlib
import json
import os
import resource
import shutil
import time
from collections.abc import Iterator, Mapping
from importlib import metadata
from pathlib import Path
from typing import Any

from pipeline import __version__
from pipeline.core.errors import StageError

MANIFEST = "manifest.json"
DEFAULT_ARTIFACTS_ROOT = Path("artifacts")
LAST_BUILD_FILE = ".last_build"

_CHUNK = 1 << 20
#: a filesystem with less than this free when a writer failed is taken as full (libraries that hide the
#: ENOSPC, e.g. torch.save's "file write failed")
_FULL_BYTES = 1 << 20


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


def changed_files(root: Path, recorded: Mapping[str, str]) -> list[str]:
    """One line per file of ``recorded`` (``{path relative to root: sha256}``, as :func:`file_hashes` wrote it at
    build time) that is missing under ``root`` or whose bytes no longer have that sha256 (streamed,
    :func:`sha256_file`); ``[]`` when every file matches. The one rule ``trtpipe serve`` applies to the files a
    server loads (:func:`pipeline.serve.compat.check_files`)."""
    problems = []
    for rel, sha in sorted(recorded.items()):
        path = Path(root) / rel
        if not path.is_file():
            problems.append(f"{path} is missing")
        elif sha256_file(path) != sha:
            problems.append(f"{path} changed on disk since the build (sha256 differs)")
    return problems


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


def size_text(n: int) -> str:
    """``n`` bytes for a message: ``312 MiB`` below 1 GiB, else ``1.45 GiB``."""
    return f"{n / 2**20:.0f} MiB" if n < 1 << 30 else f"{n / 2**30:.2f} GiB"


def free_bytes(path: Path) -> int:
    """Bytes an unprivileged writer may still use on the filesystem of ``path`` (its nearest existing ancestor)."""
    path = Path(path).absolute()
    while not path.exists() and path != path.parent:
        path = path.parent
    return shutil.disk_usage(path).free


def no_space_error(final: Path, need_bytes: int | None, *, during: bool) -> StageError:
    """The one line for a full disk under ``final``: the path, the space the writer needs (``need_bytes``, its
    estimate; ``None``: unknown) and what is free there now. ``during``: the disk filled while writing (else the
    up-front check refused)."""
    need = f"needs about {size_text(need_bytes)}" if need_bytes else "needs more space"
    what = "no space left on device while writing it" if during else "not enough free space"
    return StageError(f"{final}: {what}: it {need}, {size_text(free_bytes(final.parent))} free there — free space "
                      "or build on a larger disk (--out DIR)")


def is_no_space(exc: BaseException) -> bool:
    """True when ``exc`` or an exception it was raised from is a full disk: an ``OSError`` with ``ENOSPC``/``EDQUOT``,
    or a library's error carrying the OS text (safetensors' ``SafetensorError``: "No space left on device")."""
    seen: set[int] = set()
    e: BaseException | None = exc
    while e is not None and id(e) not in seen:
        seen.add(id(e))
        if isinstance(e, OSError) and e.errno in (errno.ENOSPC, errno.EDQUOT):
            return True
        if "No space left on device" in str(e) or "Disk quota exceeded" in str(e):
            return True
        e = e.__cause__ or e.__context__
    return False


@contextlib.contextmanager
def atomic_dir(final: Path, *, need_bytes: int | None = None) -> Iterator[Path]:
    """Yield an empty temp dir next to ``final``; on success replace ``final`` with it.

    On any exception (including KeyboardInterrupt) the temp dir is removed and ``final`` is left
    exactly as it was. The swap is two renames on the same filesystem: the old directory is moved
    aside first and deleted only after the new one is in place.

    ``need_bytes`` (the writer's estimate of what it writes): when less is free there, nothing is created and a
    :class:`StageError` names ``final``, the space needed and the space free (:func:`no_space_error`). A full disk
    while writing (:func:`is_no_space`, or nothing left free when the body failed) becomes the same one line.
    """
    final = Path(final)
    final.parent.mkdir(parents=True, exist_ok=True)
    remove_stale_tmp(final)
    if need_bytes and free_bytes(final.parent) < need_bytes:
        raise no_space_error(final, need_bytes, during=False)
    tmp = final.parent / f".{final.name}.tmp-{os.getpid()}-{time.monotonic_ns()}"
    try:
        tmp.mkdir()
        yield tmp
    except BaseException as e:
        full = is_no_space(e) or (isinstance(e, Exception) and free_bytes(final.parent) < _FULL_BYTES)
        shutil.rmtree(tmp, ignore_errors=True)
        if full:
            raise no_space_error(final, need_bytes, during=True) from e
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
    """Remove the ``.<name>.tmp-<pid>-*`` / ``.<name>.old-<pid>-*`` dirs (and ``.<name>.seed-<pid>``, a seeding's
    links: :mod:`pipeline.assemble.seed`) next to ``final`` whose process is gone.

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
        if kind not in ("tmp", "old", "seed"):
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
