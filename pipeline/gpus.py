"""The GPU catalog (``pipeline/data/gpus.yaml``): names, architectures, capacities and peak rates.

Recipe validation uses ``arch``/``fp8``/``fp4``/``compute_capability``; the planner
(:mod:`pipeline.plan`) budgets ``memory_mib`` (the total nvidia-smi reports, MiB) and uses
``memory_bandwidth_tbs`` and the dense tensor-core rates. ``"cpu"`` is not in the catalog: it is the
target of the CPU engine. Every figure's source is in the entry (``source``/``sources``).
"""

from __future__ import annotations

import functools
from importlib import resources

import yaml
from pydantic import BaseModel, ConfigDict, model_validator

CPU_TARGET = "cpu"
MIB = 1 << 20
GIB = 1 << 30


class GpuSpec(BaseModel):
    """One catalog entry.

    Units: ``memory_mib`` MiB as printed by nvidia-smi (what the planner budgets); ``memory_gib`` =
    memory_mib / 1024 (GiB, 2 decimals); ``memory_gb`` the datasheet's decimal-GB marketing figure
    (reference only); ``memory_bandwidth_tbs`` TB/s (10^12 B/s); ``*_tflops``/``int8_tops`` dense
    (no sparsity) tensor-core peaks in 10^12 ops/s, ``None`` where the format has no tensor-core path.
    """

    model_config = ConfigDict(extra="forbid", frozen=True)

    key: str
    name: str
    aliases: list[str] = []
    arch: str
    compute_capability: str
    memory_mib: int
    memory_gib: float
    memory_gb: float
    memory_bandwidth_tbs: float
    bf16_tflops: float
    fp8_tflops: float | None = None
    fp4_tflops: float | None = None
    int8_tops: float | None = None
    fp8: bool
    fp4: bool
    source: str
    sources: dict[str, str] = {}

    @model_validator(mode="after")
    def _consistent(self) -> "GpuSpec":
        if abs(self.memory_gib - self.memory_mib / 1024) > 0.01:
            raise ValueError(f"{self.key}: memory_gib {self.memory_gib} != memory_mib {self.memory_mib} / 1024")
        if self.fp8 != (self.fp8_tflops is not None) or self.fp4 != (self.fp4_tflops is not None):
            raise ValueError(f"{self.key}: fp8/fp4 flags disagree with fp8_tflops/fp4_tflops")
        return self

    @property
    def memory_bytes(self) -> int:
        """Total device memory in bytes (memory_mib × 2^20)."""
        return self.memory_mib * MIB

    @property
    def bandwidth_bytes_per_s(self) -> float:
        """Peak DRAM bandwidth in bytes/s (memory_bandwidth_tbs × 10^12)."""
        return self.memory_bandwidth_tbs * 1e12


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
