"""The VLM arithmetic rules, one place: what an image costs the decoder.

Two families, two ways an image reaches the language model:

- **mllama** (Llama 3.2 Vision, TensorRT engine path): the image goes to the decoder's *cross-attention*, not into
  its token sequence. The encoder output per image is ``max_tiles × ((tile / patch)² + 1)`` vectors — the processor
  always pads to ``max_image_tiles`` (tests/test_vision.py checks it: a 2:1 image still gives 4 tiles, only the
  mask changes), so the length is fixed per image. ``trtllm-build --max_encoder_input_len`` must hold it:
  6404 at 560 px tiles, 4 tiles, patch 14 (examples/models/core/multimodal/README.md@89fd9b74 §MLLaMA: "for instruct
  Vision model, please set the `max_encoder_input_len` as `6404`"; tensorrtllm_backend docs/multimodal.md@efb8a497:
  162-169 builds with ``--max_encoder_input_len 6404``). Per tile: ``num_patches = (image_size // patch_size) ** 2 +
  1`` (transformers v4.57.3, the release TensorRT-LLM 1.2.1 pins, models/mllama/modeling_mllama.py:131 and :956;
  the ``+ 1`` is the class token).
- **Qwen2-VL** (PyTorch path, #47): image tokens are *spliced into* the sequence. The processor resizes each image
  with ``smart_resize`` to multiples of ``patch_size × merge_size`` (28 px) within ``[min_pixels, max_pixels]``
  (transformers v4.57.3 models/qwen2_vl/image_processing_qwen2_vl.py:54-80; defaults ``min_pixels = 56·56``,
  ``max_pixels = 14·14·4·1280 = 28·28·1280``) and the text gets ``image_grid_thw.prod() // merge_size**2``
  placeholder tokens (processing_qwen2_vl.py:157-162 of the same release): one token per 28×28 px of the resized
  image, at most 1280 with the default ``max_pixels``.

Nothing here imports torch or transformers: the recipe layer, the planner and the bench may all call it.
"""

from __future__ import annotations

import math

from pipeline.core.errors import UserError

#: Qwen2-VL processor defaults (transformers v4.57.3 image_processing_qwen2_vl.py:55, 133, 135, 142)
QWEN2_VL_PATCH_SIZE = 14
QWEN2_VL_MERGE_SIZE = 2
QWEN2_VL_MIN_PIXELS = 56 * 56
QWEN2_VL_MAX_PIXELS = 28 * 28 * 1280
#: Qwen2-VL refuses an image whose long side is more than 200× its short side (image_processing_qwen2_vl.py:66-69)
QWEN2_VL_MAX_ASPECT = 200


def _positive(name: str, value: int) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
        raise UserError(f"{name}: {value!r} is not a positive integer")
    return value


