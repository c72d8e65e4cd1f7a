"""``vision`` section: a vision-language model's image path (issue #46 item 1; mllama = Llama 3.2 Vision first).

Names follow upstream: ``tile_size`` is mllama's ``vision_config.image_size``, ``max_tiles`` the processor's
``max_image_tiles`` (``vision_config.max_num_tiles``), ``max_images_per_request`` the Triton preprocessing model's
``max_num_images``, ``max_encoder_input_len`` the ``trtllm-build --max_encoder_input_len`` flag, and the three
Triton knobs keep their ``fill_template.py`` / ``launch_triton_server.py`` spellings
(tensorrtllm_backend docs/multimodal.md@efb8a497:206-235; docs/reference/multimodal-vlm.md §2).

Two values are **derived, never typed by hand** (:func:`derived_vision`): the decoder's ``max_encoder_input_len``
(:func:`pipeline.vision.geometry.mllama_encoder_len`: images × max tiles × ((tile / patch)² + 1) = 6404 at 560 px)
and the vision engine's ``max_batch_size`` (``build.max_batch_size`` × images per request,
:func:`pipeline.vision.geometry.vision_max_batch_size`). A typed value that disagrees is one error naming both
numbers.

Which engine feeds a family images in which release is data: ``vision_images`` of
``pipeline/data/release_matrix.yaml``, read by :func:`image_engines` only. On TensorRT-LLM 1.2.x mllama takes
images on the TensorRT-engine path only (the PyTorch backend's ``modeling_mllama.py@000a01de`` has
``# TODO:  Enable image_inputs`` and skips cross-attention), and that path is end-of-life after 1.2
(``triton_backend/all_models/multimodal/Deprecation_notice.md@18f906aa``).
"""

from __future__ import annotations

import functools
import json
from importlib import resources
from pathlib import Path
from typing import Annotated, Any, Literal, NamedTuple, Union

import yaml
from pydantic import Field

from pipeline.core.engine_paths import version_key
from pipeline.core.errors import UserError
from pipeline.core.recipe_paths import recipe_path
from pipeline.recipe.base import StrictModel
from pipeline.recipe.bounds import INT32_MAX
from pipeline.recipe.serving_path import (
    CROSS_ATTENTION_FAMILIES,
    ServingPath,
    ServingPathError,
    on_cpu_target,
    serving_path,
)
from pipeline.vision import geometry as vgeo

#: the vision families the recipe knows (``config.json`` ``model_type``), by how an image reaches the decoder:
#: cross-attention over encoder features (mllama) or image tokens spliced into the sequence (the Qwen2-VL family)
TOKEN_FAMILIES = ("qwen2_vl", "qwen2_5_vl")
FAMILIES = CROSS_ATTENTION_FAMILIES + TOKEN_FAMILIES
#: ``encoder_input_features_data_type`` per family: "TYPE_BF16 for mllama" (docs/multimodal.md@efb8a497:229)
FEATURES_DTYPE = {"mllama": "TYPE_BF16"}


