"""The GPU catalog (``pipeline/data/gpus.yaml``): names, architectures, capacities and peak rates.

Recipe validation uses ``arch``/``fp8``/``fp4``/``compute_capability``; the planner
(:mod:`pipeline.plan`) budgets ``memory_mib`` (the total nvidia-smi reports, MiB) and uses
``memory_bandwidth_tbs`` and the dense tensor-core rates. ``"cpu"`` is not in the catalog: it is the
target of the CPU engine, whose host rates are measured (:func:`cpu_host`: this host's, written by ``trtpipe plan
measure-host`` to :func:`host_file` in the user's cache, else the reference host's shipped in
``pipeline/data/cpu_host.yaml``). Every figure carries its source: ``sources`` names one per constant
(:data:`SOURCED_FIELDS`), ``source`` is the main datasheet.
"""

from __future__ import annotations

import functools
import os
from importlib import resources
from pathlib import Path

import yaml
from pydantic import BaseModel, ConfigDict, Field, ValidationError, model_validator

from pipeline.core.errors import UserError

CPU_TARGET = "cpu"
MIB = 1 << 20
GIB = 1 << 30
#: numeric constants of a catalog entry that must name their source in ``sources`` (when not null).
SOURCED_FIELDS = ("memory_mib", "memory_gb", "memory_bandwidth_tbs", "bf16_tflops", "fp8_tflops", "fp4_tflops", "int8_tops",
                  "interconnect_gbs")
#: environment variable naming this host's measured-rates file (default: ``cpu_host.yaml`` in trtpipe's cache)
HOST_FILE_ENV = "TRTPIPE_HOST_FILE"
#: the reference host's rates shipped with the package (the 2-core dev VM of docs/plan.md, "CPU target")
SHIPPED_HOST_FILE = "data/cpu_host.yaml"


class MigProfile(BaseModel):
    """One MIG GPU-instance profile of a GPU (``mig:`` of its catalog entry): ``count`` the most instances per GPU,
    ``compute_slices`` of 7 (the SM share is compute_slices / 7), ``memory_slices`` of 8 (memory and its bandwidth
    share: memory_slices / 8, the "Fraction of Memory" column of NVIDIA's MIG user guide), ``memory_mib`` the
    instance's memory as NVML's ``memorySizeMB`` reports it (MiB)."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    count: int
    compute_slices: int
    memory_slices: int
    memory_mib: int

    @property
    def sm_share(self) -> float:
        """Fraction of the GPU's SMs (compute_slices / 7)."""
        return self.compute_slices / 7

    @property
    def memory_share(self) -> float:
        """Fraction of the GPU's memory and memory bandwidth (memory_slices / 8)."""
        return self.memory_slices / 8


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
    #: GPU-to-GPU bandwidth per GPU as the datasheet quotes it, GB/s (10^9 B/s), both directions together
    #: (NVLink where the GPU has it in its usual server, else its PCIe link); ``interconnect`` names which
    interconnect_gbs: float | None = None
    interconnect: str | None = None
    fp8: bool
    fp4: bool
    source: str
    sources: dict[str, str] = {}
    #: MIG profiles by name (``3g.71gb``); empty: the GPU has no MIG
    mig: dict[str, MigProfile] = {}
    #: set on a MIG slice (:func:`mig_slice`): the profile this spec describes
    mig_profile: str | None = None
    #: alias → the NVML device name of that product where it differs from ``name`` (H200 NVL beside H200 SXM): what
    #: ``nvidia.com/gpu.product`` node labels carry (:func:`product_name`)
    product_names: dict[str, str] = {}

    @model_validator(mode="after")
    def _consistent(self) -> "GpuSpec":
        if abs(self.memory_gib - self.memory_mib / 1024) > 0.01:
            raise ValueError(f"{self.key}: memory_gib {self.memory_gib} != memory_mib {self.memory_mib} / 1024")
        if self.fp8 != (self.fp8_tflops is not None) or self.fp4 != (self.fp4_tflops is not None):
            raise ValueError(f"{self.key}: fp8/fp4 flags disagree with fp8_tflops/fp4_tflops")
        missing = [f for f in SOURCED_FIELDS if getattr(self, f) is not None and not self.sources.get(f)]
        if missing:
            raise ValueError(f"{self.key}: no source for {', '.join(missing)} (add them under sources:)")
        return self

    @property
    def memory_bytes(self) -> int:
        """Total device memory in bytes (memory_mib × 2^20)."""
        return self.memory_mib * MIB

    @property
    def link_bytes_per_s(self) -> float | None:
        """GPU-to-GPU bandwidth in one direction, bytes/s: interconnect_gbs / 2 × 10^9 (datasheets quote both
        directions together: H100 SXM NVLink 900 GB/s = 450 GB/s each way). None when the catalog has no figure."""
        return None if self.interconnect_gbs is None else self.interconnect_gbs / 2 * 1e9

    @property
    def bandwidth_bytes_per_s(self) -> float:
        """Peak DRAM bandwidth in bytes/s (memory_bandwidth_tbs × 10^12)."""
        return self.memory_bandwidth_tbs * 1e12


