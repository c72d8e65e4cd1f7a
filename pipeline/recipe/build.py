"""``build`` section: engine kind, TensorRT-LLM BuildConfig, KV-cache and scheduler knobs.

Every knob carries the TensorRT-LLM 1.2.1 name (``trtllm-build`` flag / ``BuildConfig`` field /
LLM-API ``KvCacheConfig`` / ``SchedulerConfig``) and is passed explicitly to the tool, because
defaults changed between TensorRT-LLM versions (e.g. tokens_per_block 64 → 32,
use_paged_context_fmha False → True). The Triton parameter names
(``kv_cache_free_gpu_mem_fraction``, ``max_tokens_in_paged_kv_cache``, …) appear only in
:mod:`pipeline.triton_repo.stage`, the single translation point.
"""

from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import Field, field_validator, model_validator

from pipeline.recipe.base import StrictModel
from pipeline.recipe.bounds import INT32_MAX, INT64_MAX, MAX_INSTANCES, is_power_of_two
from pipeline.recipe.lora import LoraSpec
from pipeline.recipe.moe import MoeSpec
from pipeline.recipe.speculative import SpeculativeSpec

PluginDtype = Literal["auto", "float16", "float32", "bfloat16", "int32", "disable"]
GemmPluginDtype = Literal["auto", "float16", "float32", "bfloat16", "int32", "fp8", "nvfp4", "disable"]


class PluginSpec(StrictModel):
    """trtllm-build plugin/feature flags (PluginConfig). Defaults = TensorRT-LLM 1.2.1 PluginConfig."""

    gpt_attention_plugin: PluginDtype = Field(default="auto", description="--gpt_attention_plugin (1.2.1 default auto).")
    gemm_plugin: GemmPluginDtype = Field(
        default="disable", description="--gemm_plugin for non-quantized GEMMs and FP8 (1.2.1 default None = disable)."
    )
    context_fmha: bool = Field(default=True, description="--context_fmha (1.2.1 default enable).")
    remove_input_padding: bool = Field(default=True, description="--remove_input_padding (1.2.1 default enable).")
    use_paged_context_fmha: bool = Field(
        default=True,
        description="--use_paged_context_fmha: needed for KV-cache reuse and chunked context (1.2.1 default enable; older: disable).",
    )
    use_fp8_context_fmha: bool = Field(
        default=True, description="--use_fp8_context_fmha, effective with FP8 quantization (1.2.1 default enable; older: disable)."
    )
    multiple_profiles: bool = Field(default=False, description="--multiple_profiles (1.2.1 default disable).")
    use_fused_mlp: bool = Field(default=True, description="--use_fused_mlp (1.2.1 default enable).")
    reduce_fusion: bool = Field(default=False, description="--reduce_fusion (1.2.1 default disable).")
    norm_quant_fusion: bool = Field(default=False, description="--norm_quant_fusion (1.2.1 default disable).")


class KvCacheSpec(StrictModel):
    """Runtime paged KV cache (LLM-API ``KvCacheConfig`` names; TensorRT-LLM 1.2.1 defaults)."""

    free_gpu_memory_fraction: float = Field(
        default=0.9, gt=0.0, le=1.0, description="Share of free GPU memory after weights given to the KV cache (default 0.9)."
    )
    max_tokens: int | None = Field(
        default=None, ge=1, le=INT32_MAX, description="Cap on KV-cache tokens; the smaller of this and the fraction wins (default None)."
    )
    enable_block_reuse: bool = Field(
        default=True, description="Reuse KV blocks across requests with a common prefix (LLM-API default True)."
    )
    max_attention_window: int | None = Field(
        default=None, ge=1, le=INT32_MAX, description="Sliding attention window in tokens (default None = max_seq_len)."
    )
    host_cache_size: int | None = Field(default=None, ge=0, le=INT64_MAX, description="Bytes of host memory for offloaded KV blocks (uint64).")


class SchedulerSpec(StrictModel):
    """In-flight batching scheduler (LLM-API ``SchedulerConfig``; TensorRT-LLM 1.2.1 defaults)."""

    capacity_scheduler_policy: Literal["GUARANTEED_NO_EVICT", "MAX_UTILIZATION"] = Field(
        default="GUARANTEED_NO_EVICT",
        description="How requests are admitted against KV capacity (default GUARANTEED_NO_EVICT; STATIC_BATCH is not in-flight batching).",
    )
    context_chunking_policy: Literal["FIRST_COME_FIRST_SERVED", "EQUAL_PROGRESS"] | None = Field(
        default=None, description="How chunked prefill is shared out (default None)."
    )


