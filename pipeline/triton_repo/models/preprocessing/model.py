"""trtpipe preprocessing: text → token ids, with TensorRT-LLM's preprocessing tensors.

Inputs QUERY [1] STRING, REQUEST_OUTPUT_LEN [1], optional BAD_WORDS_DICT / STOP_WORDS_DICT [-1] STRING,
END_ID / PAD_ID [1]. Outputs INPUT_ID [-1], REQUEST_INPUT_LEN [1], BAD_WORDS_IDS / STOP_WORDS_IDS [2,-1],
REQUEST_OUTPUT_LEN [-1], OUT_END_ID / OUT_PAD_ID [1] (defaults from generation_config.json, then the
tokenizer). Parameters: tokenizer_dir (relative to this model's directory or absolute), add_special_tokens.
"""

from __future__ import annotations

import dataclasses

import numpy as np
import triton_python_backend_utils as pb_utils
from _common import (
    array,
    default_end_pad_ids,
    get_param,
    load_tokenizer,
    parse_bool,
    raw_parameters,
    resolve_dir,
    scalar,
    text,
    word_list,
)


@dataclasses.dataclass(frozen=True)
class Params:
    """Parsed model parameters."""

    tokenizer_dir: str
    add_special_tokens: bool


class TritonPythonModel:
    """Tokenizer model (one response per request; batched by Triton's dynamic batcher)."""

    def initialize(self, args):
        import json

        config = json.loads(args["model_config"])
        raw = raw_parameters(config)
        self.params = Params(
            tokenizer_dir=resolve_dir(args["model_repository"], get_param(raw, "tokenizer_dir", lambda n, v: v)),
            add_special_tokens=get_param(raw, "add_special_tokens", parse_bool, True),
        )
        self.tokenizer = load_tokenizer(self.params.tokenizer_dir)
        self.end_id, self.pad_id = default_end_pad_ids(self.tokenizer, self.params.tokenizer_dir)

    def _one(self, request):
        query = text(array(request, "QUERY").reshape(-1)[0])
        ids = self.tokenizer.encode(query, add_special_tokens=self.params.add_special_tokens)
        if not ids:
            raise ValueError("QUERY tokenizes to zero tokens")
        out_len = int(scalar(request, "REQUEST_OUTPUT_LEN"))
        end_id = int(scalar(request, "END_ID", self.end_id))
        pad_id = int(scalar(request, "PAD_ID", self.pad_id))

        def words(name):
            arr = array(request, name)
            return [text(w) for w in arr.reshape(-1)] if arr is not None else []

        tensors = [
            pb_utils.Tensor("INPUT_ID", np.array([ids], dtype=np.int32)),
            pb_utils.Tensor("REQUEST_INPUT_LEN", np.array([[len(ids)]], dtype=np.int32)),
            pb_utils.Tensor("BAD_WORDS_IDS", word_list(self.tokenizer, words("BAD_WORDS_DICT"))[None]),
            pb_utils.Tensor("STOP_WORDS_IDS", word_list(self.tokenizer, words("STOP_WORDS_DICT"))[None]),
            pb_utils.Tensor("REQUEST_OUTPUT_LEN", np.array([[out_len]], dtype=np.int32)),
            pb_utils.Tensor("OUT_END_ID", np.array([[end_id]], dtype=np.int32)),
            pb_utils.Tensor("OUT_PAD_ID", np.array([[pad_id]], dtype=np.int32)),
        ]
        return pb_utils.InferenceResponse(output_tensors=tensors)

    def execute(self, requests):
        responses = []
        for request in requests:
            try:
                responses.append(self._one(request))
            except Exception as e:  # one bad request must not fail the batch
                responses.append(pb_utils.InferenceResponse(output_tensors=[], error=pb_utils.TritonError(f"preprocessing: {e}")))
        return responses
