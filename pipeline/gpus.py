"""The GPU catalog (``pipeline/data/gpus.yaml``): names, architectures and capacities.

Recipe validation uses ``arch``/``fp8``/``fp4``/``memory_gib``; the planner
(:mod:`pipeline.plan`) also uses bandwidth and TFLOPS. ``"cpu"`` is not in the catalog: it is
the target of the CPU engine.
"""

from __future__ import annotations

import functools
from importlib import resources

import yaml
from pydantic import BaseModel, ConfigDict

CPU_TARGET = "cpu"


class GpuSpec(BaseModel):
    """One catalog entry. Memory in GiB, bandwidth in TB/s, throughput in dense TFLOPS."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    key: str
    name: str
    aliases: list[str] = []
    arch: str
    compute_capability: str
    memory_gib: float
    memory_bandwidth_tbs: float
    bf16_tflops: float
    fp8_tflops: float | None = None
    fp4_tflops: float | None = None
    fp8: bool
    fp4: bool
    source: str


@functools.cache
def catalog() -> dict[str, GpuSpec]:
    """All catalog entries by key (lower-case, e.g. ``h200``), loaded once from the data file."""
    raw = yaml.safe_load(resources.files("pipeline").joinpath("data/gpus.yaml").read_text())
    return {key: GpuSpec(key=key, **entry) for key, entry in raw.items()}


def lookup(name: str) -> GpuSpec | None:
    """The entry whose key or alias equals ``name`` (case-insensitive), or ``None``."""
    wanted = name.strip().lower()
    for spec in catalog().values():
        if wanted == spec.key or wanted in (a.lower() for a in spec.aliases):
            return spec
    return None