class VisionSpec(StrictModel):
    """mllama (Llama 3.2 Vision): the image reaches the decoder's cross-attention as encoder features — tiles,
    images per request, the vision encoder and the Triton multimodal knobs."""

    family: Literal["mllama"] = Field(description="Vision family = the checkpoint's config.json model_type (mllama = Llama 3.2 Vision; TensorRT engine path).")
    tile_size: int = Field(default=560, ge=1, le=INT32_MAX, description="Tile edge in pixels = vision_config.image_size (560 for Llama 3.2 Vision; HF config.json).")
    patch_size: int = Field(default=14, ge=1, le=INT32_MAX, description="Patch edge in pixels = vision_config.patch_size (14).")
    max_tiles: int = Field(default=4, ge=1, le=INT32_MAX, description="Tiles per image = the processor's max_image_tiles / vision_config.max_num_tiles (4); the processor pads every image to it.")
    max_images_per_request: int = Field(default=1, ge=1, le=INT32_MAX, description="Images one request may carry = the Triton preprocessing max_num_images (docs/multimodal.md@efb8a497:208 uses 1).")
    encoder_dtype: Literal["bfloat16", "float16", "float32"] = Field(
        default="bfloat16",
        description="Vision encoder (and projector) dtype; float32 on the cpu target only (onnxruntime); never quantized: ModelOpt quantizes only the language model of a VLM "
                    "(TensorRT-Model-Optimizer examples/llm_ptq/hf_ptq.py@5a4242fa:348-368, 646-651; the mllama README keeps "
                    "the visual engine in BF16 for an FP8 decoder).")
    max_batch_size: int | None = Field(default=None, ge=1, le=INT32_MAX, description="Vision engine batch limit; derived = build.max_batch_size × max_images_per_request (docs/multimodal.md@efb8a497:171). Leave unset; a typed value must equal the derived one.")
    max_encoder_input_len: int | None = Field(default=None, ge=1, le=INT32_MAX, description="trtllm-build --max_encoder_input_len of the decoder; derived = images × max_tiles × ((tile_size / patch_size)² + 1) = 6404 at 560 px. Leave unset; a typed value must equal the derived one.")
    encoder_input_features_data_type: Literal["TYPE_BF16", "TYPE_FP16"] = Field(default="TYPE_BF16", description="Triton tensorrt_llm/multimodal_encoders parameter; TYPE_BF16 for mllama (docs/multimodal.md@efb8a497:206, 229).")
    cross_kv_cache_fraction: float = Field(default=0.5, gt=0.0, lt=1.0, description="Share of the paged KV pool given to cross-attention (Triton tensorrt_llm parameter; 0.5 in docs/multimodal.md@efb8a497:206, 230).")
    multimodal_gpu0_cuda_mem_pool_bytes: int = Field(default=300000000, ge=0, le=2**63 - 1, description="launch_triton_server.py --multimodal_gpu0_cuda_mem_pool_bytes: CUDA memory pool on GPU 0 for the encoder outputs (300000000 in docs/multimodal.md@efb8a497:235, 241).")


#: the name of the mllama section in code that reads it as one of the families
MllamaVision = VisionSpec


class QwenVLVision(StrictModel):
    """Qwen2-VL / Qwen2.5-VL (PyTorch LLM-API backend): each image becomes decoder tokens spliced into the prompt, one
    per 28×28 px after the processor's resize (:func:`pipeline.vision.geometry.qwen2_vl_image_tokens`); the vision
    tower runs in PyTorch inside the backend (no ONNX, no engine) and is never quantized."""

    family: Literal["qwen2_vl", "qwen2_5_vl"] = Field(description="Vision family = the checkpoint's config.json model_type (qwen2_vl, qwen2_5_vl; PyTorch LLM-API backend).")
    patch_size: int = Field(default=vgeo.QWEN2_VL_PATCH_SIZE, ge=1, le=INT32_MAX, description="vision_config.patch_size (14).")
    merge_size: int = Field(default=vgeo.QWEN2_VL_MERGE_SIZE, ge=1, le=INT32_MAX, description="vision_config.spatial_merge_size (2): merge² patches become one decoder token.")
    min_pixels: int = Field(default=vgeo.QWEN2_VL_MIN_PIXELS, ge=1, le=INT32_MAX, description="The image processor's min_pixels (56·56 = 3136; transformers v4.57.3 image_processing_qwen2_vl.py:55): smaller images are resized up.")
    max_pixels: int = Field(default=vgeo.QWEN2_VL_MAX_PIXELS, ge=1, le=INT32_MAX, description="The image processor's max_pixels (28·28·1280 = 1003520, at most 1280 tokens an image): larger images are resized down.")
    image_width: int = Field(default=448, ge=1, le=INT32_MAX, description="Width in pixels of the images this deployment is sized for: the token budget checks (max_input_len, max_num_tokens) and `plan` count images at this size.")
    image_height: int = Field(default=448, ge=1, le=INT32_MAX, description="Height in pixels of the images this deployment is sized for (see image_width).")
    max_images_per_request: int = Field(default=1, ge=1, le=INT32_MAX, description="Images one request may carry.")
    encoder_dtype: Literal["bfloat16", "float16"] = Field(
        default="bfloat16",
        description="Vision tower dtype; never quantized: ModelOpt quantizes only the language model of a VLM (hf_ptq.py@5a4242fa:348-368) "
                    "and the backend re-sets QuantConfig to exclude the vision encoder (modeling_qwen2vl.py, docs/reference/multimodal-vlm.md §3).")

    def image_tokens(self) -> int:
        """Decoder tokens one image of ``image_width × image_height`` costs (the rule in :mod:`pipeline.vision.geometry`)."""
        return vgeo.qwen2_vl_image_tokens(self.image_height, self.image_width, patch_size=self.patch_size,
                                          merge_size=self.merge_size, min_pixels=self.min_pixels,
                                          max_pixels=self.max_pixels)

    def request_image_tokens(self) -> int:
        """Decoder tokens the images of one full request cost: ``max_images_per_request × image_tokens()``."""
        return self.max_images_per_request * self.image_tokens()