class CpuEngineSpec(StrictModel):
    """The CPU engine (this machine, CI, the README demo): in-flight batching on a paged KV cache."""

    dtype: Literal["float32", "bfloat16"] = Field(
        default="float32",
        description=(
            "CPU engine weights, GEMMs and KV cache (residual stream, norms, attention's arithmetic and logits stay "
            "float32). float32 (default): greedy output equals transformers generate(); bfloat16: half the weight "
            "bytes per step and half the KV bytes per token, faster where the CPU has AVX512_BF16 or AMX, not "
            "token-identical: gate it with trtpipe eval."
        ),
    )
    num_threads: int | None = Field(default=None, ge=1, le=MAX_INSTANCES, description="torch threads, kept as given (default: all cores, one fewer per core other processes keep busy, re-counted while it runs).")
    detokenize: Literal["engine", "postprocessing"] = Field(
        default="engine",
        description=(
            "Where the ensemble's streamed text is decoded. engine (default): the CPU tensorrt_llm model also "
            "outputs text_output (incremental per request) and the ensemble is preprocessing → tensorrt_llm, one "
            "python-backend round trip less per streamed token; postprocessing: the TensorRT-LLM layout's three "
            "steps, as the GPU ensemble runs them. The ensemble's inputs and outputs are the same either way."
        ),
    )


class CudaGraphSpec(StrictModel):
    """LLM-API ``CudaGraphConfig`` (PyTorch backend; TensorRT-LLM 1.2.1 defaults, pipeline/data/trtllm_1.2.1_llmapi_contract.yaml)."""

    enable_padding: bool = Field(
        default=False,
        description="Round a decode batch up to the next captured batch size (upstream default false; NVIDIA's published PyTorch-backend numbers use true).",
    )
    batch_sizes: list[int] | None = Field(
        default=None, max_length=4096,
        description="Decode batch sizes to capture a CUDA graph for (default None: generated from max_batch_size, or up to 128 when that is 0).",
    )
    max_batch_size: int = Field(
        default=0, ge=0, le=INT32_MAX, description="Largest captured batch (default 0 = max(batch_sizes), or 128 with no batch_sizes); with batch_sizes it must equal their max."
    )

    @field_validator("batch_sizes")
    @classmethod
    def _positive(cls, v: list[int] | None) -> list[int] | None:
        bad = [b for b in v or () if not 1 <= b <= INT32_MAX]
        if bad:
            raise ValueError(f"batch sizes {bad} are outside 1..{INT32_MAX}")
        return v

    @model_validator(mode="after")
    def _max_matches(self) -> CudaGraphSpec:
        if self.batch_sizes and self.max_batch_size and self.max_batch_size != max(self.batch_sizes):
            raise ValueError(f"max_batch_size {self.max_batch_size} must equal max(batch_sizes) {max(self.batch_sizes)} (or be 0)")
        return self


class PytorchSpec(StrictModel):
    """PyTorch-backend (``TorchLlmArgs``) knobs, named as the LLM API names them; ``build.engine: pytorch`` only.

    Defaults are TensorRT-LLM 1.2.1's (pipeline/data/trtllm_1.2.1_llmapi_contract.yaml cites each)."""

    cuda_graph_config: CudaGraphSpec | None = Field(
        default_factory=CudaGraphSpec,
        description="CUDA graphs for decode-only batches (upstream default: a CudaGraphConfig; null turns CUDA graphs off). Each graph can take up to ~200 MB.",
    )
    disable_overlap_scheduler: bool = Field(default=False, description="Turn off the overlap scheduler, which prepares step n+1 while step n runs (default false).")
    attn_backend: str = Field(default="TRTLLM", min_length=1, max_length=64, pattern=r"^[A-Za-z_]+$", description="Attention backend (upstream type str, default TRTLLM).")
    sampler_type: Literal["TRTLLMSampler", "TorchSampler", "auto"] = Field(default="auto", description="Sampler (default auto: TorchSampler unless beam search).")
    stream_interval: int = Field(default=1, ge=1, le=INT32_MAX, description="Iterations between streamed responses (default 1; larger cuts streaming overhead at large batch).")
    enable_iter_perf_stats: bool = Field(default=False, description="Per-iteration performance statistics (default false).")
    enable_iter_req_stats: bool = Field(default=False, description="Per-request statistics per iteration (default false; needs enable_iter_perf_stats).")
    print_iter_log: bool = Field(default=False, description="Log every iteration (default false).")
    return_perf_metrics: bool = Field(default=False, description="Per-request perf metrics (LLM-API return_perf_metrics; default false).")
    speculative_config: SpeculativeSpec | None = Field(
        default=None, description="Speculative decoding (LLM-API speculative_config; decoding_type Eagle, MTP, NGram or DraftTarget; default none).",
    )
    moe_config: MoeSpec | None = Field(default=None, description="MoE kernels (LLM-API moe_config; MoE models only; default: upstream's).")
    enable_attention_dp: bool = Field(default=False, description="Attention data parallelism over the tensor-parallel ranks (LLM-API enable_attention_dp; default false).")

    @model_validator(mode="after")
    def _req_stats_need_perf_stats(self) -> PytorchSpec:
        if self.enable_iter_req_stats and not self.enable_iter_perf_stats:
            raise ValueError("enable_iter_req_stats needs enable_iter_perf_stats: true")
        return self


