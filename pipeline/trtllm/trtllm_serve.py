"""``trtllm-serve``: TensorRT-LLM's OpenAI-compatible server for the PyTorch backend (``serving.frontend:
trtllm-serve``), as a command line and an extra-options YAML.

Every flag is one of ``trtllm-serve``'s click options (the ``trtllm_serve`` table of
``pipeline/data/trtllm_1.2.1_llmapi_contract.yaml``, source ``tensorrt_llm/commands/serve.py@00209af149e7``);
:func:`argv_problems` holds a command line to it. The model is the unified HF checkpoint the quantize stage wrote;
the ``LLM()`` arguments that have no flag go into the YAML given to ``--extra_llm_api_options``, which upstream
applies over the flags (``update_llm_args_with_extra_dict``). Tensor/pipeline parallelism are ``--tp_size`` /
``--pp_size``: on one node ``trtllm-serve`` starts its own rank workers (no ``mpirun`` around it).

On the cpu target the same flags go to trtpipe's CPU stand-in for trtllm-serve (:func:`cpu_argv`: ``<python> -m
pipeline.cpu_runtime.openai``, an OpenAI-compatible server over the CPU engine's LLM facade; it is not TensorRT-LLM).
"""

from __future__ import annotations

import sys
from typing import Any

from pipeline.trtllm.llmapi import llmapi_contract

BINARY = "trtllm-serve"
#: the module of trtpipe's CPU stand-in for trtllm-serve (pipeline/cpu_runtime/openai/), run with ``python -m``
CPU_MODULE = "pipeline.cpu_runtime.openai"
#: LLM() arguments passed as flags (the rest go into the extra-options YAML)
_FLAG_ARGS = {"model": None, "tokenizer": "--tokenizer", "backend": "--backend", "tensor_parallel_size": "--tp_size",
              "pipeline_parallel_size": "--pp_size"}


#: trtllm-serve's own ``scheduler_config`` (``get_llm_args``, tensorrt_llm/commands/serve.py@c292b9f997d6:121-128):
#: GUARANTEED_NO_EVICT with batch-size tuning on. A ``scheduler_config`` in the extra-options YAML replaces this object
#: whole: ``update_llm_args_with_extra_dict`` builds ``SchedulerConfig(**yaml["scheduler_config"])`` and merges the
#: top-level dicts (``llm_args | llm_args_dict``, llm_args.py@c292b9f997d6), so a YAML without
#: ``dynamic_batch_config`` turns the tuning off. DynamicBatchConfig's three fields have no defaults on the 1.2 line.
SERVE_SCHEDULER_DEFAULT: dict[str, Any] = {
    "capacity_scheduler_policy": "GUARANTEED_NO_EVICT",
    "dynamic_batch_config": {"enable_batch_size_tuning": True, "enable_max_num_tokens_tuning": False,
                             "dynamic_batch_moving_average_window": 128},
}


def extra_options(kwargs: dict[str, Any]) -> dict[str, Any]:
    """The ``--extra_llm_api_options`` YAML content: ``kwargs`` without the arguments given as flags
    (``model``, ``tokenizer``, ``backend``, parallel sizes, ``trust_remote_code``). Its ``scheduler_config`` is
    trtllm-serve's own (:data:`SERVE_SCHEDULER_DEFAULT`) with the recipe's fields over it, so the server keeps its
    ``dynamic_batch_config`` unless the kwargs set one."""
    out = {k: v for k, v in kwargs.items() if k not in _FLAG_ARGS and k != "trust_remote_code"}
    if "scheduler_config" in out:
        out["scheduler_config"] = {**SERVE_SCHEDULER_DEFAULT, **(out["scheduler_config"] or {})}
    return out


def argv(kwargs: dict[str, Any], options_path: str, *, host: str = "127.0.0.1", port: int = 8000) -> list[str]:
    """The ``trtllm-serve`` command line for LLM() ``kwargs`` with the extra-options YAML at ``options_path``.

    ``host``/``port``: the OpenAI HTTP endpoint (upstream defaults localhost:8000)."""
    out = [BINARY, str(kwargs["model"])]
    for key, flag in _FLAG_ARGS.items():
        if flag is not None and kwargs.get(key) is not None:
            out += [flag, str(kwargs[key])]
    if kwargs.get("trust_remote_code"):
        out.append("--trust_remote_code")
    return out + ["--host", host, "--port", str(int(port)), "--extra_llm_api_options", options_path]


def cpu_argv(kwargs: dict[str, Any], options_path: str, *, host: str = "127.0.0.1", port: int = 8000) -> list[str]:
    """The command line of trtpipe's CPU stand-in for ``trtllm-serve``: this interpreter, ``-m`` :data:`CPU_MODULE`,
    then exactly the model and flags :func:`argv` gives ``trtllm-serve`` (``options_path``: the YAML of ``LLM()``
    arguments applied over the flags, as upstream's ``--extra_llm_api_options``)."""
    return [sys.executable, "-m", CPU_MODULE, *argv(kwargs, options_path, host=host, port=port)[1:]]


def serve_flags(cmd: list[str]) -> list[str]:
    """``cmd`` (a ``trtllm-serve`` line or a :func:`cpu_argv` line) as ``["trtllm-serve", MODEL, flags…]``, the form
    :func:`argv_problems` checks."""
    return [BINARY, *cmd[3:]] if len(cmd) > 2 and cmd[1:3] == ["-m", CPU_MODULE] else list(cmd)


def argv_problems(cmd: list[str]) -> list[str]:
    """Flags of ``cmd`` that ``trtllm-serve`` 1.2.1 does not have, or whose value is not of the flag's type or choices."""
    flags = llmapi_contract()["trtllm_serve"]["flags"]
    names = {f"--{n}": spec for n, spec in flags.items()}
    names.update({f"--{a}": spec for spec in flags.values() for a in spec.get("aliases", ())})
    out, i = [], 2
    while i < len(cmd):
        spec = names.get(cmd[i])
        if spec is None:
            out.append(f"trtllm-serve has no option {cmd[i]}")
            i += 2 if i + 1 < len(cmd) and not cmd[i + 1].startswith("--") else 1  # skip its value too
            continue
        if spec["type"] == "flag":
            i += 1
            continue
        value = cmd[i + 1] if i + 1 < len(cmd) else None
        if value is None:
            out.append(f"{cmd[i]} needs a value")
        elif spec["type"] == "enum" and value not in spec["values"]:
            out.append(f"{cmd[i]} {value}: not one of {spec['values']}")
        elif spec["type"] in ("int", "float"):
            try:
                (int if spec["type"] == "int" else float)(value)
            except ValueError:
                out.append(f"{cmd[i]} {value}: not {spec['type']}")
        i += 2
    return out