@functools.cache
def catalog() -> dict[str, GpuSpec]:
    """All catalog entries by key (lower-case, e.g. ``h200``), loaded once from the data file (``mig:`` may name
    another entry's key: the same profile table)."""
    raw = yaml.safe_load(resources.files("pipeline").joinpath("data/gpus.yaml").read_text())
    profiles = {k: e.get("mig") for k, e in raw.items() if isinstance(e.get("mig"), dict)}
    return {key: GpuSpec(key=key, **(entry | ({"mig": profiles[entry["mig"]]} if isinstance(entry.get("mig"), str) else {})))
            for key, entry in raw.items()}


def mig_resource(profile: str) -> str:
    """The Kubernetes resource of a MIG profile under the device plugin's ``mixed`` strategy: ``nvidia.com/mig-`` +
    the profile with ``+`` as ``.`` (NVIDIA/k8s-device-plugin@1b826acc6af3 README:262-264, internal/rm/rm.go:140-146),
    e.g. ``nvidia.com/mig-3g.71gb``."""
    return "nvidia.com/mig-" + profile.replace("+", ".")


def mig_slice(spec: GpuSpec, profile: str) -> GpuSpec:
    """``spec`` as one MIG instance of ``profile``: memory = the profile's ``memory_mib``; DRAM bandwidth × its memory
    share; tensor-core rates × its SM share; ``interconnect_gbs`` none (a slice has no NVLink peer); ``mig_profile`` set; ``name`` + `` MIG <profile>``.

    Raises:
        UserError: ``spec`` has no MIG profile of that name (one line naming ``target.mig`` and the profiles it has).
    """
    p = spec.mig.get(profile.strip().lower())
    if p is None:
        have = ", ".join(spec.mig) if spec.mig else "none: it has no MIG"
        raise UserError(f"target.mig {profile!r}: not a MIG profile of {spec.key} ({have})")
    scale, mib = p.sm_share, min(p.memory_mib, spec.memory_mib)  # the mock 7g figure can exceed what nvidia-smi reports
    return spec.model_copy(update={
        "memory_mib": mib, "memory_gib": round(mib / 1024, 2), "memory_gb": round(spec.memory_gb * p.memory_share, 1),
        "memory_bandwidth_tbs": spec.memory_bandwidth_tbs * p.memory_share, "bf16_tflops": spec.bf16_tflops * scale,
        "fp8_tflops": None if spec.fp8_tflops is None else spec.fp8_tflops * scale,
        "fp4_tflops": None if spec.fp4_tflops is None else spec.fp4_tflops * scale,
        "int8_tops": None if spec.int8_tops is None else spec.int8_tops * scale,
        "interconnect_gbs": None, "interconnect": None, "mig_profile": profile.strip().lower(),
        "name": f"{spec.name} MIG {profile.strip().lower()}"})


