"""Image workloads of ``trtpipe bench`` (issue #46 item 6, #47 item 6): which images go with each request, how they
travel on each route, and what they cost the model in tokens.

**Options** are AIPerf's (ai-dynamo/aiperf@db4f6397 ``aiperf/common/config/image_config.py:22-123``):
``--image-width-mean/--image-width-stddev/--image-height-mean/--image-height-stddev`` (pixels), ``--image-format
png|jpeg`` (``common/enums/dataset_enums.py:24-27``; AIPerf's third value ``random`` is left out) and
``--image-batch-size`` (images per request). Defaults as AIPerf's (``common/config/config_defaults.py:69-76``): means
0 = no images, batch 1, png; images are sent only when both means are > 0 (``dataset/composer/synthetic.py:161-166``).
They are :class:`~pipeline.recipe.bench.BenchSpec` fields, so a recipe's ``bench`` section can set them too.

**Images** are made as AIPerf makes them (``dataset/generator/image.py:29-57``): each side drawn from N(mean, stddev)
(rejection-sampled to ≥ 0, then rounded up: ``dataset/utils.py:74-124``; never below 1 px), a bundled photograph
resized to it (scikit-image's, :func:`pipeline.vision.images.resized_sample`; AIPerf ships its own JPEGs), encoded in
the format. The draws come from ``numpy.random.default_rng`` seeded with (``--seed``, ISL), so the same seed gives the
same bytes; at most :data:`MAX_IMAGE_SETS` distinct image sets per scenario (requests cycle through them).

**Routes** (the server's documented forms):

* gRPC ``ensemble``: ``image_bytes_input`` UINT8 ``[batch, images, H, W, 3]``, the decoded RGB pixels — what
  upstream's client sends for mllama (NVIDIA/TensorRT-LLM ``triton_backend/tools/multimodal/client.py@04d9dd84``:
  ``image_data = np.array([[raw_image]])`` with ``image_input_name = "image_bytes_input"``) and its preprocessing
  reads (``triton_backend/all_models/inflight_batcher_llm/preprocessing/1/model.py@01259b15``,
  ``VisionPreProcessor.mllama_process``: one image per ``img_list`` entry of the tensor); tensorrtllm_backend
  ``docs/multimodal.md@efb8a497:337`` (uint8 5-D, channels last or first) and ``:340`` ("use image_bytes_input when
  using grpc requests and image_url_input when sending http requests"). Images of one request that differ in size
  are zero-padded bottom/right to the largest, as that client's ``pixtral_pad_images`` does.
* HTTP ``generate_stream``: ``image_url_input`` as ``data:image/<format>;base64,…`` (AIPerf's URL,
  ``image.py:57``); one image as a string, as ``docs/multimodal.md@efb8a497:305-306``'s curl request, several as a
  list. Upstream's preprocessing decodes only the ``data:image/jpeg;base64,`` prefix (``load_images_from_urls``,
  same file): a stock upstream repository needs ``--image-format jpeg`` there.
* Triton ``llmapi`` model (gRPC and HTTP generate): upstream's post-1.2.1 ``image_url`` input (STRING ``[-1]``, one
  ``data:`` URL per image: TensorRT-LLM ``triton_backend/all_models/llmapi/tensorrt_llm/config.pbtxt@0a71057313ec:54-67``,
  which trtpipe's llmapi model declares for a vision build); the model places the image tokens.
* OpenAI chat: the text part, then one ``{"type": "image_url", "image_url": {"url": <data URL>}}`` part per image
  (AIPerf ``clients/openai/openai_chat.py:61-75``); ``/v1/completions`` takes no images.

**Prompt**: on the Triton routes an mllama prompt carries its image token (``<|image|>``: the checkpoint's
``image_token_index`` in the tokenizer, else the processor's ``image_token``) once per image before the text, as
upstream's client does (``client.py``: ``FLAGS.text = image_tag + FLAGS.text``); the text is built so that the whole
``text_input`` encodes to exactly ISL tokens, placeholders included. Through the ensemble's own chat handling
(Qwen2-VL) and on the OpenAI chat route the server places the image tokens; the text is as without images.

**Tokens**: ISL counts the text, as AIPerf's does (``parsers/inference_result_parser.py:242-254`` encodes only the
texts of a turn). Image tokens are reported beside it (:class:`ImageGeometry`): mllama — the encoder length,
``max_tiles × ((tile / patch)² + 1)`` per image whatever its size (the processor pads to ``max_tiles``), read by the
decoder's cross-attention, not part of its sequence; Qwen2-VL — :func:`pipeline.vision.geometry.qwen2_vl_image_tokens`
after the processor's resize, tokens spliced into the sequence. AIPerf has no image-token metric at db4f6397 (none
under ``aiperf/metrics/types/``): the names are trtpipe's, ``image_count`` and ``image_tokens``.
"""

