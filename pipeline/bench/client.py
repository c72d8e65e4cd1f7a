"""Triton gRPC client for decoupled LLM models: preflight checks and one stream per request.

Readiness, metadata and config come from ``tritonclient.grpc.aio.InferenceServerClient``.
Streaming uses the same gRPC service (``GRPCInferenceServiceStub.ModelStreamInfer`` from
``tritonclient.grpc.service_pb2_grpc``) on ``grpc.aio`` channels with requests pre-built as
protobufs, because ``tritonclient.grpc.aio``'s ``stream_infer`` cannot set
``triton_enable_empty_final_response`` (needed to see the end of a stream whose model sends
an empty final response) and decodes every response into an ``InferResult`` — CPU we do not
spend per token. Each request gets its own bidirectional stream, half-closed after the request.
After the final response the stream is drained until the server ends it: cancelling a stream
that already completed leaves Triton 2.51 holding the model on shutdown until its exit timeout
(measured here). Streams that fail, time out or are interrupted are cancelled, so no stream can
keep the server from shutting down.

Per response the client does only: take ``perf_counter_ns()``, read the token count (the
``output_ids`` shape, or the ``num_output_tokens`` value; text without a count keeps its bytes
for counting after the run), append both, and check ``triton_final_response``.

Three interfaces, told apart by the model's declared inputs (:func:`detect_interface`):

* ``tokens``: TensorRT-LLM's ``tensorrt_llm`` model (``input_ids``, ``request_output_len``, …).
* ``text``: ``ensemble``/``tensorrt_llm_bls`` (``text_input``, ``max_tokens``, ``min_tokens``, …).
* ``llmapi``: the LLM-API (PyTorch backend) ``tensorrt_llm`` python model (``text_input``,
  ``streaming``, ``sampling_param_max_tokens``, …). Every streamed ``text_output`` holds the WHOLE
  text so far (``CompletionOutput.text``, not ``text_diff``, in TensorRT-LLM's
  ``triton_backend/all_models/llmapi/tensorrt_llm/1/model.py``), so the client keeps only the
  latest text. Upstream's model declares no ``min_tokens``/``ignore_eos`` input and returns no
  token count: OSL is then only an upper bound, and the tokens are counted from the text after the
  run. trtpipe's own llmapi model (pipeline/triton_repo/models/llmapi) adds
  ``sampling_param_min_tokens``/``sampling_param_ignore_eos`` (exact OSL) and
  ``return_num_output_tokens`` → ``num_output_tokens`` (the server's count per response); the
  final text is then re-tokenized only to check that count (``osl_check``).

Tensor names and dtypes: docs/reference/triton-model-repository.md §3.4 (token/text) and §3.7 (llmapi).
"""

from __future__ import annotations

import asyncio
import dataclasses
import math
import time
from typing import Any

import grpc
import numpy as np
from tritonclient.grpc import service_pb2, service_pb2_grpc

from pipeline.bench.images import request_input
from pipeline.bench.prompts import Prompt
from pipeline.bench.records import (
    STALLED,
    RequestRecord,
    _fix_cumulative_counts,
    _perf_times,
)
from pipeline.core.errors import UserError

#: streams per gRPC channel before another channel is opened (HTTP/2 concurrent-stream headroom)
STREAMS_PER_CHANNEL = 128
#: ``end_id`` that no sampled token can equal, so EOS never ends a request early (NVIDIA's GH200
#: gptManagerBenchmark recipe used ``--eos_id -1``; docs/reference/benchmark-metrics.md §5.2); min_tokens = OSL too
NEVER_END_ID = -1
#: interfaces whose requests carry text (``text_input``) and need a tokenizer for exact-ISL prompts
TEXT_INTERFACES = ("text", "llmapi", "openai", "openai-chat")
#: one-line notice printed at the start of a run on the LLM-API interface
LLMAPI_OSL_WARNING = (
    "exact OSL is not enforceable on this LLM-API model (no sampling_param_min_tokens input, as in TensorRT-LLM "
    "1.2.1's own llmapi model; trtpipe's has one): OSL is sent as max_tokens, output tokens are counted from text_output after the run, early stops show as short"
)


