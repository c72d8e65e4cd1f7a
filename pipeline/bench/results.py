"""What a benchmark run produced, typed: :class:`LoadPoint` (with its :class:`Summary`) and :class:`BenchResult`.

A load point is one scenario (ISL:OSL) at one load (concurrency or request rate). The run fills it as it
measures (:mod:`pipeline.bench.run`); :func:`pipeline.bench.metrics.summarize` adds its :class:`Summary`
after the run; :meth:`LoadPoint.to_json` is its ``bench.json`` form (the exporters write it).
:func:`check_outcome` turns a finished run's failures into errors.
"""

from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import Any

from pipeline.bench.records import RequestRecord
from pipeline.core.errors import StageError, UserError
from pipeline.core.layout import BuildLayout
from pipeline.recipe.bench import BenchSpec

#: the run document's file name in a run directory
BENCH_JSON = "bench.json"


@dataclasses.dataclass(frozen=True)
class Counts:
    """Request and token counts of one load point (measured requests only; tokens of completed ones)."""

    requests: int
    completed: int
    failed: int
    short: int
    good: int | None  # meeting every goodput SLO; None without SLOs
    input_tokens: int
    output_tokens: int
    osl_mismatch: int


@dataclasses.dataclass(frozen=True)
class OslCheck:
    """Output-token counts by method (``client``/``server``/``retokenized``) and the requests where they disagree:
    ``mismatch`` of them, ``mismatch_pct`` (%, ``None`` without finished requests), up to five ``examples``."""

    methods: list[str]
    mismatch: int
    mismatch_pct: float | None
    examples: list[dict[str, Any]]


@dataclasses.dataclass(frozen=True)
class Summary:
    """All metrics of one load point: ``duration_s`` (s, first measured start → last measured response) and
    ``metrics`` by tag (a :class:`~pipeline.bench.stats.Stats` dict for distributions, else one number or ``None``)."""

    counts: Counts
    duration_s: float
    metrics: dict[str, Any]
    osl_check: OslCheck
    speculative: dict[str, Any] | None = None  # only when the model returned speculative-decoding counters
    images: dict[str, Any] | None = None  # only for image workloads (pipeline.bench.images.image_summary)
    prefix_cache: dict[str, Any] | None = None  # only when the server reported cached prompt tokens (metrics.prefix_cache)

    def stat(self, tag: str, stat: str = "avg") -> float | None:
        """One statistic of a distribution metric (e.g. ``stat("time_to_first_token", "p99")``, in its unit)."""
        return self.metrics[tag][stat]

    def to_json(self) -> dict[str, Any]:
        """The ``summary`` block of a load point in ``bench.json``."""
        out = {"counts": dataclasses.asdict(self.counts), "duration_s": self.duration_s, "metrics": self.metrics,
               "osl_check": dataclasses.asdict(self.osl_check)}
        out |= {"speculative": self.speculative} if self.speculative is not None else {}
        out |= {"prefix_cache": self.prefix_cache} if self.prefix_cache is not None else {}
        return out | ({"images": self.images} if self.images is not None else {})


@dataclasses.dataclass
class LoadPoint:
    """One scenario × load point as measured: ``mode`` is ``concurrency``, ``constant`` or ``poisson``; ``load`` its
    label (``c8``, ``r2.5``); ``concurrency`` or ``request_rate`` (requests/s) the load; ``requests_sent`` the measured
    requests started; ``client_cpu_s``/``wall_s`` the client's CPU and wall time of the measured phase (s);
    ``server_metrics`` Triton's Prometheus deltas when scraped; ``telemetry`` the device (NVML) or server-process
    telemetry of the measured phase (:mod:`pipeline.bench.telemetry`); ``summary`` filled after the run."""

    scenario: str
    isl: int
    osl: int
    mode: str
    load: str
    concurrency: int | None = None
    request_rate: float | None = None
    requests_sent: int = 0
    client_cpu_s: float = 0.0
    wall_s: float = 0.0
    client_cpu_fraction: float = 0.0
    server_metrics: dict[str, Any] | None = None
    telemetry: dict[str, Any] | None = None  # device/process telemetry of the measured phase (pipeline.bench.telemetry)
    summary: Summary | None = None

    @property
    def load_value(self) -> float:
        """The load as a number: concurrency, or requests/s."""
        return float(self.concurrency if self.concurrency is not None else self.request_rate or 0.0)

    def records(self, records: list[RequestRecord]) -> list[RequestRecord]:
        """The records of this load point (warmup ones included)."""
        return [r for r in records if r.scenario == self.scenario and r.load == self.load]

    def to_json(self) -> dict[str, Any]:
        """The load point as ``bench.json`` stores it (``server_metrics``/``summary`` only when present)."""
        out = {f.name: getattr(self, f.name) for f in dataclasses.fields(self) if f.name not in ("server_metrics", "telemetry", "summary")}
        if self.server_metrics is not None:
            out["server_metrics"] = self.server_metrics
        if self.telemetry is not None:
            out["telemetry"] = self.telemetry
        if self.summary is not None:
            out["summary"] = self.summary.to_json()
        return out