from __future__ import annotations

import base64
import dataclasses
import io
import json
import math
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np

from pipeline.bench.stats import Stats
from pipeline.core.errors import UserError
from pipeline.vision import geometry as vgeo

#: the image token an mllama prompt carries per image: transformers' ``MllamaProcessor.image_token``
#: (models/mllama/processing_mllama.py, ``self.image_token = "<|image|>"``; tensorrtllm_backend
#: docs/multimodal.md@efb8a497:306 sends ``"<|image|>If I had to write a haiku …"``)
MLLAMA_IMAGE_TOKEN = "<|image|>"
#: checkpoint ``model_type`` → the family whose token rule applies
VISION_MODEL_TYPES = {"mllama": "mllama", "qwen2_vl": "qwen2_vl", "qwen2_5_vl": "qwen2_vl"}
#: the Triton llmapi model's image input (upstream's post-1.2.1 name: config.pbtxt@0a71057313ec:63)
LLMAPI_IMAGE_INPUT = "image_url"
#: distinct image sets per scenario; requests cycle through them (bounds the client's memory)
MAX_IMAGE_SETS = 64
#: the options, by BenchSpec field (messages name what the user typed)
FLAGS = {"image_width_mean": "--image-width-mean", "image_width_stddev": "--image-width-stddev",
         "image_height_mean": "--image-height-mean", "image_height_stddev": "--image-height-stddev",
         "image_format": "--image-format", "image_batch_size": "--image-batch-size"}
_DEFAULTS = {"image_width_mean": 0.0, "image_width_stddev": 0.0, "image_height_mean": 0.0, "image_height_stddev": 0.0,
             "image_format": "png", "image_batch_size": 1}


@dataclasses.dataclass(frozen=True)
class ImageWorkload:
    """The image options of a run: size distribution (pixels), file format, images per request."""

    width_mean: float
    width_stddev: float
    height_mean: float
    height_stddev: float
    fmt: str
    per_request: int


def workload(spec: Any) -> ImageWorkload | None:
    """The image workload a :class:`~pipeline.recipe.bench.BenchSpec` asks for; ``None`` when it sends no images.

    Raises:
        UserError: one mean given without the other, or another image option given without both means (no images
            would be sent: AIPerf sends them only when both means are > 0) — one line naming the options.
    """
    w, h = spec.image_width_mean, spec.image_height_mean
    if w > 0 and h > 0:
        return ImageWorkload(float(w), float(spec.image_width_stddev), float(h), float(spec.image_height_stddev),
                             spec.image_format, int(spec.image_batch_size))
    if w > 0 or h > 0:
        given, missing = ("--image-width-mean", "--image-height-mean") if w > 0 else ("--image-height-mean", "--image-width-mean")
        raise UserError(f"{given} {max(w, h):g} needs {missing} too: images are sent only when both means are > 0")
    stray = [FLAGS[k] for k, d in _DEFAULTS.items() if getattr(spec, k) != d]
    if stray:
        raise UserError(f"{', '.join(stray)} without --image-width-mean and --image-height-mean: no images would be sent")
    return None


def sample_size(mean: float, stddev: float, rng: np.random.Generator) -> int:
    """One image side in pixels: N(mean, stddev) redrawn until ≥ 0, rounded up, at least 1 (AIPerf's
    ``sample_positive_normal_integer``, aiperf@db4f6397 dataset/utils.py:74-124)."""
    if stddev <= 0:
        return max(1, math.ceil(mean))
    while True:
        n = float(rng.normal(mean, stddev))
        if n >= 0:
            return max(1, math.ceil(n))


