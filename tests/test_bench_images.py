"""Bench image workloads (issue #46 item 6, #47 item 6), no server: AIPerf's options and their one-line refusals, seeded
images of the asked size distribution, the three routes' payloads decoded back to the images they carry, and the
image-token accounting checked against the model code (mllama's vision tower output, Qwen2-VL's image processor)."""

from __future__ import annotations

import base64
import io
import json
import shutil
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
from PIL import Image

from pipeline.bench import images as bimages
from pipeline.bench import options, stage
from pipeline.bench.client import ModelInfo, build_request
from pipeline.bench.http_client import build_openai_request, build_triton_request
from pipeline.bench.prompts import Prompt, load_tokenizer, make_prompts
from pipeline.bench.target import build_recipe
from pipeline.core.errors import UserError
from pipeline.core.layout import BuildLayout
from pipeline.recipe.bench import BenchSpec

REPO = Path(__file__).resolve().parents[1]
TINY = bimages.ImageGeometry("mllama", "test", tile_size=56, patch_size=14, max_tiles=4, max_images=2)


def _spec(**kw) -> BenchSpec:
    return stage.with_overrides(BenchSpec(), kw, flags=options.flag_names(BenchSpec))


def _decode_url(url: str) -> Image.Image:
    head, _, b64 = url.partition(",")
    assert head.startswith("data:image/") and head.endswith(";base64")
    return Image.open(io.BytesIO(base64.b64decode(b64)))


def _info(interface: str, *extra: str, name: str = "ensemble") -> ModelInfo:
    inputs = {n: "BYTES" for n in ("text_input", *extra)} | {"max_tokens": "INT32", "min_tokens": "INT32"}
    return ModelInfo(name, interface, inputs, ("text_output",), 8, {}, {}, {"endpoint": "chat/completions"})


# ------------------------------------------------------------------------------------------------ options
def test_the_options_are_aiperfs_and_set_bench_fields():
    spec = _spec(**options.overrides(BenchSpec, {
        "image_width_mean": 560.0, "image_width_stddev": 10.0, "image_height_mean": 480.0, "image_height_stddev": 5.0,
        "image_format": "jpeg", "image_batch_size": 2}))
    wl = bimages.workload(spec)
    assert wl == bimages.ImageWorkload(560.0, 10.0, 480.0, 5.0, "jpeg", 2)
    assert options.flag_names(BenchSpec)["image_batch_size"] == "--image-batch-size"
    assert bimages.workload(BenchSpec()) is None  # AIPerf's defaults: means 0 = no images


@pytest.mark.parametrize(("given", "flag"), [
    ({"image_width_mean": -1.0}, "--image-width-mean"), ({"image_height_stddev": -2.0}, "--image-height-stddev"),
    ({"image_format": "gif"}, "--image-format"), ({"image_batch_size": 0}, "--image-batch-size"),
])
def test_bad_values_are_one_line_naming_the_option(given, flag):
    with pytest.raises(UserError) as e:
        _spec(**given)
    assert str(e.value).startswith(f"{flag}:") and "\n" not in str(e.value)


@pytest.mark.parametrize(("given", "named"), [
    ({"image_width_mean": 560.0}, "--image-height-mean"), ({"image_height_mean": 560.0}, "--image-width-mean"),
    ({"image_width_stddev": 5.0}, "--image-width-stddev"), ({"image_format": "jpeg"}, "--image-format"),
])
def test_options_that_would_send_no_images_are_refused(given, named):
    with pytest.raises(UserError, match=named):
        bimages.workload(_spec(**given))


def test_the_cli_refuses_in_one_line_with_exit_2(tmp_path):
    trtpipe = str(Path(sys.executable).parent / "trtpipe")
    for args, where in ((["--image-width-mean", "-5"], "--image-width-mean"), (["--image-format", "gif"], "--image-format"),
                        (["--image-width-mean", "560", "--image-height-mean", "560"], "vision")):
        out = subprocess.run([trtpipe, "bench", "--isl", "8", "--osl", "4", *args], capture_output=True, text=True,
                             timeout=120, cwd=tmp_path, check=False)
        assert out.returncode == 2 and where in out.stderr and len(out.stderr.strip().splitlines()) == 1, out.stderr