@dataclasses.dataclass(frozen=True)
class ModelInfo:
    """What preflight learned: interface, declared tensors and the raw metadata/config JSON.

    ``interface`` is ``"tokens"`` (``input_ids`` in, ``output_ids`` out: ``tensorrt_llm``),
    ``"text"`` (``text_input`` in, ``text_output`` out: ``ensemble``/``tensorrt_llm_bls``) or
    ``"llmapi"`` (``text_input``/``sampling_param_*`` in, cumulative ``text_output`` out: the
    LLM-API ``tensorrt_llm`` model); see :func:`detect_interface`.
    ``max_batch_size > 0`` means every input carries a leading batch dimension of 1.
    """

    name: str
    interface: str
    inputs: dict[str, str]
    outputs: tuple[str, ...]
    max_batch_size: int
    server: dict[str, Any]
    metadata: dict[str, Any]
    config: dict[str, Any]

    @property
    def takes_text(self) -> bool:
        """Requests carry a prompt text (``text``/``llmapi``), not token ids."""
        return self.interface in TEXT_INTERFACES


def detect_interface(model: str, inputs: dict[str, str]) -> str:
    """The request interface of a model from its declared input names.

    ``input_ids`` → ``"tokens"``; ``text_input`` with ``sampling_param_max_tokens`` → ``"llmapi"``;
    other ``text_input`` models (``max_tokens``) → ``"text"``.

    Raises:
        UserError: neither ``input_ids`` nor ``text_input`` is declared (names the model).
    """
    if "input_ids" in inputs:
        return "tokens"
    if "text_input" in inputs:
        return "llmapi" if "sampling_param_max_tokens" in inputs else "text"
    raise UserError(f"model {model!r} has neither `input_ids` nor `text_input` inputs: not a TensorRT-LLM LLM model")


def normalize_url(url: str) -> str:
    """``host:port`` from ``host:port``, ``grpc://host:port`` or ``http://host:port``."""
    for scheme in ("grpc://", "http://", "https://"):
        if url.startswith(scheme):
            url = url[len(scheme):]
    return url.rstrip("/")


async def preflight(url: str, model: str, timeout_s: float = 5.0) -> ModelInfo:
    """Check server live/ready, model ready, decoupled, and read metadata/config — before any load.

    Raises:
        UserError: server unreachable or not ready, model missing/not ready/not decoupled, or a
            model whose inputs are neither the token (``input_ids``) nor the text (``text_input``)
            interface. One line naming the URL or model.
    """
    import tritonclient.grpc.aio as grpcclient
    from tritonclient.utils import InferenceServerException

    client = grpcclient.InferenceServerClient(url)
    try:
        try:
            if not await client.is_server_live(client_timeout=timeout_s):
                raise UserError(f"Triton at {url} is not live")
            if not await client.is_server_ready(client_timeout=timeout_s):
                raise UserError(f"Triton at {url} is live but not ready (models still loading or failed)")
        except InferenceServerException as e:
            raise UserError(f"Triton is not reachable at {url} (gRPC): {_one_line(e)}") from None
        try:
            ready = await client.is_model_ready(model, client_timeout=timeout_s)
        except InferenceServerException as e:
            raise UserError(f"model {model!r} on {url}: {_one_line(e)}") from None
        if not ready:
            index = await client.get_model_repository_index(as_json=True, client_timeout=timeout_s)
            names = sorted({m.get("name", "?") for m in index.get("models", [])})
            raise UserError(f"model {model!r} is not ready on {url} (models there: {', '.join(names) or 'none'})")
        server = await client.get_server_metadata(as_json=True, client_timeout=timeout_s)
        meta = await client.get_model_metadata(model, as_json=True, client_timeout=timeout_s)
        config = (await client.get_model_config(model, as_json=True, client_timeout=timeout_s)).get("config", {})
    finally:
        await client.close()
    inputs = {t["name"]: t["datatype"] for t in meta.get("inputs", [])}
    outputs = tuple(t["name"] for t in meta.get("outputs", []))
    interface = detect_interface(model, inputs)
    if not config.get("model_transaction_policy", {}).get("decoupled", False):
        raise UserError(f"model {model!r} is not decoupled: the bench needs streaming (serving.decoupled_mode: true)")
    return ModelInfo(model, interface, inputs, outputs, int(config.get("max_batch_size", 0)), server, meta, config)


