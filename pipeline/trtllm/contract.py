"""The TensorRT-LLM 1.2.1 contract as data, and the rules trtpipe applies before calling the tools.

The TensorRT-LLM interface lives in ``pipeline/data/trtllm_1.2.1_contract.yaml`` (flag table, BuildConfig,
PluginConfig, PretrainedConfig and QuantConfig keys; the LLM API is trtllm_1.2.1_llmapi_contract.yaml); versions come from the release
matrix (:mod:`pipeline.trtllm.release`). This module only reads them. The fake ``tests/fakes/fake_trtllm_build`` reads the same file to build its own argparse parser,
so the generated command is checked against the table by an independent consumer.

Sources of the table are marked [S] (TensorRT-LLM source copies not tagged v1.2.1) or [V] (verified from
the 1.2.1 PyPI sdist); see docs/engine-paths.md.
"""

from __future__ import annotations

import functools
from importlib import resources
from typing import Any

import yaml

from pipeline.core.geometry import ModelGeometry
from pipeline.recipe import Recipe

CONTRACT_RESOURCE = "data/trtllm_1.2.1_contract.yaml"


@functools.cache
def contract() -> dict[str, Any]:
    """The parsed contract table (read once). Raises ``FileNotFoundError`` if the package data is missing."""
    return yaml.safe_load(resources.files("pipeline").joinpath(CONTRACT_RESOURCE).read_text())


def pins() -> dict[str, str | None]:
    """The versions an engine is built for: the release matrix's default container
    (:func:`pipeline.trtllm.release.default_release`): ``tensorrt_llm``, ``tensorrt``, ``triton_container`` (the
    image), ``nvidia_modelopt`` and ``transformers`` (what the container's TensorRT-LLM pins)."""
    from pipeline.trtllm.release import default_release

    r = default_release()
    return {"tensorrt_llm": r.tensorrt_llm, "tensorrt": r.tensorrt, "triton_container": r.image,
            "nvidia_modelopt": r.nvidia_modelopt, "transformers": r.transformers}


def build_flag_names() -> frozenset[str]:
    """Every ``--flag`` spelling ``trtllm-build`` 1.2.1 accepts (general, aliases and plugin flags)."""
    tb = contract()["trtllm_build"]
    names = set()
    for f in tb["flags"] + tb["plugin_flags"]:
        names.add(f"--{f['name']}")
        names.update(f"--{a}" for a in f.get("aliases", []))
    return frozenset(names)


def plugin_choices(name: str) -> list[str] | None:
    """The CLI choices of plugin flag ``name`` (``None`` for an int flag such as tokens_per_block)."""
    tb = contract()["trtllm_build"]
    for f in tb["plugin_flags"]:
        if f["name"] == name:
            return tb["choice_sets"][f["choices"]] if "choices" in f else None
    raise KeyError(f"{name!r} is not a trtllm-build plugin flag in the 1.2.1 contract")


def plugin_cli_value(name: str, value: Any) -> str:
    """Spell a PluginConfig value as its CLI argument: bool → ``enable``/``disable``, None → ``disable``."""
    choices = plugin_choices(name)
    if choices is None:
        return str(int(value))
    if choices == contract()["trtllm_build"]["choice_sets"]["bool"]:
        return "enable" if value else "disable"
    return "disable" if value in (None, False) else str(value)


def plugin_config_value(name: str, cli_value: str | int | None) -> Any:
    """The PluginConfig (JSON) value of a CLI spelling: ``enable`` → True, ``disable`` → None/False."""
    choices = plugin_choices(name)
    if choices is None or cli_value is None:
        return cli_value
    if choices == contract()["trtllm_build"]["choice_sets"]["bool"]:
        return cli_value == "enable"
    return None if cli_value == "disable" else cli_value


def plugin_defaults() -> dict[str, Any]:
    """The full PluginConfig of TensorRT-LLM 1.2.1 as JSON values (CLI fields + JSON-only fields)."""
    tb = contract()["trtllm_build"]
    out = {f["name"]: plugin_config_value(f["name"], f["default"]) for f in tb["plugin_flags"]}
    out.update(tb["plugin_json_only"])
    return out


