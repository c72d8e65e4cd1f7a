"""What ``trtpipe plan`` computes, as data: :class:`PlanResult` (``--json`` is its ``model_dump_json()``) with its
:class:`MemoryPlan`, one :class:`ScenarioPlan` per ISL/OSL pair (with :class:`ThroughputPoint` rooflines) and the
:class:`FitVerdict` that ``trtpipe build`` checks. Units: bytes (GiB = 2^30 B), tokens, ms, tokens/s, TFLOP/s, TB/s.
"""

from __future__ import annotations

from typing import Literal

from pydantic import BaseModel, Field

from pipeline.core.geometry import ModelGeometry
from pipeline.plan.achievable import Prediction, SchedulerLimits, SloAnswer
from pipeline.plan.memory import WeightBytes
from pipeline.plan.speculative import SpecPlan
from pipeline.plan.step import Efficiency, StepCost
from pipeline.plan.vision import VisionMemory
from pipeline.plan.vision_tokens import VisionTokens


class FitVerdict(BaseModel):
    """Whether a recipe fits its target. ``errors`` refuse the build; ``warnings`` leave capacity unused."""

    ok: bool
    errors: list[str] = Field(default_factory=list)
    warnings: list[str] = Field(default_factory=list)


class ThroughputPoint(BaseModel):
    """Roofline at one concurrency: decode-only and prefill-inclusive output tokens/s, step in ms."""

    batch: int
    step_ms: float
    decode_tokens_per_s: float
    output_tokens_per_s: float
    bound: Literal["memory", "compute"]
    predicted_output_tokens_per_s: float | None = None


class ScenarioPlan(BaseModel):
    """One ISL/OSL pair: how many sequences fit, and the throughput bound vs batch size."""

    isl: int
    osl: int
    image_tokens: int = Field(default=0, description="Decoder tokens of the request's images (a vision family that splices "
                                                     "them into the prompt, e.g. Qwen2-VL); the KV, prefill and limits count "
                                                     "isl + image_tokens.")
    blocks_per_sequence: int
    kv_max_sequences: int | None = Field(description="Sequences of ISL+OSL tokens the KV cache holds at once (None: not sized).")
    max_concurrency: int = Field(description="min(kv_max_sequences, max_batch_size, max_num_tokens).")
    concurrency_limited_by: Literal["kv_cache", "max_batch_size", "max_num_tokens"]
    prefill_ms: float | None = None
    crossover_batch: float | None = Field(default=None, description="Batch where decode turns compute-bound (None: never).")
    saturation_batch: int | None = None
    saturated_by: Literal["compute", "kv_cache", "max_batch_size", "max_num_tokens"] | None = None
    peak_output_tokens_per_s: float | None = None
    curve: list[ThroughputPoint] = Field(default_factory=list)
    predicted: Prediction | None = Field(default=None, description="Achievable-throughput prediction at maximum load.")
    predicted_by_concurrency: list[Prediction] = Field(default_factory=list, description="Predictions at the bench concurrencies.")
    knee_batch: int | None = Field(default=None, description="Smallest concurrency predicted to reach 90 % of the max-load "
                                                             "output tokens/s: a starting max_batch_size.")
    within_slo: SloAnswer | None = Field(default=None, description="With an SLO (trtpipe plan --slo): the largest concurrency "
                                                                   "predicted to meet it, and what stops it.")


class MemoryPlan(BaseModel):
    """Per-GPU memory budget (bytes; GiB = 2^30 B). For the cpu target: host memory."""

    device: str
    total_bytes: int
    weights: WeightBytes
    activation_bytes: int
    overhead_bytes: int
    free_bytes: int = Field(description="total − weights − activations − overhead (what the KV fraction applies to).")
    kv_fraction: float
    kv_max_tokens_setting: int | None
    kv_token_bytes: int
    kv_tokens: int
    kv_pool_bytes: int
    kv_tokens_by_fraction: int | None = None
    kv_limited_by: Literal["fraction", "max_tokens", "max_batch_size"]
    unused_bytes: int = Field(description="Device memory left after weights, reserve and the KV pool.")
    tokens_per_block: int
    max_seq_len: int
    full_sequences_at_max_seq_len: int
    vision: VisionMemory | None = Field(default=None, description="Vision-language terms (recipe vision section): encoder "
                                        "weights, multimodal pool, the cross-attention share of the KV pool.")


class PlanResult(BaseModel):
    """Everything ``trtpipe plan`` shows; ``model_dump_json()`` is the ``--json`` output."""

    recipe: str
    model_source: str
    target: str
    gpu_name: str
    engine: str
    qformat: str
    kv_cache_dtype: str
    tp_size: int
    pp_size: int
    compute_dtype: str
    peak_tflops: float | None
    bandwidth_tbs: float | None
    geometry: ModelGeometry
    memory: MemoryPlan
    scenarios: list[ScenarioPlan]
    verdict: FitVerdict
    notes: list[str] = Field(default_factory=list)
    step_cost: StepCost | None = Field(default=None, description="Inputs of the achievable-throughput model (per GPU).")
    scheduler: SchedulerLimits | None = None
    efficiency: Efficiency | None = None
    error_terms: dict[str, float] = Field(default_factory=dict, description="Uncalibrated conditions and their relative error.")
    vision_tokens: VisionTokens | None = Field(default=None, description="Image tokens per request and the vision tower "
                                               "(a vision family whose images become decoder tokens: Qwen2-VL).")
    speculative: SpecPlan | None = Field(default=None, description="Speculative decoding (build.pytorch.speculative_config): "
                                         "the draft's memory and the predicted speed-up for an acceptance length.")