def _one_line(e: BaseException) -> str:
    text = e.message() if hasattr(e, "message") and callable(e.message) else str(e)
    return " ".join(str(text).split())[:300]


def _add(req: service_pb2.ModelInferRequest, name: str, datatype: str, arr: np.ndarray) -> None:
    t = req.inputs.add()
    t.name, t.datatype = name, datatype
    t.shape.extend(arr.shape)
    if datatype == "BYTES":
        req.raw_input_contents.append(b"".join(len(b).to_bytes(4, "little") + b for b in arr.reshape(-1)))
    else:
        req.raw_input_contents.append(np.ascontiguousarray(arr).tobytes())


def request_inputs(
    info: ModelInfo, prompt: Prompt, osl: int, *, ignore_eos: bool = True, perf_metrics: bool = False, exact_osl: bool = True,
    image_input: str = "image_bytes_input",
) -> list[tuple[str, str, Any]]:
    """``[(name, datatype, value)]``: the inputs of one streaming request for ``prompt`` with exactly ``osl``
    output tokens, whatever the transport (gRPC protobuf here, JSON for ``--api triton-http``).

    Sends ``request_output_len``/``max_tokens = osl`` and ``min_tokens = osl`` (exact OSL,
    docs/reference/benchmark-metrics.md §5.2), streaming on, ``return_num_output_tokens`` (text interface: the
    token interface counts ``output_ids`` itself), ``exclude_input_in_output`` (text), and when
    ``ignore_eos`` ``end_id = -1`` — each only if the model declares that input. ``input_ids`` is an
    int32 array; every other value a Python scalar.

    LLM-API interface (``llmapi``, docs/reference/triton-model-repository.md §3.7): ``text_input``, ``streaming = true``,
    ``sampling_param_max_tokens = osl``, ``sampling_param_min_tokens = osl`` and ``sampling_param_ignore_eos``
    (exact OSL; trtpipe's llmapi model only), ``sampling_param_skip_special_tokens = false``,
    ``return_num_output_tokens``,
    ``sampling_param_exclude_input_from_output = true``, greedy decoding as
    ``sampling_param_top_k = 1`` (greedy in every TensorRT-LLM sampler; ``temperature = 0`` is
    not: older PyTorch samplers assert ``temperature > 0``) and, with ``perf_metrics``,
    ``sampling_param_return_perf_metrics`` — again only inputs the model declares.

    A prompt with images adds them as ``image_input`` (text): ``image_bytes_input`` (uint8 ``[images, H, W, 3]``, gRPC)
    or ``image_url_input`` (Triton HTTP); llmapi: ``image_url`` data URLs — :mod:`pipeline.bench.images`.

    ``exact_osl=False`` (``trtpipe eval``) sends no ``min_tokens``: ``osl`` is then only ``max_tokens``, and
    with ``ignore_eos=False`` no ``end_id`` either, so the model stops at its own EOS (the ensemble's
    preprocessing default ``end_id``).
    """
    if info.interface == "llmapi":  # images: the model's image_url input (pipeline.bench.images.request_input)
        return _llmapi_inputs(info, prompt, osl, perf_metrics, exact_osl=exact_osl, ignore_eos=ignore_eos) + (
            [request_input(prompt.images, "image_url", http=image_input == "image_url_input")] if prompt.images else [])
    out: list[tuple[str, str, Any]] = []

    def scalar(name: str, dt: str, value: Any) -> None:
        if name in info.inputs:
            out.append((name, dt, value))

    if info.interface == "tokens":
        if prompt.ids is None:
            raise UserError(f"model {info.name!r} takes token ids; the prompt has none")
        ids = prompt.ids.astype(np.int32)
        out.append(("input_ids", "INT32", ids))
        scalar("input_lengths", "INT32", len(ids))
        scalar("request_output_len", "INT32", osl)
        scalar("streaming", "BOOL", True)
    else:
        if prompt.text is None:
            raise UserError(f"model {info.name!r} takes text; the prompt has none")
        scalar("text_input", "BYTES", prompt.text)
        if prompt.images:
            out.append(request_input(prompt.images, image_input))
        scalar("max_tokens", "INT32", osl)
        scalar("stream", "BOOL", True)
        scalar("exclude_input_in_output", "BOOL", True)
    if exact_osl:
        scalar("min_tokens", "INT32", osl)
    if info.interface == "text":  # token ids are counted from output_ids; text needs the server's count
        scalar("return_num_output_tokens", "BOOL", True)
    if ignore_eos:
        scalar("end_id", "INT32", NEVER_END_ID)
    if perf_metrics:
        scalar("return_perf_metrics", "BOOL", True)
    return out