def _layout(tmp_path: Path, recipe: str) -> BuildLayout:
    layout = BuildLayout(tmp_path / "build")
    layout.root.mkdir(parents=True)
    shutil.copy(REPO / "recipes" / recipe, layout.recipe_file)
    return layout


def test_images_against_a_text_build_or_beyond_its_image_limit_are_refused_before_the_server(tmp_path):
    from pipeline.bench.preflight import preflight

    spec = _spec(image_width_mean=560.0, image_height_mean=560.0)
    text = _layout(tmp_path / "t", "smollm2_135m_cpu_fp8.yaml")
    with pytest.raises(UserError, match="no vision section"):  # nothing listens at the URL: refused before asking
        preflight(spec, url="localhost:1", layout=text, metrics=False)
    vision = _layout(tmp_path / "v", "llama32_11b_vision_h200_fp8.yaml")
    with pytest.raises(UserError, match=r"--image-batch-size 2: the build takes at most 1"):
        preflight(spec.model_copy(update={"image_batch_size": 2}), url="localhost:1", layout=vision, metrics=False)
    checked = bimages.check_build(spec, build_recipe(vision), None)
    assert checked is not None and checked[1].tile_size == 560 and checked[1].max_images == 1


def test_routes_that_take_no_images_are_refused():
    checked = (bimages.workload(_spec(image_width_mean=64.0, image_height_mean=64.0)), TINY)
    with pytest.raises(UserError, match="--openai-endpoint chat"):
        bimages.plan(checked, _info("openai"), "openai", None)
    with pytest.raises(UserError, match="declares no image_bytes_input"):
        bimages.plan(checked, _info("text"), "grpc", None)
    with pytest.raises(UserError, match="takes no images"):
        bimages.plan(checked, _info("tokens", name="tensorrt_llm"), "grpc", None)
    assert bimages.plan(checked, _info("text", "image_url_input"), "triton-http", None).route == "image_url_input"
    assert bimages.plan(checked, _info("openai-chat"), "openai", None).placeholder is None  # the server's template


# ------------------------------------------------------------------------------------------------ images
def test_same_seed_same_bytes_and_the_size_distribution_is_honoured():
    wl = bimages.ImageWorkload(60.0, 8.0, 40.0, 0.0, "png", 1)
    a = bimages.make_image_sets(wl, 300, (7, 100))
    assert [im.data for (im,) in a[:5]] == [im.data for (im,) in bimages.make_image_sets(wl, 5, (7, 100))]
    assert [im.data for (im,) in a[:5]] != [im.data for (im,) in bimages.make_image_sets(wl, 5, (8, 100))]
    widths = np.array([im.width for (im,) in a])
    assert {im.height for (im,) in a} == {40}  # stddev 0: exactly the mean
    # N(60, 8) rounded up (mean + 0.5); within 3 standard errors, and the spread within 15 %
    assert abs(widths.mean() - 60.5) < 3 * 8 / np.sqrt(300) and 0.85 < widths.std() / 8 < 1.15
    for (im,) in a[:10]:  # the bytes are a PNG of the drawn size
        decoded = Image.open(io.BytesIO(im.data))
        assert decoded.format == "PNG" and decoded.size == (im.width, im.height)


def test_sizes_never_go_below_one_pixel():
    rng = np.random.default_rng(0)
    assert min(bimages.sample_size(1.0, 50.0, rng) for _ in range(200)) >= 1


