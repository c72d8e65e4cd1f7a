"""The generated model repository checked against the upstream-derived contract.

``pipeline/data/triton_backend_contract.yaml`` lists, each with its upstream ``file@commit:line``, every
``config.pbtxt`` parameter the C++ ``tensorrtllm`` backend reads (type, required or default, accepted
values), every tensor of the upstream ``inflight_batcher_llm`` templates and of the ``llmapi`` model, and
what the backend writes into a response. :func:`repository_problems` holds a generated repository to it;
the triton_repo stage refuses to write a repository with problems, and the tests run it over every GPU
recipe. The commits that could be read (the exact 1.2.1 sources could not) are the file's ``sources``.
"""

from __future__ import annotations

import functools
from importlib import resources
from pathlib import Path
from typing import Any

import yaml

CONTRACT_RESOURCE = "data/triton_backend_contract.yaml"
#: the multimodal repository's sibling (issue #46): its ``templates`` are merged into :func:`contract`'s
MULTIMODAL_RESOURCE = "data/triton_multimodal_contract.yaml"
#: our model name → upstream template name, per repository kind (layouts of triton_repo/layouts.yaml)
TEMPLATE_OF = {
    "cpp": {"tensorrt_llm": "tensorrt_llm", "ensemble": "ensemble", "preprocessing": "preprocessing",
            "postprocessing": "postprocessing", "tensorrt_llm_bls": "tensorrt_llm_bls"},
    "llmapi": {"tensorrt_llm": "llmapi_tensorrt_llm"},
}
#: the multimodal repository (a repository with ``multimodal_encoders``): upstream's multimodal ensemble and encoder
MULTIMODAL_TEMPLATE_OF = {"ensemble": "multimodal_ensemble", "multimodal_encoders": "multimodal_encoders"}
#: a request flag → the outputs the backend then writes (model_instance_state.cc@c2e65b88d852:1079-1305,
#: fillTritonResponse; the ensemble/BLS templates forward the same outputs): a model that accepts the
#: flag must declare them, or the values are dropped (python models) / the response fails (C++ backend)
FLAG_OUTPUTS = {
    "return_log_probs": ("cum_log_probs", "output_log_probs"),
    "return_context_logits": ("context_logits",),
    "return_generation_logits": ("generation_logits",),
    "return_num_input_tokens": ("num_input_tokens",),
    "return_num_output_tokens": ("num_output_tokens",),
}


@functools.cache
def contract() -> dict[str, Any]:
    """The parsed contract (read once), with the multimodal sibling's ``templates`` merged in and its
    ``trtpipe_deviations`` (``{template: {"inputs": {name: {data_type, dims, why}}}}``) under ``deviations``."""
    data = yaml.safe_load(resources.files("pipeline").joinpath(CONTRACT_RESOURCE).read_text())
    mm = yaml.safe_load(resources.files("pipeline").joinpath(MULTIMODAL_RESOURCE).read_text())
    data["templates"] = {**data["templates"], **mm["templates"]}
    data["deviations"] = mm.get("trtpipe_deviations") or {}
    # the multimodal ensemble copy (c2e65b8) predates tensors the inflight_batcher_llm ensemble (2a9abd95) has since
    # gained (return_perf_metrics, lora_*, guided_decoding_*, the kv/timing outputs): held to both, multimodal first
    ens, mm_ens = data["templates"]["ensemble"], data["templates"]["multimodal_ensemble"]
    for kind in ("inputs", "outputs"):
        have = {x["name"] for x in mm_ens[kind]}
        mm_ens[kind] = [*mm_ens[kind], *(dict(x, from_inflight_ensemble=True) for x in ens[kind] if x["name"] not in have)]
    return data


def _perf_outputs() -> tuple[str, ...]:
    for req in contract()["cpp_backend_response_requirements"]:
        if "acceptance_rate" in req["outputs"]:
            return tuple(req["outputs"])
    raise KeyError("the contract lists no perf-metrics outputs")


def _always_outputs() -> tuple[str, ...]:
    return tuple(contract()["cpp_backend_response_requirements"][0]["outputs"])


def _bool_spellings() -> list[str]:
    return list(contract()["parameter_parsing"]["types"]["bool"]["accepted"])


def parameter_problems(params: dict[str, str]) -> list[str]:
    """What in a C++ ``tensorrt_llm`` model's ``parameters`` would make the backend fail or misread.

    Missing required keys (read without try/catch: the instance fails to load), values outside a key's
    accepted set (case-sensitive), values that do not parse as the key's type, and keys the backend does
    not know (neither read nor in the upstream template: a misspelling is silently ignored).
    """
    c = contract()
    known = {p["name"]: p for p in c["cpp_backend_parameters"]}
    template_only = {p["name"] for p in c["template_keys_not_read_by_cpp_backend"]}
    out = [f"tensorrt_llm: required parameter {name!r} is missing (the backend cannot load the model; {p['source']})"
           for name, p in known.items() if p.get("required") and name not in params]
    for key, value in params.items():
        p = known.get(key)
        if p is None:
            if key not in template_only:
                out.append(f"tensorrt_llm: parameter {key!r} is not read by the tensorrtllm backend (misspelled?)")
            continue
        unset = value == "" or value in (p.get("unset_spellings") or [])
        if p.get("accepted") and not unset and value not in p["accepted"]:
            out.append(f"tensorrt_llm: {key}={value!r} is not one of {p['accepted']} ({p['source']})")
        problem = _type_problem(p["type"], value)
        if problem and not (unset and not p.get("required")):
            out.append(f"tensorrt_llm: {key}={value!r} {problem} ({p['source']})")
    return out