def _llmapi_inputs(info: ModelInfo, prompt: Prompt, osl: int, perf_metrics: bool, *, exact_osl: bool = True,
                   ignore_eos: bool = True) -> list[tuple[str, str, Any]]:
    """The LLM-API model's inputs (see :func:`request_inputs`): only those the model declares."""
    if prompt.text is None:
        raise UserError(f"model {info.name!r} takes text; the prompt has none")
    wanted = [("text_input", "BYTES", prompt.text), ("streaming", "BOOL", True), ("sampling_param_max_tokens", "INT32", osl),
              ("sampling_param_exclude_input_from_output", "BOOL", True), ("sampling_param_top_k", "INT32", 1),
              ("sampling_param_skip_special_tokens", "BOOL", False), ("return_num_output_tokens", "BOOL", True)]
    if exact_osl:
        wanted.append(("sampling_param_min_tokens", "INT32", osl))
    if ignore_eos:
        wanted.append(("sampling_param_ignore_eos", "BOOL", True))
    if perf_metrics:
        wanted.append(("sampling_param_return_perf_metrics", "BOOL", True))
    return [(name, dt, value) for name, dt, value in wanted if name in info.inputs]


def build_request(
    info: ModelInfo, prompt: Prompt, osl: int, *, request_id: str, ignore_eos: bool = True, perf_metrics: bool = False,
    exact_osl: bool = True,
) -> service_pb2.ModelInferRequest:
    """The gRPC streaming inference request for one prompt: :func:`request_inputs` as a protobuf, with
    ``triton_enable_empty_final_response`` (so the end of a stream is seen) and ``request_id``."""
    req = service_pb2.ModelInferRequest(model_name=info.name, id=request_id)
    req.parameters["triton_enable_empty_final_response"].bool_param = True
    lead = info.max_batch_size > 0
    dtypes = {"INT32": np.int32, "BOOL": np.bool_, "BYTES": np.object_}
    for name, dt, value in request_inputs(info, prompt, osl, ignore_eos=ignore_eos, perf_metrics=perf_metrics, exact_osl=exact_osl):
        if isinstance(value, np.ndarray):  # input_ids [n], image_bytes_input [images, H, W, 3]: + the batch dimension
            _add(req, name, dt, value[None] if lead else value)
            continue
        arr = np.array([value.encode() if isinstance(value, str) else value], dtype=dtypes[dt])
        _add(req, name, dt, arr.reshape(1, 1) if lead else arr)
    return req