def lookup(name: str) -> GpuSpec | None:
    """The entry whose key or alias equals ``name`` (case-insensitive), or ``None``."""
    wanted = name.strip().lower()
    for spec in catalog().values():
        if wanted == spec.key or wanted in (a.lower() for a in spec.aliases):
            return spec
    return None


def product_name(name: str) -> str:
    """The NVML device name of ``target.gpu`` ``name``: the alias's entry in ``product_names`` (``h200_nvl`` →
    ``NVIDIA H200 NVL``), else the catalog entry's ``name``.

    Raises:
        UserError: ``name`` is not in the catalog.
    """
    spec = lookup(name)
    if spec is None:
        raise UserError(f"target.gpu {name!r}: not in the GPU catalog (pipeline/data/gpus.yaml)")
    wanted = name.strip().lower()
    return next((v for k, v in spec.product_names.items() if k.lower() == wanted), spec.name)


def alias_note(name: str) -> str | None:
    """One line when ``name`` is an alias that picks one of several catalog entries (``h100`` → ``h100_sxm``
    while ``h100_pcie`` exists; ``a100`` → ``a100_80gb``), naming the entry taken and the others; ``None`` for a
    key, an unambiguous alias, or an unknown name."""
    spec = lookup(name)
    wanted = name.strip().lower()
    if spec is None or wanted == spec.key:
        return None
    stem = wanted.replace("-", "_").split("_")[0]
    others = sorted(k for k in catalog() if k != spec.key and k.split("_")[0] == stem)
    if not others:
        return None
    return (f"target.gpu {name!r} is taken as {spec.key} ({spec.name}), its alias in pipeline/data/gpus.yaml; "
            f"write {spec.key} or {', '.join(others)} to say which")


class HostSpec(BaseModel):
    """A host's measured rates for the CPU engine (:func:`cpu_host`).

    Written by ``trtpipe plan measure-host`` (:mod:`pipeline.calibrate.host`): ``read_bandwidth_gbs`` GB/s (10^9 B/s) at which torch Linear
    layers stream a model-sized weight set for one token (what a decode step achieves; ``stream_bandwidth_gbs``
    is the bare ``sum()`` rate, for reference); ``fp32_gflops``/``bf16_gflops`` GFLOP/s of the same Linear
    layers for 64 tokens; ``engine_step_overhead_ms`` / ``engine_seq_overhead_us`` the CPU engine's time per step and per
    sequence in a step at (nearly) zero bytes and FLOPs (a same-depth model of tiny width); ``serving_cpu_per_token_us``
    the CPU time per streamed token of everything else in a served deployment (Triton, the serving models' response
    path, the bench client) on the same cores, measured by serving that tiny model for real. ``sources``:
    how each figure was measured; ``measured``: date, library versions, threads. ``origin`` (not stored in
    the file) says which file the figures came from: this host's measurement or the shipped reference.
    """

    model_config = ConfigDict(extra="forbid", frozen=True)

    name: str
    cpu_model: str
    cores: int
    memory_gib: float
    measured: str
    read_bandwidth_gbs: float
    stream_bandwidth_gbs: float | None = None
    fp32_gflops: float
    bf16_gflops: float | None = None
    engine_step_overhead_ms: float
    engine_seq_overhead_us: float
    #: CPU time (µs) the rest of a served deployment spends per streamed token on the same cores: Triton, the serving
    #: models' response path and the ``trtpipe bench`` client (None: not measured, the prediction is the bare engine's)
    serving_cpu_per_token_us: float | None = None
    sources: dict[str, str]
    origin: str = Field(default="", exclude=True, description="Where these figures came from (set on load).")

    def gemm_flops(self, dtype_bytes: int) -> float:
        """FLOP/s of the CPU engine's GEMMs in its compute dtype (4: fp32, 2: bf16 when measured)."""
        rate = self.bf16_gflops if dtype_bytes == 2 and self.bf16_gflops else self.fp32_gflops
        return rate * 1e9

    @property
    def link_bytes_per_s(self) -> float | None:
        """GPU-to-GPU bandwidth in one direction, bytes/s: interconnect_gbs / 2 × 10^9 (datasheets quote both
        directions together: H100 SXM NVLink 900 GB/s = 450 GB/s each way). None when the catalog has no figure."""
        return None if self.interconnect_gbs is None else self.interconnect_gbs / 2 * 1e9

    @property
    def bandwidth_bytes_per_s(self) -> float:
        """Measured read bandwidth in bytes/s."""
        return self.read_bandwidth_gbs * 1e9