def _type_problem(kind: str, value: str) -> str | None:
    if kind == "bool":
        return None if value in _bool_spellings() else f"is not a boolean the backend parses ({'/'.join(_bool_spellings())})"
    parse = {"int": int, "uint32": int, "int64": int, "uint64": int, "float": float}.get(kind)
    if parse is None:
        return None
    try:
        number = parse(value)
    except ValueError:
        return f"does not parse as {kind}"
    return "is negative" if kind.startswith("uint") and number < 0 else None


#: Tensors trtpipe's CPU ``tensorrt_llm`` python model adds to the upstream interface: {model: {output: (dtype, dims)}}.
#: ``text_output`` is written only with ``build.cpu.detokenize: engine`` (the ensemble then maps it directly).
CPU_EXTRA_OUTPUTS: dict[str, dict[str, tuple[str, list[int]]]] = {"tensorrt_llm": {"text_output": ("TYPE_STRING", [-1])}}
#: Optional inputs trtpipe's ``llmapi`` model adds to upstream's (triton_repo/models/llmapi/model.py): SamplingParams
#: ``min_tokens`` / ``ignore_eos`` / ``skip_special_tokens`` (tensorrt_llm/sampling_params.py@000a01de66f0:230, 266, 270),
#: so the bench gets exact OSL and can count it from the text, and the switch of the count output below.
LLMAPI_EXTRA_INPUTS: dict[str, dict[str, tuple[str, list[int]]]] = {
    "tensorrt_llm": {"sampling_param_min_tokens": ("TYPE_INT32", [1]), "sampling_param_ignore_eos": ("TYPE_BOOL", [1]),
                     "sampling_param_skip_special_tokens": ("TYPE_BOOL", [1]),
                     "return_num_output_tokens": ("TYPE_BOOL", [1])}}
def llmapi_lora_inputs() -> dict[str, tuple[str, list[int]]]:
    """The LoRA inputs of upstream's newer llmapi ``config.pbtxt`` (``lora_id``, ``lora_name``, ``lora_path``,
    ``lora_ckpt_source``: ``templates.llmapi_tensorrt_llm.config_pbtxt_newer_copy``, @0a71057313ec:176-194), which
    trtpipe's llmapi model declares beside the older copy's interface it is held to."""
    newer = contract()["templates"]["llmapi_tensorrt_llm"]["config_pbtxt_newer_copy"]["inputs"]
    return {x["name"]: (x["data_type"], x["dims"]) for x in newer if x["name"].startswith("lora_")}


def llmapi_image_inputs() -> dict[str, tuple[str, list[int]]]:
    """The image input of upstream's newer llmapi ``config.pbtxt`` (``image_url`` STRING [-1], optional, read only with
    ``triton_config.multimodal``: @0a71057313ec:54-67, NVIDIA/TensorRT-LLM PR #18381, after 1.2.1), which trtpipe's
    llmapi model declares for a build with a vision section."""
    newer = contract()["templates"]["llmapi_tensorrt_llm"]["config_pbtxt_newer_copy"]["inputs"]
    return {x["name"]: (x["data_type"], x["dims"]) for x in newer if x["name"] == "image_url"}


#: The output trtpipe's ``llmapi`` model adds: the tokens each response adds (the C++ backend's ``num_output_tokens``,
#: same name, type and dims: ``templates.tensorrt_llm`` of pipeline/data/triton_backend_contract.yaml).
#: A multimodal build adds ``num_image_tokens`` (INT32 [1]: the image tokens of a request's prompt; upstream has no such
#: output, config.pbtxt@0a71057313ec's outputs are text, reasons, logprob, KV and timing stats).
LLMAPI_EXTRA_OUTPUTS: dict[str, dict[str, tuple[str, list[int]]]] = {
    "tensorrt_llm": {"num_output_tokens": ("TYPE_INT32", [1]), "num_image_tokens": ("TYPE_INT32", [1])}}