# ------------------------------------------------------------------------------------------------ payloads
def _image_prompt(n: int, fmt: str = "png") -> Prompt:
    wl = bimages.ImageWorkload(120.0, 30.0, 90.0, 20.0, fmt, n)
    (images,) = bimages.make_image_sets(wl, 1, (0, 8))
    return Prompt(8, text="<|image|>" * n + "hello world", images=images, image_tokens=0)


def test_grpc_sends_image_bytes_input_as_upstreams_client_does():
    prompt = _image_prompt(1)
    req = build_request(_info("text", "image_bytes_input"), prompt, 4, request_id="r")
    names = [t.name for t in req.inputs]
    t = req.inputs[names.index("image_bytes_input")]
    raw = np.frombuffer(req.raw_input_contents[names.index("image_bytes_input")], dtype=np.uint8)
    (im,) = prompt.images
    assert t.datatype == "UINT8" and list(t.shape) == [1, 1, im.height, im.width, 3]  # [batch, images, H, W, C]
    pixels = raw.reshape(t.shape)[0, 0]
    assert np.array_equal(pixels, np.asarray(Image.open(io.BytesIO(im.data)).convert("RGB")))
    text = req.raw_input_contents[names.index("text_input")][4:].decode()
    assert text.startswith("<|image|>")


def test_several_images_of_one_request_are_padded_to_the_largest():
    prompt = _image_prompt(2)
    a, b = prompt.images
    t = bimages.bytes_tensor(prompt.images)
    assert t.shape == (2, max(a.height, b.height), max(a.width, b.width), 3)
    assert np.array_equal(t[1, : b.height, : b.width], b.pixels()) and not t[1, b.height:].any() and not t[1, :, b.width:].any()


@pytest.mark.parametrize("fmt", ["png", "jpeg"])
def test_triton_http_sends_data_urls_in_image_url_input(fmt):
    prompt = _image_prompt(1, fmt)
    body = json.loads(build_triton_request(_info("text", "image_url_input"), prompt, 4).body)
    img = _decode_url(body["image_url_input"])
    (im,) = prompt.images
    assert body["image_url_input"].startswith(f"data:image/{fmt};base64,") and img.size == (im.width, im.height)
    assert img.format == fmt.upper() and body["text_input"] == prompt.text
    two = json.loads(build_triton_request(_info("text", "image_url_input"), _image_prompt(2), 4).body)
    assert isinstance(two["image_url_input"], list) and len(two["image_url_input"]) == 2


def test_openai_chat_sends_image_url_content_parts():
    prompt = _image_prompt(2)
    body = json.loads(build_openai_request(_info("openai-chat"), Prompt(8, text="hello", images=prompt.images), 4).body)
    (msg,) = body["messages"]
    assert msg["content"][0] == {"type": "text", "text": "hello"}
    parts = msg["content"][1:]
    assert [p["type"] for p in parts] == ["image_url", "image_url"]
    assert [_decode_url(p["image_url"]["url"]).size for p in parts] == [(im.width, im.height) for im in prompt.images]
    text_only = json.loads(build_openai_request(_info("openai-chat"), Prompt(8, text="hello"), 4).body)
    assert text_only["messages"][0]["content"] == "hello"  # no images: the request as before


# ------------------------------------------------------------------------------------------------ prompts
@pytest.fixture(scope="module")
def mllama_tokenizer(tmp_path_factory):
    """SmolLM2's tokenizer with mllama's `<|image|>` added as a special token (as the CPU mllama checkpoint ships it)."""
    from pipeline.quantize.sources import embedded_smollm2_dir

    tok = load_tokenizer(embedded_smollm2_dir())
    tok.add_special_tokens({"additional_special_tokens": ["<|image|>"]})
    return tok