def compute_capability_sm(cc: str | None) -> int | None:
    """``"9.0"`` → 90, ``"8.9"`` → 89; ``None`` stays ``None``."""
    if not cc:
        return None
    major, _, minor = str(cc).partition(".")
    return int(major) * 10 + int(minor or 0)


def _adjust(p: dict[str, Any], knob: str, value: Any, reason: str, out: list[dict[str, Any]]) -> None:
    if p[knob] != value:
        out.append({"knob": f"plugins.{knob}", "requested": p[knob], "effective": value, "reason": reason})
        p[knob] = value


def effective_plugins(recipe: Recipe, *, architecture: str, sm: int | None) -> tuple[dict[str, Any], list[dict[str, Any]]]:
    """The recipe's plugin knobs after the silent adjustments ``trtllm-build`` 1.2.1 would make.

    trtpipe passes these values explicitly so that the command says what the engine will contain.

    Args:
        recipe: the recipe (``build.plugins``, ``quantization``, ``target.tp_size``).
        architecture: checkpoint ``architecture`` (``LlamaForCausalLM`` …).
        sm: target compute capability as an int (90 for Hopper), ``None`` when unknown.

    Returns:
        ``(plugins, adjustments)``: recipe-field-named values (``PluginSpec`` names) and one dict per
        changed knob ``{knob, requested, effective, reason}``. Rules and sources: the contract file's
        ``trtllm_build.adjustments_source`` (builder.py ``build()``, commands/build.py ``main()``) [S].
    """
    tb = contract()["trtllm_build"]
    p = recipe.build.plugins.model_dump()
    q = recipe.quantization
    algo, kv = q.quant_algo, q.kv_cache_quant_algo
    adj: list[dict[str, Any]] = []
    if p["reduce_fusion"] and (recipe.target.tp_size == 1 or architecture not in tb["reduce_fusion_architectures"]):
        _adjust(p, "reduce_fusion", False, "reduce_fusion needs tp_size > 1 and a Llama/Gemma2/Medusa model", adj)
    if p["norm_quant_fusion"] and (p["reduce_fusion"] or architecture != "LlamaForCausalLM" or algo != "NVFP4"):
        _adjust(p, "norm_quant_fusion", False, "norm_quant_fusion needs NVFP4 Llama without reduce_fusion", adj)
    fp8_kv = kv == "FP8"
    if not p["context_fmha"]:
        _adjust(p, "use_fp8_context_fmha", False, "context_fmha is disabled", adj)
        _adjust(p, "use_paged_context_fmha", False, "context_fmha is disabled", adj)
    elif algo not in tb["fp8_context_fmha_quant_algos"]:
        _adjust(p, "use_fp8_context_fmha", False, f"FP8 context FMHA needs quant_algo FP8/W4A8_AWQ/NVFP4 (got {algo})", adj)
        if p["use_paged_context_fmha"] and fp8_kv:
            _adjust(p, "use_paged_context_fmha", False,
                    f"paged context FMHA with an FP8 KV cache needs FP8 context FMHA, which {algo} cannot use", adj)
    elif sm is not None and sm < tb["fp8_context_fmha_min_sm"]:
        _adjust(p, "use_fp8_context_fmha", False, f"FP8 context FMHA needs SM >= 89 (target SM {sm})", adj)
        if p["use_paged_context_fmha"] and fp8_kv:
            _adjust(p, "use_paged_context_fmha", False, "paged context FMHA with FP8 KV needs FP8 context FMHA", adj)
    elif p["use_paged_context_fmha"]:
        if not fp8_kv:
            _adjust(p, "use_fp8_context_fmha", False, "FP8 paged context FMHA needs an FP8 KV cache", adj)
        else:
            _adjust(p, "use_fp8_context_fmha", True, "an FP8 KV cache with paged context FMHA forces FP8 context FMHA", adj)
    if p["use_paged_context_fmha"] and kv == "INT8":
        _adjust(p, "use_paged_context_fmha", False, "paged context FMHA does not work with an INT8 KV cache", adj)
    if algo and algo not in tb["fused_mlp_quant_algos"]:
        _adjust(p, "use_fused_mlp", False, f"fused MLP is only for FP8/MIXED_PRECISION (got {algo})", adj)
    return p, adj


