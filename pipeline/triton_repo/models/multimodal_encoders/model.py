"""trtpipe's ``multimodal_encoders``: upstream's interface (all_models/multimodal/multimodal_encoders@c2e65b88d852)
for mllama, on onnxruntime (CPU) or the TensorRT vision engine (GPU).

Inputs (all optional): IMAGE (FP16, the ensemble's ``image_input``: processed pixel values [1, images·tiles, 3, tile,
tile]), pixel_values / aspect_ratio_ids / aspect_ratio_mask / cross_attention_mask (preprocessing's), max_tokens.
Outputs, as upstream's model.py writes them for mllama (:334-430): ENCODER_INPUT_FEATURES [1, encoder_len, hidden]
(the vision model + projector's ``encoder_output`` [images, 1, tiles, patches, hidden] flattened), ENCODER_OUTPUT_LENGTHS
[1, 1] = images·tiles·patches, CROSS_ATTENTION_MASK BOOL [1, seq + max_tokens, encoder_len] (preprocessing's
[seq, images, tiles] repeated per patch, last row repeated max_tokens times), SKIP_CROSS_ATTN_BLOCKS BOOL [1, 1]. A
request without an image gets zero features of length ``tiles``, an all-false mask and SKIP_CROSS_ATTN_BLOCKS true
(upstream :349-363): the decoder skips its cross-attention layers.

Parameters: multimodal_model_path (the build's ``vision/`` dir: ``onnx/model.onnx``, ``config.json``, on a GPU
``model.engine``), encoder_runtime (``onnxruntime`` | ``tensorrt``), max_num_images (optional; limits IMAGE),
cpu_num_threads (optional, onnxruntime's intra-op threads). A refused input is an INVALID_ARGUMENT error response.
"""

from __future__ import annotations

import json
import os

import numpy as np
import triton_python_backend_utils as pb_utils
from _common import array, get_param, parse_int, raw_parameters, resolve_dir, scalar
from _vision import ImageInputError, check_image_count, expand_cross_attention_mask

RUNTIMES = ("onnxruntime", "tensorrt")
ONNX_FILE = os.path.join("onnx", "model.onnx")
OUTPUT_NAME = "encoder_output"


class _Ort:
    """onnxruntime on ``<vision>/onnx/model.onnx`` (the vision stage's export, CPU execution provider)."""

    def __init__(self, vision_dir: str, threads: int | None):
        import onnxruntime as ort

        opts = ort.SessionOptions()
        if threads:
            opts.intra_op_num_threads = threads
        self.session = ort.InferenceSession(os.path.join(vision_dir, ONNX_FILE), opts, providers=["CPUExecutionProvider"])
        self.hidden = self.session.get_outputs()[0].shape[-1]

    def __call__(self, feeds: dict[str, np.ndarray]) -> np.ndarray:
        feeds = {"pixel_values": feeds["pixel_values"].astype(np.float32),
                 "aspect_ratio_ids": feeds["aspect_ratio_ids"], "aspect_ratio_mask": feeds["aspect_ratio_mask"]}
        return self.session.run([OUTPUT_NAME], feeds)[0]


class _TensorRT:
    """The TensorRT engine ``<vision>/model.engine`` through ``tensorrt_llm.runtime.Session``, as upstream's model.py
    (:108-112, 672-693). Not run on a CPU host."""

    def __init__(self, vision_dir: str, config: dict):
        import torch
        from tensorrt_llm._utils import str_dtype_to_torch, trt_dtype_to_torch
        from tensorrt_llm.runtime import Session, TensorInfo

        with open(os.path.join(vision_dir, "model.engine"), "rb") as f:
            self.session = Session.from_serialized_engine(f.read())
        self.torch, self.TensorInfo, self.to_torch = torch, TensorInfo, trt_dtype_to_torch
        self.dtype = str_dtype_to_torch(config["builder_config"]["precision"])
        self.hidden = int(config["builder_config"]["output_shape"][-1])
        self.stream = torch.cuda.current_stream()

    def __call__(self, feeds: dict[str, np.ndarray]) -> np.ndarray:
        from tensorrt_llm._utils import torch_dtype_to_trt

        t = self.torch
        inp = {k: t.from_numpy(v).to("cuda") for k, v in feeds.items()}
        inp["pixel_values"] = inp["pixel_values"].to(self.dtype)
        info = [self.TensorInfo(k, torch_dtype_to_trt(v.dtype), v.shape) for k, v in inp.items()]
        out = {o.name: t.empty(tuple(o.shape), dtype=self.to_torch(o.dtype), device="cuda") for o in self.session.infer_shapes(info)}
        if not self.session.run(inp, out, self.stream.cuda_stream):
            raise RuntimeError("the vision engine failed")
        self.stream.synchronize()
        return out[OUTPUT_NAME].float().cpu().numpy()


