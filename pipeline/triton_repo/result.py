"""The Triton-repository stage's typed result."""

from __future__ import annotations

import dataclasses
from typing import ClassVar

from pipeline.core.results import StageResult


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
