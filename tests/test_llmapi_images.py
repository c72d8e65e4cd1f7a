"""Images through trtpipe's ``llmapi`` Triton model (issue #47 item 4), no server: the rendered repository (upstream's
post-1.2.1 ``image_url`` input, ``config.pbtxt@0a71057313ec:54-67``, only for a build with a vision section, with the
``triton_config.multimodal`` switch), the URL rules (data: decoded, http(s) fetched, file:// and local paths refused,
too many images refused before any is read), the placeholders and the image-token count, and the bench's route."""

from __future__ import annotations

import base64
import functools
import http.server
import importlib
import io
import sys
import threading
import types
from pathlib import Path

import numpy as np
import pytest
import yaml
from PIL import Image

from pipeline.bench import images as bimages
from pipeline.bench.client import ModelInfo, build_request
from pipeline.bench.http_client import build_triton_request
from pipeline.bench.prompts import Prompt
from pipeline.recipe import load_recipe
from pipeline.recipe.vision import QwenVLVision
from pipeline.triton_repo import stage as triton_repo
from pipeline.trtllm import triton_contract

REPO = Path(__file__).resolve().parents[1]
RECIPE = REPO / "recipes" / "smollm2_135m_cpu_llmapi.yaml"
MODELS = REPO / "pipeline" / "triton_repo" / "models"


@pytest.fixture(scope="module")
def L():
    """``_llmapi_images`` as the python stub imports it: a top-level module beside ``_vision``."""
    sys.path.insert(0, str(MODELS))
    try:
        yield importlib.import_module("_llmapi_images")
    finally:
        sys.path.remove(str(MODELS))


def _vision_recipe(max_images: int = 2):
    """The CPU llmapi recipe with a Qwen2-VL vision section (the serving path and the template read only these)."""
    return load_recipe(RECIPE).model_copy(update={"vision": QwenVLVision(family="qwen2_vl", max_images_per_request=max_images)})


def _png(w: int = 40, h: int = 30) -> bytes:
    buf = io.BytesIO()
    Image.fromarray(np.arange(w * h * 3, dtype=np.uint8).reshape(h, w, 3)).save(buf, format="PNG")
    return buf.getvalue()


def _data_url(data: bytes, media: str = "image/png") -> str:
    return f"data:{media};base64,{base64.b64encode(data).decode()}"


# ------------------------------------------------------------------------------------------ repository
def test_image_url_input_only_in_a_vision_builds_config(tmp_path):
    text = triton_repo.model_configs(load_recipe(RECIPE), tmp_path)["tensorrt_llm"]
    vis = triton_repo.model_configs(_vision_recipe(), tmp_path)["tensorrt_llm"]
    names = lambda entries: {x.name: x for x in entries}
    assert "image_url" not in names(text.input) and "num_image_tokens" not in names(text.output)
    assert {k: v.string_value for k, v in text.parameters.items()} == {"llm_runtime": "trtpipe_cpu"}
    # the vision build: upstream's input exactly (name, type, dims, optional), held to the stored newer config.pbtxt
    from tritonclient.grpc import model_config_pb2 as pb

    got = names(vis.input)["image_url"]
    assert (pb.DataType.Name(got.data_type), list(got.dims), got.optional) == ("TYPE_STRING", [-1], True)
    assert triton_contract.llmapi_image_inputs() == {"image_url": ("TYPE_STRING", [-1])}
    out = names(vis.output)["num_image_tokens"]
    assert (pb.DataType.Name(out.data_type), list(out.dims)) == ("TYPE_INT32", [1])
    assert {k: v.string_value for k, v in vis.parameters.items()} == {"llm_runtime": "trtpipe_cpu", "max_num_images": "2"}
    # every other tensor is the text build's
    assert {n for n in names(vis.input)} - {"image_url"} == set(names(text.input))
    assert {n for n in names(vis.output)} - {"num_image_tokens"} == set(names(text.output))
    assert triton_contract.repository_problems({"tensorrt_llm": vis}, "llmapi") == []
    assert triton_contract.repository_problems({"tensorrt_llm": text}, "llmapi") == []


