"""Stand-in for TensorRT-LLM's LLM-API ``tensorrt_llm`` Triton model (python backend, decoupled).

Tensors as ``triton_repo/templates/llmapi_tensorrt_llm.pbtxt.j2`` (docs/reference/
triton-model-repository.md §3.7). Like the real ``llmapi/tensorrt_llm/1/model.py``, every streamed
response carries the WHOLE text generated so far (``CompletionOutput.text``) and the last one is
flagged final; there is no token count and no min_tokens.

Output: the pieces of :data:`PIECES`, one per response (at most ``sampling_param_max_tokens``
pieces), 20 ms after arrival then one every 5 ms (config parameters). With the SmolLM2 tokenizer
the pieces are 1, 1, 4, 2 and 2 tokens (10 in all; ASCII and multi-byte UTF-8 text), so a request
for more than 10 tokens comes back short — as an LLM-API request that hits EOS.

Request checks (error response otherwise): ``text_input`` is one non-empty string in a 1-D tensor
(the real model rejects other shapes), ``streaming`` is true and ``sampling_param_max_tokens`` is
given. Without ``sampling_param_exclude_input_from_output = true`` the prompt is echoed in front
of the output (the LLM-API default keeps the input), which a client counting tokens would notice.
"""

import json
import threading
import time

import numpy as np
import triton_python_backend_utils as pb_utils

#: streamed pieces; SmolLM2 tokens per piece: 1, 1, 4, 2, 2
PIECES = (" Hello", ",", " café au lait", " naïve", " 🙂 ok")


def _param(cfg, name, default):
    value = cfg.get("parameters", {}).get(name, {}).get("string_value")
    return type(default)(value) if value not in (None, "") else default


def _scalar(request, name):
    tensor = pb_utils.get_input_tensor_by_name(request, name)
    return None if tensor is None else tensor.as_numpy().reshape(-1)[0].item()


class TritonPythonModel:
    def initialize(self, args):
        cfg = json.loads(args["model_config"])
        self.first_ns = int(_param(cfg, "first_token_ms", 20.0) * 1e6)
        self.itl_ns = int(_param(cfg, "itl_ms", 5.0) * 1e6)

    def execute(self, requests):
        arrival_ns = time.monotonic_ns()
        for request in requests:
            threading.Thread(target=self._stream, args=(request, arrival_ns), daemon=True).start()
        return None

    def _stream(self, request, arrival_ns):
        sender = request.get_response_sender()
        try:
            text_input = pb_utils.get_input_tensor_by_name(request, "text_input").as_numpy()
            if text_input.ndim != 1 or text_input.size != 1 or not text_input[0]:
                raise ValueError(f"text_input must be one string in a 1-D tensor, got shape {text_input.shape}")
            if not _scalar(request, "streaming"):
                raise ValueError("this test model only streams: send streaming=true")
            max_tokens = _scalar(request, "sampling_param_max_tokens")
            if max_tokens is None or max_tokens < 1:
                raise ValueError(f"sampling_param_max_tokens must be given and >= 1, got {max_tokens}")
            prompt = text_input[0].decode() if isinstance(text_input[0], bytes) else str(text_input[0])
            text = "" if _scalar(request, "sampling_param_exclude_input_from_output") else prompt
            want_reason = bool(_scalar(request, "return_finish_reason"))
            n = min(len(PIECES), int(max_tokens))
            for i in range(n):
                delay = arrival_ns + self.first_ns + i * self.itl_ns - time.monotonic_ns()
                if delay > 0:
                    time.sleep(delay / 1e9)
                text += PIECES[i]
                outs = [pb_utils.Tensor("text_output", np.array([text.encode("utf-8")], dtype=np.object_))]
                final = i == n - 1
                if want_reason:
                    reason = ("length" if n == max_tokens else "stop") if final else "None"
                    outs.append(pb_utils.Tensor("finish_reason", np.array([reason.encode()], dtype=np.object_)))
                flags = pb_utils.TRITONSERVER_RESPONSE_COMPLETE_FINAL if final else 0
                sender.send(pb_utils.InferenceResponse(output_tensors=outs), flags=flags)
        except Exception as e:  # noqa: BLE001 - report every failure to the client, never hang it
            sender.send(pb_utils.InferenceResponse(error=pb_utils.TritonError(str(e))),
                        flags=pb_utils.TRITONSERVER_RESPONSE_COMPLETE_FINAL)

    def finalize(self):
        pass