@pytest.mark.parametrize("k", [1, 2])
def test_prompts_keep_exact_isl_with_the_image_tokens_in_front(mllama_tokenizer, k):
    spec = _spec(image_width_mean=100.0, image_height_mean=80.0, image_batch_size=k)
    plan = bimages.ImagePlan(bimages.workload(spec), TINY, "<|image|>", "image_bytes_input")
    info = _info("text", "image_bytes_input")
    prompts = make_prompts(spec, info, 24, 5, mllama_tokenizer, images=plan)
    for p in prompts:
        ids = mllama_tokenizer.encode(p.text, add_special_tokens=False)
        assert len(ids) == p.num_tokens == 24 and p.text.startswith("<|image|>" * k) and len(p.images) == k
        assert ids[:k] == mllama_tokenizer.convert_tokens_to_ids(["<|image|>"]) * k and p.image_tokens == k * TINY.tokens(1, 1)
    again = make_prompts(spec, info, 24, 5, mllama_tokenizer, images=plan)
    assert [im.data for p in again for im in p.images] == [im.data for p in prompts for im in p.images]


def test_a_placeholder_the_tokenizer_lacks_is_refused():
    from pipeline.quantize.sources import embedded_smollm2_dir

    spec = _spec(image_width_mean=100.0, image_height_mean=80.0)
    plan = bimages.ImagePlan(bimages.workload(spec), TINY, "<|image|>", "image_bytes_input")
    with pytest.raises(UserError, match="not one token"):
        make_prompts(spec, _info("text", "image_bytes_input"), 16, 2, load_tokenizer(embedded_smollm2_dir()), images=plan)


# ------------------------------------------------------------------------------------------------ token accounting
def test_mllama_image_tokens_are_the_vision_towers_output_length():
    """The encoder length per image = the rows mllama's vision model (tiny config, 56 px tiles) outputs for a generated
    image through its image processor: images × tiles × patches (+ class token)."""
    import torch
    from transformers.models.mllama.modeling_mllama import MllamaVisionModel

    from pipeline.vision.tiny_mllama import (
        TINY_VISION,
        image_processor,
        tiny_mllama_config,
    )

    tower = MllamaVisionModel(tiny_mllama_config().vision_config).eval()
    geo = bimages.ImageGeometry("mllama", "test", tile_size=TINY_VISION["image_size"], patch_size=TINY_VISION["patch_size"],
                                max_tiles=TINY_VISION["max_num_tiles"])
    wl = bimages.ImageWorkload(150.0, 60.0, 90.0, 40.0, "png", 1)
    for (im,) in bimages.make_image_sets(wl, 3, (1, 2)):
        x = image_processor(geo.tile_size, geo.max_tiles)(images=[[Image.open(io.BytesIO(im.data))]], return_tensors="pt")
        with torch.no_grad():
            out = tower(pixel_values=x["pixel_values"], aspect_ratio_ids=x["aspect_ratio_ids"],
                        aspect_ratio_mask=x["aspect_ratio_mask"]).last_hidden_state  # [B, images, tiles, rows, hidden]
        assert geo.tokens(im.width, im.height) == out.shape[2] * out.shape[3]


@pytest.mark.parametrize(("w", "h"), [(448, 448), (640, 480), (300, 170), (90, 1000)])
def test_qwen2_vl_image_tokens_match_its_image_processor(w, h):
    try:  # transformers 5.x: the PIL class (the default one needs torchvision); 4.57 (TensorRT-LLM 1.2.1's pin): numpy
        from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import (
            Qwen2VLImageProcessorPil as Processor,
        )
    except ImportError:
        from transformers import Qwen2VLImageProcessor as Processor

    geo = bimages.ImageGeometry("qwen2_vl", "test")
    proc = Processor()
    (im,) = bimages.make_image_sets(bimages.ImageWorkload(w, 0.0, h, 0.0, "png", 1), 1, 0)[0]
    grid = proc(images=[Image.open(io.BytesIO(im.data))], return_tensors="np")["image_grid_thw"]
    assert geo.tokens(im.width, im.height) == int(np.prod(grid)) // proc.merge_size ** 2


