"""trtpipe's CPU stand-in for ``trtllm-serve`` — an OpenAI-compatible server over the CPU engine's LLM facade
(:class:`pipeline.cpu_runtime.llm.LLM`). It is NOT TensorRT-LLM: it speaks the part of trtllm-serve's HTTP interface
that ``trtpipe bench --api openai`` and an operator use, so that a ``serving.frontend: trtllm-serve`` build runs for
real on the cpu target. Run as ``python -m pipeline.serve.openai_cpu MODEL [trtllm-serve flags]``; on GPU targets
``trtpipe serve`` runs the real ``trtllm-serve`` instead.

Upstream code read (line numbers counted on the index's copies; no 1.2.1-tagged copy is readable):
``OS`` = tensorrt_llm/serve/openai_server.py@e7f7345e31e5 (1.2-era), ``OS2`` = the same file @00057725d9a6,
``PROTO`` = tensorrt_llm/serve/openai_protocol.py@54cf7be08a35, ``POST`` = tensorrt_llm/serve/postprocess_handlers.py
@01bf19231d29, ``SERVE`` = tensorrt_llm/commands/serve.py@00209af149e7.

* Command line: the positional MODEL and the flags of the contract's ``trtllm_serve.flags``
  (pipeline/data/trtllm_1.2.1_llmapi_contract.yaml, aliases included); flags become ``LLM()`` arguments as
  SERVE:89-173 ``get_llm_args`` maps them (``--tp_size`` → ``tensor_parallel_size`` SERVE:149, the KV fraction →
  ``kv_cache_config`` SERVE:125-126), then the ``--extra_llm_api_options`` YAML is applied over them, dicts merged
  (``update_llm_args_with_extra_dict``, SERVE:32). Only flags given are passed: the facade checks the engine limits.
* Start: the socket is bound first, then the LLM is built, then the app serves on that socket (SERVE:189-230),
  so ``/health`` answers only once the model is loaded.
* Routes and fields: see the comments at each one. Decoding is the facade's (greedy): ``temperature``, ``top_p``,
  ``top_k``, ``seed`` and the penalties are accepted and have no effect; ``n``/``best_of`` > 1, beam search,
  ``logprobs``, ``suffix`` and several prompts per request are refused with HTTP 400. ``max_tokens`` absent: the
  facade's ``SamplingParams`` default (32 tokens).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import logging
import socket
import sys
import threading
import time
import uuid
from pathlib import Path
from typing import Any, Literal

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response, StreamingResponse
from pydantic import AliasChoices, BaseModel, ConfigDict, Field, model_validator

from pipeline.serve.openai_images import chat_images

log = logging.getLogger("trtpipe.openai_cpu")
#: seconds between two client-disconnect checks of a request in flight (OS:205-213 polls every 1 s)
DISCONNECT_POLL_S = 0.5
#: HTTP keep-alive, seconds (OS:72 TIMEOUT_KEEP_ALIVE)
KEEP_ALIVE_S = 5
#: ``--log_level`` values (upstream's logger severities) → Python logging levels
LOG_LEVELS = {"internal_error": logging.ERROR, "error": logging.ERROR, "warning": logging.WARNING, "info": logging.INFO,
              "verbose": logging.DEBUG, "debug": logging.DEBUG, "trace": logging.DEBUG}


# ---------------------------------------------------------------------------------------------- requests (PROTO)
class _Strict(BaseModel):
    # unknown fields are refused, as PROTO:61-63 OpenAIBaseModel (extra="forbid")
    model_config = ConfigDict(extra="forbid", populate_by_name=True)


class StreamOptions(_Strict):
    # PROTO:66-68: both default to true once stream_options is given
    include_usage: bool | None = True
    continuous_usage_stats: bool | None = True


class ResponseFormat(_Strict):
    """PROTO ResponseFormat (guided decoding; the CPU engine has no structural tags)."""

    type: Literal["text", "json", "json_object", "regex", "ebnf", "structural_tag"]
    schema_: dict | None = Field(default=None, alias="schema")
    regex: str | None = None
    ebnf: str | None = None


def _guided(fmt: ResponseFormat | None) -> Any:
    """PROTO _response_format_to_guided_decoding_params: the facade's GuidedDecodingParams (None: unguided).
    Raises ValueError as upstream does (``json`` without ``schema``), and for a structural tag."""
    from pipeline.cpu_runtime.guided import GuidedDecodingParams

    if fmt is None or fmt.type == "text":
        return None
    if fmt.type == "json":
        if fmt.schema_ is None:
            raise ValueError("The 'schema' field is required when response_format.type is 'json'.")
        return GuidedDecodingParams(json=fmt.schema_)
    if fmt.type == "structural_tag":
        raise ValueError("response_format.type 'structural_tag' is not supported by trtpipe's CPU stand-in")
    return GuidedDecodingParams(json_object=fmt.type == "json_object", regex=fmt.regex, grammar=fmt.ebnf)


class _Common(_Strict):
    """The fields CompletionRequest (PROTO:210-249) and ChatCompletionRequest (PROTO:498-550) share."""

    model: str  # PROTO:213 / 505 (required; upstream does not check it against the served name)
    n: int = 1
    best_of: int | None = None
    seed: int | None = None  # PROTO:223 / 515 (no effect: greedy)
    stop: str | list[str] | None = Field(default_factory=list)  # PROTO:224 / 516
    stream: bool | None = False  # PROTO:225 / 517
    stream_options: StreamOptions | None = None  # PROTO:226 / 518
    temperature: float | None = None  # PROTO:228 / 519 (no effect: greedy)
    top_p: float | None = None  # PROTO:229 / 520 (no effect: greedy)
    top_k: int = 0
    user: str | None = None
    frequency_penalty: float | None = 0.0
    presence_penalty: float | None = 0.0
    repetition_penalty: float = 1.0
    use_beam_search: bool = False
    stop_token_ids: list[int] | None = Field(default_factory=list)
    include_stop_str_in_output: bool = False
    ignore_eos: bool = False  # PROTO:243 / 545
    min_tokens: int = 0  # PROTO:244 / 546
    lora_request: dict[str, Any] | None = None  # PROTO:231 / 550: LoRARequest's fields (lora_name, lora_int_id, lora_path)
    skip_special_tokens: bool = True
    response_format: ResponseFormat | None = None  # PROTO CompletionRequest / ChatCompletionRequest

    @model_validator(mode="before")
    @classmethod
    def _stream_options_need_stream(cls, data: Any) -> Any:
        # PROTO:328-332 (CompletionRequest.validate_stream_options)
        if isinstance(data, dict) and data.get("stream_options") and not data.get("stream"):
            raise ValueError("Stream options can only be defined when stream is true.")
        return data


class CompletionRequest(_Common):
    prompt: str | list[int] | list[str] | list[list[int]]  # PROTO:214
    max_tokens: int | None = None  # PROTO:220
    echo: bool | None = False
    logprobs: int | None = None  # refused when set, as PROTO:321-324
    suffix: str | None = None  # refused when set, as PROTO:336-339
    add_special_tokens: bool = True
    detokenize: bool = True


class ChatCompletionRequest(_Common):
    messages: list[dict[str, Any]]  # PROTO:501
    # PROTO:510-511: max_completion_tokens, read from max_tokens
    max_completion_tokens: int | None = Field(default=None, validation_alias=AliasChoices("max_tokens", "max_completion_tokens"))
    logprobs: bool | None = False
    add_generation_prompt: bool = True  # PROTO:560
    add_special_tokens: bool = False  # PROTO:567: the chat template adds them


# ---------------------------------------------------------------------------------------------- responses
def _error(message: str, status: int = 400, kind: str = "BadRequestError") -> JSONResponse:
    """An ErrorResponse (PROTO:112-117) as OS:220-228 create_error_response sends it (default 400)."""
    return JSONResponse({"object": "error", "message": message, "type": kind, "param": None, "code": status}, status)


def _usage(prompt: int, completion: int, cached: int = 0) -> dict[str, Any]:
    """UsageInfo (PROTO:75-79); ``cached``: prompt tokens served from reused KV blocks (block reuse on, else 0)."""
    return {"prompt_tokens": prompt, "total_tokens": prompt + completion, "completion_tokens": completion,
            "prompt_tokens_details": {"cached_tokens": cached}}


def _sampling(req: _Common, max_tokens: int | None, *, add_special_tokens: bool, detokenize: bool = True) -> Any:
    """The facade's SamplingParams for ``req`` (PROTO:274-317 to_sampling_params, the fields the facade has)."""
    from pipeline.cpu_runtime.llm import SamplingParams

    extra = {} if max_tokens is None else {"max_tokens": max_tokens}
    return SamplingParams(
        **extra, min_tokens=req.min_tokens, ignore_eos=req.ignore_eos, stop=req.stop or None,
        stop_token_ids=req.stop_token_ids or None, include_stop_str_in_output=req.include_stop_str_in_output,
        n=req.n, best_of=req.best_of, use_beam_search=req.use_beam_search, seed=req.seed, top_k=req.top_k or None,
        temperature=1.0 if req.temperature is None else req.temperature, top_p=1.0 if req.top_p is None else req.top_p,
        frequency_penalty=req.frequency_penalty, presence_penalty=req.presence_penalty,
        repetition_penalty=req.repetition_penalty, skip_special_tokens=req.skip_special_tokens,
        add_special_tokens=add_special_tokens, detokenize=detokenize, guided_decoding=_guided(req.response_format))


