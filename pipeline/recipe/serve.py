"""``serving`` section: Triton model-repository parameters (names as tensorrtllm_backend spells them)."""

from __future__ import annotations

from typing import Literal

from pydantic import Field

from pipeline.recipe.base import StrictModel
from pipeline.recipe.bounds import INT32_MAX, INT64_MAX, MAX_INSTANCES


class ServingSpec(StrictModel):
    """Parameters of the generated Triton model repository (docs/model_config.md of tensorrtllm_backend)."""

    frontend: Literal["triton", "trtllm-serve"] = Field(
        default="triton",
        description=(
            "Serving frontend. triton (default): the generated Triton model repository; trtllm-serve: TensorRT-LLM's "
            "OpenAI-compatible server on the unified HF checkpoint with the generated extra-options YAML "
            "(build.engine: pytorch; on the cpu target trtpipe's trtllm-serve-shaped OpenAI server over the CPU engine "
            "serves it; docs/llm-api.md)."
        ),
    )
    triton_max_batch_size: int | None = Field(
        default=None, ge=1, le=INT32_MAX, description="Triton max_batch_size of every model (default: build.max_batch_size, as triton_cli does; int32 in model_config.proto)."
    )
    decoupled_mode: bool = Field(default=True, description="Decoupled transaction policy: required for streaming (default true).")
    batching_strategy: Literal["inflight_fused_batching"] = Field(
        default="inflight_fused_batching", description="gpt_model_type (V1 static batching was removed in TensorRT-LLM 1.x)."
    )
    max_queue_delay_microseconds: int = Field(default=0, ge=0, le=INT64_MAX, description="Dynamic-batching queue delay (default 0; uint64 in model_config.proto).")
    max_queue_size: int = Field(default=0, ge=0, le=INT32_MAX, description=(
        "Dynamic-batching queue size, 0 = unbounded (default 0; int32 in model_config.proto). The tensorrt_llm model "
        "(C++ backend: the executor's max_queue_size; CPU engine: the same) also bounds with it the requests waiting for "
        "a batch slot: one more fails at once with 'Maximum queue size of N has been reached' (UNAVAILABLE)."))
    exclude_input_in_output: bool = Field(
        default=True, description="Return only generated tokens (backend default false; triton_cli and trtpipe use true)."
    )
    preprocessing_instance_count: int = Field(default=1, ge=1, le=MAX_INSTANCES, description="Instances of the preprocessing model (each a process: checked against the CPU cores at validate time).")
    postprocessing_instance_count: int = Field(
        default=1,
        ge=1,
        le=MAX_INSTANCES,
        description=(
            "Instances of the postprocessing model (kept at 1 when decoupled_mode is on: it holds each stream's "
            "incremental detokenizer; its dynamic batching keeps throughput)."
        ),
    )
    bls_instance_count: int = Field(default=1, ge=1, le=MAX_INSTANCES, description="Instances of the tensorrt_llm_bls model (each a process: checked against the CPU cores at validate time).")
    accumulate_tokens: bool = Field(
        default=True, description="BLS streaming detokenizes all accumulated tokens (correct spaces and multi-byte UTF-8)."
    )
    add_special_tokens: bool = Field(default=True, description="Preprocessing tokenizer add_special_tokens.")
    skip_special_tokens: bool = Field(default=True, description="Postprocessing tokenizer skip_special_tokens.")
    cancellation_check_period_ms: int = Field(default=100, ge=1, le=INT32_MAX, description="tensorrt_llm cancellation check period (default 100; std::stoi).")
    stats_check_period_ms: int = Field(default=100, ge=1, le=INT32_MAX, description="tensorrt_llm stats check period (default 100; std::stoi).")
