"""The recipe's ``vision`` section and its plan terms (issue #46 items 1 and 7, recipe level): derived values,
both-number errors, the release rules (PyTorch engine refused for mllama on 1.2.x, nothing after 1.2), the
checkpoint agreement, the two shipped Llama 3.2 Vision recipes through ``recipe validate`` and ``plan --json``."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from typer.testing import CliRunner

from pipeline.cli import app
from pipeline.core.errors import RecipeError
from pipeline.recipe import load_recipe
from pipeline.recipe.vision import derived_vision, image_engines

REPO = Path(__file__).resolve().parents[1]
R11 = REPO / "recipes" / "llama32_11b_vision_h200_fp8.yaml"
R90 = REPO / "recipes" / "llama32_90b_vision_h200_tp8_fp8.yaml"
TEXT = REPO / "recipes" / "llama31_8b_h200_fp8.yaml"
runner = CliRunner()


def _error(path: Path, *overrides: str) -> str:
    with pytest.raises(RecipeError) as e:
        load_recipe(path, list(overrides))
    msg = str(e.value)
    assert "\n" not in msg.strip()  # one line
    return msg


@pytest.mark.parametrize("path, batch", [(R11, 64), (R90, 256)], ids=["11b", "90b"])
def test_shipped_vision_recipes_derive_6404_and_batch_times_images(path, batch):
    r = load_recipe(path)
    assert r.vision is not None and r.build.engine == "tensorrt"
    d = derived_vision(r.vision, r.build.max_batch_size)
    # 6404: "for instruct Vision model, please set the max_encoder_input_len as 6404" (multimodal README@89fd9b74)
    assert d.max_encoder_input_len == 6404
    assert d.max_batch_size == batch == r.build.max_batch_size * r.vision.max_images_per_request
    # two images per request: both values double (the rule is linear in images)
    d2 = derived_vision(load_recipe(path, ["vision.max_images_per_request=2"]).vision, r.build.max_batch_size)
    assert d2 == (2 * batch, 2 * 6404)


def test_typed_values_that_agree_are_accepted_and_disagreeing_ones_name_both_numbers():
    load_recipe(R11, ["vision.max_encoder_input_len=6404", "vision.max_batch_size=64"])
    msg = _error(R11, "vision.max_encoder_input_len=4100")
    assert "vision.max_encoder_input_len" in msg and "4100" in msg and "6404" in msg
    msg = _error(R11, "vision.max_batch_size=8")
    assert "vision.max_batch_size" in msg and " 8 " in msg and "64" in msg


def test_pytorch_engine_is_refused_for_mllama_images_on_1_2(tmp_path):
    # R11 without its trtllm-build knobs and bench.model (since issue #45 a knob section of another engine is refused
    # by type first, tests/test_build_types.py): what is left to refuse is the engine for the mllama images
    import yaml

    data = yaml.safe_load(R11.read_text())
    data["build"] = {k: v for k, v in data["build"].items() if k not in ("plugins", "kv_cache_type", "workers", "opt_num_tokens")}
    data.get("bench", {}).pop("model", None)
    path = tmp_path / R11.name
    path.write_text(yaml.safe_dump(data))
    msg = _error(path, "build.engine=pytorch")
    assert "build.engine" in msg and "use build.engine: tensorrt" in msg and "modeling_mllama" in msg


def test_release_data_mllama_images_engine_path_only_and_ends_after_1_2():
    # True: end-of-life; the CPU engine (issue #46 item 5) behind the same 1.2.x multimodal repository
    assert image_engines("mllama", "1.2.1") == {"tensorrt": True, "cpu": False}
    assert image_engines("mllama", "1.1.0") == {"tensorrt": True, "cpu": False}
    assert image_engines("mllama", "1.3.0rc20") == {}
    msg = _error(R11, "target.tensorrt_llm=1.3.0rc20")
    assert "target.tensorrt_llm" in msg and "end-of-life" in msg


@pytest.mark.parametrize("override, field", [
    ("vision.tile_size=448", "vision.tile_size"),          # the checkpoint's vision_config.image_size is 560
    ("vision.max_tiles=2", "vision.max_tiles"),
    ("vision.encoder_input_features_data_type=TYPE_FP16", "vision.encoder_input_features_data_type"),
    ("vision.tile_size=561", "vision.tile_size"),          # not a whole number of 14 px patches (and not 560)
])
def test_vision_section_disagreeing_with_the_checkpoint_or_family_is_refused(override, field):
    assert field in _error(R11, override)


def test_text_model_with_a_vision_section_is_refused():
    msg = _error(TEXT, "vision.family=mllama")
    assert "vision.family" in msg and "text" in msg


def test_encoder_dtype_cannot_be_a_quantized_format():
    assert "vision.encoder_dtype" in _error(R11, "vision.encoder_dtype=fp8")


def test_vision_param_count_matches_transformers_module():
    torch = pytest.importorskip("torch")
    mllama = pytest.importorskip("transformers.models.mllama.modeling_mllama")
    from transformers import MllamaVisionConfig

    from pipeline.plan.vision import mllama_vision_params
    from pipeline.recipe.vision import vision_geometry

    vis = vision_geometry("meta-llama/Llama-3.2-11B-Vision-Instruct")["vision_config"]
    cfg = MllamaVisionConfig(**{k: v for k, v in vis.items() if k != "max_aspect_ratio_id"})
    assert cfg.max_aspect_ratio_id == vis["max_aspect_ratio_id"]
    with torch.device("meta"):
        module = mllama.MllamaVisionModel(cfg)
    assert mllama_vision_params(vis) == sum(p.numel() for p in module.parameters())


def test_cli_validate_both_recipes_with_the_end_of_life_note():
    res = runner.invoke(app, ["recipe", "validate", str(R11), str(R90)])
    assert res.exit_code == 0, res.output
    assert res.stdout.count("ok ") == 2
    assert res.stdout.count("end-of-life after TensorRT-LLM 1.2") == 2
    # a text recipe gets no such note
    res = runner.invoke(app, ["recipe", "validate", str(TEXT)])
    assert res.exit_code == 0 and "end-of-life" not in res.stdout


@pytest.mark.parametrize("path", [R11, R90], ids=["11b", "90b"])
def test_cli_plan_json_counts_the_encoder_and_splits_the_kv_pool(path):
    res = runner.invoke(app, ["plan", str(path), "--json"])
    assert res.exit_code == 0, res.output
    data = json.loads(res.stdout)
    assert data["verdict"]["ok"] is True
    m = data["memory"]
    v = m["vision"]
    r = load_recipe(path)
    # encoder + projector in bf16: 2 B per parameter; the projector maps 7680 → the text hidden size (with bias)
    hidden = data["geometry"]["hidden_size"]
    assert v["projector_params"] == 7680 * hidden + hidden
    assert v["encoder_bytes"] == 2 * (v["encoder_params"] + v["projector_params"])
    assert v["gpu0_reserve_bytes"] == v["encoder_bytes"] + 300_000_000
    # the same recipe without the vision section: the reserve differs by exactly the vision terms
    text_plan = runner.invoke(app, ["plan", str(path), "--json", "--set", "vision=null"])
    assert text_plan.exit_code == 0, text_plan.output
    t = json.loads(text_plan.stdout)["memory"]
    assert t["vision"] is None
    assert m["overhead_bytes"] - t["overhead_bytes"] == v["gpu0_reserve_bytes"]
    # self + cross pools together = one pool of free × fraction (to within a block each), split 50/50
    tpb, frac = r.build.tokens_per_block, r.build.kv_cache_config.free_gpu_memory_fraction
    whole = int(m["free_bytes"] * frac // (tpb * m["kv_token_bytes"])) * tpb
    assert whole - 2 * tpb <= m["kv_tokens"] + v["cross_kv_tokens"] <= whole
    assert abs(m["kv_tokens"] - v["cross_kv_tokens"]) <= tpb
    assert v["image_requests_in_cross_pool"] == (v["cross_kv_tokens"] // tpb) // -(-6404 // tpb)
    # a smaller cross share leaves more self-attention KV for the rest of the plan
    res = runner.invoke(app, ["plan", str(path), "--json", "--set", "vision.cross_kv_cache_fraction=0.25"])
    assert json.loads(res.stdout)["memory"]["kv_tokens"] > m["kv_tokens"]


def test_a_vision_recipe_dry_run_writes_the_multimodal_repository(tmp_path):
    """issue #46 Done-when (GPU recipes): `build --dry-run` holds the multimodal repository, passing the contract."""
    from pipeline.assemble.stage import run as run_build
    from pipeline.core.layout import BuildLayout
    from pipeline.trtllm import triton_contract

    run_build(load_recipe(R11), tmp_path / "build", recipe_dir=R11.parent, dry_run=True, warn=lambda _m: None)
    repo = BuildLayout(tmp_path / "build").triton_repo
    configs = triton_contract.load_repository(repo)
    assert "multimodal_encoders" in configs and triton_contract.repository_problems(configs, "cpp") == []
    enc = {k: v.string_value for k, v in configs["multimodal_encoders"].parameters.items()}
    assert enc["multimodal_model_path"] == str(BuildLayout(tmp_path / "build").vision.resolve())


@pytest.mark.parametrize("path,gpu,dtype,ok", [(R11, "h200", "float32", False), (R11, "h200", "float16", True)])
def test_float32_encoder_only_on_the_cpu_target(path, gpu, dtype, ok):
    if ok:
        assert load_recipe(path, [f"vision.encoder_dtype={dtype}"]).vision.encoder_dtype == dtype
    else:
        assert "vision.encoder_dtype" in _error(path, f"vision.encoder_dtype={dtype}")
    cpu = REPO / "recipes" / "tiny_mllama_cpu.yaml"
    assert "vision.encoder_dtype" in _error(cpu, "vision.encoder_dtype=bfloat16")
