"""The TensorRT-LLM LLM API as trtpipe writes it: ``tensorrt_llm.LLM(**kwargs)`` for a recipe.

Shared by the engine stage (``build.engine: pytorch``, :mod:`pipeline.engine.pytorch`), the Triton repository
stage (the ``llmapi`` model's ``model.yaml``), ``trtllm-serve``'s extra-options YAML and ``trtpipe deploy``. Every
argument is held to the LLM-API contract, ``pipeline/data/trtllm_1.2.1_llmapi_contract.yaml`` (name, type, default,
accepted values, backend; each with its upstream source): :func:`check_kwargs`.
"""

from __future__ import annotations

import functools
import math
from importlib import resources
from pathlib import Path
from typing import Any

import yaml

from pipeline.core import hardware
from pipeline.core.errors import UserError
from pipeline.core.geometry import (
    ModelGeometry,
    geometry_for_source,
    geometry_from_config,
)
from pipeline.recipe import Recipe, derived
from pipeline.recipe.knobs import TRT_ONLY_KNOBS  # noqa: F401  (re-exported: recipe validation refuses them)

CONTRACT_RESOURCE = "data/trtllm_1.2.1_llmapi_contract.yaml"


@functools.cache
def llmapi_contract() -> dict[str, Any]:
    """The parsed LLM-API contract table (read once). Raises ``FileNotFoundError`` if the package data is missing."""
    return yaml.safe_load(resources.files("pipeline").joinpath(CONTRACT_RESOURCE).read_text())


def _max_seq_len(recipe: Recipe, hf_ckpt_dir: Path, source_geometry: ModelGeometry | None = None) -> int:
    """:func:`pipeline.recipe.derived.require_max_seq_len` with the model's max_position_embeddings
    (HF config.json, else ``source_geometry``, else the known-model table or a local ``model.source``)."""
    cfg = Path(hf_ckpt_dir) / "config.json"
    geo = geometry_from_config(cfg) if cfg.is_file() else source_geometry or geometry_for_source(recipe.model.source)
    return derived.require_max_seq_len(recipe.build, geo.max_position_embeddings if geo is not None else None)


def llm_api_kwargs(recipe: Recipe, hf_ckpt_dir: Path, *, draft_dir: str | None = None,
                   source_geometry: ModelGeometry | None = None) -> dict[str, Any]:
    """The ``tensorrt_llm.LLM(**kwargs)`` arguments for ``recipe`` (TensorRT-LLM 1.2.1 LLM-API names).

    Args:
        recipe: the recipe (``build``, ``target``, ``model``, ``quantization.kv_cache_dtype``).
        hf_ckpt_dir: the unified HF checkpoint ModelOpt exported (model weights + tokenizer); used as
            ``model`` and ``tokenizer`` verbatim (make it absolute for a server started elsewhere).
        draft_dir: the speculative draft model's directory, when the recipe has one.
        source_geometry: the model's geometry when ``hf_ckpt_dir`` has no config.json yet (a dry run): the engine
            stage passes the source the quantize stage resolved against the recipe's directory
            (:meth:`pipeline.quantize.result.QuantizeResult.source_geometry`).

    Returns:
        A JSON-able dict: ``model``, ``tokenizer``, ``backend`` ("pytorch"), ``dtype``, ``trust_remote_code``,
        ``tensor_parallel_size``, ``pipeline_parallel_size``, ``max_batch_size``, ``max_input_len``,
        ``max_seq_len`` (resolved, tokens), ``max_beam_width``, ``max_num_tokens``, ``kv_cache_config``
        {free_gpu_memory_fraction, enable_block_reuse, max_tokens, max_attention_window, host_cache_size,
        tokens_per_block, dtype ("fp8" for an FP8 KV cache, else "auto" = from the checkpoint)},
        ``scheduler_config`` {capacity_scheduler_policy, context_chunking_policy}, ``enable_chunked_prefill``,
        ``guided_decoding_backend`` when the recipe turns guided decoding on, and
        on a GPU target the ``build.pytorch`` knobs under their LLM-API names (``cuda_graph_config``
        {enable_padding, batch_sizes, max_batch_size} or None, ``disable_overlap_scheduler``, ``attn_backend``,
        ``sampler_type``, ``stream_interval``, ``enable_iter_perf_stats``, ``enable_iter_req_stats``,
        ``print_iter_log``, ``return_perf_metrics``); the CPU facade reads none of those, so the cpu target omits
        them (but ``speculative_config``, n-gram, which the CPU engine runs), and :func:`feature_kwargs` (speculative
        decoding, MoE; ``draft_dir``: the resolved local draft model, else the recipe's spelling). Every key passes
        :func:`check_kwargs`.

    Raises:
        UserError: max_seq_len is unset and cannot be derived from the model.
    """
    b, kv, t = recipe.build, recipe.build.kv_cache_config, recipe.target
    kwargs = {
        "model": str(hf_ckpt_dir),
        "tokenizer": str(hf_ckpt_dir),
        "backend": "pytorch",
        "dtype": recipe.model.dtype,
        "trust_remote_code": recipe.model.trust_remote_code,
        "tensor_parallel_size": t.tp_size,
        "pipeline_parallel_size": t.pp_size,
        "max_batch_size": b.max_batch_size,
        "max_input_len": b.max_input_len,
        "max_seq_len": _max_seq_len(recipe, hf_ckpt_dir, source_geometry),
        "max_beam_width": b.max_beam_width,
        "max_num_tokens": b.max_num_tokens,
        "kv_cache_config": {
            "free_gpu_memory_fraction": kv.free_gpu_memory_fraction,
            "enable_block_reuse": kv.enable_block_reuse,
            "max_tokens": kv.max_tokens,
            # LLM-API max_attention_window is a per-layer list (repeated across layers).
            "max_attention_window": [kv.max_attention_window] if kv.max_attention_window else None,
            "host_cache_size": kv.host_cache_size,
            "tokens_per_block": b.tokens_per_block,
            "dtype": "fp8" if recipe.quantization.kv_cache_dtype == "fp8" else "auto",
        },
        "scheduler_config": {
            "capacity_scheduler_policy": b.scheduler_config.capacity_scheduler_policy,
            "context_chunking_policy": b.scheduler_config.context_chunking_policy,
        },
        "enable_chunked_prefill": b.enable_chunked_prefill,
    }
    if b.guided_decoding_backend:  # absent = upstream default None (off); the CPU facade honours it too
        kwargs["guided_decoding_backend"] = b.guided_decoding_backend
    if t.gpu != hardware.CPU_TARGET:
        kwargs.update(pytorch_kwargs(recipe, draft_dir=draft_dir))
    elif b.pytorch.speculative_config is not None:  # NGram: the CPU facade runs it (pipeline/cpu_runtime/speculative.py)
        kwargs["speculative_config"] = feature_kwargs(recipe)["speculative_config"]
    if b.lora is not None:
        kwargs["lora_config"] = lora_config(recipe)
    return kwargs