#: ``build.engine``'s description (each type narrows the field to its own value)
ENGINE_DOC = (
            "`tensorrt`: trtllm-build engine + C++ tensorrtllm Triton backend (TensorRT-LLM ≤1.2); `pytorch`: LLM-API "
            "backend, no engine (the future); `cpu`: trtpipe's CPU engine on the same Triton interface. It chooses "
            "the section's type: `plugins`, `kv_cache_type`, `workers` and `opt_num_tokens` are tensorrt/cpu knobs, "
            "`pytorch` a pytorch one, `cpu` a cpu/pytorch one (the pytorch engine on the cpu target runs on the CPU "
            "engine)."
        )


class _BuildBase(StrictModel):
    """Engine build: the knobs every engine reads. Defaults are TensorRT-LLM 1.2.1 BuildConfig defaults unless stated.

    ``build`` is one of three types chosen by ``build.engine`` (:data:`BuildSpec`), as upstream splits its LLM-API
    arguments into ``TrtLlmArgs`` and ``TorchLlmArgs`` over a shared ``BaseLlmArgs``
    (tensorrt_llm/llmapi/llm_args.py@c292b9f9:2676 ``class TorchLlmArgs(BaseLlmArgs)``, :2258 ``TrtLlmArgs``): a knob section of another engine is an unknown key of the type,
    refused by validation. A section an engine never reads answers its defaults when read (the planner plans a
    recipe on its twin path, e.g. a GPU recipe on the host, with them).
    """

    engine: str = Field(default="tensorrt", description=ENGINE_DOC)

    max_batch_size: int = Field(default=2048, ge=1, le=INT32_MAX, description="--max_batch_size: most requests scheduled at once (default 2048; int32).")
    max_input_len: int = Field(default=1024, ge=1, le=INT32_MAX, description="--max_input_len: longest prompt in tokens (default 1024; int32).")
    max_seq_len: int | None = Field(
        default=None, ge=2, le=INT32_MAX, description="--max_seq_len: longest prompt+output in tokens (default None = model's max_position_embeddings)."
    )
    max_num_tokens: int = Field(
        default=8192, ge=1, le=INT32_MAX, description="--max_num_tokens: most tokens in one batch after padding removal (default 8192)."
    )
    max_beam_width: int = Field(default=1, ge=1, le=1024, description="--max_beam_width (default 1; trtpipe refuses more than 1024 beams: no upstream limit was read for 1.2.1).")
    tokens_per_block: int = Field(default=32, ge=1, le=1024, description="--tokens_per_block: tokens per paged-KV block, a power of two (1.2.1 default 32; older 64).")
    kv_cache_config: KvCacheSpec = Field(default_factory=KvCacheSpec, description="Runtime KV cache.")
    scheduler_config: SchedulerSpec = Field(default_factory=SchedulerSpec, description="Runtime scheduler.")
    enable_chunked_prefill: bool = Field(
        default=False, description="Chunked context/prefill (LLM-API enable_chunked_prefill; Triton enable_chunked_context; default False)."
    )
    guided_decoding_backend: Literal["xgrammar"] | None = Field(
        default=None,
        description=(
            "Guided decoding (JSON schema / regex / EBNF grammar per request) with xgrammar (LLM-API "
            "guided_decoding_backend, default None = off). The engine path's tensorrt_llm model gets "
            "guided_decoding_backend and xgrammar_tokenizer_info_path (a tokenizer-info file the build writes), the "
            "PyTorch backend the LLM() argument, the CPU engine masks its logits with xgrammar. Requests send "
            "guided_decoding_guide_type / guided_decoding_guide (Triton) or response_format (trtllm-serve)."
        ),
    )
    allow_kv_oversubscription: bool = Field(
        default=False,
        description=(
            "Build even when `trtpipe plan` estimates that the KV cache cannot hold one max_seq_len sequence or "
            "that kv_cache_config.max_tokens exceeds what fits (turns those refusals into warnings)."
        ),
    )
    lora: LoraSpec | None = Field(default=None, description="LoRA adapters served per request (docs/lora.md; default none).")

    @field_validator("tokens_per_block")
    @classmethod
    def _power_of_two(cls, v: int) -> int:
        if not is_power_of_two(v):
            raise ValueError(f"{v} is not a power of two (the paged KV cache takes 8, 16, 32, 64, 128, …)")
        return v

    @property
    def engine_compute_dtype(self) -> str | None:
        """The compute dtype a build knob sets for this engine's numerics (``build.cpu.dtype`` on the CPU engine);
        ``None``: no build knob changes them (the quantize stage's checkpoint does)."""
        return None

    def cuda_graph_problems(self) -> list[tuple[str, str]]:
        """CUDA-graph batch sizes TensorRT-LLM would never capture (``[(field, message)]``); empty: this engine
        captures none (only the PyTorch backend does, :meth:`PytorchBuild.cuda_graph_problems`)."""
        return []


