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
from typing import Any, Literal, NamedTuple

import yaml
from pydantic import Field

from pipeline.core.engine_paths import version_key
from pipeline.core.errors import UserError
from pipeline.recipe.base import StrictModel
from pipeline.recipe.bounds import INT32_MAX
from pipeline.recipe.serving_path import on_cpu_target
from pipeline.vision import geometry as vgeo

#: the vision families the recipe knows (``config.json`` ``model_type``)
FAMILIES = ("mllama",)
#: ``encoder_input_features_data_type`` per family: "TYPE_BF16 for mllama" (docs/multimodal.md@efb8a497:229)
FEATURES_DTYPE = {"mllama": "TYPE_BF16"}


class VisionSpec(StrictModel):
    """The image path of a vision-language model: tiles, images per request, the vision encoder and the Triton
    multimodal knobs. Absent = a text-only recipe."""

    family: Literal["mllama"] = Field(default="mllama", description="Vision family = the checkpoint's config.json model_type (mllama = Llama 3.2 Vision; TensorRT engine path).")
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


class VisionDerived(NamedTuple):
    """The derived values of a vision section: ``max_batch_size`` (vision engine, images) and
    ``max_encoder_input_len`` (encoder vectors per request)."""

    max_batch_size: int
    max_encoder_input_len: int


@functools.cache
def _matrix_images() -> dict[str, Any]:
    return yaml.safe_load(resources.files("pipeline").joinpath("data/release_matrix.yaml").read_text())["vision_images"]


@functools.cache
def _known_models() -> dict[str, Any]:
    return yaml.safe_load(resources.files("pipeline").joinpath("data/models.yaml").read_text())


def image_engines(family: str, tensorrt_llm: str) -> dict[str, bool]:
    """The engines that feed ``family`` images on TensorRT-LLM ``tensorrt_llm``, each mapped to whether that path is
    end-of-life after its last release line (``vision_images`` of pipeline/data/release_matrix.yaml).

    Raises:
        ValueError: ``tensorrt_llm`` is not a version string.
    """
    release = version_key(tensorrt_llm)[:2]
    out: dict[str, bool] = {}
    for engine, row in _matrix_images().get(family, {}).items():
        last = (row or {}).get("last_line")
        if last is not None and release <= tuple(int(x) for x in str(last).split(".")):
            out[engine] = bool(row.get("end_of_life"))
    return out


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
        return {"model_type": "mllama" if vis and entry.get("architecture", "").startswith("Mllama") else "text",
                "vision_config": vis, "cross_attention_layers": list(entry.get("cross_attention_layers") or [])}
    path = Path(source).expanduser()
    if base_dir is not None and not path.is_absolute():
        path = base_dir / path
    cfg_file = path / "config.json"
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

    Rules: the engine/release feeds the family images (:func:`image_engines`); the checkpoint is that family and
    its ``vision_config`` agrees on tile, patch and tiles; ``encoder_input_features_data_type`` is the family's;
    the derived values agree with typed ones (:func:`derived_vision`).
    """
    v = recipe.vision
    if v is None:
        return []
    out: list[tuple[str, str]] = []
    problem = _release_problem(v.family, recipe.build.engine, recipe.target.tensorrt_llm)
    out += [problem] if problem else []
    model_type, vcfg = vision_config_of(recipe.model.source, base_dir)
    if model_type is not None and model_type != v.family:
        out.append(("vision.family", f"'{v.family}', but model.source {recipe.model.source} is a '{model_type}' model"))
    for key, cfg_key in (("tile_size", "image_size"), ("patch_size", "patch_size"), ("max_tiles", "max_num_tiles")):
        have = (vcfg or {}).get(cfg_key)
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
