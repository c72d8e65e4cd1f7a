"""Mixture-of-experts knobs: ``target.ep_size``, ``build.pytorch.moe_config``, ``build.pytorch.enable_attention_dp``.

LLM-API names (TensorRT-LLM 1.2.1, pipeline/data/trtllm_1.2.1_llmapi_contract.yaml): ``moe_expert_parallel_size``
(BaseLlmArgs, llm_args.py@c292b9f9:1883), ``enable_attention_dp`` (:1887), ``moe_config`` (TorchLlmArgs :2705,
``MoeConfig`` :410). :func:`moe_problems` holds the rules.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Literal

from pydantic import Field

from pipeline.recipe.base import StrictModel
from pipeline.recipe.bounds import INT32_MAX

if TYPE_CHECKING:
    from pipeline.core.geometry import ModelGeometry

#: MoeConfig.backend values (llm_args.py@c292b9f9:414-417)
MoeBackend = Literal["CUTLASS", "CUTEDSL", "WIDEEP", "TRTLLM", "DEEPGEMM", "VANILLA", "TRITON"]
#: tp_size = moe_tp_size × moe_ep_size × moe_cluster_size, else ValueError (tensorrt_llm/mapping.py@05ebebb2:175-180);
#: each EP rank holds num_experts // moe_ep_size experts (Mapping.ep_experts)
MAPPING_SRC = "tensorrt_llm/mapping.py@05ebebb2:175-180"


class MoeSpec(StrictModel):
    """LLM-API ``MoeConfig`` (PyTorch backend)."""

    backend: MoeBackend = Field(
        default="CUTLASS",
        description="MoE kernels (MoeConfig.backend, upstream default CUTLASS; TRTLLM is Blackwell's, DEEPGEMM FP8 block-scale).",
    )
    max_num_tokens: int | None = Field(
        default=None, ge=1, le=INT32_MAX,
        description="Most tokens sent to the fused MoE at once; more are chunked (default None = no chunking).",
    )


def moe_problems(*, ep_size: int, tp_size: int, expert_parallel: bool, gpu_target: bool, moe_config: MoeSpec | None,
                 attention_dp: bool, geo: ModelGeometry | None, source: str) -> list[tuple[str, str]]:
    """``[(field, message)]`` for MoE/EP knobs that cannot apply (empty = fine).

    Rules: ``ep_size`` > 1 only with ``build.engine: pytorch`` on a GPU (trtpipe writes it only as the LLM-API
    argument), only for a model with experts, dividing ``tp_size`` (expert-parallel ranks split the tensor-parallel
    group, :data:`MAPPING_SRC`) and the model's expert count; ``moe_config`` only for a model with experts;
    ``enable_attention_dp`` only with ``tp_size`` > 1 (it replicates attention over the tensor-parallel ranks).
    Models of unknown geometry are checked for divisibility by the GPUs only.
    """
    out: list[tuple[str, str]] = []
    dense = geo is not None and not geo.is_moe
    if ep_size > 1:
        if not expert_parallel:
            out.append(("target.ep_size", f"{ep_size}: expert parallelism is the LLM-API argument moe_expert_parallel_size; "
                                          "use build.engine: pytorch on a GPU target (or ep_size 1)"))
        elif dense:
            out.append(("target.ep_size", f"{ep_size}, but {source} has no experts (dense MLP): use 1"))
        elif tp_size % ep_size:
            out.append(("target.ep_size", f"{ep_size} does not divide tp_size {tp_size} (the GPUs of one instance): "
                                          f"expert-parallel ranks split the tensor-parallel group ({MAPPING_SRC})"))
        elif geo is not None and geo.num_experts % ep_size:
            out.append(("target.ep_size", f"{ep_size} does not divide the model's {geo.num_experts} experts: each rank "
                                          "holds num_experts / ep_size of them"))
    if moe_config is not None and (dense or not gpu_target):
        why = f"{source} has no experts (dense MLP)" if gpu_target else "the CPU engine has no MoE kernels"
        out.append(("build.pytorch.moe_config", f"{why}: remove it"))
    if attention_dp and (tp_size == 1 or not gpu_target):
        out.append(("build.pytorch.enable_attention_dp", "true needs tp_size > 1 on a GPU target (attention data parallelism "
                                                         "replicates attention over the tensor-parallel ranks)"))
    return out
