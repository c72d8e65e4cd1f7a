"""The command line of trtpipe's CPU stand-in for trtllm-serve: ``python -m pipeline.cpu_runtime.openai MODEL
[trtllm-serve flags]`` (:mod:`pipeline.cpu_runtime.openai`).

``SERVE`` = tensorrt_llm/commands/serve.py@00209af149e7, ``OS`` = tensorrt_llm/serve/openai_server.py@e7f7345e31e5.

* Command line: the positional MODEL and the flags of the contract's ``trtllm_serve.flags``
  (pipeline/data/trtllm_1.2.1_llmapi_contract.yaml, aliases included); flags become ``LLM()`` arguments as
  SERVE:89-173 ``get_llm_args`` maps them (``--tp_size`` → ``tensor_parallel_size`` SERVE:149, the KV fraction →
  ``kv_cache_config`` SERVE:125-126), then the ``--extra_llm_api_options`` YAML is applied over them, dicts merged
  (``update_llm_args_with_extra_dict``, SERVE:32). Only flags given are passed: the facade checks the engine limits.
* Start: the socket is bound first, then the LLM is built, then the app serves on that socket (SERVE:189-230),
  so ``/health`` answers only once the model is loaded.
"""

from __future__ import annotations

import argparse
import asyncio
import logging
import socket
import sys
from pathlib import Path
from typing import Any

from pipeline.cpu_runtime.openai.routes import create_app

log = logging.getLogger("trtpipe.openai_cpu")  # the routes' logger

#: HTTP keep-alive, seconds (OS:72 TIMEOUT_KEEP_ALIVE)
KEEP_ALIVE_S = 5
#: ``--log_level`` values (upstream's logger severities) → Python logging levels
LOG_LEVELS = {"internal_error": logging.ERROR, "error": logging.ERROR, "warning": logging.WARNING, "info": logging.INFO,
              "verbose": logging.DEBUG, "debug": logging.DEBUG, "trace": logging.DEBUG}


def parser() -> argparse.ArgumentParser:
    """trtllm-serve's command line (the contract's ``trtllm_serve.flags``, aliases included); every default ``None``
    (a flag not given is not passed to the LLM)."""
    from pipeline.trtllm.llmapi import llmapi_contract

    p = argparse.ArgumentParser(
        prog="python -m pipeline.cpu_runtime.openai",
        description="trtpipe's CPU stand-in for trtllm-serve (NOT TensorRT-LLM): an OpenAI-compatible server "
                    "(/health, /v1/models, /v1/completions, /v1/chat/completions) over the CPU engine's LLM facade, "
                    "taking trtllm-serve's flags.")
    p.add_argument("model", help="The model directory (the CPU engine directory of a build).")
    kinds = {"int": int, "float": float, "str": str}
    for name, spec in llmapi_contract()["trtllm_serve"]["flags"].items():
        names = [f"--{name}", *(f"--{a}" for a in spec.get("aliases", ()))]
        if spec["type"] == "flag":
            p.add_argument(*names, dest=name, action="store_true", default=None)
        elif spec["type"] == "enum":
            p.add_argument(*names, dest=name, choices=spec["values"], default=None)
        else:
            p.add_argument(*names, dest=name, type=kinds[spec["type"]], default=None)
    return p


#: flags → LLM() arguments (SERVE:144-171)
_FLAG_ARGS = {"tokenizer": "tokenizer", "backend": "backend", "tp_size": "tensor_parallel_size",
              "pp_size": "pipeline_parallel_size", "trust_remote_code": "trust_remote_code", "max_beam_width": "max_beam_width",
              "max_batch_size": "max_batch_size", "max_num_tokens": "max_num_tokens", "max_seq_len": "max_seq_len",
              "enable_chunked_prefill": "enable_chunked_prefill"}


def llm_kwargs(args: argparse.Namespace) -> dict[str, Any]:
    """The ``LLM()`` arguments of a parsed command line: the flags given, then the extra-options YAML over them.

    Raises:
        OSError / ValueError: the YAML cannot be read or is not a mapping.
    """
    import yaml

    kwargs: dict[str, Any] = {"model": args.model}
    kwargs |= {arg: getattr(args, flag) for flag, arg in _FLAG_ARGS.items() if getattr(args, flag) is not None}
    if args.kv_cache_free_gpu_memory_fraction is not None:
        kwargs["kv_cache_config"] = {"free_gpu_memory_fraction": args.kv_cache_free_gpu_memory_fraction}
    if args.extra_llm_api_options:
        extra = yaml.safe_load(Path(args.extra_llm_api_options).read_text()) or {}
        if not isinstance(extra, dict):
            raise ValueError(f"{args.extra_llm_api_options}: not a mapping of LLM() arguments")
        for key, value in extra.items():  # dict-valued arguments (kv_cache_config, …) are merged, the rest replaced
            old = kwargs.get(key)
            kwargs[key] = {**old, **value} if isinstance(old, dict) and isinstance(value, dict) else value
    return kwargs


def _bind(host: str, port: int) -> socket.socket:
    """The listening address bound before the model loads, as SERVE:189-197."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    s = socket.socket(family, socket.SOCK_STREAM)
    s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    s.bind((host, port))
    return s


def main(argv: list[str] | None = None) -> int:
    """Parse trtllm-serve's flags, load the model, serve until SIGINT/SIGTERM; the exit status (1 with one
    ``error:`` line on stderr when the address cannot be bound or the model does not load)."""
    args = parser().parse_args(argv)
    logging.basicConfig(level=LOG_LEVELS.get(args.log_level or "info", logging.INFO),
                        format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    host, port = args.host or "localhost", 8000 if args.port is None else args.port  # contract defaults (SERVE p0)
    try:
        kwargs = llm_kwargs(args)
        sock = _bind(host, port)
    except (OSError, ValueError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 1
    from pipeline.cpu_runtime.llm import LLM

    try:
        llm = LLM(**kwargs)
    except (OSError, ValueError, KeyError) as e:
        print(f"error: {args.model}: {e}", file=sys.stderr)
        return 1
    model = Path(args.model)
    name = model.name if model.is_dir() else args.model  # OS:127-131: a directory is served under its name
    log.info("trtpipe CPU stand-in for trtllm-serve (not TensorRT-LLM): %s as %r on http://%s:%d; ignored LLM() "
             "arguments: %s", args.model, name, host, port, ", ".join(llm.ignored_args) or "none")
    import uvicorn

    app = create_app(llm, name, str(kwargs.get("tokenizer") or args.model))
    config = uvicorn.Config(app, log_level=LOG_LEVELS.get(args.log_level or "info", logging.INFO),
                            timeout_keep_alive=KEEP_ALIVE_S, timeout_graceful_shutdown=5)
    try:
        asyncio.run(uvicorn.Server(config).serve(sockets=[sock]))
    finally:
        llm.shutdown()
    return 0
