"""The VLM arithmetic rules (pipeline/vision/geometry.py, issues #46/#47) against numbers computed elsewhere:
upstream's published figures, and transformers' own processors and vision model run here on generated images."""

from __future__ import annotations

import pytest

from pipeline.core.errors import UserError
from pipeline.vision import geometry as g

# --- mllama: encoder length ---------------------------------------------------------------------------------------

def test_mllama_encoder_len_is_upstreams_figure():
    """examples/models/core/multimodal/README.md@89fd9b74 §MLLaMA: "for instruct Vision model, please set the
    `max_encoder_input_len` as `6404`" (560 px tiles; tensorrtllm_backend docs/multimodal.md@efb8a497:169 builds
    with it). The README's default build line uses 4100 = 4 × 1025, the same rule at 448 px tiles — the size
    tensorrt_llm/tools/multimodal_builder.py@b35ac1b64368 ``build_mllama_engine`` notes for its traced
    ``pixel_values`` ([1, 1, 4, 3, 448, 448])."""
    assert g.mllama_encoder_len(images=1, max_tiles=4, tile_size=560, patch_size=14) == 6404
    assert g.mllama_encoder_len(images=1, max_tiles=4, tile_size=448, patch_size=14) == 4100


def test_typed_encoder_len_that_disagrees_is_refused_naming_both_numbers():
    derived = g.mllama_encoder_len(1, 4, 560, 14)
    with pytest.raises(UserError) as err:
        g.check_max_encoder_input_len(4100, derived)
    msg = str(err.value)
    assert "4100" in msg and "6404" in msg and "max_encoder_input_len" in msg and "\n" not in msg
    assert g.check_max_encoder_input_len(None, derived) == 6404
    assert g.check_max_encoder_input_len(6404, derived) == 6404


@pytest.mark.parametrize("args, field", [((0, 4, 560, 14), "images_per_request"), ((1, 0, 560, 14), "max_tiles"),
                                         ((1, 4, 561, 14), "tile_size"), ((1, 4, 560, -14), "patch_size"),
                                         ((1, 4, 560.0, 14), "tile_size")])
def test_bad_vision_geometry_is_one_line_naming_the_field(args, field):
    with pytest.raises(UserError) as err:
        g.mllama_encoder_len(*args)
    assert field in str(err.value) and "\n" not in str(err.value)


def test_vision_max_batch_size_is_requests_times_images():
    """tensorrtllm_backend docs/multimodal.md@efb8a497:171: ``--max_batch_size 8 #max_batch_size *
    max_num_images_per_request``, beside a decoder built with ``--max_batch_size 8`` (:166) and the preprocessing
    model's ``max_num_images:1`` (:208)."""
    assert g.vision_max_batch_size(8, 1) == 8
    assert g.vision_max_batch_size(4, 2) == 8
    with pytest.raises(UserError):
        g.vision_max_batch_size(4, 0)


def test_mllama_encoder_len_is_what_the_hf_vision_model_emits_at_560px():
    """transformers' MllamaVisionModel (tiny width, Llama 3.2 Vision's 560 px tiles / 14 px patches / 4 tiles) on an
    image processed by transformers' mllama processor: tiles × vectors per tile of its output = the rule."""
    import torch
    from transformers.models.mllama.modeling_mllama import MllamaVisionModel

    from pipeline.vision.images import bundled_sample
    from pipeline.vision.tiny_mllama import image_processor, tiny_mllama_config

    cfg = tiny_mllama_config(vision={"image_size": 560}).vision_config
    torch.manual_seed(0)
    model = MllamaVisionModel(cfg).eval()
    px = image_processor(560, 4)(images=[[bundled_sample("astronaut")]], return_tensors="pt")
    with torch.no_grad():
        out = model(px["pixel_values"], px["aspect_ratio_ids"], px["aspect_ratio_mask"]).last_hidden_state
    _, images, tiles, per_tile, _ = out.shape
    assert (images, tiles, per_tile) == (1, 4, 1601)
    assert images * tiles * per_tile == g.mllama_encoder_len(1, cfg.max_num_tiles, 560, cfg.patch_size) == 6404


# --- Qwen2-VL: image tokens ---------------------------------------------------------------------------------------

def _qwen2_vl_processor():
    try:  # transformers 5.x: the torch-free one
        from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import (
            Qwen2VLImageProcessorPil as cls,
        )
    except ImportError:  # transformers 4.57 (TensorRT-LLM 1.2.1's pin): numpy/PIL already
        from transformers import Qwen2VLImageProcessor as cls
    # the processor's documented defaults, spelled out: a processor built earlier in the session with other bounds
    # (the tiny Qwen2-VL's, 448² px) changes transformers 5.x's class-level size defaults for later instances
    px = (g.QWEN2_VL_MIN_PIXELS, g.QWEN2_VL_MAX_PIXELS)
    return cls(min_pixels=px[0], max_pixels=px[1], size={"shortest_edge": px[0], "longest_edge": px[1]})


def test_qwen2_vl_504px_is_upstreams_324_tokens():
    """tensorrtllm_backend docs/multimodal.md@efb8a497:173-188 sizes ``--max_multimodal_len`` as batch × 324
    "for image_shape=[504,504]"."""
    assert g.qwen2_vl_image_tokens(504, 504) == 324


@pytest.mark.parametrize("width, height", [(224, 224), (640, 480), (504, 504), (1120, 1120), (60, 40),
                                           (3000, 100), (4000, 3000), (517, 333)])
def test_qwen2_vl_tokens_match_the_processor_on_a_generated_image(width, height):
    """The placeholder count transformers' processor would insert (image_grid_thw.prod() // merge_size², as
    processing_qwen2_vl.py does) on a real PIL image of that size: below min_pixels (60×40), above max_pixels
    (4000×3000), extreme aspect (3000×100), odd sizes."""
    from pipeline.vision.images import synthetic_image

    proc = _qwen2_vl_processor()
    out = proc(images=synthetic_image(width, height, seed=1), return_tensors="np")
    expected = int(out["image_grid_thw"].prod()) // proc.merge_size ** 2
    assert g.qwen2_vl_image_tokens(height, width) == expected
    assert expected <= 1280  # the default max_pixels = 28·28·1280


def test_qwen2_vl_smart_resize_matches_transformers_on_a_grid():
    try:
        from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import (
            smart_resize,
        )
    except ImportError:
        from transformers.models.qwen2_vl.image_processing_qwen2_vl import smart_resize
    sizes = [1, 13, 28, 29, 41, 56, 100, 333, 560, 999, 1400, 2048, 5000]
    for h in sizes:
        for w in sizes:
            if max(h, w) / min(h, w) > 200:
                continue
            assert g.qwen2_vl_smart_resize(h, w) == tuple(smart_resize(h, w)), (h, w)


def test_qwen2_vl_refuses_what_the_processor_refuses():
    with pytest.raises(UserError) as err:
        g.qwen2_vl_image_tokens(10, 2500)
    assert "aspect ratio" in str(err.value) and "200" in str(err.value)
    with pytest.raises(UserError):
        g.qwen2_vl_image_tokens(0, 100)