class _ChatTemplate:
    """The model's chat template (its tokenizer_config.json, rendered by transformers), loaded on first use."""

    def __init__(self, tokenizer_dir: str) -> None:
        self.dir, self._tok, self._lock = tokenizer_dir, None, threading.Lock()

    def render(self, messages: list[dict[str, Any]], add_generation_prompt: bool) -> str:
        with self._lock:
            if self._tok is None:
                from transformers import AutoTokenizer

                self._tok = AutoTokenizer.from_pretrained(self.dir, local_files_only=True)
        return self._tok.apply_chat_template(messages, tokenize=False, add_generation_prompt=add_generation_prompt)


def _lora(req: _Common) -> Any:
    """The request's ``lora_request`` as a :class:`pipeline.cpu_runtime.llm.LoRARequest` (ValueError when malformed)."""
    from pipeline.cpu_runtime.llm import LoRARequest

    try:
        return None if req.lora_request is None else LoRARequest(**req.lora_request)
    except TypeError as e:
        raise ValueError(f"lora_request: {e}") from None


# ---------------------------------------------------------------------------------------------- the app
def create_app(llm: Any, model_name: str, tokenizer_dir: str) -> FastAPI:
    """The FastAPI app serving ``llm`` (a :class:`pipeline.cpu_runtime.llm.LLM`) as ``model_name``."""
    app = FastAPI(title="trtpipe CPU stand-in for trtllm-serve (not TensorRT-LLM)")
    template = _ChatTemplate(tokenizer_dir)

    @app.exception_handler(RequestValidationError)
    async def _invalid(_: Request, exc: RequestValidationError) -> Any:  # OS:192-194: a malformed request is a 400
        return _error("; ".join(f"{'.'.join(map(str, e['loc'][1:])) or 'body'}: {e['msg']}" for e in exc.errors()))

    @app.get("/health")  # OS:245 route; OS2:484-492: 200 while the model answers (OS2:333-339), else 503
    async def health() -> Any:
        state = llm.health()
        if state.ok:
            return Response(status_code=200)
        log.warning("/health: %s", state.reason)
        return Response(status_code=503, content="LLM is unavailable. Please check the server logs for more details.")

    @app.get("/v1/models")  # OS:248 route, OS:342-344 get_model; ModelList/ModelCard PROTO:82-91
    async def models() -> Any:
        return JSONResponse({"object": "list", "data": [{"id": model_name, "object": "model", "created": int(time.time()),
                                                         "owned_by": "trtpipe-cpu"}]})

    @app.post("/v1/completions")  # OS:257 route, OS:646-803 openai_completion
    async def completions(req: CompletionRequest, raw: Request) -> Any:
        if req.logprobs:
            return _error("logprobs is not supported")
        if req.suffix:
            return _error("suffix is not supported")
        prompt: Any = req.prompt  # OS:737-741: a string or token ids is one prompt, a list of them several
        if isinstance(prompt, list) and prompt and isinstance(prompt[0], (str, list)):
            if len(prompt) != 1:
                return _error(f"{len(prompt)} prompts in one request: trtpipe's CPU stand-in serves one prompt per request")
            prompt = prompt[0]
        try:
            params = _sampling(req, req.max_tokens, add_special_tokens=req.add_special_tokens, detokenize=req.detokenize)
            res = llm.generate_async(prompt, params, streaming=bool(req.stream), lora_request=_lora(req))  # OS:771-778
        except ValueError as e:
            return _error(str(e))
        return await _respond(raw, res, req, chat=False, echo=prompt if req.echo and isinstance(prompt, str) else None)

    @app.post("/v1/chat/completions")  # OS:260 route, OS:445-568 openai_chat
    async def chat(req: ChatCompletionRequest, raw: Request) -> Any:
        if req.logprobs:
            return _error("logprobs is not supported by trtpipe's CPU stand-in")
        try:
            prompt = await asyncio.to_thread(template.render, req.messages, req.add_generation_prompt)
            images = await asyncio.to_thread(chat_images, req.messages)  # image_url parts (openai_images.py)
            params = _sampling(req, req.max_completion_tokens, add_special_tokens=req.add_special_tokens)
            inputs = {"prompt": prompt, "multi_modal_data": {"image": images}} if images else prompt
            res = llm.generate_async(inputs, params, streaming=bool(req.stream), lora_request=_lora(req))  # OS:541-549
        except Exception as e:  # OS:566-568: any failure of the request is a 400 naming it
            return _error(str(e))
        return await _respond(raw, res, req, chat=True)

    async def _respond(raw: Request, res: Any, req: _Common, *, chat: bool, echo: str | None = None) -> Any:
        # OS:550 / OS:779: a client that goes away aborts its request in the engine (OS:205-213 await_disconnected)
        watcher = asyncio.create_task(_abort_on_disconnect(raw, res))
        rid = f"{'chatcmpl' if chat else 'cmpl'}-{uuid.uuid4().hex}"
        if req.stream:  # OS:555-558 / OS:786-791: server-sent events
            return StreamingResponse(_events(res, rid, req.stream_options, chat=chat, watcher=watcher, echo=echo),
                                     media_type="text/event-stream")
        try:
            async for _ in res:  # not streaming: one item, at the end
                pass
        except RuntimeError as e:
            return _error(str(e), 500, "InternalServerError")
        finally:
            watcher.cancel()
        return JSONResponse(_final_body(res, rid, chat=chat, echo=echo))

    async def _abort_on_disconnect(raw: Request, res: Any) -> None:
        while not await raw.is_disconnected():
            await asyncio.sleep(DISCONNECT_POLL_S)
        if not res.finished:
            res.abort()
            log.info("%s disconnected: aborted request %s", raw.client, res.request_id)

    async def _events(res: Any, rid: str, options: StreamOptions | None, *, chat: bool, watcher: asyncio.Task,
                      echo: str | None):
        # POST:552-557 (completions) / POST:256-261 (chat): usage only with stream_options.include_usage, and in every
        # chunk with continuous_usage_stats too
        include = bool(options and options.include_usage)
        running = include and bool(options and options.continuous_usage_stats)
        created, n_prompt = int(time.time()), len(res.prompt_token_ids)
        kind = "chat.completion.chunk" if chat else "text_completion"  # PROTO:469-475 / PROTO:174-180

        def chunk(choices: list[dict[str, Any]], usage: dict[str, Any] | None) -> str:
            body = {"id": rid, "object": kind, "created": created, "model": model_name, "choices": choices}
            return f"data: {json.dumps(body | ({'usage': usage} if usage is not None else {}))}\n\n"

        try:
            if chat:  # POST:262-266: the first chunk carries the role only
                yield chunk([{"index": 0, "delta": {"role": "assistant"}, "finish_reason": None}], _usage(n_prompt, 0) if running else None)
            first = True
            async for out in res:
                o = out.outputs[0]
                text = (echo or "") + o.text_diff if first else o.text_diff
                first = False
                choice = ({"index": 0, "delta": {"content": text}} if chat else {"index": 0, "text": text, "logprobs": None})
                yield chunk([choice | {"finish_reason": o.finish_reason, "stop_reason": o.stop_reason}],
                            _usage(n_prompt, o.length) if running else None)  # POST:583-589
            if include:  # POST:593-610: a last chunk with no choices and the request's usage
                yield chunk([], _usage(n_prompt, res.outputs[0].length, res.cached_tokens))
            yield "data: [DONE]\n\n"  # OS:733 (completions), OS:470 (chat)
        except RuntimeError as e:  # the engine failed the request
            yield f"data: {json.dumps({'error': {'object': 'error', 'message': str(e), 'type': 'InternalServerError', 'code': 500}})}\n\n"
        finally:
            watcher.cancel()
            if not res.finished:  # the client went away mid-stream: free the engine slot now
                res.abort()
                log.info("stream of request %s closed early: aborted it", res.request_id)

    def _final_body(res: Any, rid: str, *, chat: bool, echo: str | None) -> dict[str, Any]:
        o = res.outputs[0]
        usage = _usage(len(res.prompt_token_ids), o.length, res.cached_tokens)  # POST:650 / POST:462-470
        if chat:  # ChatCompletionResponse PROTO:439-448
            choice = {"index": 0, "message": {"role": "assistant", "content": o.text}, "logprobs": None}
            obj = "chat.completion"
        else:  # CompletionResponse PROTO:146-155
            choice = {"index": 0, "text": (echo or "") + o.text, "token_ids": None, "logprobs": None}
            obj = "text_completion"
        choice |= {"finish_reason": o.finish_reason, "stop_reason": o.stop_reason}
        return {"id": rid, "object": obj, "created": int(time.time()), "model": model_name, "choices": [choice], "usage": usage}

    return app


# ---------------------------------------------------------------------------------------------- command line
def parser() -> argparse.ArgumentParser:
    """trtllm-serve's command line (the contract's ``trtllm_serve.flags``, aliases included); every default ``None``
    (a flag not given is not passed to the LLM)."""
    from pipeline.trtllm.llmapi import llmapi_contract

    p = argparse.ArgumentParser(
        prog="python -m pipeline.serve.openai_cpu",
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


if __name__ == "__main__":
    sys.exit(main())
