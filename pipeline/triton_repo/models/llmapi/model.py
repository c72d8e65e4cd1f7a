"""trtpipe's ``llmapi`` Triton model: the TensorRT-LLM LLM-API (PyTorch backend) model's interface, on
``tensorrt_llm.LLM`` (GPU, the ``26.04-trtllm-python-py3`` image) or on trtpipe's CPU engine.

The interface is upstream's (NVIDIA/TensorRT-LLM triton_backend/all_models/llmapi/tensorrt_llm, read at
``1/model.py@b35ac1b64368`` = 1.2.0rc2, the newest copy whose version.py is a 1.2.x, and ``@044a90d209e3``, a newer
undated copy with the same request and response code; line numbers below are ``@044a90d209e3``'s):

* ``1/model.yaml``: ``triton_config`` {``decoupled``, ``max_batch_size`` (both required: model.py:173-175, set again in
  ``auto_complete_config`` 153-177), ``cancellation_check_period_ms`` (optional, default 100: 279-284)}; every other
  top-level key is an ``LLM()`` keyword argument (263-268, ``LLM(**args)`` 363), after
  ``update_llm_args_with_extra_dict`` on the GPU. ``$LLM_CONFIG_PATH`` names another file in the version dir (109-132).
* Inputs: ``text_input`` (required, 1-D, element 0 is the prompt: 609-620), ``streaming`` (needs a decoupled model:
  526-528), ``sampling_param_{best_of,temperature,top_k,top_p,frequency_penalty,presence_penalty,max_tokens,seed,
  exclude_input_from_output,return_perf_metrics}`` → ``SamplingParams`` fields of the same name (defaults best_of 1,
  exclude_input_from_output false, return_perf_metrics false: helpers.py@0df60f9ad779:70-100), ``sampling_param_stop``
  (a list of strings → ``SamplingParams.stop``), ``return_{finish_reason,stop_reason,cumulative_logprob}`` (switch the
  three string outputs: helpers.py 103-124, model.py 668-684), ``stop`` (true: cancel the requests with this
  request id, answered with a CANCELLED error: ``handle_stop_request``, 505). trtpipe adds three optional inputs:
  ``sampling_param_min_tokens`` (INT32) and ``sampling_param_ignore_eos`` (BOOL) → ``SamplingParams.min_tokens`` /
  ``ignore_eos`` (tensorrt_llm/sampling_params.py@000a01de66f0:230, 266), so a benchmark gets exactly
  ``max_tokens`` tokens, and ``sampling_param_skip_special_tokens`` (BOOL, ``SamplingParams.skip_special_tokens``,
  default true: 270), so that a client counting tokens by re-tokenizing ``text_output`` also counts the special
  tokens a model generates past its EOS under ``ignore_eos`` (SmolLM2's ``<|im_end|>``, ``<|im_start|>``). A fourth,
  ``return_num_output_tokens`` (BOOL), adds the output ``num_output_tokens`` (INT32: the tokens THIS response adds, as
  the C++ ``tensorrt_llm`` backend's pair of the same names counts them), so a client needs no tokenizer to count.
* Outputs: ``text_output`` (the CUMULATIVE text of ``outputs[0]``, each streamed response: 662-664), the three string
  outputs, and with ``sampling_param_return_perf_metrics`` the twelve perf outputs (694-770). Upstream builds the
  perf tensors with ``text_output``'s dtype (a BYTES decimal string); this model sends the types config.pbtxt
  declares (INT32 / FP32 / INT64 nanoseconds).
* Cancellation: a thread asks every in-flight request ``is_cancelled()`` each ``cancellation_check_period_ms`` and
  aborts it with a CANCELLED error (``cancellation_loop``); a request whose final response is out is never asked
  again (asking then crashed Triton 2.51: see models/tensorrt_llm_cpu/model.py ``Job.final_lock``).

* Images (issue #47 item 4; ``_llmapi_images``): with ``triton_config.multimodal: true`` in model.yaml (a build with a
  ``vision:`` section; the switch of upstream's PR #18381) the optional ``image_url`` input (STRING [-1], one URL per
  image: config.pbtxt@0a71057313ec:54-67) is read, its images decoded and passed as upstream's LLM API takes them,
  ``generate_async({"prompt": text, "multi_modal_data": {"image": [PIL.Image, …]}}, …)``; a refused image is an
  INVALID_ARGUMENT error of one line. The final response then carries trtpipe's ``num_image_tokens`` (INT32 [1]: the
  image tokens in the request's ``prompt_token_ids``; upstream's outputs @0a71057313ec have no such count).

Which ``LLM`` runs is the config.pbtxt parameter ``llm_runtime``: ``tensorrt_llm`` (absent = this; MPI ranks > 0 of a
tp/pp > 1 launch serve as workers, as upstream does) or ``trtpipe_cpu``
(:class:`pipeline.cpu_runtime.llm.LLM`, whose names and semantics follow the LLM API). No import is tried and
caught: the parameter decides.
"""

