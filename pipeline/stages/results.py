"""Typed results of the build stages: what one stage hands the next.

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

from pipeline import artifacts
from pipeline.layout import HF_CKPT, TRTLLM_CKPT

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


@dataclasses.dataclass(frozen=True)
class QuantizeResult(StageResult):
    """The quantize stage: ModelOpt checkpoints (``trtllm_ckpt/``, ``hf_ckpt/``) or, dry, the command."""

    STAGE: ClassVar[str] = "quantize"

    @property
    def trtllm_ckpt(self) -> Path:
        """The TensorRT-LLM checkpoint directory (exists only when built)."""
        return self.path / TRTLLM_CKPT

    @property
    def hf_ckpt(self) -> Path:
        """The unified HF checkpoint directory with the tokenizer (exists only when built)."""
        return self.path / HF_CKPT

    @property
    def quant_algo(self) -> str | None:
        """The exported ``quantization.quant_algo`` (``None`` = unquantized weights)."""
        return (self.manifest.get("exported") or {}).get("quant_algo")

    @property
    def kv_cache_quant_algo(self) -> str | None:
        """The exported ``quantization.kv_cache_quant_algo`` (``None`` = KV cache in the model dtype)."""
        return (self.manifest.get("exported") or {}).get("kv_cache_quant_algo")


@dataclasses.dataclass(frozen=True)
class EngineResult(StageResult):
    """The engine stage: TensorRT engine, LLM-API configuration or CPU engine directory."""

    STAGE: ClassVar[str] = "engine"

    @property
    def engine_kind(self) -> str:
        """``tensorrt`` | ``pytorch`` | ``cpu`` (the recipe's ``build.engine``)."""
        return str(self.manifest["engine_kind"])

    @property
    def world_size(self) -> int:
        """Ranks the engine runs on (tp × pp); 1 for the CPU engine."""
        return int(self.manifest.get("world_size") or 1)

    @property
    def max_seq_len(self) -> int | None:
        """The resolved ``max_seq_len`` in tokens, when the stage recorded it."""
        value = self.manifest.get("max_seq_len")
        return int(value) if value is not None else None

    @property
    def paged_context_fmha(self) -> bool:
        """Whether the engine has paged context FMHA (KV reuse and chunked context need it).

        A TensorRT engine records what ``trtllm-build`` really enables in ``effective_plugins``;
        the other engine kinds have no such plugin and report ``True``."""
        return bool((self.manifest.get("effective_plugins") or {}).get("use_paged_context_fmha", True))


@dataclasses.dataclass(frozen=True)
class RepoResult(StageResult):
    """The Triton model repository."""

    STAGE: ClassVar[str] = "triton_repo"

    @property
    def models(self) -> list[str]:
        """Names of the models in the repository, sorted."""
        return list(self.manifest.get("models") or [])

    @property
    def engine_kind(self) -> str:
        """The engine kind the repository serves."""
        return str(self.manifest["engine_kind"])