#: the recipe's ``vision`` section: one of the families' sections, chosen by ``family``
AnyVision = Annotated[Union[VisionSpec, QwenVLVision], Field(discriminator="family")]


def cross_attention(vision: Any) -> bool:
    """True when a recipe's images go through trtpipe's own vision encoder stage into the decoder's cross-attention
    (mllama: ONNX → TensorRT / onnxruntime, the multimodal Triton repository, image calibration); False without a
    vision section, and for a token family (Qwen2-VL: the PyTorch backend runs its vision tower itself)."""
    return isinstance(vision, VisionSpec)


def image_tokens_per_request(vision: Any) -> int:
    """Decoder-sequence tokens a request's images add to its ISL: the image tokens of a token family (Qwen2-VL), 0 for
    a cross-attention family (mllama: its one ``<|image|>`` token is text; the encoder features go to the cross
    pool) or no vision section."""
    return vision.request_image_tokens() if isinstance(vision, QwenVLVision) else 0


class VisionDerived(NamedTuple):
    """The derived values of a vision section: ``max_batch_size`` (vision engine, images) and
    ``max_encoder_input_len`` (encoder vectors per request)."""

    max_batch_size: int
    max_encoder_input_len: int


@functools.cache
def _matrix_all() -> dict[str, Any]:
    return yaml.safe_load(resources.files("pipeline").joinpath("data/release_matrix.yaml").read_text())


def _matrix_images() -> dict[str, Any]:
    return _matrix_all()["vision_images"]


@functools.cache
def _known_models() -> dict[str, Any]:
    return yaml.safe_load(resources.files("pipeline").joinpath("data/models.yaml").read_text())


def image_engines(family: str, tensorrt_llm: str) -> dict[str, bool]:
    """The engines that feed ``family`` images on TensorRT-LLM ``tensorrt_llm``, each mapped to whether that path is
    end-of-life after its last release line (``vision_images`` of pipeline/data/release_matrix.yaml: a row feeds
    images unless ``images: false``, from release line ``since`` through ``last_line``, either open when null).

    Raises:
        ValueError: ``tensorrt_llm`` is not a version string.
    """
    release = version_key(tensorrt_llm)[:2]
    out: dict[str, bool] = {}
    for engine, row in _matrix_images().get(family, {}).items():
        row = row or {}
        since, last = row.get("since"), row.get("last_line")
        if row.get("images", True) is False or (since is not None and release < _line(since)):
            continue
        if last is None or release <= _line(last):
            out[engine] = bool(row.get("end_of_life"))
    return out


def _line(text: Any) -> tuple[int, ...]:
    return tuple(int(x) for x in str(text).split("."))


def triton_llmapi_images(tensorrt_llm: str) -> bool:
    """Whether the Triton ``llmapi`` model of TensorRT-LLM ``tensorrt_llm`` takes images (``vision_triton_llmapi`` of
    pipeline/data/release_matrix.yaml: ``since`` = the first release line with its ``image_url`` input, null = none
    the matrix lists)."""
    since = _matrix_all()["vision_triton_llmapi"].get("since")
    return since is not None and version_key(tensorrt_llm)[:2] >= _line(since)


#: config.json ``architectures[0]`` → ``model_type`` for the known-model table (whose entries name the architecture)
_ARCH_FAMILY = {"MllamaForConditionalGeneration": "mllama", "Qwen2VLForConditionalGeneration": "qwen2_vl",
                "Qwen2_5_VLForConditionalGeneration": "qwen2_5_vl"}


def vision_config_of(source: str, base_dir: Path | None = None) -> tuple[str | None, dict | None]:
    """``(model_type, vision_config)`` of a recipe source (:func:`vision_geometry`); ``(None, None)`` when unknown."""
    g = vision_geometry(source, base_dir)
    return (None, None) if g is None else (g["model_type"], g["vision_config"])