def host_file() -> Path:
    """Where this host's measured rates live: ``$TRTPIPE_HOST_FILE``, else ``cpu_host.yaml`` in trtpipe's cache
    (:func:`pipeline.core.artifacts.cache_dir`: ``$TRTPIPE_CACHE_DIR``, else ``$XDG_CACHE_HOME/trtpipe``, default
    ``~/.cache/trtpipe``). ``trtpipe plan measure-host`` writes it; :func:`cpu_host` reads it when it exists."""
    env = os.environ.get(HOST_FILE_ENV)
    if env:
        return Path(env).expanduser()
    from pipeline.core.artifacts import cache_dir

    return cache_dir() / "cpu_host.yaml"


def cpu_host() -> HostSpec:
    """The host rates the planner predicts the cpu target with: this host's (:func:`host_file`, written by
    ``trtpipe plan measure-host``) when that file exists, else the reference host's shipped in
    ``pipeline/data/cpu_host.yaml`` (measured on a 2-core AVX-512 VM). ``origin`` names the one used.

    Raises:
        UserError: the user's file exists but is not a valid host measurement (rerun measure-host or delete it).
    """
    path = host_file()
    try:
        st = path.stat()
    except OSError:
        return _shipped_host()
    return _user_host(str(path), st.st_mtime_ns, st.st_size)


@functools.cache
def _shipped_host() -> HostSpec:
    raw = yaml.safe_load(resources.files("pipeline").joinpath(SHIPPED_HOST_FILE).read_text())
    return HostSpec(**raw, origin="the shipped reference host's rates (pipeline/data/cpu_host.yaml): run "
                                  "`trtpipe plan measure-host` to measure this host")


@functools.lru_cache(maxsize=4)
def _user_host(path: str, mtime_ns: int, size: int) -> HostSpec:
    """This host's file, parsed once per (path, modification time, size)."""
    try:
        raw = yaml.safe_load(Path(path).read_text())
        origin = f"this host's measured rates ({path}, from `trtpipe plan measure-host`)"
        if raw.get("serving_cpu_per_token_us") is None:  # a file from before the served probe (or --no-served)
            origin += (" without the served deployment's CPU per token: the prediction is the bare engine's and "
                       "over-predicts a served deployment's tok/s (+65 % at 16 streams on the reference host); rerun "
                       "`trtpipe plan measure-host`")
        return HostSpec(**raw, origin=origin)
    except (OSError, yaml.YAMLError, TypeError, AttributeError, ValidationError) as e:
        first = str(e).splitlines()[0]
        raise UserError(f"{path}: not a host measurement ({first}): rerun `trtpipe plan measure-host` or delete it") from None


def write_host(host: HostSpec, path: Path, header: str = "") -> Path:
    """Write ``host`` (without ``origin``) as YAML to ``path`` (parents created), ``header`` (comment lines)
    first; returns ``path``. Written through a temporary file and renamed, so a reader never sees half a file."""
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.tmp-{os.getpid()}")
    tmp.write_text(header + yaml.safe_dump(host.model_dump(), sort_keys=False, allow_unicode=True, width=120))
    tmp.replace(path)
    return path
