"""trtpipe preprocessing: text → token ids, with TensorRT-LLM's preprocessing tensors.

Inputs QUERY [1] STRING, REQUEST_OUTPUT_LEN [1], optional BAD_WORDS_DICT / STOP_WORDS_DICT [-1] STRING,
END_ID / PAD_ID [1]. Outputs INPUT_ID [-1], REQUEST_INPUT_LEN [1], BAD_WORDS_IDS / STOP_WORDS_IDS [2,-1],
REQUEST_OUTPUT_LEN [-1], OUT_END_ID / OUT_PAD_ID [1] (defaults from generation_config.json, then the
tokenizer). Parameters: tokenizer_dir (relative to this model's directory or absolute), add_special_tokens.

Multimodal repository (parameter ``multimodal_model_path``: the build's ``vision/`` directory, whose
``preprocessor_config.json`` is the checkpoint's image processor): optional inputs IMAGE_BYTES (UINT8 decoded pixels)
and IMAGE_URL (STRING, ``data:`` URLs; http(s) only with ``allow_http_image_urls: true``) — at most one of them, at most
``max_num_images`` images (_vision.py) — and the outputs of upstream's preprocessing for mllama
(inflight_batcher_llm/preprocessing/1/model.py@c2e65b88d852:794-841): PIXEL_VALUES FP16 [1, images·tiles, 3, tile,
tile], ASPECT_RATIO_IDS INT64 [1, images], ASPECT_RATIO_MASK INT64 [1, images, tiles], CROSS_ATTENTION_MASK INT64
[1, seq, images, tiles] (transformers' mllama rule: a text row sees the images from the last ``<|image|>`` at or before
it). A prompt lacking ``<|image|>`` gets it in front, as upstream's client adds it. A text-only request gets the same
outputs with 0 images. A refused image input is an INVALID_ARGUMENT error; the model keeps serving.
"""

from __future__ import annotations

import dataclasses

import numpy as np
import triton_python_backend_utils as pb_utils
from _common import (
    apply_pythonpath,
    array,
    default_end_pad_ids,
    get_param,
    load_tokenizer,
    parse_bool,
    parse_int,
    raw_parameters,
    resolve_dir,
    scalar,
    text,
    word_list,
)
from _vision import (
    PREPROCESSING_INPUT,
    ImageInputError,
    check_image_count,
    cross_attention_mask,
    images_from_bytes,
    images_from_urls,
    insert_image_tokens,
    one_image_form,
)

IMAGE_TOKEN = "<|image|>"  # mllama's image placeholder (config.json image_token_index)


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
        self.end_id, self.pad_id = default_end_pad_ids(self.tokenizer)
        vision_dir = get_param(raw, "multimodal_model_path", lambda n, v: v, None)
        self.vision = None if vision_dir is None else _Vision(resolve_dir(args["model_repository"], vision_dir), raw, self.tokenizer)

    def _one(self, request):
        query = text(array(request, "QUERY").reshape(-1)[0])
        ids = self.tokenizer.encode(query, add_special_tokens=self.params.add_special_tokens)
        if not ids:
            raise ValueError("QUERY tokenizes to zero tokens")
        vision = []
        if self.vision is not None:
            ids, vision = self.vision.tensors(request, ids, self.params.add_special_tokens)
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
            *vision,
        ]
        return pb_utils.InferenceResponse(output_tensors=tensors)

    def execute(self, requests):
        responses = []
        for request in requests:
            try:
                responses.append(self._one(request))
            except ImageInputError as e:  # the client's image: INVALID_ARGUMENT (HTTP 400)
                responses.append(pb_utils.InferenceResponse(output_tensors=[], error=pb_utils.TritonError(
                    f"preprocessing: {e}", pb_utils.TritonError.INVALID_ARG)))
            except Exception as e:  # one bad request must not fail the batch
                responses.append(pb_utils.InferenceResponse(output_tensors=[], error=pb_utils.TritonError(f"preprocessing: {e}")))
        return responses


class _Vision:
    """The image side of the multimodal preprocessing (the checkpoint's mllama image processor)."""

    def __init__(self, vision_dir: str, raw: dict, tokenizer):
        apply_pythonpath()
        from pipeline.vision.tiny_mllama import image_processor_class

        self.processor = image_processor_class().from_pretrained(vision_dir)
        self.max_num_images = get_param(raw, "max_num_images", lambda n, v: parse_int(n, v, minimum=1), None)
        self.allow_http = get_param(raw, "allow_http_image_urls", parse_bool, False)
        self.image_token_id = tokenizer.backend.token_to_id(IMAGE_TOKEN)
        if self.image_token_id is None:
            raise ValueError(f"the tokenizer has no {IMAGE_TOKEN} token (not an mllama checkpoint's tokenizer)")
        bos = tokenizer.encode("", add_special_tokens=True)
        self.bos_id = bos[0] if bos else None
        self.tiles = int(self.processor.max_image_tiles)
        size = self.processor.size
        self.tile = int(size["height"] if isinstance(size, dict) else size.height)

    def images(self, request) -> list:
        """The request's images (IMAGE_BYTES or IMAGE_URL, not both; at most max_num_images). Raises ImageInputError."""
        given = {form: array(request, name) for form, name in PREPROCESSING_INPUT.items()}
        form = one_image_form(given)
        if form is None:
            return []
        arr = given[form]
        n = int(np.prod(arr.shape[:-3])) if form == "image_bytes_input" and arr.ndim >= 4 else arr.size
        check_image_count(n, self.max_num_images, form)
        if form == "image_bytes_input":
            return images_from_bytes(arr)
        return images_from_urls(arr, allow_http=self.allow_http)

    def tensors(self, request, ids: list[int], add_special_tokens: bool):
        """``(input ids, [PIXEL_VALUES, ASPECT_RATIO_IDS, ASPECT_RATIO_MASK, CROSS_ATTENTION_MASK])`` for one request."""
        images = self.images(request)
        n = len(images)
        tags = sum(1 for t in ids if t == self.image_token_id)
        if n and tags > n:
            raise ImageInputError(f"text_input: {tags} {IMAGE_TOKEN} tokens for {n} image(s): one tag per image")
        if n:
            ids = insert_image_tokens(ids, n, self.image_token_id, self.bos_id if add_special_tokens else None)
            out = self.processor(images=[images], return_tensors="np")
            pixels = np.asarray(out["pixel_values"]).reshape(1, -1, 3, self.tile, self.tile)
            ar_ids = np.asarray(out["aspect_ratio_ids"], dtype=np.int64).reshape(1, n)
            ar_mask = np.asarray(out["aspect_ratio_mask"], dtype=np.int64).reshape(1, n, self.tiles)
        else:
            pixels = np.zeros((1, 0, 3, self.tile, self.tile), np.float16)
            ar_ids, ar_mask = np.zeros((1, 0), np.int64), np.zeros((1, 0, self.tiles), np.int64)
        cam = cross_attention_mask(ids, self.image_token_id, ar_mask[0].sum(-1), self.tiles, n)
        return ids, [
            pb_utils.Tensor("PIXEL_VALUES", pixels.astype(np.float16)),
            pb_utils.Tensor("ASPECT_RATIO_IDS", ar_ids),
            pb_utils.Tensor("ASPECT_RATIO_MASK", ar_mask),
            pb_utils.Tensor("CROSS_ATTENTION_MASK", cam[None]),
        ]

