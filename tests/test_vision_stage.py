"""The vision encoder stage (issue #46 item 3) and the mllama quantize's source check (item 2) on real artifacts:
the tiny random mllama (:func:`pipeline.vision.tiny_mllama.build_tiny_mllama`, 53 k parameters, seconds) exported,
run by onnxruntime against PyTorch, cached by content; and the dry run of both GPU vision recipes."""

from __future__ import annotations

import json
import re
import shlex
from pathlib import Path

import pytest

from pipeline.core.errors import StageError, UserError
from pipeline.core.layout import BuildLayout
from pipeline.recipe import load_recipe
from pipeline.recipe.vision import derived_vision

REPO = Path(__file__).resolve().parents[1]
pytestmark = pytest.mark.xdist_group("mllama_build")  # shares conftest mllama_build with test_vision_served
CPU = REPO / "recipes" / "tiny_mllama_cpu.yaml"
GPU_VISION = [REPO / "recipes" / "llama32_11b_vision_h200_fp8.yaml", REPO / "recipes" / "llama32_90b_vision_h200_tp8_fp8.yaml"]
#: the tiny model's 256 positions: the CPU recipe's sizes shrunk to fit it
TINY_SETS = ["build.max_seq_len=256", "build.max_input_len=128", "build.max_num_tokens=256",
             "build.kv_cache_config.max_tokens=8192"]


@pytest.fixture(scope="module")
def tiny_dir(tmp_path_factory) -> Path:
    from pipeline.vision.tiny_mllama import build_tiny_mllama

    return build_tiny_mllama(tmp_path_factory.mktemp("tiny") / "ckpt", seed=0)


def _recipe(tiny_dir: Path, *sets: str):
    return load_recipe(CPU, [f"model.source={tiny_dir}", *TINY_SETS, *sets])


def test_stage_exports_checks_parity_and_reuses_its_result(tiny_dir, tmp_path):
    from pipeline.vision_encoder import stage

    layout = BuildLayout(tmp_path / "b")
    first = stage.run(_recipe(tiny_dir), layout, recipe_dir=CPU.parent)
    assert first.status == "built" and not first.cached and first.onnx.is_file()
    p = first.parity
    assert p["batch_sizes"] == [1, 2] and 0 <= p["max_abs_diff"] <= p["tolerance"]
    assert p["output_shape"][1:] == [1, 4, 17, 32]  # 4 tiles × (56/14)² + 1 vectors of text hidden 32
    cfg = json.loads(first.config.read_text())["builder_config"]
    assert cfg["model_type"] == "mllama" and cfg["precision"] == "float32" and cfg["output_shape"] == [-1, 1, 4, 17, 32]
    assert cfg["max_batch_size"] == 32  # build.max_batch_size × 1 image
    assert first.encoder_len_per_image == 68 == 4 * 17
    src = json.loads((tiny_dir / "preprocessor_config.json").read_text())
    assert json.loads((first.path / "preprocessor_config.json").read_text()) == src
    sig = first.manifest["signature"]
    assert sig["pixel_values"][0] == "batch" and list(sig)[:3] == ["pixel_values", "aspect_ratio_ids", "aspect_ratio_mask"]
    second = stage.run(_recipe(tiny_dir), layout, recipe_dir=CPU.parent)
    assert second.cached and second.cache_key == first.cache_key
    third = stage.run(_recipe(tiny_dir, "build.max_batch_size=8"), layout, recipe_dir=CPU.parent)  # vision batch changes
    assert not third.cached and json.loads(third.config.read_text())["builder_config"]["max_batch_size"] == 8
    fourth = stage.run(_recipe(tiny_dir, "build.max_batch_size=8", "quantization.qformat=int8_sq"), layout,
                       recipe_dir=CPU.parent)
    assert fourth.cached  # the encoder comes from the source checkpoint: a quantization change does not rebuild it


def test_a_difference_beyond_the_tolerance_is_refused_and_nothing_is_written(tiny_dir, tmp_path, monkeypatch):
    from pipeline.vision import onnx_export
    from pipeline.vision_encoder import stage

    monkeypatch.setattr(onnx_export, "ATOL", 0.0)
    monkeypatch.setattr(onnx_export, "RTOL", 0.0)  # the real float32 rounding difference (≥ 1e-8) is now too much
    layout = BuildLayout(tmp_path / "b")
    with pytest.raises(StageError, match=r"onnxruntime differs from PyTorch by .* above the tolerance"):
        stage.run(_recipe(tiny_dir), layout, recipe_dir=CPU.parent)
    assert not layout.vision.exists()


def test_quantize_refuses_a_checkpoint_of_another_family_in_one_line(tiny_dir, tmp_path):
    from pipeline.quantize import vlm

    other = tmp_path / "llama"
    other.mkdir()
    cfg = json.loads((tiny_dir / "config.json").read_text())
    (other / "config.json").write_text(json.dumps({**cfg, "model_type": "llava"}))
    with pytest.raises(UserError) as e:
        vlm.check_source(_recipe(tiny_dir), other)
    assert str(e.value).startswith("vision.family:") and "'llava'" in str(e.value) and "\n" not in str(e.value)
    vlm.check_source(_recipe(tiny_dir), tiny_dir)  # the right family and geometry pass
    with pytest.raises(UserError, match="vision.tile_size: 112 disagrees"):
        vlm.check_source(_recipe(tiny_dir, "vision.tile_size=112"), tiny_dir)


