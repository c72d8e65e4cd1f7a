"""Base class of every recipe section: unknown keys are rejected, instances are immutable."""

from __future__ import annotations

from pydantic import BaseModel, ConfigDict


class StrictModel(BaseModel):
    """A recipe section. ``extra="forbid"``: a misspelt key is an error, never silently ignored."""

    model_config = ConfigDict(extra="forbid", frozen=True, validate_default=True)