def lora_config(recipe: Recipe, lora_dirs: list[str] | None = None) -> dict[str, Any]:
    """The LLM API's ``lora_config`` (``LoraConfig``, pipeline/data/trtllm_1.2.1_llmapi_contract.yaml) of ``build.lora``:
    ``lora_dir`` (``lora_dirs``, default the adapters' paths), ``lora_ckpt_source`` hf, ``max_lora_rank``,
    ``lora_target_modules`` in TensorRT-LLM's names (default: the modules the adapters target), ``max_loras``,
    ``max_cpu_loras``. Raises :class:`UserError` for an adapter that cannot be read."""
    from pipeline.core.lora import TRTLLM_MODULES, AdapterError, read_adapter_config
    from pipeline.recipe.lora import target_modules

    spec = recipe.build.lora
    assert spec is not None
    try:
        mods = target_modules(spec, [] if spec.target_modules is not None else
                              [read_adapter_config(Path(a.path)).target_modules for a in spec.adapters])
    except AdapterError as e:
        raise UserError(f"build.lora.adapters: {e}") from None
    return {"lora_dir": list(lora_dirs) if lora_dirs is not None else [a.path for a in spec.adapters],
            "lora_ckpt_source": "hf", "max_lora_rank": spec.max_lora_rank,
            "lora_target_modules": [TRTLLM_MODULES[m] for m in mods], "max_loras": spec.max_loras,
            "max_cpu_loras": spec.max_cpu_loras}



#: build.pytorch fields written only when set (speculative decoding, MoE): :func:`feature_kwargs`
FEATURE_FIELDS = {"speculative_config", "moe_config", "enable_attention_dp"}


def pytorch_kwargs(recipe: Recipe, *, draft_dir: str | None = None) -> dict[str, Any]:
    """The ``TorchLlmArgs`` arguments of ``recipe.build.pytorch`` (LLM-API names; ``cuda_graph_config`` None = off),
    plus :func:`feature_kwargs`."""
    p = recipe.build.pytorch
    out = p.model_dump(mode="json", exclude=FEATURE_FIELDS)
    if p.cuda_graph_config is not None:
        out["cuda_graph_config"] = {k: v for k, v in out["cuda_graph_config"].items() if not (k == "batch_sizes" and v is None)}
    return {**out, **feature_kwargs(recipe, draft_dir=draft_dir)}


