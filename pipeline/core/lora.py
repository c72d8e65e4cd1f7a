"""A LoRA adapter directory as ``peft`` saves it (``adapter_config.json`` + ``adapter_model.safetensors``): its
configuration, read and checked once, for the recipe check (:mod:`pipeline.recipe.lora`), the engine stages and the
CPU runtime (:mod:`pipeline.cpu_runtime.lora`).

What trtpipe serves: plain LoRA (``peft_type`` LORA) on the Llama-family Linear layers named as transformers names
them (:data:`HF_MODULES`), one rank and one ``lora_alpha`` for every module, no bias, no DoRA, no rsLoRA, no extra
trained modules (``modules_to_save``). The delta of a target module is ``x · Aᵀ · Bᵀ · (lora_alpha / r)`` (peft's
``LoraLayer.scaling`` without rsLoRA), ``A`` ``[r, in]`` and ``B`` ``[out, r]`` as peft stores them
(``…<module>.lora_A.weight`` / ``lora_B.weight``).

TensorRT-LLM names the same modules differently (``--lora_target_modules`` and ``LoraConfig.lora_target_modules``
take its names): :data:`TRTLLM_MODULES`, the inverse of ``get_default_trtllm_modules_to_hf_modules``
(``tensorrt_llm/lora_helper.py``@037d4ba10931:43-58).
"""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path
from typing import Any

#: The adapter files ``peft``'s ``save_pretrained`` writes (safetensors; the pickled ``adapter_model.bin`` is refused).
CONFIG_FILE = "adapter_config.json"
WEIGHTS_FILE = "adapter_model.safetensors"

#: transformers module name → TensorRT-LLM LoRA module name (tensorrt_llm/lora_helper.py@037d4ba10931:43-58,
#: get_default_trtllm_modules_to_hf_modules, inverted; gate_proj is mlp_h_to_4h, up_proj is mlp_gate there).
TRTLLM_MODULES: dict[str, str] = {
    "q_proj": "attn_q", "k_proj": "attn_k", "v_proj": "attn_v", "o_proj": "attn_dense",
    "gate_proj": "mlp_h_to_4h", "up_proj": "mlp_gate", "down_proj": "mlp_4h_to_h",
}
#: The transformers module names an adapter may target (the Linear layers of a Llama-family decoder layer).
HF_MODULES: tuple[str, ...] = tuple(TRTLLM_MODULES)


class AdapterError(ValueError):
    """An adapter directory trtpipe cannot serve; the message is one line (what, and the file)."""


@dataclasses.dataclass(frozen=True)
class AdapterConfig:
    """What trtpipe reads of ``adapter_config.json``: ``rank`` (peft ``r``), ``alpha`` (``lora_alpha``), the
    ``target_modules`` (transformers names, sorted) and ``scale`` = alpha / rank."""

    rank: int
    alpha: float
    target_modules: tuple[str, ...]

    @property
    def scale(self) -> float:
        """The factor peft multiplies ``B · A`` by (``lora_alpha / r``)."""
        return self.alpha / self.rank


def _target_modules(raw: Any, path: Path) -> tuple[str, ...]:
    if isinstance(raw, str):  # peft also takes a regular expression or "all-linear": not resolvable here
        raise AdapterError(f"{path}: target_modules {raw!r} is a pattern; trtpipe needs the list of module names")
    names = sorted({str(m).rsplit(".", 1)[-1] for m in raw or ()})
    bad = [m for m in names if m not in HF_MODULES]
    if not names or bad:
        raise AdapterError(f"{path}: target_modules {bad or names} are not LoRA-servable modules "
                           f"(one or more of {', '.join(HF_MODULES)})")
    return tuple(names)


def read_adapter_config(adapter_dir: Path) -> AdapterConfig:
    """Read and check ``adapter_dir/adapter_config.json`` (and that the safetensors weights are there).

    Raises:
        AdapterError: a missing file, malformed JSON, or a feature trtpipe does not serve (not ``peft_type``
            LORA, ``use_dora``, ``use_rslora``, ``bias`` other than none, ``fan_in_fan_out``, per-module
            ``rank_pattern`` / ``alpha_pattern``, ``modules_to_save``, ``layers_to_transform``, a rank below 1,
            a target module outside :data:`HF_MODULES`).
    """
    adapter_dir = Path(adapter_dir)
    path = adapter_dir / CONFIG_FILE
    if not path.is_file():
        raise AdapterError(f"{adapter_dir}: no {CONFIG_FILE} (a peft LoRA adapter directory holds it)")
    if not (adapter_dir / WEIGHTS_FILE).is_file():
        raise AdapterError(f"{adapter_dir}: no {WEIGHTS_FILE} (save the adapter with safetensors)")
    try:
        cfg = json.loads(path.read_text())
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
        raise AdapterError(f"{path}: not readable JSON ({e})") from None
    if not isinstance(cfg, dict):
        raise AdapterError(f"{path}: not a JSON object")
    kind = str(cfg.get("peft_type", "LORA")).upper()
    unsupported = [
        ("peft_type", kind != "LORA"), ("use_dora", bool(cfg.get("use_dora"))), ("use_rslora", bool(cfg.get("use_rslora"))),
        ("bias", cfg.get("bias", "none") != "none"), ("fan_in_fan_out", bool(cfg.get("fan_in_fan_out"))),
        ("rank_pattern", bool(cfg.get("rank_pattern"))), ("alpha_pattern", bool(cfg.get("alpha_pattern"))),
        ("modules_to_save", bool(cfg.get("modules_to_save"))), ("layers_to_transform", cfg.get("layers_to_transform") is not None),
    ]
    bad = [name for name, hit in unsupported if hit]
    if bad:
        raise AdapterError(f"{path}: {bad[0]} {cfg.get(bad[0])!r} is not served (plain LoRA only: no DoRA, rsLoRA, bias, "
                           "per-module ranks or extra trained modules)")
    rank = cfg.get("r")
    if not isinstance(rank, int) or isinstance(rank, bool) or rank < 1:
        raise AdapterError(f"{path}: r is {rank!r}, expected a rank ≥ 1")
    alpha = cfg.get("lora_alpha", 8)  # peft LoraConfig's default lora_alpha
    if not isinstance(alpha, (int, float)) or isinstance(alpha, bool):
        raise AdapterError(f"{path}: lora_alpha is {alpha!r}, expected a number")
    return AdapterConfig(rank=rank, alpha=float(alpha), target_modules=_target_modules(cfg.get("target_modules"), path))
