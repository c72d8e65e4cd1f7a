"""``bench`` section: ISL/OSL scenarios and load points for ``trtpipe bench``."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated, Literal

from pydantic import Field

from pipeline.recipe.base import StrictModel
from pipeline.recipe.bounds import INT32_MAX, MAX_CONCURRENCY, MAX_DURATION_S, MAX_REQUESTS, MAX_TIMEOUT_S, SEED_MAX


class ScenarioSpec(StrictModel):
    """One input/output sequence-length pair, in tokens."""

    isl: int = Field(ge=1, le=INT32_MAX, description="Input sequence length: prompt tokens per request (exact; at most build.max_input_len).")
    osl: int = Field(
        ge=1,
        le=INT32_MAX,
        description=(
            "Output sequence length: generated tokens per request (exact via min_tokens = OSL on the TensorRT-LLM and "
            "CPU interfaces; the LLM-API model has no min_tokens input, so short requests are reported there)."
        ),
    )


class BenchSpec(StrictModel):
    """Default benchmark of the deployment; every field can be overridden by a ``trtpipe bench`` flag."""

    model: str = Field(
        default="ensemble", min_length=1, description=(
            "Triton model to load: `ensemble`/`tensorrt_llm_bls` (text) or `tensorrt_llm` (token ids; with build.engine "
            "pytorch it is the LLM-API text model); any other decoupled model with one of these interfaces works too."
        )
    )
    scenarios: list[ScenarioSpec] = Field(
        default_factory=lambda: [ScenarioSpec(isl=100, osl=2000)], min_length=1, description="ISL/OSL pairs."
    )
    concurrency: list[Annotated[int, Field(ge=1, le=MAX_CONCURRENCY)]] = Field(
        default_factory=lambda: [1, 8, 64, 256], min_length=1, description="Closed-loop load points: requests always in flight."
    )
    request_rate: list[Annotated[float, Field(gt=0, le=1e6, allow_inf_nan=False)]] | None = Field(
        default=None, description="Open-loop load points in requests/s (instead of concurrency)."
    )
    arrival: Literal["poisson", "constant"] = Field(default="poisson", description="Inter-arrival distribution for request_rate.")
    num_requests: int | None = Field(
        default=None,
        ge=1,
        le=MAX_REQUESTS,
        description="Measured requests per load point (default: max(requests_per_load × load, min_requests)).",
    )
    requests_per_load: float = Field(
        default=4.0, gt=0, le=1e4, allow_inf_nan=False, description="Default measured requests per unit of load (concurrency, or requests/s)."
    )
    min_requests: int = Field(default=16, ge=1, le=MAX_REQUESTS, description="Fewest measured requests of a load point by default.")
    warmup_requests: int = Field(default=2, ge=0, le=MAX_REQUESTS, description="Requests sent first and excluded from statistics.")
    request_timeout_s: float = Field(default=600.0, gt=0, le=MAX_TIMEOUT_S, allow_inf_nan=False, description="Per-request timeout in seconds (at most a day).")
    goodput: dict[Literal["ttft", "itl", "tpot", "e2e"], Annotated[float, Field(gt=0, le=MAX_TIMEOUT_S * 1000, allow_inf_nan=False)]] = Field(
        default_factory=dict, description="SLOs in ms for goodput, e.g. {ttft: 200, itl: 20}."
    )
    seed: int = Field(default=0, ge=0, le=SEED_MAX, description="Seed in [0, 2^32) of the synthetic prompts and of Poisson arrivals.")
    duration_s: float | None = Field(
        default=None, gt=0, le=MAX_DURATION_S, allow_inf_nan=False,
        description="Measure each load point for this many seconds instead of a request count (at most a week)."
    )
    dataset: Path | None = Field(
        default=None, description=(
            "JSONL prompts (text/prompt/input_ids) instead of synthetic ones; the scenario ISL is then only a label "
            "(each request records its own input tokens)."
        ),
    )
    allow_short: bool = Field(
        default=False, description=(
            "Accept requests that return fewer than OSL tokens although exact OSL was forced (min_tokens): by default "
            "such a run fails, naming the requests and how short they were."
        ),
    )
    server_timestamps: bool = Field(
        default=False, description="Also ask the server for its per-request perf timestamps (return_perf_metrics)."
    )

    # ------------------------------------------------------------------ derived values
    def load_points(self) -> list[tuple[str, float]]:
        """``[(mode, value)]``: ``("concurrency", c)`` per concurrency, or ``(arrival, rate)`` per request
        rate when ``request_rate`` is set (rates in requests/s)."""
        if self.request_rate:
            return [(self.arrival, float(r)) for r in self.request_rate]
        return [("concurrency", float(c)) for c in self.concurrency]

    def requests_for(self, value: float) -> int:
        """Measured requests of one load point (concurrency or rate ``value``):
        ``num_requests``, else ``max(requests_per_load × value, min_requests)``."""
        if self.num_requests is not None:
            return self.num_requests
        return max(int(self.requests_per_load * value), self.min_requests)