def feature_kwargs(recipe: Recipe, *, draft_dir: str | None = None) -> dict[str, Any]:
    """Speculative-decoding and MoE ``LLM()`` arguments, each only when the recipe sets it (upstream defaults otherwise).

    ``speculative_config`` {decoding_type, max_draft_len, speculative_model_dir, …} as the YAML form
    ``DecodingBaseConfig.from_dict`` takes (llm_args.py@c292b9f9:725-745; the Triton llmapi model and trtllm-serve
    both pass the YAML through ``update_llm_args_with_extra_dict``, :3217-3251), with ``speculative_model_dir``
    replaced by ``draft_dir`` when given (the resolved local draft); ``moe_config`` {backend, max_num_tokens};
    ``moe_expert_parallel_size`` (``target.ep_size`` > 1); ``enable_attention_dp`` (true only).
    """
    p, out = recipe.build.pytorch, {}
    if p.speculative_config is not None:
        dumped = p.speculative_config.model_dump(mode="json", exclude_none=True)
        spec = {"decoding_type": dumped.pop("decoding_type"), **dumped}
        if draft_dir and "speculative_model_dir" in spec:
            spec["speculative_model_dir"] = draft_dir
        out["speculative_config"] = spec
    if p.moe_config is not None:
        out["moe_config"] = p.moe_config.model_dump(mode="json", exclude_none=True)
    if recipe.target.ep_size > 1:
        out["moe_expert_parallel_size"] = recipe.target.ep_size
    if p.enable_attention_dp:
        out["enable_attention_dp"] = True
    return out


def _type_problem(where: str, spec: dict[str, Any], value: Any) -> str | None:
    """Why ``value`` does not fit contract entry ``spec`` (``None``: it fits)."""
    if value is None:
        return None if spec.get("nullable") or spec.get("default", "") is None else f"{where} may not be null"
    kind = spec["type"]
    ok = {
        "bool": isinstance(value, bool),
        "int": isinstance(value, int) and not isinstance(value, bool),
        "float": isinstance(value, (int, float)) and not isinstance(value, bool),
        "str": isinstance(value, str),
        "list_int": isinstance(value, list) and all(isinstance(v, int) and not isinstance(v, bool) for v in value),
        "list_str": isinstance(value, list) and all(isinstance(v, str) for v in value),
        "enum": value in spec.get("values", ()),
        "config": isinstance(value, dict),
        "speculative": isinstance(value, dict),
        "any": True,
    }[kind]
    if not ok:
        want = f"one of {spec['values']}" if kind == "enum" else kind
        return f"{where} is {value!r}: must be {want}"
    nums = value if kind == "list_int" else [value] if kind in ("int", "float") else []
    if kind == "list_int" and len(value) < spec.get("min_items", 0):
        return f"{where} needs at least {spec['min_items']} item(s)"
    for v in nums:
        if "ge" in spec and v < spec["ge"]:
            return f"{where} is {value!r}: must be >= {spec['ge']}"
        if "le" in spec and v > spec["le"]:
            return f"{where} is {value!r}: must be <= {spec['le']}"
    return None


def _check_table(where: str, table: dict[str, Any], values: dict[str, Any], backend: str, what: str) -> list[str]:
    c, out = llmapi_contract(), []
    for key, value in values.items():
        spec = table.get(key)
        path = f"{where}{key}"
        if spec is None:
            out.append(f"{path}: {what} has no such field in TensorRT-LLM {c['tensorrt_llm']} ({c['sources']['L12']})")
            continue
        if spec.get("backend", "both") not in ("both", backend):
            out.append(f"{path}: a {spec['backend']}-backend-only argument ({spec['src']}); the {backend} backend rejects it")
            continue
        problem = _type_problem(path, spec, value)
        if problem:
            out.append(f"{problem} ({spec['src']})")
        elif spec["type"] == "config" and value is not None:
            out += _check_table(f"{path}.", c["configs"][spec["config"]], value, backend, spec["config"])
        elif spec["type"] == "speculative" and value is not None:
            out += _check_speculative(f"{path}.", value, backend)
    return out


