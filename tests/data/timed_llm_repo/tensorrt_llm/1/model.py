"""Timed stand-in for TensorRT-LLM's ``tensorrt_llm`` model (Triton python backend, decoupled).

Tensor names follow the real model (docs/reference/triton-model-repository.md §3.4): inputs
``input_ids`` [-1] INT32, ``input_lengths``, ``request_output_len``, ``min_tokens``, ``end_id``,
``pad_id`` INT32 [1], ``streaming``, ``return_num_output_tokens``, ``return_perf_metrics`` BOOL [1];
outputs per streamed response ``output_ids`` [1, k] (the k new tokens), ``sequence_length`` [1],
``num_output_tokens`` [1] (k, tokens in this response) and, when ``return_perf_metrics``,
``arrival_time_ns``/``first_token_time_ns``/``last_token_time_ns`` [1] INT64 (ns since epoch).

Timing is known exactly (config parameters, milliseconds): token ``i`` (0-based) leaves the model
at ``arrival + first_token_ms + i * itl_ms``. Each request runs in its own thread and sleeps until
its absolute deadline (``time.sleep`` of the remainder, measured on ``time.monotonic_ns``), so
late wake-ups never accumulate and concurrent requests never serialize. ``first_token_ms = 0``
and ``itl_ms = 0`` stream as fast as the backend can (the client-ceiling model).
``sequence_length`` is the token count of each response, as tensorrtllm_backend writes it
(``model_instance_state.cc@c2e65b88d852:1059-1099``: each beam's ``outputTokenIds`` size of that result). ``max_output_tokens > 0`` caps the output (a model that comes back short); ``tokens_per_response``
groups tokens into one response. A cancelled request (client gone) stops within 10 tokens, so
the server can shut down without waiting for it. Generated token ids cycle through ``token_ids`` (never ``end_id``).
"""

import json
import threading
import time

import numpy as np
import triton_python_backend_utils as pb_utils

#: tokens between cancellation checks (each check is an IPC round trip to the server)
CANCEL_CHECK_EVERY = 10


def _param(cfg, name, default):
    value = cfg.get("parameters", {}).get(name, {}).get("string_value")
    return type(default)(value) if value not in (None, "") else default


def _scalar(request, name, default):
    tensor = pb_utils.get_input_tensor_by_name(request, name)
    return default if tensor is None else tensor.as_numpy().reshape(-1)[0].item()


class TritonPythonModel:
    def initialize(self, args):
        cfg = json.loads(args["model_config"])
        self.first_ns = int(_param(cfg, "first_token_ms", 50.0) * 1e6)
        self.itl_ns = int(_param(cfg, "itl_ms", 10.0) * 1e6)
        self.max_output_tokens = _param(cfg, "max_output_tokens", 0)
        self.tokens_per_response = max(1, _param(cfg, "tokens_per_response", 1))
        self.token_ids = np.array([int(t) for t in _param(cfg, "token_ids", "1000,2000,3000").split(",")], np.int32)
        self.text_interface = _param(cfg, "text_interface", 0) == 1

    def execute(self, requests):
        arrival_ns = time.monotonic_ns()
        arrival_epoch_ns = time.time_ns()
        for request in requests:
            threading.Thread(target=self._stream, args=(request, arrival_ns, arrival_epoch_ns), daemon=True).start()
        return None

    def _stream(self, request, arrival_ns, arrival_epoch_ns):
        sender = request.get_response_sender()
        try:
            if self.text_interface:
                osl = int(_scalar(request, "max_tokens", 16))
                streaming = bool(_scalar(request, "stream", True))
            else:
                osl = int(_scalar(request, "request_output_len", 16))
                streaming = bool(_scalar(request, "streaming", True))
            want_count = bool(_scalar(request, "return_num_output_tokens", False))
            want_perf = bool(_scalar(request, "return_perf_metrics", False))
            n = osl if self.max_output_tokens <= 0 else min(osl, self.max_output_tokens)
            step = self.tokens_per_response if streaming else n
            first_epoch = None
            sent = 0
            while sent < n:
                if sent and sent % CANCEL_CHECK_EVERY == 0 and request.is_cancelled():
                    sender.send(flags=pb_utils.TRITONSERVER_RESPONSE_COMPLETE_FINAL)  # client gone: stop
                    return
                k = min(step, n - sent)
                last_index = sent + k - 1
                deadline = arrival_ns + self.first_ns + last_index * self.itl_ns
                delay = deadline - time.monotonic_ns()
                if delay > 0:
                    time.sleep(delay / 1e9)
                now_epoch = time.time_ns()
                first_epoch = first_epoch or now_epoch
                ids = self.token_ids[np.arange(sent, sent + k) % len(self.token_ids)]
                outs = []
                if self.text_interface:
                    text = "".join(" a" for _ in range(k))
                    outs.append(pb_utils.Tensor("text_output", np.array([text.encode()], dtype=np.object_)))
                else:
                    outs.append(pb_utils.Tensor("output_ids", ids.reshape(1, k)))
                    # this response's tokens, as the backend's beamLength (not a running total)
                    outs.append(pb_utils.Tensor("sequence_length", np.array([k], np.int32)))
                if want_count:
                    outs.append(pb_utils.Tensor("num_output_tokens", np.array([k], np.int32)))
                sent += k
                final = sent >= n
                if want_perf and final:
                    for name, value in (("arrival_time_ns", arrival_epoch_ns), ("first_token_time_ns", first_epoch),
                                        ("last_token_time_ns", now_epoch)):
                        outs.append(pb_utils.Tensor(name, np.array([value], np.int64)))
                flags = pb_utils.TRITONSERVER_RESPONSE_COMPLETE_FINAL if final else 0
                sender.send(pb_utils.InferenceResponse(output_tensors=outs), flags=flags)
        except Exception as e:  # noqa: BLE001 - report every failure to the client, never hang it
            sender.send(pb_utils.InferenceResponse(error=pb_utils.TritonError(str(e))),
                        flags=pb_utils.TRITONSERVER_RESPONSE_COMPLETE_FINAL)

    def finalize(self):
        pass