@dataclasses.dataclass(frozen=True)
class BenchImage:
    """One image as sent: ``width × height`` pixels, encoded as ``fmt`` (``png``/``jpeg``) in ``data``."""

    width: int
    height: int
    fmt: str
    data: bytes

    def data_url(self) -> str:
        """``data:image/<fmt>;base64,<data>`` (AIPerf's form)."""
        return f"data:image/{self.fmt};base64,{base64.b64encode(self.data).decode('ascii')}"

    def pixels(self) -> np.ndarray:
        """The decoded image, uint8 ``[height, width, 3]`` RGB (what the server decodes from ``data``; lossy for jpeg)."""
        from PIL import Image

        with Image.open(io.BytesIO(self.data)) as im:
            return np.asarray(im.convert("RGB"), dtype=np.uint8)


def make_image_sets(wl: ImageWorkload, count: int, seed: Any) -> list[tuple[BenchImage, ...]]:
    """``count`` sets of ``wl.per_request`` images each (sizes drawn width then height per image, then which bundled
    photograph), seeded: the same ``(wl, count, seed)`` gives the same bytes.

    Args:
        wl: the workload; count: sets to make (≥ 1); seed: a ``numpy.random.default_rng`` seed (int or sequence).
    """
    from pipeline.vision.images import BUNDLED_SAMPLES, encode, resized_sample

    rng = np.random.default_rng(seed)
    sets = []
    for _ in range(max(1, count)):
        images = []
        for _ in range(wl.per_request):
            w = sample_size(wl.width_mean, wl.width_stddev, rng)
            h = sample_size(wl.height_mean, wl.height_stddev, rng)
            pick = int(rng.integers(len(BUNDLED_SAMPLES)))
            images.append(BenchImage(w, h, wl.fmt, encode(resized_sample(w, h, pick), wl.fmt)))
        sets.append(tuple(images))
    return sets


@dataclasses.dataclass(frozen=True)
class ImageGeometry:
    """How the served model counts an image's tokens, and where that was read (``source``).

    mllama: ``tile_size``/``patch_size`` px, ``max_tiles``; Qwen2-VL: ``patch_size`` px, ``merge_size``,
    ``min_pixels``/``max_pixels``. ``max_images``: images one request may carry (``None``: not known).
    """

    family: str
    source: str
    tile_size: int = 560
    patch_size: int = 14
    max_tiles: int = 4
    merge_size: int = vgeo.QWEN2_VL_MERGE_SIZE
    min_pixels: int = vgeo.QWEN2_VL_MIN_PIXELS
    max_pixels: int = vgeo.QWEN2_VL_MAX_PIXELS
    max_images: int | None = None

    def tokens(self, width: int, height: int) -> int:
        """Tokens one ``width × height`` px image costs: mllama's encoder length per image
        (:func:`~pipeline.vision.geometry.mllama_encoder_len` of one image, size-independent), Qwen2-VL's spliced
        tokens (:func:`~pipeline.vision.geometry.qwen2_vl_image_tokens`).

        Raises:
            UserError: as those rules (bad geometry; a Qwen2-VL aspect ratio above 200).
        """
        if self.family == "mllama":
            return vgeo.mllama_encoder_len(1, self.max_tiles, self.tile_size, self.patch_size)
        return vgeo.qwen2_vl_image_tokens(height, width, patch_size=self.patch_size, merge_size=self.merge_size,
                                          min_pixels=self.min_pixels, max_pixels=self.max_pixels)

    def to_json(self) -> dict[str, Any]:
        """The geometry as bench.json records it (only the family's fields)."""
        keys = ("tile_size", "patch_size", "max_tiles") if self.family == "mllama" else (
            "patch_size", "merge_size", "min_pixels", "max_pixels")
        return {"family": self.family, "source": self.source, "max_images": self.max_images} | {k: getattr(self, k) for k in keys}


def _read_json(path: Path) -> dict[str, Any]:
    try:
        data = json.loads(path.read_text())
    except (OSError, ValueError):
        return {}
    return data if isinstance(data, dict) else {}