from __future__ import annotations

import asyncio
import dataclasses
import datetime
import itertools
import json
import os
import queue
import threading
import time
from typing import Any

import numpy as np
import triton_python_backend_utils as pb_utils
import yaml

FINAL = pb_utils.TRITONSERVER_RESPONSE_COMPLETE_FINAL
RUNTIMES = ("tensorrt_llm", "trtpipe_cpu")
#: request input → SamplingParams field (upstream's ten, helpers.py@0df60f9ad779:75-86, plus trtpipe's three)
SAMPLING_INPUTS = ("best_of", "temperature", "top_k", "top_p", "frequency_penalty", "presence_penalty", "max_tokens",
                   "seed", "exclude_input_from_output", "return_perf_metrics", "min_tokens", "ignore_eos",
                   "skip_special_tokens")
SAMPLING_DEFAULTS = {"best_of": 1, "exclude_input_from_output": False, "return_perf_metrics": False}
#: switch → (output, CompletionOutput attribute)  (model.py@044a90d209e3:668-675)
STRING_OUTPUTS = {"return_finish_reason": ("finish_reason", "finish_reason"),
                  "return_stop_reason": ("stop_reason", "stop_reason"),
                  "return_cumulative_logprob": ("cumulative_logprob", "cumulative_logprob")}
#: trtpipe's switch for ``num_output_tokens`` (INT32: tokens added by this response, the pair and semantics of the C++
#: backend's ``return_num_output_tokens``/``num_output_tokens``: pipeline/data/triton_backend_contract.yaml)
COUNT_SWITCH = "return_num_output_tokens"
#: perf output → (RequestPerfMetrics group, attribute, numpy dtype)  (model.py@044a90d209e3:694-770)
PERF_OUTPUTS = {
    "kv_cache_reused_block": ("kv_cache_metrics", "num_reused_blocks", np.int32),
    "kv_cache_hit_rate": ("kv_cache_metrics", "kv_cache_hit_rate", np.float32),
    "kv_cache_alloc_new_blocks": ("kv_cache_metrics", "num_new_allocated_blocks", np.int32),
    "kv_cache_alloc_total_blocks": ("kv_cache_metrics", "num_total_allocated_blocks", np.int32),
    "kv_cache_missed_block": ("kv_cache_metrics", "num_missed_blocks", np.int32),
    "arrival_time_ns": ("timing_metrics", "arrival_time", np.int64),
    "first_scheduled_time_ns": ("timing_metrics", "first_scheduled_time", np.int64),
    "first_token_time_ns": ("timing_metrics", "first_token_time", np.int64),
    "last_token_time_ns": ("timing_metrics", "last_token_time", np.int64),
    "acceptance_rate": ("speculative_decoding", "acceptance_rate", np.float32),
    "total_accepted_draft_tokens": ("speculative_decoding", "total_accepted_draft_tokens", np.int32),
    "total_draft_tokens": ("speculative_decoding", "total_draft_tokens", np.int32),
}


