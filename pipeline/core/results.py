"""The typed result every build stage returns: what one stage hands the next.

Each stage declares its own subclass beside its ``run()``: :class:`pipeline.quantize.result.QuantizeResult`,
:class:`pipeline.engine.result.EngineResult`, :class:`pipeline.triton_repo.result.RepoResult`.

Every stage writes its directory with a ``manifest.json`` (the persisted form) and returns one of these.
The typed fields are the facts later stages act on; ``manifest`` keeps the whole record (versions,
timings, hashes) for display and provenance. ``from_manifest`` reads a result back from disk (a reused
stage, or a build made by another process) and ``to_manifest`` is the dict the stage wrote.

``status`` is one vocabulary for every stage:

* ``built``     — the stage produced its real artifact (weights, engine, LLM-API config, repository);
* ``dry_run``   — commands and configs only (``trtpipe build --dry-run``);
* ``not_built`` — the GPU tool is missing here: the exact command was written, the artifact was not.
"""

from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import Any, ClassVar, Literal, TypeVar, get_args

from pipeline.core import artifacts

Status = Literal["built", "dry_run", "not_built"]
STATUSES: tuple[str, ...] = get_args(Status)

R = TypeVar("R", bound="StageResult")


@dataclasses.dataclass(frozen=True)
class StageResult:
    """A stage's directory, its manifest, and whether it was reused (``cached``)."""

    STAGE: ClassVar[str] = ""

    path: Path
    manifest: dict[str, Any]
    cached: bool = False

    @property
    def stage(self) -> str:
        """The stage name (``quantize``, ``engine``, ``triton_repo``)."""
        return self.STAGE

    @property
    def cache_key(self) -> str:
        """The content hash of what the stage consumed."""
        return str(self.manifest["cache_key"])

    @property
    def status(self) -> Status:
        """``built`` | ``dry_run`` | ``not_built``."""
        return self.manifest["status"]

    @property
    def built(self) -> bool:
        """True when the real artifact exists (``status == "built"``)."""
        return self.status == "built"

    def to_manifest(self) -> dict[str, Any]:
        """The manifest this result was written with."""
        return self.manifest

    @classmethod
    def from_manifest(cls: type[R], path: Path, manifest: dict[str, Any], *, cached: bool = False) -> R:
        """The result of the stage directory ``path`` whose manifest is ``manifest``.

        Raises:
            ValueError: the manifest is of another stage or lacks ``cache_key``/a known ``status``.
        """
        if manifest.get("stage") != cls.STAGE:
            raise ValueError(f"{path}: manifest of stage {manifest.get('stage')!r}, expected {cls.STAGE!r}")
        if "cache_key" not in manifest or manifest.get("status") not in STATUSES:
            raise ValueError(f"{path}: manifest lacks cache_key or a status in {STATUSES}")
        return cls(path=Path(path), manifest=manifest, cached=cached)

    @classmethod
    def load(cls: type[R], path: Path, cache_key: str | None = None) -> R | None:
        """The result stored in ``path`` (``cached=True``), or ``None`` when there is none, it is
        unreadable, or (given ``cache_key``) it was made from other inputs."""
        manifest = artifacts.read_manifest(path)
        if not manifest or (cache_key is not None and manifest.get("cache_key") != cache_key):
            return None
        try:
            return cls.from_manifest(path, manifest, cached=True)
        except ValueError:
            return None
