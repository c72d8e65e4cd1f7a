"""Geometry check of a TensorRT-LLM checkpoint against the Hugging Face config it was exported from.

TensorRT-LLM builds its model config straight from ``trtllm_ckpt/config.json``: a key that is missing
silently takes the config class default (e.g. ``rotary_base`` 10000, no ``rotary_scaling``, ``hidden_act``
gelu), so an engine builds, serves and answers wrong. ModelOpt 0.47 drops ``rotary_base``/``rotary_scaling``
when transformers ≥ 5 keeps RoPE in ``rope_parameters`` (modelopt 0.47.0
``torch/export/tensorrt_llm_utils.py:228-232``, ``layer_utils.py:1503-1511``).

:func:`check_checkpoint_config` compares every field of ``pipeline/data/trtllm_geometry.yaml`` (each with
its TensorRT-LLM ``file@commit:line`` and default) with the source HF config, whichever transformers major
wrote it:

* a field the exporter **left out** whose TensorRT-LLM default differs from the source (or that TensorRT-LLM
  requires) is filled in from the source and reported as an *adjustment*;
* a field **present with another value** is a *problem* (the stage fails: weights and config disagree).
"""

from __future__ import annotations

import dataclasses
import functools
import json
import math
from importlib import resources
from pathlib import Path
from typing import Any

from pipeline.core.geometry import SCALING_KEYS, hf_rope

GEOMETRY_RESOURCE = "data/trtllm_geometry.yaml"
#: families whose config class has other defaults (trtllm_geometry.yaml loader.architectures)
QWEN_ARCHS = ("Qwen2ForCausalLM",)


@functools.cache
def geometry_table() -> dict[str, Any]:
    """The parsed ``trtllm_geometry.yaml``."""
    import yaml

    return yaml.safe_load(resources.files("pipeline").joinpath(GEOMETRY_RESOURCE).read_text())


@dataclasses.dataclass
class GeometryReport:
    """What :func:`check_checkpoint_config` found: fills (``{key, value, default, source}``) and problems."""

    adjustments: list[dict[str, Any]]
    problems: list[str]
    checked: list[str]