def mllama_tokens_per_tile(tile_size: int, patch_size: int) -> int:
    """Encoder vectors one mllama tile yields: ``(tile_size // patch_size)² + 1`` (patches + class token).

    Args:
        tile_size: tile edge in pixels (``vision_config.image_size``; 560 for Llama 3.2 Vision, 448 for the base
            models' example).
        patch_size: patch edge in pixels (``vision_config.patch_size``, 14).

    Returns:
        vectors per tile (1601 at 560/14, 1025 at 448/14).

    Raises:
        UserError: a non-positive size, or a tile that is not a whole number of patches (the processor would
            drop the remainder pixels; no shipped checkpoint does that, so it is a typo).
    """
    _positive("vision.tile_size", tile_size)
    _positive("vision.patch_size", patch_size)
    if tile_size % patch_size:
        raise UserError(f"vision.tile_size: {tile_size} px is not a multiple of the patch size {patch_size} px")
    return (tile_size // patch_size) ** 2 + 1


def mllama_encoder_len(images: int, max_tiles: int, tile_size: int, patch_size: int) -> int:
    """The decoder's ``max_encoder_input_len`` for mllama: ``images × max_tiles × ((tile / patch)² + 1)``.

    Args:
        images: images per request (the ``max_num_images`` of the Triton preprocessing model).
        max_tiles: ``vision_config.max_num_tiles`` (the processor pads every image to it).
        tile_size: tile edge in pixels; patch_size: patch edge in pixels.

    Returns:
        encoder vectors per request (6404 for one image at 560 px, 4 tiles, patch 14).

    Raises:
        UserError: any argument not a positive integer, or a tile that is not a whole number of patches.
    """
    _positive("vision.images_per_request", images)
    _positive("vision.max_tiles", max_tiles)
    return images * max_tiles * mllama_tokens_per_tile(tile_size, patch_size)


def check_max_encoder_input_len(typed: int | None, derived: int, *, field: str = "build.max_encoder_input_len") -> int:
    """The value to build with: the derived one; a typed value must equal it.

    Args:
        typed: what the user wrote (None when left out, the intended way).
        derived: :func:`mllama_encoder_len` of the recipe's vision section.
        field: the recipe field named in the error.

    Returns:
        ``derived``.

    Raises:
        UserError: ``typed`` is given and differs (the message names both numbers): a smaller value truncates the
            image's cross-attention, a larger one wastes cross-KV memory on every request.
    """
    if typed is not None and typed != derived:
        raise UserError(f"{field}: {typed} disagrees with {derived} derived from the vision section "
                        "(images × max tiles × ((tile / patch)² + 1)); leave it out or write the derived value")
    return derived


def vision_max_batch_size(max_batch_size: int, images_per_request: int) -> int:
    """The vision engine's batch limit: requests × images (tensorrtllm_backend docs/multimodal.md@efb8a497:171,
    ``--max_batch_size 8 #max_batch_size * max_num_images_per_request``).

    Raises:
        UserError: either argument not a positive integer.
    """
    return _positive("build.max_batch_size", max_batch_size) * _positive("vision.images_per_request", images_per_request)


def qwen2_vl_smart_resize(height: int, width: int, *, factor: int = QWEN2_VL_PATCH_SIZE * QWEN2_VL_MERGE_SIZE,
                          min_pixels: int = QWEN2_VL_MIN_PIXELS, max_pixels: int = QWEN2_VL_MAX_PIXELS) -> tuple[int, int]:
    """Qwen2-VL's resize rule (transformers v4.57.3 image_processing_qwen2_vl.py:54-80), restated.

    Each side is rounded to the nearest multiple of ``factor``; if the area is then above ``max_pixels`` both sides
    are scaled by ``sqrt(h·w / max_pixels)`` and floored to multiples of ``factor`` (never below ``factor``); if below
    ``min_pixels`` scaled up by ``sqrt(min_pixels / (h·w))`` and ceiled.

    Args:
        height, width: the image in pixels.
        factor: ``patch_size × merge_size`` (28).
        min_pixels, max_pixels: the processor's area bounds in pixels.

    Returns:
        (height, width) after the resize, in pixels, both multiples of ``factor``.

    Raises:
        UserError: a non-positive size, or an aspect ratio above 200 (the processor raises ValueError there).
    """
    _positive("image height", height)
    _positive("image width", width)
    if max(height, width) / min(height, width) > QWEN2_VL_MAX_ASPECT:
        raise UserError(f"image {width}×{height}: aspect ratio {max(height, width) / min(height, width):.1f} is above "
                        f"{QWEN2_VL_MAX_ASPECT}, which the Qwen2-VL processor refuses")
    h_bar = round(height / factor) * factor
    w_bar = round(width / factor) * factor
    if h_bar * w_bar > max_pixels:
        beta = math.sqrt((height * width) / max_pixels)
        h_bar = max(factor, math.floor(height / beta / factor) * factor)
        w_bar = max(factor, math.floor(width / beta / factor) * factor)
    elif h_bar * w_bar < min_pixels:
        beta = math.sqrt(min_pixels / (height * width))
        h_bar = math.ceil(height * beta / factor) * factor
        w_bar = math.ceil(width * beta / factor) * factor
    return h_bar, w_bar


def qwen2_vl_image_tokens(height: int, width: int, *, patch_size: int = QWEN2_VL_PATCH_SIZE,
                          merge_size: int = QWEN2_VL_MERGE_SIZE, min_pixels: int = QWEN2_VL_MIN_PIXELS,
                          max_pixels: int = QWEN2_VL_MAX_PIXELS) -> int:
    """Decoder tokens one image costs in Qwen2-VL: ``(H'/patch)·(W'/patch) // merge²`` after
    :func:`qwen2_vl_smart_resize` — one token per 28×28 px of the resized image (504×504 → 324, the figure
    tensorrtllm_backend docs/multimodal.md@efb8a497:173-188 sizes ``--max_multimodal_len`` with).

    A still image is one temporal patch (the processor repeats the frame to ``temporal_patch_size``), so
    ``grid_t = 1`` and the count is the spatial grid over ``merge_size²``.

    Args:
        height, width: the image in pixels before resizing.
        patch_size, merge_size: vision_config's ``patch_size`` (14) and ``spatial_merge_size`` (2).
        min_pixels, max_pixels: the processor's area bounds in pixels.

    Returns:
        image tokens (count of ``<|image_pad|>`` placeholders the processor inserts).

    Raises:
        UserError: as :func:`qwen2_vl_smart_resize`.
    """
    h, w = qwen2_vl_smart_resize(height, width, factor=_positive("patch_size", patch_size) *
                                 _positive("merge_size", merge_size), min_pixels=min_pixels, max_pixels=max_pixels)
    return (h // patch_size) * (w // patch_size) // merge_size ** 2