def resolve_geometry(recipe: Any, tokenizer_dir: Path | None) -> ImageGeometry | None:
    """The image geometry of the served model: the build recipe's ``vision`` section (mllama; Qwen2-VL's where the
    recipe has one: ``patch_size``, ``merge_size``, ``min_pixels``, ``max_pixels``), else the checkpoint
    ``config.json`` (+ ``preprocessor_config.json``) beside the tokenizer when its ``model_type`` is a vision family;
    ``None`` when neither says the model takes images.

    Qwen2-VL's processor bounds: ``min_pixels``/``max_pixels`` or ``size.shortest_edge``/``longest_edge`` (both
    spellings exist: transformers v4.57.3 image_processing_qwen2_vl.py:133-142), else the defaults.
    """
    v = getattr(recipe, "vision", None) if recipe is not None else None
    max_images = getattr(v, "max_images_per_request", None)
    if v is not None and v.family == "mllama":
        return ImageGeometry("mllama", "the build recipe's vision section", tile_size=v.tile_size,
                             patch_size=v.patch_size, max_tiles=v.max_tiles, max_images=max_images)
    if v is not None and VISION_MODEL_TYPES.get(v.family) == "qwen2_vl" and hasattr(v, "merge_size"):  # #47's section
        return ImageGeometry("qwen2_vl", "the build recipe's vision section", patch_size=v.patch_size,
                             merge_size=v.merge_size, min_pixels=v.min_pixels, max_pixels=v.max_pixels,
                             max_images=max_images)
    if tokenizer_dir is None:
        return None
    cfg_path = Path(tokenizer_dir) / "config.json"
    cfg = _read_json(cfg_path)
    family = VISION_MODEL_TYPES.get(str(cfg.get("model_type")))
    if family is None:
        return None
    vc = cfg.get("vision_config") or {}
    if family == "mllama":
        return ImageGeometry("mllama", str(cfg_path), tile_size=int(vc.get("image_size", 560)),
                             patch_size=int(vc.get("patch_size", 14)), max_tiles=int(vc.get("max_num_tiles", 4)),
                             max_images=max_images)
    pp = _read_json(Path(tokenizer_dir) / "preprocessor_config.json")
    size = pp.get("size") or {}
    return ImageGeometry(
        "qwen2_vl", str(cfg_path), patch_size=int(pp.get("patch_size") or vc.get("patch_size", vgeo.QWEN2_VL_PATCH_SIZE)),
        merge_size=int(pp.get("merge_size") or vc.get("spatial_merge_size", vgeo.QWEN2_VL_MERGE_SIZE)),
        min_pixels=int(pp.get("min_pixels") or size.get("shortest_edge") or vgeo.QWEN2_VL_MIN_PIXELS),
        max_pixels=int(pp.get("max_pixels") or size.get("longest_edge") or vgeo.QWEN2_VL_MAX_PIXELS), max_images=max_images)


def placeholder_token(tokenizer_dir: Path | None) -> str:
    """mllama's image token: the checkpoint's ``image_token_index`` looked up in its tokenizer files
    (``added_tokens`` of tokenizer.json / ``added_tokens_decoder`` of tokenizer_config.json), else
    :data:`MLLAMA_IMAGE_TOKEN`."""
    if tokenizer_dir is not None:
        idx = _read_json(Path(tokenizer_dir) / "config.json").get("image_token_index")
        added = _read_json(Path(tokenizer_dir) / "tokenizer_config.json").get("added_tokens_decoder") or {}
        if idx is not None and isinstance(added.get(str(idx)), dict) and added[str(idx)].get("content"):
            return str(added[str(idx)]["content"])
        for tok in _read_json(Path(tokenizer_dir) / "tokenizer.json").get("added_tokens") or []:
            if idx is not None and tok.get("id") == idx and tok.get("content"):
                return str(tok["content"])
    return MLLAMA_IMAGE_TOKEN


@dataclasses.dataclass(frozen=True)
class ImagePlan:
    """What a run sends: the ``workload``, the model's ``geometry``, the ``placeholder`` text put before the prompt
    once per image (``None``: the server places the image tokens) and the ``route`` — ``image_bytes_input`` (gRPC),
    ``image_url_input`` (Triton HTTP) or ``image_url`` (OpenAI chat content parts)."""

    workload: ImageWorkload
    geometry: ImageGeometry
    placeholder: str | None
    route: str

    def to_json(self) -> dict[str, Any]:
        """The ``images`` block of bench.json."""
        return {"workload": dataclasses.asdict(self.workload), "geometry": self.geometry.to_json(),
                "placeholder": self.placeholder, "route": self.route}