def test_quantize_refuses_a_real_mllama_run_for_the_tensorrt_engine(tmp_path):
    from pipeline.quantize import vlm

    with pytest.raises(UserError, match=r"^build.engine: tensorrt .* quantize_command.sh"):
        vlm.check_source(load_recipe(GPU_VISION[0]), tmp_path)


@pytest.mark.parametrize("path", GPU_VISION, ids=[p.stem for p in GPU_VISION])
def test_dry_run_of_the_gpu_vision_recipes_lists_export_tensorrt_build_and_encoder_len(path, tmp_path):
    from pipeline.assemble import stage as build_stage

    recipe = load_recipe(path)
    res = build_stage.run(recipe, tmp_path / "b", recipe_dir=path.parent, dry_run=True, until="engine", warn=lambda _m: None)
    build = res.layout.root
    lines = (build / "vision" / "vision_command.sh").read_text().strip().splitlines()
    export, trt = shlex.split(lines[-2]), shlex.split(lines[-1])
    assert export[:2] == ["python3", "export_vision_onnx.py"] and export[export.index("--dtype") + 1] == "bfloat16"
    assert export[export.index("--model_dir") + 1] == recipe.model.source
    assert trt == ["python3", "build_vision_engine.py", "--onnx", "onnx/model.onnx", "--output-dir", "."]
    assert export[export.index("--output") + 1] == trt[3]  # the build reads what the export writes
    script = (build / "vision" / "build_vision_engine.py").read_text()
    batch = recipe.build.max_batch_size * recipe.vision.max_images_per_request
    assert f"MAX_BATCH_SIZE = {batch}" in script and "PRECISION = 'bfloat16'" in script
    assert f"[{batch}, 1, 4, 3, 560, 560]" in script  # the profile's max shape: batch N, the per-sample dims fixed
    exp = (build / "vision" / "export_vision_onnx.py").read_text()
    assert "OPSET = 17" in exp and "('pixel_values', 'aspect_ratio_ids', 'aspect_ratio_mask')" in exp
    compile(exp, "export_vision_onnx.py", "exec")
    compile(script, "build_vision_engine.py", "exec")
    argv = shlex.split((build / "engine" / "trtllm_build.sh").read_text().strip().splitlines()[-1])
    derived = derived_vision(recipe.vision, recipe.build.max_batch_size).max_encoder_input_len
    assert int(argv[argv.index("--max_encoder_input_len") + 1]) == derived == 6404
    from pipeline.trtllm import contract

    assert {a for a in argv if a.startswith("--")} <= contract.build_flag_names()  # trtllm-build 1.2.1's flag table
    assert json.loads((build / "engine" / "build_config.json").read_text())["max_encoder_input_len"] == 6404
    assert json.loads((build / "engine" / "checkpoint_config.json").read_text())["architecture"] == "MLLaMAForCausalLM"
    q = (build / "quantize" / "quantize_command.sh").read_text().replace(" \\\n    ", " ")
    assert re.search(r"--calib_dataset scienceqa", q) and "--output_dir ${OUT_DIR}/trtllm_ckpt" in q
    assert res.stages["vision"].status == "dry_run"


def test_a_build_until_the_vision_stage_stops_after_it(tmp_path):
    """``--stage vision`` (``until="vision"``) runs quantize and vision and nothing after them (a dry run of the CPU VLM
    recipe: the stop does not depend on what the stages do; the real stages are read from conftest's build below)."""
    from pipeline.assemble import stage as build_stage

    res = build_stage.run(load_recipe(CPU), tmp_path / "b", recipe_dir=CPU.parent, dry_run=True, until="vision",
                          warn=lambda _m: None)
    assert list(res.stages) == ["quantize", "vision"] and res.engine is None and res.repo is None
    assert not res.layout.engine.exists() and not res.layout.triton_repo.exists()


@pytest.mark.slow
def test_cpu_mllama_recipe_quantizes_with_images_and_exports_its_encoder(mllama_build):
    """The shipped CPU VLM recipe built by the CLI (the session's ``mllama_build``, shared with the served tests): the
    decoder calibrated with images — both cross-attention layers saw image features — the vision tower and projector
    unquantized in the whole-model checkpoint, and the encoder's parity in its manifest."""
    layout = BuildLayout(mllama_build[1])
    q = json.loads((layout.quantize / "manifest.json").read_text())
    cal = q["image_calibration"]
    assert cal["images"] == 32 and cal["cross_attention_layers"] == 2
    assert len(cal["cross_attention_k_proj_calibrated"]) == 2
    assert {"vision_model", "multi_modal_projector"} <= set(cal["excluded_from_quantization"])
    hfq = json.loads((layout.hf_ckpt / "hf_quant_config.json").read_text())["quantization"]
    assert hfq["quant_algo"] == "FP8" and "multi_modal_projector" in hfq["exclude_modules"]
    cfg = json.loads((layout.hf_ckpt / "config.json").read_text())
    assert cfg["model_type"] == "mllama" and cfg["vision_config"]["image_size"] == 56
    assert (layout.hf_ckpt / "preprocessor_config.json").is_file()
    v = json.loads((layout.vision / "manifest.json").read_text())
    assert v["parity"]["max_abs_diff"] <= v["parity"]["tolerance"] and v["encoder_len_per_image"] == 68
