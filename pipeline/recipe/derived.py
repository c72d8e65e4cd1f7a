"""Values derived from a recipe (and the model it names): the ONE place each rule lives.

Validation, the planner and every engine builder call these instead of re-deriving:

* :func:`model_dtype` — the checkpoint/export dtype behind ``model.dtype: auto``;
* :func:`max_seq_len` / :func:`require_max_seq_len` — ``build.max_seq_len`` or the model's
  ``max_position_embeddings``;
* :func:`format_problems` — whether a qformat / KV-cache dtype runs on a GPU architecture;
* :func:`cpu_engine_problems` — build knobs the CPU engine cannot honour;

Each function takes the recipe sections it reads (:class:`ModelSpec`, :class:`TargetSpec`, :class:`BuildSpec`,
:class:`QuantSpec`), never the whole recipe: :mod:`pipeline.recipe.schema` validates the root model with them, so
this module must not depend on it.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from pipeline.core.errors import UserError
from pipeline.recipe.serving_path import PATHS

if TYPE_CHECKING:
    from pipeline.core.hardware import GpuSpec
    from pipeline.recipe.build import BuildSpec
    from pipeline.recipe.model import ModelSpec, TargetSpec
    from pipeline.recipe.quant import QuantSpec

#: dtype used when ``model.dtype`` is ``auto`` and the checkpoint does not say (TensorRT-LLM quantize.py
#: defaults ``--dtype auto`` to the checkpoint's ``torch_dtype``; float16 when absent)
DEFAULT_CHECKPOINT_DTYPE = "float16"


def model_dtype(model: ModelSpec, target: TargetSpec, checkpoint_dtype: str | None) -> str:
    """The dtype the quantize stage exports in and the engine computes in (torch name, e.g. ``bfloat16``).

    ``model.dtype`` when set; for ``auto`` the checkpoint's ``dtype``/``torch_dtype``
    (``checkpoint_dtype``, :data:`DEFAULT_CHECKPOINT_DTYPE` when unknown), except that a float32
    checkpoint becomes float16 on GPU targets, as TensorRT-LLM ``examples/quantization/quantize.py``
    does (docs/reference/quantization.md §2.1), and stays float32 on the ``cpu`` target.
    """
    name = model.dtype
    if name != "auto":
        return name
    name = checkpoint_dtype or DEFAULT_CHECKPOINT_DTYPE
    if name == "float32" and target.gpu != "cpu":
        return "float16"
    return name


def max_seq_len(build: BuildSpec, max_position_embeddings: int | None) -> int | None:
    """``build.max_seq_len``, else the model's ``max_position_embeddings`` (tokens); ``None`` when neither is known.

    TensorRT-LLM's ``trtllm-build`` resolves an unset ``--max_seq_len`` the same way (BuildConfig
    defaults it from the checkpoint's max_position_embeddings; docs/reference/trtllm-1.2.1-contract.md §2).
    """
    return build.max_seq_len or max_position_embeddings


def require_max_seq_len(build: BuildSpec, max_position_embeddings: int | None) -> int:
    """:func:`max_seq_len`, checked against the model and ``max_input_len``.

    Raises:
        UserError: neither is known; ``build.max_seq_len`` exceeds max_position_embeddings; or
            ``build.max_input_len`` exceeds the result (trtllm-build would clip it).
    """
    value = max_seq_len(build, max_position_embeddings)
    if not value:
        raise UserError("build.max_seq_len: unset and the model's max_position_embeddings is unknown; set it")
    if max_position_embeddings and value > max_position_embeddings:
        raise UserError(f"build.max_seq_len: {value} exceeds the model's max_position_embeddings {max_position_embeddings}")
    if build.max_input_len > value:
        raise UserError(f"build.max_input_len: {build.max_input_len} exceeds max_seq_len {value} (prompt + output must fit)")
    return int(value)


def format_problems(quant: QuantSpec, gpu: GpuSpec) -> list[tuple[str, str]]:
    """``[(field path, message)]`` for a qformat / KV-cache dtype ``gpu`` cannot run; empty when it can.

    FP8 tensor cores exist from Ada (SM 8.9) on, FP4 from Blackwell (SM 10.0); A100 (Ampere) runs
    neither (NVIDIA H100/L40S/B200 datasheets; TensorRT-LLM's support matrix). Which format needs which is the
    ``needs`` rule of pipeline/data/qformat_rules.yaml (:mod:`pipeline.recipe.qformats`).
    """
    from pipeline.recipe import qformats

    out: list[tuple[str, str]] = []
    arch = gpu.arch.capitalize()
    need = qformats.needs(quant.qformat)
    if need == "fp4" and not gpu.fp4:
        alt = "fp8" if gpu.fp8 else "int8_sq or int4_awq"
        out.append(("quantization.qformat", f"{quant.qformat} needs a Blackwell GPU (FP4 tensor cores); {gpu.key} is {arch}: use {alt}"))
    elif need == "fp8" and not gpu.fp8:
        out.append((
            "quantization.qformat",
            f"{quant.qformat} needs FP8 tensor cores (Ada, Hopper or Blackwell); {gpu.key} is {arch} "
            f"(SM {gpu.compute_capability}): use int8_sq (or int4_awq for memory)",
        ))
    if qformats.kv_needs(quant.kv_cache_dtype) == "fp8" and not gpu.fp8:
        out.append(("quantization.kv_cache_dtype", f"fp8 KV cache needs Ada, Hopper or Blackwell; {gpu.key} is {arch}: use int8"))
    return out


def cpu_engine_problems(build: BuildSpec) -> list[tuple[str, str]]:
    """Build knobs the CPU engine cannot honour (``[(field, message)]``): it reuses prompt-prefix KV blocks only on
    the LLM-API path (``build.engine: pytorch``: pipeline/cpu_runtime/prefix.py), has no host offload tier and no sliding window, decodes greedily, and reserves each
    request's KV slot at admission (GUARANTEED_NO_EVICT). ``enable_block_reuse`` defaults to true
    (TensorRT-LLM's default): only a recipe that asks for it explicitly is refused."""
    b = build
    kv = b.kv_cache_config
    out = []
    llm_api = any(p.on_cpu and p.llm_api and p.engine == b.engine for p in PATHS.values())  # the serving-path table
    if kv.enable_block_reuse and "enable_block_reuse" in kv.model_fields_set and not llm_api:
        out.append(("build.kv_cache_config.enable_block_reuse", ("true is served by the CPU engine on the LLM-API path "
                                                                  "only (build.engine: pytorch): set it to false")))
    if kv.host_cache_size:
        out.append(("build.kv_cache_config.host_cache_size", "the CPU engine has no host offload tier: unset it"))
    if kv.max_attention_window is not None:
        out.append(("build.kv_cache_config.max_attention_window", "the CPU engine attends over the whole sequence: unset it"))
    if b.kv_cache_type != "paged":
        out.append(("build.kv_cache_type", f"{b.kv_cache_type!r}: in-flight batching on the CPU engine needs its slot "
                                           "KV cache: use paged"))
    if b.max_beam_width != 1:
        out.append(("build.max_beam_width", "the CPU engine decodes greedily: use 1"))
    if b.scheduler_config.capacity_scheduler_policy != "GUARANTEED_NO_EVICT":
        out.append(("build.scheduler_config.capacity_scheduler_policy",
                    "the CPU engine reserves each request's KV at admission: use GUARANTEED_NO_EVICT"))
    return out
