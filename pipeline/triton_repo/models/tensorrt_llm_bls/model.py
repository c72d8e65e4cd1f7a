"""trtpipe tensorrt_llm_bls: text in, text out, through the ``tensorrt_llm`` model (BLS).

Same text interface as the ensemble (text_input, max_tokens, stream, min_tokens, end_id, pad_id,
stop_words, bad_words, sampling knobs, return_* flags → text_output + num_input_tokens,
num_output_tokens, perf timestamps, …). Tokenization and detokenization run in this process; with
``accumulate_tokens`` (default) every streamed step goes through an :class:`IncrementalDetokenizer`
owned by the request, so pieces keep spaces and multi-byte characters; without it each step is
decoded alone (TensorRT-LLM's old behaviour). The text still held back when the stream ends is sent
with the final response.

Decoupled: each request runs on its own thread (``execute`` returns at once), so one instance serves
many concurrent streams. Client cancellation (``request.is_cancelled()``) stops the inner request.
Every error becomes a ``TritonError`` response with the final flag.

Parameters: tokenizer_dir, add_special_tokens, skip_special_tokens, accumulate_tokens,
tensorrt_llm_model_name; in the multimodal repository also multimodal_encoders_name (upstream's BLS parameter,
tensorrt_llm_bls/config.pbtxt@0193dbd4:436) and multimodal_model_path (the vision dir: the image processor's tile
count). Images: ``image_input`` only, as upstream's BLS ("tensorrt_llm_bls only supports image_input"): FP16
[1, images·tiles, 3, tile, tile] processed pixel values, every tile real; the model asks multimodal_encoders for the
encoder features (a BLS call) and hands them to tensorrt_llm. A bad image_input is an INVALID_ARGUMENT error.
"""

from __future__ import annotations

import dataclasses
import json
import threading

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
from _vision import (
    ENCODER_INPUTS,
    ImageInputError,
    cross_attention_mask,
    insert_image_tokens,
)
from detokenize import IncrementalDetokenizer

FINAL = pb_utils.TRITONSERVER_RESPONSE_COMPLETE_FINAL
#: BLS input → tensorrt_llm input for scalars forwarded unchanged (names as in the ensemble).
FORWARD = {
    "exclude_input_in_output": "exclude_input_in_output", "top_k": "runtime_top_k", "top_p": "runtime_top_p",
    "temperature": "temperature", "length_penalty": "len_penalty", "repetition_penalty": "repetition_penalty",
    "min_tokens": "min_tokens", "presence_penalty": "presence_penalty", "frequency_penalty": "frequency_penalty",
    "seed": "seed", "return_log_probs": "return_log_probs", "return_context_logits": "return_context_logits",
    "return_generation_logits": "return_generation_logits", "return_perf_metrics": "return_perf_metrics",
    "return_num_input_tokens": "return_num_input_tokens", "return_num_output_tokens": "return_num_output_tokens",
    "beam_width": "beam_width", "num_return_sequences": "num_return_sequences",
    # guided decoding, passed through as upstream's BLS does (tensorrt_llm_bls/1/lib/triton_decoder.py@c2e65b88d852:457-458)
    "guided_decoding_guide_type": "guided_decoding_guide_type", "guided_decoding_guide": "guided_decoding_guide",
}
#: this model's own output that is not a tensorrt_llm output (every other declared output is passed through)
TEXT_OUTPUT = "text_output"


@dataclasses.dataclass(frozen=True)
class Params:
    """Parsed model parameters."""

    tokenizer_dir: str
    add_special_tokens: bool
    skip_special_tokens: bool
    accumulate_tokens: bool
    tensorrt_llm_model_name: str
    multimodal_encoders_name: str | None = None
    multimodal_model_path: str | None = None