def vision_geometry(source: str, base_dir: Path | None = None) -> dict | None:
    """``{"model_type", "vision_config", "cross_attention_layers"}`` of a recipe source: the known-model table
    (pipeline/data/models.yaml ``vision`` / ``cross_attention_layers``; model_type ``text`` for a text model there)
    or a local directory's config.json (``text_config.cross_attention_layers``); ``None`` when unknown."""
    entry = _known_models().get(source.strip())
    if entry is not None:
        vis = entry.get("vision")
        return {"model_type": _ARCH_FAMILY.get(entry.get("architecture", ""), "text") if vis else "text",
                "vision_config": vis, "cross_attention_layers": list(entry.get("cross_attention_layers") or [])}
    cfg_file = recipe_path(source, base_dir) / "config.json"
    if not cfg_file.is_file():
        return None
    try:
        cfg = json.loads(cfg_file.read_text())
    except ValueError:
        return None
    text = cfg.get("text_config") or {}
    return {"model_type": cfg.get("model_type"), "vision_config": cfg.get("vision_config"),
            "cross_attention_layers": list(text.get("cross_attention_layers") or [])}


def derived_vision(vision: VisionSpec, build_max_batch_size: int) -> VisionDerived:
    """The derived vision values (rules in :mod:`pipeline.vision.geometry`).

    Raises:
        UserError: a typed ``max_batch_size`` or ``max_encoder_input_len`` that disagrees (both numbers named), or a
            tile that is not a whole number of patches.
    """
    batch = vgeo.vision_max_batch_size(build_max_batch_size, vision.max_images_per_request)
    if vision.max_batch_size is not None and vision.max_batch_size != batch:
        raise UserError(f"vision.max_batch_size: {vision.max_batch_size} disagrees with {batch} derived from "
                        f"build.max_batch_size {build_max_batch_size} × vision.max_images_per_request "
                        f"{vision.max_images_per_request}; leave it out or write the derived value")
    enc = vgeo.mllama_encoder_len(vision.max_images_per_request, vision.max_tiles, vision.tile_size, vision.patch_size)
    return VisionDerived(batch, vgeo.check_max_encoder_input_len(vision.max_encoder_input_len, enc,
                                                                  field="vision.max_encoder_input_len"))


def _release_problem(family: str, engine: str, tensorrt_llm: str) -> tuple[str, str] | None:
    engines = image_engines(family, tensorrt_llm)
    if engine in engines:
        return None
    if not engines:
        return ("target.tensorrt_llm", (f"{tensorrt_llm}: no engine feeds {family} images there (the TensorRT-engine "
                "multimodal path is end-of-life after 1.2; pipeline/data/release_matrix.yaml vision_images)"))
    why = (_matrix_images().get(family, {}).get(engine) or {}).get("why", "no image path")
    use = " or ".join(f"build.engine: {e}" for e in engines)
    return ("build.engine", f"'{engine}' gives {family} no images on TensorRT-LLM {tensorrt_llm} ({why}): use {use}")


def vision_problems(recipe: Any, base_dir: Path | None = None) -> list[tuple[str, str]]:
    """``(field, message)`` for each rule a recipe's vision section breaks (empty = fine, or no vision section).

    Rules for every family: the engine/release feeds the family images (:func:`image_engines`; on the cpu target the
    ``cpu`` row, whatever ``build.engine`` names) and the checkpoint is that family. Then the family's own:
    :func:`_mllama_problems` (tiles against ``vision_config``, the features dtype, derived values) or
    :func:`_token_problems` (Qwen2-VL: patch/merge against ``vision_config``, the Triton llmapi model's image input,
    the image tokens against the build's token limits).
    """
    v = recipe.vision
    if v is None:
        return []
    out: list[tuple[str, str]] = []
    try:
        path: ServingPath | None = serving_path(recipe)  # the image engine is the path's builder (cpu on the host)
    except ServingPathError:  # no row for this engine × target × frontend (× modality): the release rule still names why
        path = None
    builder = path.builder if path is not None else ("cpu" if on_cpu_target(recipe.target.gpu) else recipe.build.engine)
    problem = _release_problem(v.family, builder, recipe.target.tensorrt_llm)
    out += [problem] if problem else []
    model_type, vcfg = vision_config_of(recipe.model.source, base_dir)
    if model_type is not None and model_type != v.family:
        out.append(("vision.family", f"'{v.family}', but model.source {recipe.model.source} is a '{model_type}' model"))
    out += _token_problems(recipe, path, v, vcfg or {}) if isinstance(v, QwenVLVision) else _mllama_problems(recipe, v, vcfg or {})
    return out