@dataclasses.dataclass
class BenchResult:
    """One benchmark run, filled as it goes; exported even when the run stops early.

    ``spec`` is the bench section it ran; ``url``/``layout`` what it ran against; ``run_dir`` where
    :mod:`pipeline.bench.exporters` wrote it (bench.json = :func:`pipeline.bench.exporters.run_document`).
    ``t0_ns`` (``perf_counter_ns``) and ``t0_epoch_ns`` (``time_ns``) are the run start on both clocks.
    """

    spec: BenchSpec
    started_at: str
    t0_ns: int
    t0_epoch_ns: int = 0
    info: Any = None  # the model's client.ModelInfo
    tokenizer_path: str | None = None
    records: list[RequestRecord] = dataclasses.field(default_factory=list)
    load_points: list[LoadPoint] = dataclasses.field(default_factory=list)
    interrupted: bool = False
    aborted: str | None = None
    warnings: list[str] = dataclasses.field(default_factory=list)
    notes: list[str] = dataclasses.field(default_factory=list)
    url: str = ""
    layout: BuildLayout | None = None
    run_dir: Path | None = None
    gpus: int | None = None
    metrics_url: str | None = None
    api: Any = None  # the apis.Api it spoke
    image_plan: Any = None  # the images.ImagePlan of an image workload, else None
    probe: Any = None  # the telemetry.Probe sampled during each load point (None: no telemetry)

    @property
    def osl_forced(self) -> bool:
        """Exact OSL was asked for: the model declares ``min_tokens`` (``sampling_param_min_tokens`` on trtpipe's
        LLM-API model), sent as OSL."""
        return self.info is not None and bool({"min_tokens", "sampling_param_min_tokens"} & set(self.info.inputs))

    @property
    def scenarios(self) -> list[tuple[int, int]]:
        """``[(isl, osl)]`` of the spec, in tokens."""
        return [(s.isl, s.osl) for s in self.spec.scenarios]

    def total(self, count: str) -> int:
        """A count (a :class:`Counts` field, e.g. ``short``) summed over the summarized load points."""
        return sum(getattr(p.summary.counts, count) or 0 for p in self.load_points if p.summary is not None)

    @staticmethod
    def read(run_dir: Path) -> dict[str, Any]:
        """The ``bench.json`` document of a finished run directory (for comparisons and sweeps).

        Raises:
            UserError: ``run_dir`` holds no readable bench.json.
        """
        import json

        try:
            return json.loads((Path(run_dir) / BENCH_JSON).read_text())
        except (OSError, ValueError):
            raise UserError(f"{run_dir}: not a bench run directory (no {BENCH_JSON}, or it is not readable JSON)") from None


def check_outcome(run: BenchResult, out: Path | None = None) -> None:
    """Raise for a run that did not complete cleanly (call after showing the results).

    Raises:
        KeyboardInterrupt: the run was stopped with Ctrl-C (exit 130).
        StageError: the server went away, or measured requests failed, or requests stopped short of a
            forced OSL without ``allow_short`` (exit 1).
    """
    out = out or run.run_dir
    if run.interrupted:
        raise KeyboardInterrupt
    if run.aborted:
        raise StageError(f"{run.aborted}; partial results in {out}")
    failed = run.total("failed")
    if failed:
        first = next((r.error for r in run.records if r.error and not r.warmup), "?") or "?"
        if failed == run.total("requests"):
            raise StageError(f"{failed} request(s) failed — every measured one, no results (first: {first}); the "
                             f"requests and their errors are in {out}")
        raise StageError(f"{failed} request(s) failed (first: {first}); results in {out}")
    if run.osl_forced and not run.spec.allow_short:
        short = [r for r in run.records if not r.warmup and r.short]
        if short:
            raise StageError(f"{short_summary(short)}; results in {out} (--allow-short accepts this)")


def short_summary(short: list[RequestRecord], shown: int = 5) -> str:
    """One line naming short requests (``scenario load #index got/requested``) and by how many tokens."""
    worst = max(r.requested_tokens - r.output_tokens for r in short)
    named = ", ".join(f"{r.scenario} {r.load} #{r.index}: {r.output_tokens}/{r.requested_tokens} (−{r.requested_tokens - r.output_tokens})"
                      for r in short[:shown])
    more = f", … {len(short) - shown} more" if len(short) > shown else ""
    return (f"{len(short)} request(s) stopped short of the forced OSL (min_tokens), up to {worst} token(s) short: "
            f"{named}{more}")
