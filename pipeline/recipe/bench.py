"""``bench`` section: ISL/OSL scenarios and load points for ``trtpipe bench``."""

from __future__ import annotations

from typing import Literal

from pydantic import Field

from pipeline.recipe.base import StrictModel


class ScenarioSpec(StrictModel):
    """One input/output sequence-length pair, in tokens."""

    isl: int = Field(ge=1, description="Input sequence length: prompt tokens per request (exact).")
    osl: int = Field(
        ge=1,
        description=(
            "Output sequence length: generated tokens per request (exact via min_tokens = OSL on the TensorRT-LLM and "
            "CPU interfaces; the LLM-API model has no min_tokens input, so short requests are reported there)."
        ),
    )


class BenchSpec(StrictModel):
    """Default benchmark of the deployment; every field can be overridden by a ``trtpipe bench`` flag."""

    model: Literal["ensemble", "tensorrt_llm", "tensorrt_llm_bls"] = Field(
        default="ensemble", description=(
            "Triton model: `ensemble`/`tensorrt_llm_bls` (text) or `tensorrt_llm` (token ids; with build.engine "
            "pytorch it is the LLM-API text model)."
        )
    )
    scenarios: list[ScenarioSpec] = Field(
        default_factory=lambda: [ScenarioSpec(isl=100, osl=2000)], min_length=1, description="ISL/OSL pairs."
    )
    concurrency: list[int] = Field(
        default_factory=lambda: [1, 8, 64, 256], min_length=1, description="Closed-loop load points: requests always in flight."
    )
    request_rate: list[float] | None = Field(
        default=None, description="Open-loop load points in requests/s (instead of concurrency)."
    )
    arrival: Literal["poisson", "constant"] = Field(default="poisson", description="Inter-arrival distribution for request_rate.")
    num_requests: int | None = Field(
        default=None,
        ge=1,
        description="Measured requests per load point (default: max(requests_per_load × load, min_requests)).",
    )
    requests_per_load: float = Field(
        default=4.0, gt=0, description="Default measured requests per unit of load (concurrency, or requests/s)."
    )
    min_requests: int = Field(default=16, ge=1, description="Fewest measured requests of a load point by default.")
    warmup_requests: int = Field(default=2, ge=0, description="Requests sent first and excluded from statistics.")
    request_timeout_s: float = Field(default=600.0, gt=0, description="Per-request timeout in seconds.")
    goodput: dict[Literal["ttft", "itl", "tpot", "e2e"], float] = Field(
        default_factory=dict, description="SLOs in ms for goodput, e.g. {ttft: 200, itl: 20}."
    )
    seed: int = Field(default=0, description="Seed of the synthetic prompts.")