def _check_speculative(where: str, value: dict[str, Any], backend: str) -> list[str]:
    """A ``speculative_config`` mapping as ``DecodingBaseConfig.from_dict`` takes it: a known ``decoding_type`` the
    backend supports, the fields of that type's class (its table + ``decoding_base``), and what
    ``TorchLlmArgs.validate_speculative_config`` asserts (``positive`` fields > 0, ``required`` fields set)."""
    c = llmapi_contract()
    sd, kind = c["speculative_decoding"], value.get("decoding_type")
    t = sd["types"].get(kind)
    if t is None:
        known = sorted(sd["types"]) + sd["not_written"]
        return [f"{where}decoding_type is {kind!r}: must be one of {known} (trtpipe writes {sorted(sd['types'])}; {c['sources']['L12']})"]
    if backend not in t["backends"]:
        return [f"{where}decoding_type {kind} does not support the {backend} backend ({t['src']})"]
    fields = {k: v for k, v in value.items() if k != "decoding_type"}
    table = {**c["configs"]["decoding_base"], **c["configs"][t["config"]]}
    out = _check_table(where, table, fields, backend, f"{kind} speculative_config")
    for name in t["positive"]:
        default = table[name].get("default")
        v = fields.get(name, default)
        if not (isinstance(v, int) and not isinstance(v, bool) and v > 0):
            out.append(f"{where}{name} is {v!r}: {kind} needs it > 0 ({t['src']})")
    out += [f"{where}{name}: {kind} needs it set ({t['src']})" for name in t["required"] if fields.get(name) in (None, "")]
    return out


def cuda_graph_batch_sizes(max_batch_size: int, enable_padding: bool) -> list[int]:
    """The CUDA-graph batch sizes TensorRT-LLM 1.2 generates for ``max_batch_size`` (requests, ≥ 1), ascending.

    The rule of ``CudaGraphConfig._generate_cuda_graph_batch_sizes`` (llm_args.py@c292b9f997d6:135-164): with padding
    1, 2, 4 and the multiples of 8 up to 128, else 1…31, 32, 64, 128; then the powers of two from 256 up to (not
    including) 2^ceil(log2 max_batch_size); every size ≤ ``max_batch_size`` kept, and ``max_batch_size`` itself last.
    (Main generates sizes past 128 in steps of 64 instead: the contract's ``main_differences``.)
    """
    sizes = [1, 2, 4, *range(8, 129, 8)] if enable_padding else [*range(1, 32), 32, 64, 128]
    sizes += [2 ** i for i in range(8, math.ceil(math.log(max_batch_size, 2)))] if max_batch_size > 1 else []
    sizes = sorted(x for x in sizes if x <= max_batch_size)
    if not sizes or sizes[-1] != max_batch_size:
        sizes.append(max_batch_size)
    return sizes


def check_kwargs(kwargs: dict[str, Any], backend: str = "pytorch") -> list[str]:
    """What in ``LLM(**kwargs)`` TensorRT-LLM 1.2.1 would reject, one line per defect (empty = fine).

    Args:
        kwargs: LLM() keyword arguments (JSON values, nested configs as dicts).
        backend: ``pytorch`` (TorchLlmArgs) or ``tensorrt`` (TrtLlmArgs): an argument of the other backend is refused.

    Checks, against the contract table: unknown argument or nested field (all LLM-API models forbid extra keys), a
    value of the wrong type or outside its bounds, a value outside an enum, an argument of the other backend, and the
    cross-field rules (``cuda_graph_config``: ``batch_sizes`` together with a non-zero ``max_batch_size`` must equal
    :func:`cuda_graph_batch_sizes`; ``enable_iter_req_stats`` needs ``enable_iter_perf_stats``).
    """
    c = llmapi_contract()
    out = _check_table("", c["llm_args"], kwargs, backend, "LLM()")
    missing = [k for k, spec in c["llm_args"].items() if spec.get("required") and k not in kwargs]
    out += [f"{k}: required LLM() argument missing ({c['llm_args'][k]['src']})" for k in missing]
    cg = kwargs.get("cuda_graph_config")
    if (isinstance(cg, dict) and isinstance(cg.get("batch_sizes"), list) and cg["batch_sizes"]
            and isinstance(cg.get("max_batch_size"), int) and cg["max_batch_size"] > 0
            and all(isinstance(b, int) for b in cg["batch_sizes"])):
        generated = cuda_graph_batch_sizes(cg["max_batch_size"], bool(cg.get("enable_padding", False)))
        if sorted(cg["batch_sizes"]) != generated:
            out.append(f"cuda_graph_config: batch_sizes with max_batch_size {cg['max_batch_size']} must be the generated "
                       f"{generated} (set max_batch_size 0 to give batch_sizes alone; {c['rules']['cuda_graph_max_batch_size']})")
    if kwargs.get("enable_iter_req_stats") and not kwargs.get("enable_iter_perf_stats"):
        out.append(f"enable_iter_req_stats without enable_iter_perf_stats ({c['rules']['iter_req_stats_need_perf_stats']})")
    return out


def kwargs_problems(kwargs: dict[str, Any]) -> list[str]:
    """:func:`check_kwargs` for the PyTorch backend (the name the engine stages call)."""
    return check_kwargs(kwargs, "pytorch")