def read_model_yaml(version_dir: str) -> dict[str, Any]:
    """``model.yaml`` (or ``$LLM_CONFIG_PATH``) of the version directory, with ``triton_config`` checked."""
    path = os.path.join(version_dir, os.environ.get("LLM_CONFIG_PATH", "model.yaml"))
    try:
        with open(path) as f:
            data = yaml.safe_load(f)
    except (OSError, yaml.YAMLError) as e:
        raise pb_utils.TritonModelException(f"{path}: cannot read the LLM() arguments: {e}") from None
    tc = data.get("triton_config") if isinstance(data, dict) else None
    missing = [k for k in ("decoupled", "max_batch_size") if not isinstance(tc, dict) or k not in tc]
    if missing:
        raise pb_utils.TritonModelException(f"{path}: triton_config.{missing[0]} is required")
    return data


def _ns(value: Any) -> int:
    """A perf-metrics time (a ``datetime.timedelta`` since the clock's epoch, or a number of ns) in nanoseconds."""
    if isinstance(value, datetime.timedelta):
        return (value.days * 86_400 + value.seconds) * 1_000_000_000 + value.microseconds * 1_000
    return int(value)


def _scalar(request: Any, name: str) -> Any:
    t = pb_utils.get_input_tensor_by_name(request, name)
    if t is None:
        return None
    arr = t.as_numpy()
    if arr.size != 1:
        raise pb_utils.TritonModelException(f"Expected a scalar tensor for tensor {name}")
    return arr.reshape(-1)[0].item()


def _text(value: Any) -> str:
    return value.decode("utf-8") if isinstance(value, (bytes, np.bytes_)) else str(value)


@dataclasses.dataclass
class Request:
    """One request in flight. ``lock`` guards ``done``: once the final response is queued nothing else is sent, and
    ``is_cancelled()`` is never asked again."""

    triton: Any
    sender: Any
    user_id: str
    streaming: bool
    wanted: dict[str, bool]
    result: Any = None
    done: bool = False
    tokens_sent: int = 0  # output tokens counted in responses so far (``num_output_tokens``)
    images: int = 0  # images the request carried (``num_image_tokens`` goes with its final response)
    lock: threading.Lock = dataclasses.field(default_factory=threading.Lock)