# ------------------------------------------------------------------------------------ the HF side
def _hf_head_size(hf: dict[str, Any]) -> int:
    return int(hf.get("head_dim") or hf.get("kv_channels") or hf["hidden_size"] // hf["num_attention_heads"])


def _hf_attn_bias(hf: dict[str, Any]) -> bool:
    if (hf.get("architectures") or [""])[0] in QWEN_ARCHS:
        return True  # Qwen2 always has qkv bias; its HF config has no key for it (qwen/config.py, see data file)
    return bool(hf.get("attention_bias") or hf.get("bias"))


def expected_values(hf: dict[str, Any]) -> dict[str, Any]:
    """The TensorRT-LLM checkpoint values the HF config implies, keyed by TensorRT-LLM name."""
    hf = {**(hf.get("text_config") or {}), **{k: v for k, v in hf.items() if k != "text_config"}}
    theta, scaling = hf_rope(hf)
    arch = (hf.get("architectures") or [None])[0]
    out: dict[str, Any] = {
        "architecture": arch,
        "num_hidden_layers": hf.get("num_hidden_layers"),
        "num_attention_heads": hf.get("num_attention_heads"),
        "num_key_value_heads": hf.get("num_key_value_heads") or hf.get("num_attention_heads"),
        "hidden_size": hf.get("hidden_size"),
        "intermediate_size": hf.get("intermediate_size"),
        "head_size": _hf_head_size(hf),
        "max_position_embeddings": hf.get("max_position_embeddings"),
        "vocab_size": hf.get("vocab_size"),
        "hidden_act": hf.get("hidden_act"),
        "norm_epsilon": hf.get("rms_norm_eps"),
        "position_embedding_type": "rope_gpt_neox",
        "rotary_base": theta,
        "rotary_scaling": scaling,
        "attn_bias": _hf_attn_bias(hf),
        "mlp_bias": bool(hf.get("mlp_bias", False)),
        "tie_word_embeddings": bool(hf.get("tie_word_embeddings", False)),
    }
    if arch in QWEN_ARCHS:
        out["qwen_type"] = hf.get("model_type")
    return {k: v for k, v in out.items() if v is not None or k == "rotary_scaling"}


# ------------------------------------------------------------------------------------ the check
#: defaults TensorRT-LLM derives from other fields of the same config (PretrainedConfig.__init__, data file)
_DERIVED = {
    "num_key_value_heads": lambda c: c.get("num_attention_heads"),
    "intermediate_size": lambda c: 4 * c["hidden_size"] if c.get("hidden_size") else None,
    "head_size": lambda c: c["hidden_size"] // c["num_attention_heads"] if c.get("hidden_size") and c.get("num_attention_heads") else None,
}
_REQUIRED = object()


def _default(field: dict[str, Any], arch: str | None, trtllm: dict[str, Any]) -> Any:
    """The value TensorRT-LLM uses when the key is missing (:data:`_REQUIRED` when it cannot load without it)."""
    key = field["trtllm_key"]
    if key in _DERIVED:
        return _DERIVED[key](trtllm)
    d = field.get("default_if_missing")
    if isinstance(d, dict):  # per config class
        d = d.get("QWenConfig" if arch in QWEN_ARCHS else "LLaMAConfig")
    if isinstance(d, str) and (d.startswith("required") or d.startswith("none")):
        return _REQUIRED
    return d


def _same(key: str, a: Any, b: Any) -> bool:
    if key == "rotary_scaling":
        if not a or not b:
            return not a and not b
        ta, tb = a.get("type") or a.get("rope_type"), b.get("type") or b.get("rope_type")
        return ta == tb and all(_same(k, a.get(k), b.get(k)) for k in SCALING_KEYS if k in a or k in b)
    if isinstance(a, (int, float)) and isinstance(b, (int, float)) and not isinstance(a, bool):
        return math.isclose(float(a), float(b), rel_tol=1e-6)  # fp32-rounded epsilons (9.9999997e-06 vs 1e-5)
    return a == b


def check_checkpoint_config(trtllm: dict[str, Any], hf: dict[str, Any], *, has_lm_head: bool | None = None) -> GeometryReport:
    """Compare a TensorRT-LLM checkpoint ``config.json`` (``trtllm``, filled in place) with its source HF config.

    Args:
        trtllm: the exported checkpoint config; missing fields whose TensorRT-LLM default is wrong are added.
        hf: the source model's ``config.json``.
        has_lm_head: whether the checkpoint holds ``lm_head.weight`` (for tied embeddings: TensorRT-LLM loads a
            checkpoint without it only when ``share_embedding_table`` is set); ``None`` skips that check.

    Returns:
        The :class:`GeometryReport`; ``problems`` empty means the engine gets the source geometry.
    """
    table = geometry_table()
    want = expected_values(hf)
    arch = want.get("architecture")
    report = GeometryReport([], [], [])
    for field in table["fields"]:
        key = field["trtllm_key"]
        if key not in want or (field.get("families") and arch not in QWEN_ARCHS):
            continue
        if key == "tie_word_embeddings":
            if want[key] and has_lm_head is False and not trtllm.get("share_embedding_table"):
                report.problems.append("tie_word_embeddings: the source ties lm_head to the embedding, the checkpoint "
                                       "has no lm_head.weight and share_embedding_table is not set")
            report.checked.append(key)
            continue
        report.checked.append(key)
        expected = want[key]
        if key in trtllm:
            if not _same(key, trtllm[key], expected):
                report.problems.append(f"{key}: checkpoint has {trtllm[key]!r}, the source model {expected!r} ({field['source']})")
            continue
        default = _default(field, arch, trtllm)
        if default is _REQUIRED or not _same(key, default, expected):
            trtllm[key] = expected
            report.adjustments.append({
                "key": key, "value": expected, "default": None if default is _REQUIRED else default, "source": field["source"],
                "reason": "the exporter left it out and TensorRT-LLM " + (
                    "cannot load the model without it" if default is _REQUIRED else "would use another value"),
            })
    return report


def check_checkpoint_dir(ckpt_dir: Path, hf_config_path: Path) -> GeometryReport:
    """:func:`check_checkpoint_config` on ``ckpt_dir/config.json``; writes the filled config back when adjusted."""
    from safetensors import safe_open

    path = Path(ckpt_dir) / "config.json"
    trtllm = json.loads(path.read_text())
    hf = json.loads(Path(hf_config_path).read_text())
    has_lm_head = None
    ranks = sorted(Path(ckpt_dir).glob("rank*.safetensors"))
    if ranks:
        with safe_open(str(ranks[-1]), "pt") as f:  # the last pipeline rank holds lm_head
            has_lm_head = "lm_head.weight" in f.keys()
    report = check_checkpoint_config(trtllm, hf, has_lm_head=has_lm_head)
    if report.adjustments:
        path.write_text(json.dumps(trtllm, indent=4) + "\n")
    return report
