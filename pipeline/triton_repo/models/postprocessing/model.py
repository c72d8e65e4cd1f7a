"""trtpipe postprocessing: token ids → text, with TensorRT-LLM's postprocessing tensors.

Inputs TOKENS_BATCH [-1,-1] (beams × tokens), SEQUENCE_LENGTH [-1]. Output OUTPUT [-1] STRING (one
text per beam). Parameters: tokenizer_dir, skip_special_tokens.

Streaming: in the three-step ensemble (the GPU layout; on CPU with ``build.cpu.detokenize:
postprocessing``, where the default decodes in the engine's own model) every streamed step of
tensorrt_llm reaches this model as a separate request, and Triton cannot also pass it the ensemble's
``stream`` input (a step may not mix a decoupled model's outputs with ensemble inputs). So every request
that carries a request id (or a correlation id) goes to an incremental detokenizer kept per (id, beam) —
the ensemble scheduler copies the client's ids onto each composing request — and its pieces keep spaces
and multi-byte characters; a non-streamed response is simply the first and only piece of its id. The
repository runs ONE instance of this model in decoupled mode (the state lives in this process); idle
streams are dropped after 5 minutes. A request without any id is decoded statelessly (a warning is logged
once): clients that stream through the ensemble must set a unique request id per request. Text of an
incomplete trailing UTF-8 sequence is held back and never sent (the BLS flushes it).
"""

from __future__ import annotations

import dataclasses

import numpy as np
import triton_python_backend_utils as pb_utils
from _common import (
    array,
    get_param,
    load_tokenizer,
    parse_bool,
    raw_parameters,
    resolve_dir,
)
from detokenize import DetokenizerRegistry, IncrementalDetokenizer


@dataclasses.dataclass(frozen=True)
class Params:
    """Parsed model parameters."""

    tokenizer_dir: str
    skip_special_tokens: bool


class TritonPythonModel:
    """Detokenizer model."""

    def initialize(self, args):
        import json

        raw = raw_parameters(json.loads(args["model_config"]))
        self.params = Params(
            tokenizer_dir=resolve_dir(args["model_repository"], get_param(raw, "tokenizer_dir", lambda n, v: v)),
            skip_special_tokens=get_param(raw, "skip_special_tokens", parse_bool, True),
        )
        self.tokenizer = load_tokenizer(self.params.tokenizer_dir)
        self.streams = DetokenizerRegistry(
            lambda: IncrementalDetokenizer(self.tokenizer, skip_special_tokens=self.params.skip_special_tokens)
        )
        self._warned = False

    def _stream_key(self, request):
        rid = request.request_id()
        if rid:
            return ("id", rid)
        cid = request.correlation_id()
        if cid:
            return ("corr", cid)
        if not self._warned:
            pb_utils.Logger.log_warn("postprocessing: request without request id: streamed text is decoded step by step")
            self._warned = True
        return None

    def _one(self, request):
        tokens = array(request, "TOKENS_BATCH")
        lengths = array(request, "SEQUENCE_LENGTH")
        tokens = tokens.reshape(-1, tokens.shape[-1])  # [beams, tokens]
        lengths = lengths.reshape(-1) if lengths is not None else np.full(len(tokens), tokens.shape[-1])
        key = self._stream_key(request)
        texts = []
        for beam, row in enumerate(tokens):
            ids = [int(t) for t in row[: int(lengths[beam])]]
            if key is None:
                texts.append(self.tokenizer.decode(
                    ids, skip_special_tokens=self.params.skip_special_tokens, clean_up_tokenization_spaces=False
                ))
            else:
                texts.append(self.streams.add(key + (beam,), ids))
        out = np.array([[t.encode("utf-8") for t in texts]], dtype=object)
        return pb_utils.InferenceResponse(output_tensors=[pb_utils.Tensor("OUTPUT", out)])

    def execute(self, requests):
        responses = []
        for request in requests:
            try:
                responses.append(self._one(request))
            except Exception as e:
                responses.append(pb_utils.InferenceResponse(output_tensors=[], error=pb_utils.TritonError(f"postprocessing: {e}")))
        return responses