class TritonPythonModel:
    """Business-logic-scripting model: preprocessing + tensorrt_llm + postprocessing in one."""

    def initialize(self, args):
        config = json.loads(args["model_config"])
        #: tensorrt_llm outputs returned unchanged next to text_output: the ones this config declares
        self.passthrough = tuple(o["name"] for o in config.get("output", []) if o["name"] != TEXT_OUTPUT)
        raw = raw_parameters(config)
        self.params = Params(
            tokenizer_dir=resolve_dir(args["model_repository"], get_param(raw, "tokenizer_dir", lambda n, v: v)),
            add_special_tokens=get_param(raw, "add_special_tokens", parse_bool, True),
            skip_special_tokens=get_param(raw, "skip_special_tokens", parse_bool, True),
            accumulate_tokens=get_param(raw, "accumulate_tokens", parse_bool, True),
            tensorrt_llm_model_name=get_param(raw, "tensorrt_llm_model_name", lambda n, v: v, "tensorrt_llm"),
            multimodal_encoders_name=get_param(raw, "multimodal_encoders_name", lambda n, v: v, None),
            multimodal_model_path=get_param(raw, "multimodal_model_path", lambda n, v: resolve_dir(args["model_repository"], v), None),
        )
        self.tiles = self.image_token_id = None
        if self.params.multimodal_model_path is not None:
            import os

            with open(os.path.join(self.params.multimodal_model_path, "preprocessor_config.json")) as f:
                self.tiles = int(json.load(f)["max_image_tiles"])
        self.decoupled = pb_utils.using_decoupled_model_transaction_policy(config)
        self.tokenizer = load_tokenizer(self.params.tokenizer_dir)
        self.end_id, self.pad_id = default_end_pad_ids(self.tokenizer)
        if self.tiles is not None:
            self.image_token_id = self.tokenizer.backend.token_to_id("<|image|>")
            bos = self.tokenizer.encode("", add_special_tokens=True)
            self.bos_id = bos[0] if bos else None

    def _encoder_inputs(self, request, ids: list[int], max_tokens: int):
        """``(ids with <|image|> tags, [tensorrt_llm encoder tensors])`` for an ``image_input`` request (a BLS call to
        multimodal_encoders); ``(ids, [])`` without one. Raises ImageInputError for a malformed image_input."""
        image = array(request, "image_input")
        if image is None or image.size == 0 or self.params.multimodal_encoders_name is None:
            return ids, []
        if image.ndim != 5 or image.shape[1] % self.tiles or image.shape[1] == 0:
            raise ImageInputError(f"image_input: expected FP16 [1, images*{self.tiles}, 3, tile, tile], got {list(image.shape)}")
        n = image.shape[1] // self.tiles
        ids = insert_image_tokens(ids, n, self.image_token_id, self.bos_id if self.params.add_special_tokens else None)
        cam = cross_attention_mask(ids, self.image_token_id, [self.tiles] * n, self.tiles, n)
        enc = pb_utils.InferenceRequest(
            model_name=self.params.multimodal_encoders_name,
            inputs=[pb_utils.Tensor("IMAGE", image.astype(np.float16)),
                    pb_utils.Tensor("aspect_ratio_mask", np.ones((1, n, self.tiles), np.int64)),
                    pb_utils.Tensor("cross_attention_mask", cam[None]),
                    pb_utils.Tensor("max_tokens", np.array([[max_tokens]], np.int32))],
            requested_output_names=["ENCODER_INPUT_FEATURES", "ENCODER_OUTPUT_LENGTHS", "CROSS_ATTENTION_MASK",
                                    "SKIP_CROSS_ATTN_BLOCKS"]).exec()
        if enc.has_error():
            raise ImageInputError(enc.error().message())
        out = ["ENCODER_INPUT_FEATURES", "ENCODER_OUTPUT_LENGTHS", "CROSS_ATTENTION_MASK", "SKIP_CROSS_ATTN_BLOCKS"]
        return ids, [pb_utils.Tensor(dst, pb_utils.get_output_tensor_by_name(enc, src).as_numpy())
                     for src, dst in zip(out, ENCODER_INPUTS)]

    # ------------------------------------------------------------------ one request
    def _inner_request(self, request, streaming: bool):
        prompt = text(array(request, "text_input").reshape(-1)[0])
        ids = self.tokenizer.encode(prompt, add_special_tokens=self.params.add_special_tokens)
        if not ids:
            raise ValueError("text_input tokenizes to zero tokens")

        def i32(v):
            return np.array([[v]], dtype=np.int32)

        ids, encoder = self._encoder_inputs(request, ids, int(scalar(request, "max_tokens")))

        def words(name):
            arr = array(request, name)
            return word_list(self.tokenizer, [text(w) for w in arr.reshape(-1)] if arr is not None else [])[None]

        inputs = [
            pb_utils.Tensor("input_ids", np.array([ids], dtype=np.int32)),
            pb_utils.Tensor("input_lengths", i32(len(ids))),
            pb_utils.Tensor("request_output_len", i32(int(scalar(request, "max_tokens")))),
            pb_utils.Tensor("end_id", i32(int(scalar(request, "end_id", self.end_id)))),
            pb_utils.Tensor("pad_id", i32(int(scalar(request, "pad_id", self.pad_id)))),
            pb_utils.Tensor("streaming", np.array([[streaming]], dtype=bool)),
            pb_utils.Tensor("stop_words_list", words("stop_words")),
            pb_utils.Tensor("bad_words_list", words("bad_words")),
            *encoder,
        ]
        for src, dst in FORWARD.items():
            arr = array(request, src)
            if arr is not None:
                inputs.append(pb_utils.Tensor(dst, arr.reshape(1, 1)))
        return pb_utils.InferenceRequest(
            model_name=self.params.tensorrt_llm_model_name,
            inputs=inputs,
            requested_output_names=["output_ids", "sequence_length", *self.passthrough],
        )

    def _response(self, texts: list[str], inner=None):
        tensors = [pb_utils.Tensor("text_output", np.array([[t.encode("utf-8") for t in texts]], dtype=object))]
        if inner is not None:
            for name in self.passthrough:
                t = pb_utils.get_output_tensor_by_name(inner, name)
                if t is not None:
                    tensors.append(pb_utils.Tensor(name, t.as_numpy()))
        return pb_utils.InferenceResponse(output_tensors=tensors)

    def _generate(self, request, send) -> None:
        """Run one request; ``send(response_or_None, final)`` delivers results."""
        streaming = bool(scalar(request, "stream", False)) and self.decoupled
        inner_req = self._inner_request(request, streaming)
        detoks: dict[int, IncrementalDetokenizer] = {}
        tokens: dict[int, list[int]] = {}
        responses = inner_req.exec(decoupled=self.decoupled)
        if not self.decoupled:
            responses = [responses]
        last = None
        for inner in responses:
            if inner.has_error():
                raise RuntimeError(inner.error().message())
            if self.decoupled and request.is_cancelled():
                if hasattr(responses, "cancel"):
                    responses.cancel()
                send(None, True)
                return
            out = pb_utils.get_output_tensor_by_name(inner, "output_ids")
            if out is None:  # flag-only final response of the inner model
                continue
            ids = out.as_numpy().reshape(-1, out.as_numpy().shape[-1])
            lens = pb_utils.get_output_tensor_by_name(inner, "sequence_length").as_numpy().reshape(-1)
            new = {b: [int(t) for t in ids[b, : int(lens[b])]] for b in range(len(ids))}
            last = inner
            if not streaming:
                for b, n in new.items():
                    tokens.setdefault(b, []).extend(n)
                continue
            texts = []
            for b, n in new.items():
                if self.params.accumulate_tokens:
                    d = detoks.setdefault(b, IncrementalDetokenizer(
                        self.tokenizer, skip_special_tokens=self.params.skip_special_tokens))
                    texts.append(d.add(n))
                else:
                    texts.append(self._decode(n))
            send(self._response(texts, inner), False)
        if streaming:
            tail = [d.flush() for _, d in sorted(detoks.items())]
            send(self._response(tail) if any(tail) else None, True)
        else:
            texts = [self._decode(t) for _, t in sorted(tokens.items())] or [""]
            send(self._response(texts, last), True)

    def _decode(self, ids: list[int]) -> str:
        return self.tokenizer.decode(ids, skip_special_tokens=self.params.skip_special_tokens,
                                     clean_up_tokenization_spaces=False)

    # ------------------------------------------------------------------ entry points
    def _run_decoupled(self, request) -> None:
        sender = request.get_response_sender()
        finished = False

        def send(response, final):
            nonlocal finished
            if final:
                finished = True
                if response is None:
                    sender.send(flags=FINAL)
                else:
                    sender.send(response, flags=FINAL)
            elif response is not None:
                sender.send(response)

        try:
            self._generate(request, send)
        except Exception as e:
            if not finished:
                sender.send(pb_utils.InferenceResponse(output_tensors=[], error=_error(e)), flags=FINAL)

    def execute(self, requests):
        if self.decoupled:
            for request in requests:
                threading.Thread(target=self._run_decoupled, args=(request,), daemon=True).start()
            return None
        results = []
        for request in requests:
            box = []
            try:
                self._generate(request, lambda r, final: box.append(r) if final else None)
                results.append(box[-1])
            except Exception as e:
                results.append(pb_utils.InferenceResponse(output_tensors=[], error=_error(e)))
        return results


def _error(e: Exception):
    """The TritonError of a failed request: INVALID_ARGUMENT for the client's image, else the default code."""
    if isinstance(e, ImageInputError):
        return pb_utils.TritonError(f"tensorrt_llm_bls: {e}", pb_utils.TritonError.INVALID_ARG)
    return pb_utils.TritonError(f"tensorrt_llm_bls: {e}")