class _EngineBuildKnobs(_BuildBase):
    """The ``trtllm-build`` knobs (tensorrt; the CPU engine reads kv_cache_type and plans its GPU twin with them)."""

    opt_num_tokens: int | None = Field(default=None, ge=1, le=INT32_MAX, description="--opt_num_tokens (default None = max_batch_size × max_beam_width).")
    kv_cache_type: Literal["paged", "continuous", "disabled"] = Field(
        default="paged", description="--kv_cache_type (default paged; in-flight batching needs paged)."
    )
    workers: int = Field(default=1, ge=1, le=MAX_INSTANCES, description="--workers: parallel build processes (default 1; at most tp × pp: one per rank, docs/reference/trtllm-1.2.1-contract.md §2).")
    plugins: PluginSpec = Field(default_factory=PluginSpec, description="Plugin/feature flags.")


class TensorrtBuild(_EngineBuildKnobs):
    """``build.engine: tensorrt``: a ``trtllm-build`` engine served by the C++ ``tensorrtllm`` backend
    (upstream ``TrtLlmArgs``)."""

    engine: Literal["tensorrt"] = Field(default="tensorrt", description=ENGINE_DOC)

    @property
    def cpu(self) -> CpuEngineSpec:
        """The CPU-engine settings this engine never reads: their defaults (its twin on the host plans with them)."""
        return CpuEngineSpec()

    @property
    def pytorch(self) -> PytorchSpec:
        """The PyTorch-backend knobs this engine never reads: their defaults."""
        return PytorchSpec()


class CpuBuild(_EngineBuildKnobs):
    """``build.engine: cpu``: trtpipe's CPU engine behind the same Triton interface."""

    engine: Literal["cpu"] = Field(default="cpu", description=ENGINE_DOC)

    @property
    def engine_compute_dtype(self) -> str | None:
        """``build.cpu.dtype``: the CPU engine's weights, GEMMs and KV cache."""
        return self.cpu.dtype

    cpu: CpuEngineSpec = Field(default_factory=CpuEngineSpec, description="CPU-engine settings (engine: cpu only).")

    @property
    def pytorch(self) -> PytorchSpec:
        """The PyTorch-backend knobs this engine never reads: their defaults."""
        return PytorchSpec()