class TritonPythonModel:
    """One response per request; the images of a request are one encoder batch."""

    def initialize(self, args):
        config = json.loads(args["model_config"])
        raw = raw_parameters(config)
        vision_dir = resolve_dir(args["model_repository"], get_param(raw, "multimodal_model_path", lambda n, v: v))
        runtime = get_param(raw, "encoder_runtime", lambda n, v: v, "onnxruntime")
        if runtime not in RUNTIMES:
            raise ValueError(f"parameter encoder_runtime={runtime!r}: one of {', '.join(RUNTIMES)}")
        self.max_num_images = get_param(raw, "max_num_images", lambda n, v: parse_int(n, v, minimum=1), None)
        with open(os.path.join(vision_dir, "config.json")) as f:
            vconfig = json.load(f)
        with open(os.path.join(vision_dir, "preprocessor_config.json")) as f:
            self.tiles = int(json.load(f)["max_image_tiles"])  # the image processor's tiles per image
        if runtime == "onnxruntime":
            threads = get_param(raw, "cpu_num_threads", lambda n, v: parse_int(n, v, minimum=1), None)
            self.encoder = _Ort(vision_dir, threads)
        else:
            self.encoder = _TensorRT(vision_dir, vconfig)
        out = {o["name"]: o for o in config["output"]}
        self.features_dtype = pb_utils.triton_string_to_numpy(out["ENCODER_INPUT_FEATURES"]["data_type"])

    def _one(self, request):
        image = array(request, "IMAGE")
        pixels = array(request, "pixel_values")
        max_tokens = int(scalar(request, "max_tokens", 0))
        cam = array(request, "cross_attention_mask")  # [1, seq, images, tiles] or absent
        seq = int(cam.shape[1]) if cam is not None and cam.ndim == 4 else 1
        has_image, has_pixels = image is not None and image.size > 0, pixels is not None and pixels.size > 0
        if has_image and has_pixels:
            raise ImageInputError("image_input and image_bytes_input/image_url_input: send exactly one of image_input, "
                                  "image_bytes_input, image_url_input per request")
        ar_ids, ar_mask = array(request, "aspect_ratio_ids"), array(request, "aspect_ratio_mask")
        tiles = self.tiles
        if has_image:  # processed pixel values straight from the client: every tile real
            if image.ndim != 5 or image.shape[1] % tiles or image.shape[1] == 0:
                raise ImageInputError(f"image_input: expected FP16 [1, images*{tiles}, 3, tile, tile], got {list(image.shape)}")
            n = image.shape[1] // tiles
            check_image_count(n, self.max_num_images, "image_input")
            pixels = image
            ar_ids = np.full((1, n), self._full_ratio_id(tiles), np.int64)
            ar_mask = np.ones((1, n, tiles), np.int64)
            if cam is None or cam.ndim != 4 or cam.shape[2] != n:  # no per-image mask (ensemble image_input): text sees all
                cam = np.ones((1, seq, n, tiles), np.int64)
        if pixels is None or pixels.size == 0:
            return self._text_only(max_tokens, seq, tiles)
        n, tiles = int(ar_ids.shape[-1]), int(ar_mask.shape[-1])
        feeds = {"pixel_values": pixels.reshape(n, 1, tiles, *pixels.shape[-3:]),
                 "aspect_ratio_ids": ar_ids.reshape(n, 1).astype(np.int64),
                 "aspect_ratio_mask": ar_mask.reshape(n, 1, tiles).astype(np.int64)}
        enc = self.encoder(feeds)  # [images, 1, tiles, patches, hidden]
        patches = int(enc.shape[3])
        features = enc.reshape(1, -1, enc.shape[-1]).astype(self.features_dtype)
        mask = expand_cross_attention_mask(cam.reshape(seq, n, tiles), patches, max_tokens)
        return self._response(features, mask, skip=False)

    @staticmethod
    def _full_ratio_id(tiles: int) -> int:
        """mllama's aspect-ratio id of the squarest layout filling every tile (ids are 1-based over the processor's
        supported (rows, cols) pairs in order; transformers mllama image_processing ``get_all_supported_aspect_ratios``)."""
        pairs = [(w, h) for w in range(1, tiles + 1) for h in range(1, tiles + 1) if w * h <= tiles]
        full = [p for p in pairs if p[0] * p[1] == tiles]
        return pairs.index(min(full, key=lambda p: abs(p[0] - p[1]))) + 1

    def _text_only(self, max_tokens: int, seq: int, tiles: int):
        features = np.zeros((1, tiles, self.encoder.hidden), self.features_dtype)
        return self._response(features, np.zeros((seq + max_tokens, tiles), bool), skip=True)

    @staticmethod
    def _response(features: np.ndarray, mask: np.ndarray, skip: bool):
        return pb_utils.InferenceResponse(output_tensors=[
            pb_utils.Tensor("ENCODER_INPUT_FEATURES", features),
            pb_utils.Tensor("ENCODER_OUTPUT_LENGTHS", np.array([[features.shape[1]]], np.int32)),
            pb_utils.Tensor("CROSS_ATTENTION_MASK", mask[None]),
            pb_utils.Tensor("SKIP_CROSS_ATTN_BLOCKS", np.array([[skip]], bool)),
        ])

    def execute(self, requests):
        responses = []
        for request in requests:
            try:
                responses.append(self._one(request))
            except ImageInputError as e:
                responses.append(pb_utils.InferenceResponse(output_tensors=[], error=pb_utils.TritonError(
                    f"multimodal_encoders: {e}", pb_utils.TritonError.INVALID_ARG)))
            except Exception as e:  # one bad request must not fail the batch
                responses.append(pb_utils.InferenceResponse(output_tensors=[], error=pb_utils.TritonError(
                    f"multimodal_encoders: {e}")))
        return responses
