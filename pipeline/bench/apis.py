"""The protocols ``trtpipe bench`` speaks, behind one small interface (``--api``).

Each :class:`Api` knows how to find the model (``preflight`` → :class:`~pipeline.bench.client.ModelInfo`),
prebuild a request for a prompt (``build``), give a prebuilt request its per-send id (``with_id``) and open a
client with ``stream(request, record)``/``stop()``/``close()``. The load generator, metrics, OSL check and
exports only see :class:`~pipeline.bench.records.RequestRecord` objects, whatever the protocol.

* ``grpc``: Triton's gRPC ``ModelStreamInfer`` (:mod:`pipeline.bench.client`), the default.
* ``triton-http``: Triton's ``POST /v2/models/<model>/generate_stream`` (SSE), same inputs as gRPC.
* ``openai``: any OpenAI-compatible server (vLLM, TGI, trtllm-serve, Triton's OpenAI frontend),
  streaming ``/v1/completions`` (or ``/v1/chat/completions`` with ``--openai-endpoint chat``).

Imports are lazy: the gRPC path never imports aiohttp, the HTTP paths never open a gRPC channel.
"""

from __future__ import annotations

import asyncio
import dataclasses
from typing import Any

from pipeline.bench.prompts import Prompt

#: ``--api`` values; the first is the default
API_NAMES = ("grpc", "triton-http", "openai")
#: URL used when ``--url`` is not given
DEFAULT_URLS = {"grpc": "localhost:8001", "triton-http": "http://localhost:8000", "openai": "http://localhost:8000/v1"}


@dataclasses.dataclass(frozen=True)
class Api:
    """One protocol: ``name`` (an :data:`API_NAMES` value), ``url`` as the client uses it, and for
    ``openai`` the ``endpoint`` (``completions`` | ``chat``)."""

    name: str
    url: str
    endpoint: str = "completions"

    @classmethod
    def make(cls, name: str, url: str | None, endpoint: str = "completions") -> Api:
        """The API ``name`` at ``url`` (default :data:`DEFAULT_URLS`), the URL normalized for it.

        Raises:
            UserError: an unknown ``name`` (names ``--api``).
        """
        from pipeline.core.errors import UserError

        if name not in API_NAMES:
            raise UserError(f"--api {name!r}: use one of {', '.join(API_NAMES)}")
        url = url or DEFAULT_URLS[name]
        if name == "grpc":
            from pipeline.bench.client import normalize_url

            return cls(name, normalize_url(url), endpoint)
        from pipeline.bench.http_client import base_url

        return cls(name, base_url(url, name), endpoint)

    @property
    def is_triton(self) -> bool:
        """A Triton server (its Prometheus metrics are scraped by default)."""
        return self.name != "openai"

    def preflight(self, model: str | None) -> Any:
        """Check the server and model before any load; returns a ``ModelInfo``.

        ``model`` ``None`` (openai only) takes the server's only model.

        Raises:
            UserError: unreachable server, unknown/not-ready model (one line).
        """
        if self.name == "grpc":
            from pipeline.bench.client import preflight

            return asyncio.run(preflight(self.url, model or "ensemble"))
        from pipeline.bench import http_client

        if self.name == "triton-http":
            return asyncio.run(http_client.triton_http_preflight(self.url, model or "ensemble"))
        return asyncio.run(http_client.openai_preflight(self.url, model, self.endpoint))

    def build(self, info: Any, prompt: Prompt, osl: int, *, perf_metrics: bool = False) -> Any:
        """The prebuilt streaming request for ``prompt`` with exactly ``osl`` output tokens (EOS ignored)."""
        if self.name == "grpc":
            from pipeline.bench.client import build_request

            return build_request(info, prompt, osl, request_id="", ignore_eos=True, perf_metrics=perf_metrics)
        from pipeline.bench import http_client

        if self.name == "triton-http":
            return http_client.build_triton_request(info, prompt, osl, ignore_eos=True)
        return http_client.build_openai_request(info, prompt, osl)

    def with_id(self, request: Any, request_id: str) -> Any:
        """``request`` carrying ``request_id`` (a copy; OpenAI requests are returned as is)."""
        if self.name == "grpc":
            from pipeline.bench.client import with_request_id

            return with_request_id(request, request_id)
        from pipeline.bench.http_client import with_request_id

        return with_request_id(request, request_id, self.name)

    def client(self, info: Any, *, timeout_s: float, max_streams: int, stall_s: float | None = None) -> Any:
        """A client with ``stream(request, record)``, ``stop()`` and ``async close()``; ``timeout_s`` per request (s);
        ``stall_s``: gRPC streams that stop answering end with error ``stalled`` (:class:`~pipeline.bench.client.StreamClient`)."""
        if self.name == "grpc":
            from pipeline.bench.client import StreamClient

            return StreamClient(self.url, info, timeout_s=timeout_s, max_streams=max_streams, stall_s=stall_s)
        from pipeline.bench.http_client import SSEClient

        return SSEClient(self.url, info, api=self.name, timeout_s=timeout_s, max_streams=max_streams)