class PytorchBuild(_BuildBase):
    """``build.engine: pytorch``: the LLM-API PyTorch backend, no engine (upstream ``TorchLlmArgs``); on the cpu
    target trtpipe's CPU engine runs it behind the LLM facade (``cpu`` settings)."""

    engine: Literal["pytorch"] = Field(default="pytorch", description=ENGINE_DOC)
    cpu: CpuEngineSpec = Field(default_factory=CpuEngineSpec, description="CPU-engine settings (the cpu target only).")
    pytorch: PytorchSpec = Field(default_factory=PytorchSpec, description="PyTorch LLM-API backend knobs (engine: pytorch only).")

    @property
    def opt_num_tokens(self) -> None:
        """``trtllm-build`` only: the LLM API has no such argument (pipeline/data/trtllm_1.2.1_llmapi_contract.yaml)."""
        return None

    @property
    def kv_cache_type(self) -> str:
        """``trtllm-build`` only: the PyTorch backend's KV cache is paged."""
        return "paged"

    @property
    def workers(self) -> int:
        """``trtllm-build`` only: no engine is built, so one process."""
        return 1

    @property
    def plugins(self) -> PluginSpec:
        """``trtllm-build`` only: the defaults (the LLM API has no plugin config)."""
        return PluginSpec()

    def cuda_graph_problems(self) -> list[tuple[str, str]]:
        """CUDA-graph batch sizes the recipe asks for that TensorRT-LLM would never capture (``[(field, message)]``).

        The PyTorch backend keeps only the sizes ≤ ``min(max_batch_size, max_num_tokens / (1 + draft tokens per
        step))``, the largest pure-decode batch, and drops the rest without an error (``_filter_cuda_graph_batch_sizes``,
        tensorrt_llm/_torch/pyexecutor/model_engine.py@1a0dc5f70054:95-125; with ``enable_padding`` the first size
        above that ceiling becomes the ceiling). trtpipe refuses instead: a recipe is the record of what runs, so an
        explicit ``build.pytorch.cuda_graph_config.batch_sizes`` entry or non-zero ``max_batch_size`` above the
        ceiling is an error naming both numbers; the upstream defaults (no sizes, ``max_batch_size`` 0 → 128) are not
        the recipe's statement and are left to upstream's rule. Draft tokens per step: ``max_draft_len`` (Eagle,
        DraftTarget, NGram) or ``num_nextn_predict_layers`` (MTP).
        """
        cg = self.pytorch.cuda_graph_config
        if cg is None:
            return []
        spec = self.pytorch.speculative_config
        draft = int(getattr(spec, "max_draft_len", None) or getattr(spec, "num_nextn_predict_layers", None) or 0)
        by_tokens = int(self.max_num_tokens / (1 + draft))
        ceiling = min(self.max_batch_size, by_tokens)
        why = (f"build.max_batch_size {self.max_batch_size}" if ceiling == self.max_batch_size else
               f"build.max_num_tokens {self.max_num_tokens} / (1 + {draft} draft tokens) = {by_tokens}")
        field = "build.pytorch.cuda_graph_config"
        over = sorted({b for b in cg.batch_sizes or () if b > ceiling})
        if over:
            sizes = ", ".join(map(str, over))
            verb = "exceeds" if len(over) == 1 else "exceed"
            return [(f"{field}.batch_sizes", (f"{sizes} {verb} the largest decode batch, {why}: TensorRT-LLM never "
                                              f"captures a CUDA graph above {ceiling}; end the list at {ceiling}"))]
        if cg.max_batch_size > ceiling:
            return [(f"{field}.max_batch_size", (f"{cg.max_batch_size} exceeds the largest decode batch, {why}: "
                                                 f"TensorRT-LLM never captures a CUDA graph above {ceiling}; set it to "
                                                 f"{ceiling} or less"))]
        return []


#: the ``build`` section: one type per ``build.engine`` (a knob section of another engine is refused by type)
BuildSpec = Annotated[TensorrtBuild | PytorchBuild | CpuBuild, Field(discriminator="engine")]
#: the types by ``build.engine``
BUILD_TYPES: dict[str, type[_BuildBase]] = {"tensorrt": TensorrtBuild, "pytorch": PytorchBuild, "cpu": CpuBuild}


def for_engine(build: dict[str, Any], engine: str) -> dict[str, Any]:
    """A raw ``build`` mapping switched to ``build.engine`` ``engine``: the knob sections the new engine's type does not
    declare are left out (what a tune's ``build.engine`` knob compares is the paths, each with its own knobs).

    Raises:
        KeyError: ``engine`` is not a ``build.engine`` value.
    """
    fields = BUILD_TYPES[engine].model_fields
    return {k: v for k, v in build.items() if k in fields}


def engines_reading(knob: str) -> list[str]:
    """The ``build.engine`` values whose type has the field ``knob`` (a name under ``build``), in table order."""
    return [e for e, t in BUILD_TYPES.items() if knob in t.model_fields]
