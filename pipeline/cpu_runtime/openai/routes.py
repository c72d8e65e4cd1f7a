"""The routes of trtpipe's CPU stand-in for trtllm-serve (``/health``, ``/v1/models``, ``/v1/completions``,
``/v1/chat/completions``): HTTP, server-sent events and client disconnects over the CPU LLM facade; what a request and
an answer hold is :mod:`pipeline.cpu_runtime.openai.protocol`.

Upstream code read (line numbers counted on the index's copies; no 1.2.1-tagged copy is readable):
``OS`` = tensorrt_llm/serve/openai_server.py@e7f7345e31e5 (1.2-era), ``OS2`` = the same file @00057725d9a6,
``PROTO`` = tensorrt_llm/serve/openai_protocol.py@54cf7be08a35, ``POST`` = tensorrt_llm/serve/postprocess_handlers.py
@01bf19231d29.
"""

from __future__ import annotations

import asyncio
import json
import logging
import threading
import time
import uuid
from typing import Any

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response, StreamingResponse

from pipeline.cpu_runtime.openai.images import chat_images
from pipeline.cpu_runtime.openai.protocol import (
    ChatCompletionRequest,
    CommonRequest,
    CompletionRequest,
    StreamOptions,
    chunk_body,
    completion_prompt,
    error_body,
    final_body,
    lora,
    sampling,
    usage,
)

log = logging.getLogger("trtpipe.openai_cpu")
#: seconds between two client-disconnect checks of a request in flight (OS:205-213 polls every 1 s)
DISCONNECT_POLL_S = 0.5


def _error(message: str, status: int = 400, kind: str = "BadRequestError") -> JSONResponse:
    """An ErrorResponse (PROTO:112-117) as OS:220-228 create_error_response sends it (default 400)."""
    return JSONResponse(error_body(message, status, kind), status)


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
        try:
            prompt = completion_prompt(req)
            params = sampling(req, req.max_tokens, add_special_tokens=req.add_special_tokens, detokenize=req.detokenize)
            res = llm.generate_async(prompt, params, streaming=bool(req.stream), lora_request=lora(req))  # OS:771-778
        except ValueError as e:
            return _error(str(e))
        return await _respond(raw, res, req, chat=False, echo=prompt if req.echo and isinstance(prompt, str) else None)

    @app.post("/v1/chat/completions")  # OS:260 route, OS:445-568 openai_chat
    async def chat(req: ChatCompletionRequest, raw: Request) -> Any:
        if req.logprobs:
            return _error("logprobs is not supported by trtpipe's CPU stand-in")
        try:
            prompt = await asyncio.to_thread(template.render, req.messages, req.add_generation_prompt)
            images = await asyncio.to_thread(chat_images, req.messages)  # image_url parts (images.py)
            params = sampling(req, req.max_completion_tokens, add_special_tokens=req.add_special_tokens)
            inputs = {"prompt": prompt, "multi_modal_data": {"image": images}} if images else prompt
            res = llm.generate_async(inputs, params, streaming=bool(req.stream), lora_request=lora(req))  # OS:541-549
        except Exception as e:  # OS:566-568: any failure of the request is a 400 naming it
            return _error(str(e))
        return await _respond(raw, res, req, chat=True)

    async def _respond(raw: Request, res: Any, req: CommonRequest, *, chat: bool, echo: str | None = None) -> Any:
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
        return JSONResponse(final_body(res, rid, model_name, chat=chat, echo=echo))

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

        def chunk(choices: list[dict[str, Any]], use: dict[str, Any] | None) -> str:
            return f"data: {json.dumps(chunk_body(rid, model_name, created, choices, use, chat=chat))}\n\n"

        try:
            if chat:  # POST:262-266: the first chunk carries the role only
                yield chunk([{"index": 0, "delta": {"role": "assistant"}, "finish_reason": None}], usage(n_prompt, 0) if running else None)
            first = True
            async for out in res:
                o = out.outputs[0]
                text = (echo or "") + o.text_diff if first else o.text_diff
                first = False
                choice = ({"index": 0, "delta": {"content": text}} if chat else {"index": 0, "text": text, "logprobs": None})
                yield chunk([choice | {"finish_reason": o.finish_reason, "stop_reason": o.stop_reason}],
                            usage(n_prompt, o.length) if running else None)  # POST:583-589
            if include:  # POST:593-610: a last chunk with no choices and the request's usage
                yield chunk([], usage(n_prompt, res.outputs[0].length, res.cached_tokens))
            yield "data: [DONE]\n\n"  # OS:733 (completions), OS:470 (chat)
        except RuntimeError as e:  # the engine failed the request
            yield f"data: {json.dumps({'error': {'object': 'error', 'message': str(e), 'type': 'InternalServerError', 'code': 500}})}\n\n"
        finally:
            watcher.cancel()
            if not res.finished:  # the client went away mid-stream: free the engine slot now
                res.abort()
                log.info("stream of request %s closed early: aborted it", res.request_id)

    return app
