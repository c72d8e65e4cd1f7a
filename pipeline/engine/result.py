"""The engine stage's typed result."""

from __future__ import annotations

import dataclasses
from typing import ClassVar

from pipeline.core.results import StageResult


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
