"""``build.lora``: LoRA adapters served beside the base model, selected per request.

Each engine kind takes them its own upstream way (docs/lora.md):

- ``tensorrt``: ``trtllm-build --lora_plugin … --lora_dir DIR… --max_lora_rank N --lora_target_modules …``
  (pipeline/data/trtllm_1.2.1_contract.yaml), the ``lora_cache_*`` parameters of the C++ backend and the
  ``lora_task_id`` / ``lora_weights`` / ``lora_config`` request tensors;
- ``pytorch``: the LLM API's ``lora_config`` (``LoraConfig``: lora_dir, max_lora_rank, lora_target_modules,
  max_loras, max_cpu_loras) and a ``LoRARequest(lora_name, lora_int_id, lora_path)`` per request;
- ``cpu``: the adapters are copied into the engine directory and a request selects one by ``lora_task_id``.

The rules that need the adapter files (rank against ``max_lora_rank``, target modules) run when a build starts
(:func:`resolve_adapters`), before anything is written: relative paths resolve against the recipe's directory.
"""

from __future__ import annotations

from pathlib import Path
from typing import Literal

from pydantic import Field, model_validator

from pipeline.core.errors import UserError
from pipeline.core.lora import HF_MODULES, AdapterError, read_adapter_config
from pipeline.core.recipe_paths import recipe_path
from pipeline.recipe.base import StrictModel
from pipeline.recipe.bounds import INT32_MAX, INT64_MAX

HfModule = Literal[HF_MODULES]  # type: ignore[valid-type]


class LoraAdapterSpec(StrictModel):
    """One adapter: a ``peft`` LoRA directory (``adapter_config.json`` + ``adapter_model.safetensors``)."""

    name: str = Field(min_length=1, max_length=64, pattern=r"^[A-Za-z0-9][A-Za-z0-9_.-]*$",
                      description="Adapter name (LLM API lora_name; the folder name in the engine directory).")
    path: str = Field(min_length=1, max_length=4096, description="The adapter directory (relative: to the recipe file).")
    task_id: int | None = Field(
        default=None, ge=1, le=INT64_MAX,
        description="The id a request selects it by (Triton lora_task_id, LLM API lora_int_id; default: its position, from 1).",
    )


class LoraSpec(StrictModel):
    """LoRA serving (TensorRT-LLM 1.2.1 names: trtllm-build LoRA flags, LLM-API ``LoraConfig``)."""

    max_lora_rank: int = Field(
        default=64, ge=1, le=INT32_MAX,
        description="Largest adapter rank served (--max_lora_rank / LoraConfig.max_lora_rank, default 64); every adapter's r must fit.",
    )
    target_modules: list[HfModule] | None = Field(
        default=None, max_length=len(HF_MODULES),
        description="Modules LoRA may apply to, transformers names (default: those the adapters target); mapped to "
                    "TensorRT-LLM's names (attn_q, attn_v, …) for --lora_target_modules / lora_target_modules.",
    )
    adapters: list[LoraAdapterSpec] = Field(min_length=1, max_length=1024, description="The adapters the deployment serves.")
    max_loras: int | None = Field(default=None, ge=1, le=INT32_MAX, description="LLM API: adapters held on the GPU at once (LoraConfig.max_loras).")
    max_cpu_loras: int | None = Field(default=None, ge=1, le=INT32_MAX, description="LLM API: adapters cached in host memory (LoraConfig.max_cpu_loras).")
    cache_gpu_memory_fraction: float | None = Field(
        default=None, gt=0.0, le=1.0, description="C++ backend lora_cache_gpu_memory_fraction (backend default 0.05).")
    cache_host_memory_bytes: int | None = Field(
        default=None, ge=1, le=INT64_MAX, description="C++ backend lora_cache_host_memory_bytes (backend default 1 GiB).")
    cache_optimal_adapter_size: int | None = Field(
        default=None, ge=1, le=INT32_MAX, description="C++ backend lora_cache_optimal_adapter_size (backend default 8).")
    cache_max_adapter_size: int | None = Field(
        default=None, ge=1, le=INT32_MAX, description="C++ backend lora_cache_max_adapter_size (backend default 64).")

    @model_validator(mode="after")
    def _unique(self) -> "LoraSpec":
        names = [a.name for a in self.adapters]
        if len(set(names)) != len(names):
            raise ValueError(f"adapter names must be unique: {names}")
        ids = task_ids(self)
        if len(set(ids)) != len(ids):
            raise ValueError(f"adapter task ids must be unique: {ids}")
        return self


def task_ids(spec: LoraSpec) -> list[int]:
    """Each adapter's request id: its ``task_id``, else its position counted from 1."""
    return [a.task_id if a.task_id is not None else i + 1 for i, a in enumerate(spec.adapters)]


def target_modules(spec: LoraSpec, adapter_modules: list[tuple[str, ...]]) -> list[str]:
    """``spec.target_modules``, or the union of the adapters' own (transformers names, in :data:`HF_MODULES` order)."""
    chosen = set(spec.target_modules) if spec.target_modules is not None else {m for mods in adapter_modules for m in mods}
    return [m for m in HF_MODULES if m in chosen]


def resolve_adapters(recipe, recipe_dir: Path):
    """``recipe`` with every ``build.lora`` adapter path absolute, after checking each adapter's files.

    Raises:
        UserError: one line naming the field: an adapter directory that is missing or not a servable peft LoRA
            (``build.lora.adapters.N.path``), a rank above ``build.lora.max_lora_rank`` or a target module outside
            ``build.lora.target_modules`` (``build.lora.adapters.N``).
    """
    spec = recipe.build.lora
    if spec is None:
        return recipe
    resolved = []
    for i, a in enumerate(spec.adapters):
        where = f"build.lora.adapters.{i}"
        path = recipe_path(a.path, recipe_dir).resolve()
        try:
            cfg = read_adapter_config(path)
        except AdapterError as e:
            raise UserError(f"{where}.path: {e}") from None
        if cfg.rank > spec.max_lora_rank:
            raise UserError(f"{where}: adapter '{a.name}' has rank r={cfg.rank} (its adapter_config.json), above "
                            f"build.lora.max_lora_rank {spec.max_lora_rank}: raise max_lora_rank or use a smaller adapter")
        if spec.target_modules is not None and set(cfg.target_modules) - set(spec.target_modules):
            extra = sorted(set(cfg.target_modules) - set(spec.target_modules))
            raise UserError(f"{where}: adapter '{a.name}' targets {extra}, not in build.lora.target_modules {spec.target_modules}")
        resolved.append(a.model_copy(update={"path": str(path)}))
    lora = spec.model_copy(update={"adapters": resolved})
    return recipe.model_copy(update={"build": recipe.build.model_copy(update={"lora": lora})})