def check_build(spec: Any, recipe: Any, tokenizer_dir: Path | None) -> tuple[ImageWorkload, ImageGeometry] | None:
    """Before the server is asked anything: the workload (``None`` without images) and the geometry it needs.

    Raises:
        UserError: bad image options (:func:`workload`); images for a build without a vision section (and no vision
            checkpoint beside the tokenizer); more images per request than the build takes; a size the model's rule
            refuses.
    """
    wl = workload(spec)
    if wl is None:
        return None
    geo = resolve_geometry(recipe, tokenizer_dir)
    if geo is None:
        what = ("the served build has no vision section (a text-only model)" if recipe is not None else
                "no build with a vision section, and no vision checkpoint config.json beside the tokenizer")
        raise UserError(f"--image-width-mean/--image-height-mean: {what}; image workloads need a vision-language model")
    if geo.max_images is not None and wl.per_request > geo.max_images:
        raise UserError(f"--image-batch-size {wl.per_request}: the build takes at most {geo.max_images} image(s) per "
                        "request (vision.max_images_per_request)")
    geo.tokens(max(1, math.ceil(wl.width_mean)), max(1, math.ceil(wl.height_mean)))  # the rule accepts the mean size
    return wl, geo


def check_spliced_lengths(spec: Any, checked: tuple[ImageWorkload, ImageGeometry] | None, limits: Any) -> None:
    """Refuse, before any request, a scenario whose ISL plus the spliced image tokens (Qwen2-VL family: the images are
    decoder tokens) of images at the mean size exceed the served build's ``max_input_len`` (``limits``: a
    :class:`~pipeline.bench.preflight.BuildLimits`, or ``None``). mllama's image tokens go to cross-attention: not
    counted here.

    Raises:
        UserError: one line naming the scenario, the image tokens, the limit and where it was read.
    """
    if checked is None or limits is None or limits.max_input_len is None or checked[1].family == "mllama":
        return
    wl, geo = checked
    per_request = wl.per_request * geo.tokens(max(1, math.ceil(wl.width_mean)), max(1, math.ceil(wl.height_mean)))
    for s in spec.scenarios:
        if s.isl + per_request > limits.max_input_len:
            raise UserError(
                f"ISL {s.isl} + {per_request} image tokens ({wl.per_request} image(s) of "
                f"{math.ceil(wl.width_mean)}×{math.ceil(wl.height_mean)} px) exceeds the served build's max_input_len "
                f"{limits.max_input_len} ({limits.source}): lower --isl or the image size")


def plan(checked: tuple[ImageWorkload, ImageGeometry] | None, info: Any, api: str,
         tokenizer_dir: Path | None) -> ImagePlan | None:
    """The route for the served model's interface (after preflight found it).

    Raises:
        UserError: an interface that takes no images: ``/v1/completions`` (use ``--openai-endpoint chat``), a model
            without the ensemble's image input, the token (``tensorrt_llm``) or LLM-API interfaces.
    """
    if checked is None:
        return None
    wl, geo = checked
    if info.interface == "openai-chat":
        return ImagePlan(wl, geo, None, "image_url")
    if info.interface == "openai":
        raise UserError("--image-*: /v1/completions takes no images; use --openai-endpoint chat (image_url content parts)")
    if info.interface == "llmapi" and LLMAPI_IMAGE_INPUT in info.inputs:
        return ImagePlan(wl, geo, None, LLMAPI_IMAGE_INPUT)
    if info.interface != "text":
        raise UserError(f"--image-*: model {info.name!r} ({info.interface} interface) takes no images; bench the "
                        "multimodal `ensemble` (grpc, triton-http) or an OpenAI chat endpoint")
    route = "image_bytes_input" if api == "grpc" else "image_url_input"
    if route not in info.inputs:
        raise UserError(f"--image-*: model {info.name!r} declares no {route} input: not a multimodal ensemble")
    return ImagePlan(wl, geo, placeholder_token(tokenizer_dir) if geo.family == "mllama" else None, route)