def test_geometry_from_a_vision_checkpoint_beside_the_tokenizer(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "qwen2_vl", "vision_config": {"patch_size": 14}}))
    (tmp_path / "preprocessor_config.json").write_text(json.dumps({"min_pixels": 3136, "max_pixels": 200704}))
    geo = bimages.resolve_geometry(None, tmp_path)
    assert (geo.family, geo.min_pixels, geo.max_pixels) == ("qwen2_vl", 3136, 200704)
    assert bimages.resolve_geometry(None, tmp_path / "nothing") is None


# ------------------------------------------------------------------------------------------------ reports
def test_text_isl_and_image_tokens_are_reported_separately_everywhere(tmp_path):
    from pipeline.bench.console import scenario_tables
    from pipeline.bench.exporters import write_run
    from pipeline.bench.records import RequestRecord
    from pipeline.bench.results import BenchResult, LoadPoint
    from pipeline.bench.run import summarize_run
    from pipeline.bench.summary_csv import read_summary

    spec = _spec(scenarios=[{"isl": 10, "osl": 3}], concurrency=[2], image_width_mean=64.0, image_height_mean=48.0)
    plan = bimages.ImagePlan(bimages.workload(spec), TINY, "<|image|>", "image_bytes_input")
    run = BenchResult(spec, started_at="x", t0_ns=0, t0_epoch_ns=10**18, url="u", image_plan=plan)
    per_image = TINY.tokens(64, 48)
    for i in range(5):
        r = RequestRecord("10:3", "c2", i, i == 0, 10, 3, start_ns=i * 10**8, images=1, image_tokens=per_image)
        r.response_ns = [i * 10**8 + k * 10**6 for k in (5, 6, 7)]
        r.response_tokens, r.end_ns = [1, 1, 1], i * 10**8 + 8 * 10**6
        run.records.append(r)
    run.load_points = [LoadPoint("10:3", 10, 3, "concurrency", "c2", concurrency=2)]
    summarize_run(run)
    out = write_run(tmp_path / "run", run)
    doc = json.loads((out / "bench.json").read_text())
    summary = doc["load_points"][0]["summary"]
    assert summary["metrics"]["input_sequence_length"]["avg"] == 10  # the text ISL, images not in it
    assert summary["images"]["total_image_tokens"] == 4 * per_image and summary["images"]["image_tokens"]["avg"] == per_image
    assert doc["images"]["geometry"]["family"] == "mllama" and doc["config"]["image_width_mean"] == 64.0
    assert [(q["input_tokens"], q["image_tokens"]) for q in doc["requests"]] == [(10, per_image)] * 5
    (row,) = read_summary(out)
    assert row["image_tokens_avg"] == per_image and row["input_sequence_length_tokens_avg"] == 10
    lines = [json.loads(x) for x in (out / "profile_export.jsonl").read_text().splitlines()]
    assert {x["metrics"]["image_tokens"]["value"] for x in lines} == {per_image}
    assert {x["metrics"]["input_sequence_length"]["value"] for x in lines} == {10}
    agg = json.loads((out / "profile_export_aiperf.json").read_text())
    assert agg["image_tokens"]["avg"] == per_image and agg["total_image_tokens"]["avg"] == 4 * per_image
    assert "Image Tokens (tokens)" in (out / "profile_export_aiperf.csv").read_text()
    (table,) = scenario_tables(run.load_points)
    assert [c.header for c in table.columns][-3:] == ["ISL text", "img/req", "img tok/req"]
    assert list(table.columns[-1].cells) == [f"{per_image:,.0f}"]


def test_a_text_run_records_no_image_fields(tmp_path):
    from pipeline.bench.exporters import write_run
    from pipeline.bench.results import BenchResult

    run = BenchResult(BenchSpec(), started_at="x", t0_ns=0, url="u")
    doc = json.loads((write_run(tmp_path / "run", run) / "bench.json").read_text())
    assert "images" not in doc and not any(k.startswith("image_") for k in doc["config"])