def _mllama_problems(recipe: Any, v: VisionSpec, vcfg: dict) -> list[tuple[str, str]]:
    out: list[tuple[str, str]] = []
    for key, cfg_key in (("tile_size", "image_size"), ("patch_size", "patch_size"), ("max_tiles", "max_num_tiles")):
        have = vcfg.get(cfg_key)
        if have is not None and have != getattr(v, key):
            out.append((f"vision.{key}", f"{getattr(v, key)} disagrees with the checkpoint's vision_config.{cfg_key} {have}"))
    on_cpu = on_cpu_target(recipe.target.gpu)
    if (v.encoder_dtype == "float32") != on_cpu:  # onnxruntime on CPU; bf16/fp16 TensorRT on a GPU
        out.append(("vision.encoder_dtype", f"'{v.encoder_dtype}' on target.gpu {recipe.target.gpu}: use "
                    + ("float32 (the CPU target runs the encoder in onnxruntime)" if on_cpu else "bfloat16 or float16")))
    if v.encoder_input_features_data_type != FEATURES_DTYPE[v.family]:
        out.append(("vision.encoder_input_features_data_type", (f"'{v.encoder_input_features_data_type}': {v.family} "
                    f"needs {FEATURES_DTYPE[v.family]} (docs/multimodal.md@efb8a497:229)")))
    try:
        derived_vision(v, recipe.build.max_batch_size)
    except UserError as e:
        field, _, msg = str(e).partition(": ")
        out.append((field, msg))
    return out


def _token_problems(recipe: Any, path: ServingPath | None, v: QwenVLVision, vcfg: dict) -> list[tuple[str, str]]:
    """Qwen2-VL family rules; the image tokens of one full request (:meth:`QwenVLVision.request_image_tokens`) plus one
    text token must fit ``build.max_input_len``, leave ``build.max_seq_len`` room for one output token and, without
    chunked prefill, fit one step's ``build.max_num_tokens`` (the backend prefills a prompt in one step then)."""
    out: list[tuple[str, str]] = []
    for key, cfg_key in (("patch_size", "patch_size"), ("merge_size", "spatial_merge_size")):
        have = vcfg.get(cfg_key)
        if have is not None and have != getattr(v, key):
            out.append((f"vision.{key}", f"{getattr(v, key)} disagrees with the checkpoint's vision_config.{cfg_key} {have}"))
    if path is not None and path.server == "tritonserver" and not path.on_cpu and not triton_llmapi_images(recipe.target.tensorrt_llm):
        out.append(("serving.frontend", (f"triton: the Triton llmapi model of TensorRT-LLM {recipe.target.tensorrt_llm} takes no "
                    f"images ({_matrix_all()['vision_triton_llmapi']['why']}): use serving.frontend: trtllm-serve")))
    if v.min_pixels > v.max_pixels:
        out.append(("vision.min_pixels", f"{v.min_pixels} is above vision.max_pixels {v.max_pixels}"))
        return out
    try:
        tokens = v.request_image_tokens()
    except UserError as e:
        return out + [("vision.image_width", str(e))]
    b = recipe.build
    need = f"{v.max_images_per_request} image(s) of {v.image_width}×{v.image_height} px = {tokens} image tokens + 1 text token"
    if b.max_input_len is not None and tokens + 1 > b.max_input_len:
        out.append(("build.max_input_len", f"{b.max_input_len} cannot hold one request: {need}"))
    if b.max_seq_len is not None and tokens + 2 > b.max_seq_len:
        out.append(("build.max_seq_len", f"{b.max_seq_len} cannot hold one request: {need} + 1 output token"))
    if not b.enable_chunked_prefill and b.max_num_tokens is not None and tokens + 1 > b.max_num_tokens:
        out.append(("build.max_num_tokens", f"{b.max_num_tokens} cannot prefill one request in one step: {need} "
                    "(raise it or set build.enable_chunked_prefill: true)"))
    return out


def vision_notes(recipe: Any) -> list[str]:
    """One line per release fact the user should read (the engine-path end-of-life), for ``recipe validate`` and
    ``plan``; empty for a text recipe."""
    v = recipe.vision
    if v is None:
        return []
    try:
        eol = image_engines(v.family, recipe.target.tensorrt_llm).get(recipe.build.engine)
    except ValueError:
        return []
    if eol:
        return [(f"{v.family} images on build.engine: {recipe.build.engine} use TensorRT-LLM's multimodal Triton backend, "
                "deprecated and end-of-life after TensorRT-LLM 1.2 (Deprecation_notice.md@18f906aa; "
                "pipeline/data/release_matrix.yaml vision_images)")]
    return []