def attach(prompts: list[Any], plan: ImagePlan, tokenizer: Any, seed: Any, exact_isl: int | None) -> list[Any]:
    """``prompts`` (:class:`~pipeline.bench.prompts.Prompt`) with their images, image tokens and, where the plan has
    one, the placeholder once per image before the text (counted in ``num_tokens``).

    Args:
        exact_isl: the ISL every prompt must now encode to (synthetic prompts), or ``None`` (dataset prompts).

    Raises:
        UserError: the placeholder is not one token of this tokenizer (not the model's tokenizer), or a prompt that
            no longer encodes to ``exact_isl`` tokens.
    """
    k = plan.workload.per_request
    lead = (plan.placeholder or "") * k
    if plan.placeholder and tokenizer is not None and len(tokenizer.encode(plan.placeholder, add_special_tokens=False)) != 1:
        raise UserError(f"image token {plan.placeholder!r} is not one token of the tokenizer: not this model's tokenizer")
    sets = make_image_sets(plan.workload, min(len(prompts), MAX_IMAGE_SETS), seed)
    out = []
    for i, p in enumerate(prompts):
        images = sets[i % len(sets)]
        text = None if p.text is None else lead + p.text
        n = p.num_tokens + (k if plan.placeholder and p.num_tokens >= 0 else 0)
        if exact_isl is not None and lead and tokenizer is not None and text is not None:
            got = len(tokenizer.encode(text, add_special_tokens=False))
            if got != exact_isl:
                raise UserError(f"prompt with {k} image token(s) encodes to {got} tokens, not ISL {exact_isl}")
        out.append(dataclasses.replace(p, text=text, num_tokens=n, images=images,
                                       image_tokens=sum(plan.geometry.tokens(im.width, im.height) for im in images)))
    return out


def bytes_tensor(images: Sequence[BenchImage]) -> np.ndarray:
    """``image_bytes_input`` of one request without its batch dimension: uint8 ``[images, H, W, 3]``, smaller images
    zero-padded bottom/right to the largest height and width."""
    pix = [im.pixels() for im in images]
    h, w = max(p.shape[0] for p in pix), max(p.shape[1] for p in pix)
    out = np.zeros((len(pix), h, w, 3), dtype=np.uint8)
    for i, p in enumerate(pix):
        out[i, : p.shape[0], : p.shape[1]] = p
    return out


def url_value(images: Sequence[BenchImage]) -> str | list[str]:
    """``image_url_input`` of one request in a generate body: one data URL, or a list of them."""
    urls = [im.data_url() for im in images]
    return urls[0] if len(urls) == 1 else urls


def request_input(images: Sequence[BenchImage], name: str, http: bool = True) -> tuple[str, str, Any]:
    """``(name, datatype, value)`` of one request's images (see :func:`pipeline.bench.client.request_inputs`):
    ``image_bytes_input`` → ``UINT8`` :func:`bytes_tensor`, ``image_url_input`` → ``BYTES`` :func:`url_value`, the
    llmapi model's ``image_url`` → ``BYTES`` ``[images]`` data URLs (a list of str in a generate body, ``http``; else
    an object array of bytes)."""
    if name == "image_bytes_input":
        return name, "UINT8", bytes_tensor(images)
    if name == LLMAPI_IMAGE_INPUT:
        urls = [im.data_url() for im in images]
        return name, "BYTES", urls if http else np.array([u.encode() for u in urls], dtype=object)
    return name, "BYTES", url_value(images)


def chat_content(text: str, images: Sequence[BenchImage]) -> list[dict[str, Any]]:
    """An OpenAI chat message's ``content``: the text part, then one ``image_url`` part per image (AIPerf's order)."""
    return [{"type": "text", "text": text}] + [{"type": "image_url", "image_url": {"url": im.data_url()}} for im in images]


def image_summary(records: Sequence[Any]) -> dict[str, Any] | None:
    """The ``images`` block of a load point's summary: images and image tokens per completed measured request
    (:class:`~pipeline.bench.stats.Stats` dicts) and their totals; ``None`` when no request carried images."""
    measured = [r for r in records if not r.warmup]
    if not any(r.images for r in measured):
        return None
    done = [r for r in measured if r.ok]
    return {"images_per_request": Stats.of(r.images for r in done).as_dict(),
            "image_tokens": Stats.of(r.image_tokens for r in done).as_dict(),
            "total_images": sum(r.images for r in done), "total_image_tokens": sum(r.image_tokens for r in done)}


def spec_json(spec: Any) -> dict[str, Any]:
    """``spec.model_dump(mode="json")`` as a run records it: the image options only when one is set (a text run's
    bench.json and AIPerf ``input_config`` stay as they were before image workloads existed)."""
    out = spec.model_dump(mode="json")
    if all(getattr(spec, k) == d for k, d in _DEFAULTS.items()):
        for k in _DEFAULTS:
            out.pop(k, None)
    return out
