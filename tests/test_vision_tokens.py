"""Issue #47 (recipe, release gates, planner): Qwen2-VL-family recipes, whose images become decoder tokens.

The token rule itself (``geometry.qwen2_vl_image_tokens``) is checked against transformers' processor in
tests/test_vision_geometry.py; here: the recipe and the planner use it, the release gates refuse what 1.2.1 cannot
serve (one line, exit 2), and the vision tower count equals transformers' module."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from typer.testing import CliRunner

from pipeline.cli import app
from pipeline.core.errors import RecipeError
from pipeline.plan import plan_recipe
from pipeline.recipe import load_recipe
from pipeline.recipe.vision import QwenVLVision, image_engines, triton_llmapi_images
from pipeline.vision import geometry as vgeo

REPO = Path(__file__).resolve().parents[1]
QWEN = REPO / "recipes" / "qwen25_vl_7b_h200_fp8.yaml"
runner = CliRunner()


def _error(*overrides: str) -> str:
    with pytest.raises(RecipeError) as e:
        load_recipe(QWEN, list(overrides))
    msg = str(e.value)
    assert "\n" not in msg.strip()
    return msg


def test_shipped_qwen_recipe_validates_and_counts_image_tokens_by_the_processor_rule():
    r = load_recipe(QWEN)
    assert isinstance(r.vision, QwenVLVision) and r.build.engine == "pytorch" and r.serving.frontend == "trtllm-serve"
    assert r.vision.image_tokens() == vgeo.qwen2_vl_image_tokens(r.vision.image_height, r.vision.image_width)
    res = runner.invoke(app, ["recipe", "validate", str(QWEN)])
    assert res.exit_code == 0, res.output


def test_plan_counts_image_tokens_in_the_kv_cache_like_prompt_tokens():
    """A 100-token prompt with one image holds as many KV sequences as a text prompt of 100 + image tokens."""
    r = load_recipe(QWEN)
    img = r.vision.request_image_tokens()
    with_image = plan_recipe(r, scenarios=[(100, 64)])
    s = with_image.scenarios[0]
    assert (s.isl, s.image_tokens) == (100, img)
    assert with_image.vision_tokens.image_tokens_per_request == img
    text_only = plan_recipe(r.model_copy(update={"vision": None}),
                            scenarios=[(100 + img, 64)])
    t = text_only.scenarios[0]
    # the tower's weights shrink the KV pool a little, so the image request holds at most as many sequences
    assert s.blocks_per_sequence == t.blocks_per_sequence
    assert 0.97 * t.kv_max_sequences <= s.kv_max_sequences <= t.kv_max_sequences
    assert with_image.memory.overhead_bytes - text_only.memory.overhead_bytes == with_image.vision_tokens.tower_bytes


def test_plan_json_has_the_image_tokens_and_the_tower():
    res = runner.invoke(app, ["plan", str(QWEN), "--json"])
    assert res.exit_code == 0, res.output
    d = json.loads(res.output)
    assert all(s["image_tokens"] == d["vision_tokens"]["image_tokens_per_request"] > 0 for s in d["scenarios"])
    assert d["vision_tokens"]["tower_bytes"] == 2 * d["vision_tokens"]["tower_params"]  # bfloat16


@pytest.mark.parametrize("family, builder", [("qwen2_5_vl", "qwen2_5_vl"), ("qwen2_vl", "qwen2_vl")])
def test_tower_parameter_count_equals_transformers_module(family, builder):
    torch = pytest.importorskip("torch")
    from pipeline.plan.vision_tokens import (
        qwen2_5_vl_tower_params,
        qwen2_vl_tower_params,
    )
    from pipeline.recipe.vision import vision_geometry

    if family == "qwen2_5_vl":
        from transformers import Qwen2_5_VLConfig
        from transformers.models.qwen2_5_vl.modeling_qwen2_5_vl import (
            Qwen2_5_VisionTransformerPretrainedModel as Tower,
        )

        vis = vision_geometry("Qwen/Qwen2.5-VL-7B-Instruct")["vision_config"]
        cfg, count = Qwen2_5_VLConfig(vision_config=dict(vis)).vision_config, qwen2_5_vl_tower_params(vis, 3584)
    else:
        from transformers import Qwen2VLConfig
        from transformers.models.qwen2_vl.modeling_qwen2_vl import (
            Qwen2VisionTransformerPretrainedModel as Tower,
        )

        cfg = Qwen2VLConfig().vision_config  # the class defaults: Qwen2-VL-7B's tower
        count = qwen2_vl_tower_params(cfg.to_dict(), 3584)
    with torch.device("meta"):
        tower = Tower._from_config(cfg)
    assert count == sum(p.numel() for p in tower.parameters())


def test_triton_llmapi_frontend_is_refused_on_1_2_1_naming_the_release():
    assert not triton_llmapi_images("1.2.1")
    msg = _error("serving.frontend=triton")
    assert "serving.frontend" in msg and "1.2.1" in msg and "trtllm-serve" in msg
    res = runner.invoke(app, ["recipe", "validate", str(QWEN), "--set", "serving.frontend=triton"])
    assert res.exit_code == 2 and len(res.output.strip().splitlines()) == 1


def test_release_data_qwen_images_on_the_pytorch_backend_only():
    assert image_engines("qwen2_5_vl", "1.2.1") == {"pytorch": False}
    # Qwen2-VL also on the CPU engine (its LLM facade + trtllm-serve stand-in, issue #47 item 5)
    assert image_engines("qwen2_vl", "1.1.0") == {"pytorch": False, "cpu": False}
    assert "build.engine" in _error("build.engine=tensorrt")


def test_image_tokens_beyond_the_token_limits_are_refused_before_building():
    big = ["vision.image_width=4000", "vision.image_height=4000", "vision.max_pixels=12845056"]
    tokens = vgeo.qwen2_vl_image_tokens(4000, 4000, max_pixels=12845056)
    msg = _error(*big)
    assert "build.max_input_len" in msg and str(tokens) in msg and "8192" in msg
    msg = _error("vision.max_images_per_request=40")
    assert f"{40 * 256} image tokens" in msg
    assert "vision.image_width" in _error("vision.image_width=20000", "vision.image_height=50")  # aspect > 200


def test_family_and_section_disagreeing_with_the_checkpoint_are_refused():
    assert "qwen2_5_vl" in _error("vision.family=qwen2_vl")
    assert "vision.merge_size" in _error("vision.merge_size=4")
    msg = _error("vision.family=mllama")  # the mllama section has no image_width: the union names the field
    assert "vision." in msg
    msg = _error("vision.family=llava")
    assert "vision.family" in msg and "mllama" in msg and "qwen2_5_vl" in msg


def test_dry_run_quantizes_the_language_model_only_with_modelopt_and_serve_prints_trtllm_serve(tmp_path):
    out = tmp_path / "b"
    res = runner.invoke(app, ["build", str(QWEN), "--dry-run", "--out", str(out)], env={"COLUMNS": "300"})
    assert res.exit_code == 0, res.output
    script = (out / "quantize/quantize_command.sh").read_text()
    assert "llm_ptq/hf_ptq.py" in script and "--pyt_ckpt_path" in script and "quantization/quantize.py" not in script
    assert "${MODELOPT_EXAMPLES:?" in script  # the examples are not in the image: the script says what to set
    res = runner.invoke(app, ["serve", str(out), "--print-command"], env={"COLUMNS": "300"})
    assert res.exit_code == 0 and res.output.split()[0] == "trtllm-serve", res.output