def tensor_problems(model: str, template: str, cfg: Any, extra_outputs: dict[str, tuple[str, list[int]]] | None = None,
                    extra_inputs: dict[str, tuple[str, list[int]]] | None = None) -> list[str]:
    """Tensors of our ``ModelConfig`` ``cfg`` that differ from upstream template ``template``.

    Every input and output we declare must exist upstream with the same data type (an upstream
    ``${…}`` type, e.g. the logits dtype, accepts any) and dims; inputs keep upstream's ``optional``.
    Outputs the backend always writes, and those a declared ``return_*`` flag makes it write, must be
    declared; the LLM-API model must declare every output upstream's ``model.py`` emits.
    ``extra_outputs`` ({name: (dtype, dims)}) are outputs allowed beyond upstream's, with exactly that type and dims;
    ``extra_inputs`` the same for inputs (which must then be optional).
    """
    from tritonclient.grpc import model_config_pb2

    t = contract()["templates"][template]
    name_of = model_config_pb2.DataType.Name
    out: list[str] = []
    deviate = contract()["deviations"].get(template, {})
    for kind, ours, theirs in (("input", cfg.input, t["inputs"]), ("output", cfg.output, t["outputs"])):
        up = {x["name"]: x for x in theirs}
        for name, d in (deviate.get(f"{kind}s") or {}).items():  # trtpipe's recorded departures, each with its why
            up[name] = {**up.get(name, {"optional": True}), "name": name, "data_type": d["data_type"], "dims": d["dims"]}
        for x in ours:
            u = up.get(x.name)
            extra = (extra_outputs if kind == "output" else extra_inputs) or {}
            if u is None and x.name in extra:
                dtype, dims = extra[x.name]
                if name_of(x.data_type) != dtype or list(x.dims) != dims or (kind == "input" and not x.optional):
                    whose = "trtpipe's CPU model" if kind == "output" else "trtpipe's llmapi model"
                    out.append(f"{model}: {kind} {x.name!r} must be {dtype} dims {dims}{' optional' if kind == 'input' else ''} "
                               f"({whose})")
                continue
            if u is None:
                out.append(f"{model}: {kind} {x.name!r} does not exist in upstream {template} ({t['source']})")
                continue
            dtype = name_of(x.data_type)
            if not str(u["data_type"]).startswith("${") and dtype != u["data_type"]:
                out.append(f"{model}: {kind} {x.name!r} is {dtype}, upstream declares {u['data_type']} (line {u.get('line')})")
            if list(x.dims) != list(u["dims"]):
                out.append(f"{model}: {kind} {x.name!r} has dims {list(x.dims)}, upstream {u['dims']} (line {u.get('line')})")
            if kind == "input" and "optional" in u and bool(x.optional) != bool(u["optional"]):
                out.append(f"{model}: input {x.name!r} optional={x.optional}, upstream optional={u['optional']}")
    declared_in = {x.name for x in cfg.input}
    declared_out = {x.name for x in cfg.output}
    need: set[str] = set()
    if template == "tensorrt_llm":
        need |= set(_always_outputs())
    if template == "llmapi_tensorrt_llm":
        need |= {x["name"] for x in t["outputs"]}
    if "return_perf_metrics" in declared_in:
        need |= set(_perf_outputs()) & {x["name"] for x in t["outputs"]}
    for flag, outputs in FLAG_OUTPUTS.items():
        if flag in declared_in:
            need |= set(outputs) & {x["name"] for x in t["outputs"]}
    out += [f"{model}: output {name!r} is not declared, but upstream's backend/model writes it" for name in sorted(need - declared_out)]
    return out


def repository_problems(configs: dict[str, Any], implementation: str) -> list[str]:
    """Every contract problem of a repository's ``{model name: ModelConfig}``.

    Args:
        configs: the parsed configs (e.g. from :func:`pipeline.triton.model_config.load_model_config`).
        implementation: the ``tensorrt_llm`` implementation of the layout: ``cpp`` (C++ ``tensorrtllm``
            backend: tensors and parameters are checked), ``llmapi`` (the LLM-API python model) or
            ``cpu`` (trtpipe's python model behind the same tensors: tensors only). A repository with
            ``multimodal_encoders`` is held to upstream's multimodal ensemble and encoder
            (``pipeline/data/triton_multimodal_contract.yaml``).
    """
    templates = TEMPLATE_OF["llmapi" if implementation == "llmapi" else "cpp"]
    if "multimodal_encoders" in configs:
        templates = {**templates, **MULTIMODAL_TEMPLATE_OF}
    out: list[str] = []
    for model, cfg in configs.items():
        template = templates.get(model)
        if template is None:
            out.append(f"{model}: not a model of the upstream {implementation} repository")
            continue
        extra = {"cpu": CPU_EXTRA_OUTPUTS, "llmapi": LLMAPI_EXTRA_OUTPUTS}.get(implementation, {}).get(model)
        extra_in = {**LLMAPI_EXTRA_INPUTS[model], **llmapi_lora_inputs(), **llmapi_image_inputs()} if implementation == "llmapi" and model in LLMAPI_EXTRA_INPUTS else None
        out += tensor_problems(model, template, cfg, extra, extra_in)
        if implementation == "cpp" and model == "tensorrt_llm":
            if cfg.backend != "tensorrtllm":
                out.append(f"tensorrt_llm: backend {cfg.backend!r}, upstream uses 'tensorrtllm'")
            out += parameter_problems({k: v.string_value for k, v in cfg.parameters.items()})
    return out


def load_repository(repo: Path) -> dict[str, Any]:
    """``{model name: ModelConfig}`` of every ``<model>/config.pbtxt`` in ``repo``."""
    from pipeline.triton.model_config import load_model_config

    return {p.parent.name: load_model_config(p) for p in sorted(Path(repo).glob("*/config.pbtxt"))}