def test_model_yaml_sets_the_multimodal_switch_only_for_a_vision_build(tmp_path):
    engine = tmp_path / "engine"
    engine.mkdir()
    (engine / "llm_api_config.yaml").write_text(yaml.safe_dump({"model": str(engine), "backend": "pytorch"}))
    done = types.SimpleNamespace(path=str(engine), hf_ckpt=str(engine))
    for name, recipe in (("text", load_recipe(RECIPE)), ("vision", _vision_recipe())):
        triton_repo._write_llmapi_files(recipe, tmp_path / name / "tensorrt_llm", done, done)
    tc = {n: yaml.safe_load((tmp_path / n / "tensorrt_llm" / "1" / "model.yaml").read_text())["triton_config"]
          for n in ("text", "vision")}
    assert "multimodal" not in tc["text"] and tc["vision"]["multimodal"] is True
    assert {k: v for k, v in tc["vision"].items() if k != "multimodal"} == tc["text"]
    # the model's image code travels with it (shared_python)
    assert (tmp_path / "vision" / "tensorrt_llm" / "1" / "_llmapi_images.py").is_file()


# ------------------------------------------------------------------------------------------ URL rules
def test_data_urls_decode_and_non_images_are_refused(L):
    imgs = L.load_images(np.array([_data_url(_png(40, 30)).encode(), _data_url(_png(8, 9))], dtype=object), 2)
    assert [im.size for im in imgs] == [(40, 30), (8, 9)] and all(im.mode == "RGB" for im in imgs)
    assert L.load_images(None, 2) == [] and L.load_images(np.array([b""], dtype=object), 2) == []
    cases = {
        _data_url(b"\x89PNG\r\n\x1a\n not really a png"): "not a decodable image",
        _data_url(b"hello", "text/plain"): "media type 'text/plain', not an image",
        "data:image/png;base64,@@@": "not valid base64",
    }
    for url, why in cases.items():
        with pytest.raises(L.ImageInputError, match=why) as e:
            L.load_images(np.array([url], dtype=object), 2)
        assert str(e.value).startswith("image_url: ") and "\n" not in str(e.value)


@pytest.mark.parametrize(("url", "why"), [
    ("file:///etc/hostname", "file:// URLs are refused"), ("FILE:///tmp/a.png", "file:// URLs are refused"),
    ("/etc/hostname", "local paths are refused"), ("./a.png", "local paths are refused"),
    ("C:\\images\\a.png", "local paths are refused"), ("a.png", "local paths are refused"),
    ("ftp://example.com/a.png", "scheme 'ftp' is not accepted"),
])
def test_file_urls_local_paths_and_other_schemes_are_refused(L, url, why, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    (tmp_path / "a.png").write_bytes(_png())  # a readable image at the relative path: still refused
    with pytest.raises(L.ImageInputError, match=why) as e:
        L.load_images(np.array([url], dtype=object), 2)
    assert "\n" not in str(e.value)


def test_too_many_images_are_refused_before_any_is_read(L):
    urls = np.array(["file:///etc/hostname"] * 3, dtype=object)  # the count is checked first
    with pytest.raises(L.ImageInputError, match="3 images in one request, more than max_num_images=2"):
        L.load_images(urls, 2)


def test_http_urls_are_fetched_as_upstream_does(L, tmp_path):
    (tmp_path / "a.png").write_bytes(_png(20, 10))
    (tmp_path / "a.txt").write_text("not an image")
    handler = functools.partial(http.server.SimpleHTTPRequestHandler, directory=str(tmp_path))
    handler.log_message = lambda *a: None
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), handler)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    try:
        base = f"http://127.0.0.1:{server.server_address[1]}"
        assert [im.size for im in L.load_images(np.array([f"{base}/a.png"], dtype=object), 1)] == [(20, 10)]
        with pytest.raises(L.ImageInputError, match="not a decodable image"):
            L.load_images(np.array([f"{base}/a.txt"], dtype=object), 1)
        with pytest.raises(L.ImageInputError, match="fetching .* failed"):
            L.load_images(np.array([f"{base}/missing.png"], dtype=object), 1)
    finally:
        server.shutdown()