def quant_config(recipe: Recipe) -> dict[str, Any]:
    """The checkpoint ``quantization`` dict ModelOpt's TensorRT-LLM export writes for ``recipe``.

    Only QuantConfig field names (an unknown key is a TypeError in 1.2.1). AWQ formats carry
    ``group_size`` = awq_block_size and ``pre_quant_scale`` True; ``lm_head`` stays unquantized
    (ModelOpt's default exclusion) [S].
    """
    q = recipe.quantization
    awq = q.qformat in ("int4_awq", "w4a8_awq")
    out = {
        "quant_algo": q.quant_algo,
        "kv_cache_quant_algo": q.kv_cache_quant_algo,
        "group_size": q.awq_block_size if awq else contract()["quant_config"]["fields"]["group_size"],
        "has_zero_point": False,
        "pre_quant_scale": awq,
        "exclude_modules": ["lm_head"] if q.quant_algo else None,
    }
    return out


def synthesize_checkpoint_config(recipe: Recipe, geo: ModelGeometry) -> dict[str, Any]:
    """A TensorRT-LLM checkpoint ``config.json`` (PretrainedConfig keys, docs/reference/trtllm-1.2.1-contract.md §5) from model geometry.

    Used for dry runs and ``--model_config`` builds without weights (the quantize stage did not run).
    ``dtype`` ``auto`` becomes the model's own ``torch_dtype`` (bfloat16 when unknown); the geometry, RoPE
    base and scaling come from :func:`pipeline.trtllm.checkpoint.expected_values` of the known model config.
    """
    from pipeline.trtllm.checkpoint import expected_values

    t = recipe.target
    dtype = recipe.model.dtype if recipe.model.dtype != "auto" else (getattr(geo, "torch_dtype", None) or "bfloat16")
    values = expected_values(geo.hf_config())  # the same mapping the quantize stage's geometry check uses
    values.pop("tie_word_embeddings", None)
    if values.get("rotary_scaling") is None:
        values.pop("rotary_scaling", None)
    return {
        **values,
        "dtype": dtype,
        "logits_dtype": "float32",
        "use_parallel_embedding": False,
        "embedding_sharding_dim": 0,
        "mapping": {"world_size": t.world_size, "tp_size": t.tp_size, "pp_size": t.pp_size},
        "quantization": quant_config(recipe),
    }


def checkpoint_config_problems(cfg: dict[str, Any], recipe: Recipe) -> list[str]:
    """What in a checkpoint ``config.json`` would make ``trtllm-build`` 1.2.1 fail or mismatch the recipe.

    Checks: required PretrainedConfig keys; ``quantization`` keys ⊆ QuantConfig fields and algos valid;
    ``mapping`` world/tp/pp equal the recipe's target. Returns human-readable lines (empty = fine).
    """
    c = contract()
    out = [f"missing required key {k!r}" for k in c["pretrained_config"]["required"] if k not in cfg]
    quant = cfg.get("quantization") or {}
    unknown = sorted(set(quant) - set(c["quant_config"]["fields"]))
    if unknown:
        out.append(f"quantization keys {unknown} are not QuantConfig fields (TypeError in 1.2.1)")
    if quant.get("quant_algo") not in (None, *c["quant_config"]["quant_algos"]):
        out.append(f"quantization.quant_algo {quant['quant_algo']!r} is not a QuantAlgo")
    if quant.get("kv_cache_quant_algo") not in (None, *c["quant_config"]["kv_cache_quant_algos"]):
        out.append(f"quantization.kv_cache_quant_algo {quant['kv_cache_quant_algo']!r} is not in KV_CACHE_QUANT_ALGO_LIST")
    m = cfg.get("mapping") or {}
    t = recipe.target
    for key, want in (("tp_size", t.tp_size), ("pp_size", t.pp_size)):
        if m.get(key, 1) != want:
            out.append(f"mapping.{key} is {m.get(key, 1)} but the recipe's target.{key} is {want}")
    return out