def with_request_id(request: service_pb2.ModelInferRequest, request_id: str) -> service_pb2.ModelInferRequest:
    """A copy of a prebuilt ``request`` carrying ``request_id``: the ensemble's postprocessing keeps each
    stream's incremental detokenizer under the request id (triton_repo/models/postprocessing), so every
    request in flight needs its own; the prebuilt request is shared by many sends and is not changed."""
    out = service_pb2.ModelInferRequest()
    out.CopyFrom(request)
    out.id = request_id
    return out


class _Stalled(Exception):
    """No response for ``args[0]`` seconds."""


class StreamClient:
    """Runs requests as decoupled gRPC streams and records receipt times into records.

    Args:
        url: ``host:port`` of Triton's gRPC endpoint.
        info: the model, from :func:`preflight`.
        timeout_s: per-request deadline in seconds (gRPC deadline; error ``timeout``).
        stall_s: a stream ends with error ``stalled: …`` (:data:`STALLED`) when it got no response for this long after
            its last one, or, before its first, when no stream of this client got one for this long (a request
            queued behind others that progress is not stalled). ``None``: only ``timeout_s``.
        max_streams: the most streams in flight at once (sizes the channel pool).
    """

    def __init__(self, url: str, info: ModelInfo, *, timeout_s: float, max_streams: int = 1,
                 stall_s: float | None = None) -> None:
        self.info = info
        self.timeout_s = timeout_s
        self.stall_s = stall_s
        self._last_ns = time.perf_counter_ns()  # the last response on any stream (or the start of a stream when idle)
        opts = [("grpc.max_receive_message_length", -1), ("grpc.use_local_subchannel_pool", 1)]
        n = max(1, math.ceil(max_streams / STREAMS_PER_CHANNEL))
        self._channels = [grpc.aio.insecure_channel(url, options=opts) for _ in range(n)]
        self._stubs = [service_pb2_grpc.GRPCInferenceServiceStub(c) for c in self._channels]
        self._next = 0
        self._active: set[Any] = set()
        self._stopping = False
        self._tokens = info.interface == "tokens"
        self._cumulative = info.interface == "llmapi"

    async def stream(self, request: service_pb2.ModelInferRequest, rec: RequestRecord) -> None:
        """Send ``request`` and record every response into ``rec``; never raises for request
        failures (they become ``rec.error``), only re-raises a cancellation we did not start.

        ``rec.end_ns`` is the receipt of the final response; the call returns once the server
        closed the stream (right after the final response)."""
        stub = self._stubs[self._next % len(self._stubs)]
        self._next += 1
        rec.start_ns = time.perf_counter_ns()
        call = stub.ModelStreamInfer(iter((request,)), timeout=self.timeout_s)
        if not self._active:
            self._last_ns = rec.start_ns
        self._active.add(call)
        response_ns, response_tokens = rec.response_ns, rec.response_tokens
        try:
            while (resp := await self._read(call, rec)) is not grpc.aio.EOF:
                now = self._last_ns = time.perf_counter_ns()
                if rec.end_ns is not None:  # after the final response: only drain the stream
                    continue
                if resp.error_message:
                    rec.end_ns, rec.error = now, "server error: " + " ".join(resp.error_message.split())[:300]
                    continue
                ir = resp.infer_response
                n = self._count(ir, rec)
                if n:
                    response_ns.append(now)
                    response_tokens.append(n)
                final = ir.parameters.get("triton_final_response")
                if final is not None and final.bool_param:
                    rec.end_ns = now
                    if "last_token_time_ns" in self.info.outputs:
                        rec.server = _perf_times(ir) or None
            if rec.end_ns is None:
                rec.end_ns = time.perf_counter_ns()
                rec.error = "stream closed without a final response"
        except grpc.aio.AioRpcError as e:
            if rec.end_ns is not None:  # failed while draining a finished request: keep the result
                return
            rec.end_ns = time.perf_counter_ns()
            code = e.code()
            if code == grpc.StatusCode.DEADLINE_EXCEEDED:
                rec.error = f"timeout after {self.timeout_s:g} s"
            else:
                rec.error = f"{code.name}: {' '.join(str(e.details()).split())[:300]}"
        except _Stalled as e:
            if rec.end_ns is None:  # (a finished request whose stream is slow to close keeps its result)
                rec.end_ns, rec.error = time.perf_counter_ns(), f"{STALLED}: no response for {e.args[0]:.0f} s"
        except asyncio.CancelledError:
            if rec.end_ns is None:
                rec.end_ns = time.perf_counter_ns()
                rec.error = "cancelled"
            if not self._stopping:
                raise
        finally:
            self._active.discard(call)
            if not call.done():
                call.cancel()
            _fix_cumulative_counts(rec)

    async def _read(self, call: Any, rec: RequestRecord) -> Any:
        """The next response of ``call`` (or ``grpc.aio.EOF``); raises :class:`_Stalled` per ``stall_s``. The read
        itself is never cancelled while waiting (cancelling a read cancels the call)."""
        if self.stall_s is None:
            return await call.read()
        read = asyncio.ensure_future(call.read())
        try:
            while True:
                done, _ = await asyncio.wait({read}, timeout=min(1.0, self.stall_s))
                if done:
                    return read.result()
                since = rec.response_ns[-1] if rec.response_ns else max(rec.start_ns or 0, self._last_ns)
                idle_s = (time.perf_counter_ns() - since) / 1e9
                if idle_s >= self.stall_s:
                    raise _Stalled(idle_s)
        finally:
            if not read.done():
                read.cancel()

    def _count(self, ir: Any, rec: RequestRecord) -> int:
        """Tokens in one response: ``output_ids`` length, ``num_output_tokens``, or ``-1`` (text kept).

        LLM-API (cumulative text): keeps a reference to the latest ``text_output`` bytes and the
        text's length; no copy, no decoding."""
        names = [o.name for o in ir.outputs]
        if self._cumulative:
            if "text_output" not in names:
                return 0
            raw = ir.raw_output_contents[names.index("text_output")]
            rec.text_last = raw  # the whole text so far: re-tokenized after the run (counts or osl_check)
            if "num_output_tokens" in names:  # trtpipe's llmapi model counts the tokens of each response
                return int.from_bytes(ir.raw_output_contents[names.index("num_output_tokens")][:4], "little", signed=True)
            if rec.text_len is None:
                rec.text_len = []
            rec.text_len.append(len(raw) - 4)
            return -1
        if self._tokens and "output_ids" in names:
            shape = ir.outputs[names.index("output_ids")].shape
            if "sequence_length" in names:  # this response's token count, summed for osl_check (records.RequestRecord)
                n = int.from_bytes(ir.raw_output_contents[names.index("sequence_length")][:4], "little", signed=True)
                rec.server_tokens = (rec.server_tokens or 0) + n
            return int(shape[-1]) if shape else 0
        if "num_output_tokens" in names:
            i = names.index("num_output_tokens")
            if "text_output" in names:  # keep the text too: re-tokenized after the run (osl_check)
                if rec.response_text is None:
                    rec.response_text = []
                rec.response_text.append(ir.raw_output_contents[names.index("text_output")][4:])
            return int.from_bytes(ir.raw_output_contents[i][:4], "little", signed=True)
        if "text_output" in names:
            raw = ir.raw_output_contents[names.index("text_output")]
            if rec.response_text is None:
                rec.response_text = []
            rec.response_text.append(raw[4:])
            return -1
        return 0

    def stop(self) -> None:
        """Cancel every stream in flight (Ctrl-C); their records end with error ``cancelled``."""
        self._stopping = True
        for call in list(self._active):
            call.cancel()

    async def close(self) -> None:
        """Cancel what is left and close the channels."""
        self.stop()
        for c in self._channels:
            await c.close()