def test_placeholders_and_image_token_count_from_the_checkpoint(L, tmp_path):
    import json

    (tmp_path / "config.json").write_text(json.dumps({"model_type": "qwen2_vl", "image_token_id": 7,
                                                      "vision_start_token_id": 5, "vision_end_token_id": 6}))
    (tmp_path / "tokenizer.json").write_text(json.dumps({"added_tokens": [
        {"id": 5, "content": "<vs>"}, {"id": 6, "content": "<ve>"}, {"id": 7, "content": "<img>"}]}))
    eng = tmp_path / "engine"  # the CPU engine directory: tokenizer at the top, the full config in vision/
    (eng / "vision").mkdir(parents=True)
    (eng / "config.json").write_text(json.dumps({"model_type": "qwen2"}))
    (eng / "vision" / "config.json").write_text((tmp_path / "config.json").read_text())
    (eng / "tokenizer.json").write_text((tmp_path / "tokenizer.json").read_text())
    assert L.Placeholders([eng]).image_token_id == 7 and L.Placeholders([eng]).text == "<vs><img><ve>"
    p = L.Placeholders([tmp_path])
    assert p.image_token_id == 7 and p.text == "<vs><img><ve>"
    assert p.prompt("Describe.", 2) == "<vs><img><ve><vs><img><ve>Describe."
    assert p.prompt("<img> and <img>?", 2) == "<img> and <img>?"  # already placed: as sent
    with pytest.raises(L.ImageInputError, match="1 <img> token"):
        p.prompt("<img> only", 2)
    assert p.count([1, 5, 7, 7, 7, 6, 9]) == 3
    # without the files: Qwen2-VL's texts, and no count without an image_token_id
    q = L.Placeholders([tmp_path / "missing"])
    assert q.text == "<|vision_start|><|image_pad|><|vision_end|>" and q.count([1, 2]) is None


# ------------------------------------------------------------------------------------------ bench route
def _llmapi_info(*extra: str) -> ModelInfo:
    inputs = {n: "BYTES" for n in ("text_input", *extra)} | {"sampling_param_max_tokens": "INT32", "streaming": "BOOL"}
    return ModelInfo("tensorrt_llm", "llmapi", inputs, ("text_output",), 0, {}, {}, {})


def test_bench_sends_the_llmapi_image_url_input_over_grpc_and_http():
    geo = bimages.ImageGeometry("qwen2_vl", "test", max_images=2)
    wl = bimages.ImageWorkload(64.0, 0.0, 56.0, 0.0, "png", 2)
    plan = bimages.plan((wl, geo), _llmapi_info("image_url"), "grpc", None)
    assert (plan.route, plan.placeholder) == ("image_url", None)  # the model places the image tokens
    with pytest.raises(Exception, match="takes no images"):
        bimages.plan((wl, geo), _llmapi_info(), "grpc", None)  # a text build declares no image_url
    ims = bimages.make_image_sets(wl, 1, 0)[0]
    prompt = Prompt(text="hello", ids=None, num_tokens=1, images=ims, image_tokens=2 * geo.tokens(64, 56))
    req = build_request(_llmapi_info("image_url"), prompt, 8, request_id="r1")
    (t,) = [t for t in req.inputs if t.name == "image_url"]
    raw = req.raw_input_contents[[i.name for i in req.inputs].index("image_url")]
    urls, off = [], 0
    while off < len(raw):
        n = int.from_bytes(raw[off:off + 4], "little")
        urls.append(raw[off + 4:off + 4 + n].decode())
        off += 4 + n
    assert (t.datatype, list(t.shape)) == ("BYTES", [2]) and urls == [im.data_url() for im in ims]
    body = __import__("json").loads(build_triton_request(_llmapi_info("image_url"), prompt, 8).body)
    assert body["image_url"] == urls and body["text_input"] == "hello"
