"""Issue 46 item 7: the VLM throughput terms — vision encoder FLOPs per image on the prefill side, cross-attention K/V
projections, attention and KV reads — so both vision recipes predict throughput per ISL/OSL with N images, and a vision
recipe that cannot fit is refused by check_fits (what `trtpipe build` calls)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from typer.testing import CliRunner

from pipeline.cli import app
from pipeline.plan import check_fits, plan_recipe
from pipeline.plan.vision import mllama_vision_gflops_per_image
from pipeline.recipe import load_recipe
from pipeline.recipe.vision import vision_geometry

REPO = Path(__file__).resolve().parents[1]
V11 = REPO / "recipes" / "llama32_11b_vision_h200_fp8.yaml"
V90 = REPO / "recipes" / "llama32_90b_vision_h200_tp8_fp8.yaml"


def test_cross_attention_terms_by_hand():
    """11B, one image of 4 tiles at 560/14: E = 4 × (40² + 1) = 6404 encoder tokens; 8 cross-attention layers
    (models.yaml cross_attention_layers), 8 KV heads × 128, FP8 KV: 6404 × 8 × 2 × 8 × 128 × 1 B read per decode step per
    sequence; the prompt's extra work = the encoder's FLOPs + 8 × 2 × 6404 × 4096 × 2·8·128 (K/V projections)."""
    r = load_recipe(V11)
    plan = plan_recipe(r)
    c = plan.step_cost
    layers = vision_geometry(r.model.source)["cross_attention_layers"]
    assert len(layers) == 8
    assert c.cross_kv_bytes_per_seq == 6404 * 8 * 2 * 8 * 128 * 1
    enc = mllama_vision_gflops_per_image(vision_geometry(r.model.source)["vision_config"], 4096) * 1e9
    assert c.prompt_extra_flops == pytest.approx(enc + 8 * 2 * 6404 * 4096 * 2 * 8 * 128)
    assert c.prompt_extra_flops_rate == pytest.approx(989e12, rel=0.01)  # the H200's dense BF16 peak (encoder dtype)
    # 90B at tp 8: 8 KV heads / 8 = 1 per GPU, 20 cross-attention layers
    c90 = plan_recipe(load_recipe(V90)).step_cost
    assert c90.cross_kv_bytes_per_seq == 6404 * 20 * 2 * 1 * 128 * 1


@pytest.mark.parametrize("recipe", [V11, V90])
def test_both_vision_recipes_predict_per_isl_osl_in_json(recipe):
    out = CliRunner().invoke(app, ["plan", str(recipe), "--json"], terminal_width=250)
    assert out.exit_code == 0, out.output
    doc = json.loads(out.output)
    assert doc["memory"]["vision"]["images_per_request"] == 1
    for s in doc["scenarios"]:
        p = s["predicted"]
        assert p["output_tokens_per_s"] > 0 and p["step_split_ms"]["vision"] > 0
        assert all(q["ttft_ms"] > 0 for q in s["predicted_by_concurrency"])


def test_images_cost_throughput_and_ttft():
    """More images per request: more encoder work per prompt and more cross KV per step — lower max-load throughput and
    a longer TTFT at one client; the same decoder without the vision terms is faster."""
    one = plan_recipe(load_recipe(V11), scenarios=[(128, 128)], concurrency=[1])
    two = plan_recipe(load_recipe(V11, ["vision.max_images_per_request=2"]), scenarios=[(128, 128)], concurrency=[1])
    assert two.memory.vision.images_per_request == 2 and two.memory.vision.encoder_tokens_per_request == 2 * 6404
    assert two.step_cost.prompt_extra_flops > 1.9 * one.step_cost.prompt_extra_flops
    assert two.scenarios[0].predicted.output_tokens_per_s < one.scenarios[0].predicted.output_tokens_per_s
    assert two.scenarios[0].predicted_by_concurrency[0].ttft_ms > one.scenarios[0].predicted_by_concurrency[0].ttft_ms
    text = one.step_cost.model_copy(update={"cross_kv_bytes_per_seq": 0.0, "prompt_extra_flops": 0.0})
    from pipeline.plan.achievable import predict_point

    no_vis = predict_point(text, one.scheduler, one.efficiency, 128, 128, None)
    assert no_vis.output_tokens_per_s > one.scenarios[0].predicted.output_tokens_per_s


def test_check_fits_refuses_a_vision_recipe_that_cannot_fit():
    """The vision reserve (encoder + multimodal pool on GPU 0) counts against device memory, and the cross-attention
    share of the pool must hold one request's encoder tokens: either refusal is a check_fits error (build refuses)."""
    v = check_fits(load_recipe(V11, ["vision.multimodal_gpu0_cuda_mem_pool_bytes=140000000000"]))
    assert not v.ok and "exceed h200's" in v.errors[0]
    v = check_fits(load_recipe(V11, ["vision.cross_kv_cache_fraction=0.00001"]))
    assert not v.ok and "holds no request with an image" in v.errors[0]
    assert check_fits(load_recipe(V11)).ok and check_fits(load_recipe(V90)).ok