class TritonPythonModel:
    """The LLM-API model (module docstring)."""

    @classmethod
    def auto_complete_config(cls, config):
        tc = read_model_yaml(pb_utils.get_model_dir())["triton_config"]
        config.set_model_transaction_policy({"decoupled": bool(tc["decoupled"])})
        config.set_max_batch_size(int(tc["max_batch_size"]))
        return config

    def initialize(self, args):
        self.model_config = json.loads(args["model_config"])
        data = read_model_yaml(os.path.join(args["model_repository"], args["model_version"]))
        tc = data.pop("triton_config")
        self.decoupled = bool(tc["decoupled"])
        self.cancel_period_s = int(tc.get("cancellation_check_period_ms", 100)) / 1000.0
        params = {k: v.get("string_value", "") for k, v in self.model_config.get("parameters", {}).items()}
        runtime = params.get("llm_runtime") or "tensorrt_llm"
        if runtime not in RUNTIMES:
            raise pb_utils.TritonModelException(f"parameter llm_runtime={runtime!r}: expected one of {', '.join(RUNTIMES)}")
        self.follower = False
        self.images = None
        if tc.get("multimodal"):  # upstream reads image_url only then (config.pbtxt@0a71057313ec:54-55)
            import _llmapi_images

            self.images = _llmapi_images
            self.placeholders = _llmapi_images.Placeholders([d for d in (data.get("tokenizer"), data.get("model")) if d])
            self.max_num_images = int(params["max_num_images"]) if params.get("max_num_images") else None
        llm_cls, self.SamplingParams, llm_args = self._runtime(runtime, data)
        if self.follower:
            return
        self.requests: dict[int, Request] = {}
        self.by_user: dict[str, set[int]] = {}
        self.lock = threading.Lock()
        self.ids = itertools.count()
        self.responses: queue.SimpleQueue = queue.SimpleQueue()
        self.running = True
        started = threading.Event()
        self.loop = asyncio.new_event_loop()
        self.loop_thread = threading.Thread(target=self._run_loop, args=(started,), name="llmapi-loop", daemon=True)
        self.loop_thread.start()
        started.wait()
        try:  # the LLM is built on the loop's thread, so results created there find the running loop
            self.llm = asyncio.run_coroutine_threadsafe(self._make_llm(llm_cls, llm_args), self.loop).result()
        except BaseException:
            self.loop.call_soon_threadsafe(self.loop.stop)
            raise
        self.threads = [threading.Thread(target=self._send_loop, name="llmapi-send", daemon=True),
                        threading.Thread(target=self._cancel_loop, name="llmapi-cancel", daemon=True)]
        for t in self.threads:
            t.start()
        pb_utils.Logger.log_info(f"llmapi: {runtime} LLM ready ({'decoupled' if self.decoupled else 'not decoupled'})")

    def _runtime(self, runtime: str, llm_args: dict[str, Any]):
        """``(LLM class, SamplingParams class, LLM kwargs)`` of ``runtime``; sets ``follower`` on MPI ranks > 0."""
        if runtime == "trtpipe_cpu":
            from _common import apply_pythonpath

            apply_pythonpath()
            from pipeline.cpu_runtime.llm import LLM, LoRARequest, SamplingParams

            self.LoRARequest = LoRARequest
            return LLM, SamplingParams, llm_args
        from tensorrt_llm import LLM, SamplingParams
        from tensorrt_llm._utils import global_mpi_rank, global_mpi_size
        from tensorrt_llm.executor.request import LoRARequest
        from tensorrt_llm.llmapi.llm_utils import update_llm_args_with_extra_dict

        if global_mpi_rank() != 0:  # a worker rank serves the leader's MPI session until it ends (upstream initialize)
            from mpi4py.futures import MPICommExecutor
            from mpi4py.MPI import COMM_WORLD

            self.follower = True
            with MPICommExecutor(COMM_WORLD) as executor:
                if executor is not None:
                    raise RuntimeError(f"llmapi: rank {COMM_WORLD.rank} should not have an executor")
            return LLM, SamplingParams, {}
        self.LoRARequest = LoRARequest
        llm_args = update_llm_args_with_extra_dict({}, llm_args)
        if global_mpi_size() > 1:  # one MPI session over the ranks mpirun started (upstream initialize)
            from mpi4py.MPI import COMM_WORLD
            from tensorrt_llm.llmapi import MpiCommSession

            llm_args["_mpi_session"] = MpiCommSession(comm=COMM_WORLD, n_workers=COMM_WORLD.Get_size())
        return LLM, SamplingParams, llm_args

    def _run_loop(self, started: threading.Event) -> None:
        asyncio.set_event_loop(self.loop)
        self.loop.call_soon(started.set)
        self.loop.run_forever()

    async def _make_llm(self, llm_cls, llm_args):
        return await self.loop.run_in_executor(None, lambda: llm_cls(**llm_args))

    # ------------------------------------------------------------------ requests
    def execute(self, requests):
        for request in requests:
            asyncio.run_coroutine_threadsafe(self._serve(request), self.loop)

    def _convert(self, request) -> tuple[Any, Any, bool, dict[str, bool]]:
        """``(prompt, SamplingParams, streaming, {string-output switch: on})`` of a request; the prompt is a string, or
        ``{"prompt", "multi_modal_data"}`` for a request with images (:meth:`_with_images`)."""
        text = pb_utils.get_input_tensor_by_name(request, "text_input")
        if text is None:
            raise pb_utils.TritonModelException("text_input is missing from the request")
        arr = text.as_numpy()
        if arr.ndim > 1:
            raise pb_utils.TritonModelException("text_input must be a 1-D tensor (one prompt)")
        kwargs = dict(SAMPLING_DEFAULTS)
        for name in SAMPLING_INPUTS:
            value = _scalar(request, f"sampling_param_{name}")
            if value is not None:
                kwargs[name] = value
        stop = pb_utils.get_input_tensor_by_name(request, "sampling_param_stop")
        if stop is not None:
            kwargs["stop"] = [_text(s) for s in stop.as_numpy().reshape(-1)]
        wanted = {k: bool(_scalar(request, k) or False) for k in (*STRING_OUTPUTS, COUNT_SWITCH)}
        prompt = self._with_images(request, _text(arr.reshape(-1)[0]))
        return prompt, self.SamplingParams(**kwargs), bool(_scalar(request, "streaming") or False), wanted

    def _with_images(self, request, text: str) -> Any:
        """``text``, or with ``image_url`` images on a multimodal model ``{"prompt": text with one placeholder per image,
        "multi_modal_data": {"image": [PIL.Image, …]}}``. Raises ``ImageInputError`` (_llmapi_images) for a refused image."""
        if self.images is None:
            return text
        t = pb_utils.get_input_tensor_by_name(request, self.images.INPUT)
        images = self.images.load_images(None if t is None else t.as_numpy(), self.max_num_images)
        if not images:
            return text
        return {"prompt": self.placeholders.prompt(text, len(images)), "multi_modal_data": {"image": images}}

    def _lora(self, request) -> Any:
        """The request's ``LoRARequest`` from ``lora_id`` / ``lora_name`` / ``lora_path`` (all three or none;
        ``lora_ckpt_source`` hf, the default, only), as upstream's ``get_lora_request_from_request``
        (helpers.py@0df60f9ad779) builds it; ``None`` without them."""
        def string(key: str) -> str | None:  # a STRING scalar (bytes in an object array: no .item())
            t = pb_utils.get_input_tensor_by_name(request, key)
            return None if t is None else _text(t.as_numpy().reshape(-1)[0])

        lora_id, name, path = _scalar(request, "lora_id"), string("lora_name"), string("lora_path")
        if lora_id is None and name is None and path is None:
            return None
        if lora_id is None or name is None or path is None:
            raise pb_utils.TritonModelException("lora_id, lora_name, and lora_path must all be provided together")
        source = string("lora_ckpt_source")
        if source is not None and source != "hf":
            raise pb_utils.TritonModelException(f"lora_ckpt_source {source!r}: trtpipe serves hf (peft) adapters only")
        if not os.path.exists(path):
            raise pb_utils.TritonModelException(f"lora_path does not exist on the Triton server's filesystem: {path}")
        return self.LoRARequest(lora_name=name, lora_int_id=int(lora_id), lora_path=path)

    async def _serve(self, request) -> None:
        sender = request.get_response_sender()
        if _scalar(request, "stop"):
            self._stop(request.request_id(), sender)
            return
        key = next(self.ids)
        req = None
        try:
            prompt, params, streaming, wanted = self._convert(request)
            if streaming and not self.decoupled:
                raise pb_utils.TritonModelException("Streaming is only supported in decoupled mode.")
            req = Request(request, sender, request.request_id() or "", streaming, wanted)
            req.images = len(prompt["multi_modal_data"]["image"]) if isinstance(prompt, dict) else 0
            with self.lock:
                self.requests[key] = req
                if req.user_id:
                    self.by_user.setdefault(req.user_id, set()).add(key)
            req.result = self.llm.generate_async(prompt, params, streaming=streaming, lora_request=self._lora(request))
            output = None
            async for output in req.result:
                if streaming:
                    self._queue(req, self._response(output, req), output.finished)
            if not streaming and output is not None:
                self._queue(req, self._response(output, req), True)
        except Exception as e:
            pb_utils.Logger.log_error(f"llmapi: error generating request: {e}")
            bad_image = self.images is not None and isinstance(e, self.images.ImageInputError)  # the client's: HTTP 400
            error = pb_utils.TritonError(str(e), pb_utils.TritonError.INVALID_ARG) if bad_image else pb_utils.TritonError(
                f"Error generating request: {e}")
            response = pb_utils.InferenceResponse(output_tensors=[], error=error)
            if req is None:
                sender.send(response, flags=FINAL)
            else:
                self._queue(req, response, True)
        finally:
            self._forget(key, req)

    def _forget(self, key: int, req: Request | None) -> None:
        with self.lock:
            self.requests.pop(key, None)
            if req is not None and req.user_id in self.by_user:
                self.by_user[req.user_id].discard(key)
                if not self.by_user[req.user_id]:
                    del self.by_user[req.user_id]

    def _stop(self, user_id: str, sender) -> None:
        """``stop = true``: abort the requests with this request id; the stop request itself gets CANCELLED."""
        if not user_id:
            sender.send(pb_utils.InferenceResponse(error=pb_utils.TritonError(
                "A request id must be provided for request cancellation")), flags=FINAL)
            return
        with self.lock:
            targets = [self.requests[k] for k in self.by_user.get(user_id, ()) if k in self.requests]
        for req in targets:
            if req.result is not None:
                req.result.abort()
        sender.send(pb_utils.InferenceResponse(error=pb_utils.TritonError(
            "Request cancelled by client", pb_utils.TritonError.CANCELLED)), flags=FINAL)

    # ------------------------------------------------------------------ responses
    def _response(self, output, req: Request) -> Any:
        """The response for the current state of a ``RequestOutput`` (cumulative text) to ``req`` (its output switches;
        ``num_output_tokens`` = the tokens this response adds, ``req.tokens_sent`` moves on; ``num_image_tokens`` with
        the final response of a request with images)."""
        seq = output.outputs[0]
        tensors = [pb_utils.Tensor("text_output", np.array([seq.text.encode("utf-8")], dtype=np.object_))]
        count = self.placeholders.count(getattr(output, "prompt_token_ids", None)) if req.images and output.finished else None
        if count is not None:
            tensors.append(pb_utils.Tensor(self.images.COUNT_OUTPUT, np.array([count], dtype=np.int32)))
        if req.wanted.get(COUNT_SWITCH):
            tensors.append(pb_utils.Tensor("num_output_tokens", np.array([len(seq.token_ids) - req.tokens_sent], dtype=np.int32)))
            req.tokens_sent = len(seq.token_ids)
        for switch, (name, attr) in STRING_OUTPUTS.items():
            if req.wanted.get(switch):
                tensors.append(pb_utils.Tensor(name, np.array([str(getattr(seq, attr))], dtype=np.object_)))
        perf = getattr(seq, "request_perf_metrics", None)
        if perf:
            for name, (group, attr, dtype) in PERF_OUTPUTS.items():
                value = getattr(getattr(perf, group), attr)
                value = _ns(value) if dtype is np.int64 else value
                tensors.append(pb_utils.Tensor(name, np.array([value], dtype=dtype)))
        return pb_utils.InferenceResponse(output_tensors=tensors)

    def _queue(self, req: Request, response, final: bool) -> None:
        self.responses.put((req, response, final))

    def _send_loop(self) -> None:
        """Send queued responses in order (the engine goes on while a response is sent: model.py ``_response_loop``)."""
        while True:
            item = self.responses.get()
            if item is None:
                return
            req, response, final = item
            with req.lock:
                if req.done:
                    continue
                req.done = final
                try:
                    req.sender.send(response, flags=FINAL if final else 0)
                except Exception as e:
                    pb_utils.Logger.log_error(f"llmapi: could not send a response: {e}")

    def _cancel_loop(self) -> None:
        """Abort requests whose client went away (``cancellation_loop``), each with one CANCELLED final response."""
        while self.running:
            time.sleep(self.cancel_period_s)
            with self.lock:
                live = list(self.requests.values())
            for req in live:
                with req.lock:
                    if req.done or not req.triton.is_cancelled():
                        continue
                    req.done = True
                    if req.result is not None:
                        req.result.abort()
                    try:
                        req.sender.send(pb_utils.InferenceResponse(error=pb_utils.TritonError(
                            "Request cancelled by client", pb_utils.TritonError.CANCELLED)), flags=FINAL)
                    except Exception as e:
                        pb_utils.Logger.log_error(f"llmapi: could not send the cancellation: {e}")

    def finalize(self):
        if self.follower:
            return
        self.running = False
        self.responses.put(None)
        for t in self.threads:
            t.join(timeout=5)
        try:
            self.llm.shutdown()
        finally:
            self.loop.call_soon_threadsafe(self.loop.stop)
            self.loop_thread.join(timeout=5)
