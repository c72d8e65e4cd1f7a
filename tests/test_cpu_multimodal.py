"""Issue #47 items 3 and 5: images through the CPU LLM facade (upstream's ``multi_modal_data`` prompt form) and the
trtllm-serve stand-in's ``image_url`` content parts, on the tiny SmolLM2-grafted Qwen2-VL (``embedded:tiny-qwen2-vl``).

The engine directory is written by the engine stage's own writer (:func:`pipeline.engine.cpu_vision.write_image_model`)
from the source checkpoint (full precision: the decoder is the source's), so the facade's greedy tokens must equal
transformers' ``Qwen2VLForConditionalGeneration.generate`` on the same image; the image token counts must equal the
rule of :func:`pipeline.vision.geometry.qwen2_vl_image_tokens`."""

from __future__ import annotations

import asyncio
import base64
import json
import shutil
import struct
import zlib
from io import BytesIO

import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("transformers")
pytest.importorskip("fastapi")

from pipeline.vision import geometry as vgeo

LIMITS = {"max_batch_size": 4, "max_input_len": 512, "max_seq_len": 640, "max_num_tokens": 1024}


def _engine_cfg(vision: bool) -> dict:
    cfg = {"kind": "cpu", "runtime": "trtpipe-torch", "compute_dtype": "float32", "dtype": "float32", **LIMITS,
           "kv_cache": {"dtype": "float32", "max_tokens": 2560}, "vocab_size": 49156, "enable_chunked_prefill": False}
    if vision:
        cfg["vision"] = {"family": "qwen2_vl", "max_images_per_request": 1}
    return cfg


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    """(source checkpoint dir, image engine dir, text-only engine dir)."""
    from pipeline.cpu_runtime.dequant import plain_config
    from pipeline.engine.cpu_vision import write_image_model
    from pipeline.quantize.sources import _tiny_qwen2_vl

    src = _tiny_qwen2_vl().hf_dir
    d = tmp_path_factory.mktemp("qwen2vl_engine")
    write_image_model(src, d, "float32", plain_config(src, "float32"))
    for f in src.iterdir():
        if f.suffix != ".safetensors" and f.name != "config.json":
            shutil.copy2(f, d / f.name)
    (d / "engine_config.json").write_text(json.dumps(_engine_cfg(True)))
    text = tmp_path_factory.mktemp("qwen2vl_text_engine")
    for f in d.iterdir():
        if f.is_file():
            (text / f.name).symlink_to(f)
    (text / "engine_config.json").unlink()
    (text / "engine_config.json").write_text(json.dumps(_engine_cfg(False)))
    return src, d, text


@pytest.fixture(scope="module")
def llm(tiny):
    from pipeline.cpu_runtime.llm import LLM

    with LLM(str(tiny[1])) as m:
        yield m


def _image(w, h, seed=1):
    import numpy as np
    from PIL import Image

    return Image.fromarray(np.random.default_rng(seed).integers(0, 256, (h, w, 3), dtype=np.uint8))


def _prompt(src, n_images=1):
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(src)
    parts = [{"type": "image"}] * n_images + [{"type": "text", "text": "What is in the picture?"}]
    return tok, tok.apply_chat_template([{"role": "user", "content": parts}], add_generation_prompt=True, tokenize=False)


def _run(llm, inputs, n):
    from pipeline.cpu_runtime.llm import SamplingParams

    async def go():
        r = llm.generate_async(inputs, SamplingParams(max_tokens=n, min_tokens=n, add_special_tokens=False))
        async for _ in r:
            pass
        return r

    return asyncio.run(go())


def test_facade_image_prompt_decodes_as_transformers_and_counts_the_rule(tiny, llm):
    from transformers import Qwen2VLForConditionalGeneration

    from pipeline.vision.tiny_qwen2_vl import expand_image_pads, load_image_processor

    src = tiny[0]
    tok, prompt = _prompt(src)
    img, n = _image(448, 448), 8
    r = _run(llm, {"prompt": prompt, "multi_modal_data": {"image": [img]}}, n)
    assert r.image_tokens == vgeo.qwen2_vl_image_tokens(448, 448, min_pixels=56 * 56, max_pixels=448 * 448) == 256
    model = Qwen2VLForConditionalGeneration.from_pretrained(src, dtype=torch.float32).eval()
    px = load_image_processor(src)(images=[img], return_tensors="pt")
    ids = expand_image_pads(tok(prompt, add_special_tokens=False)["input_ids"], px["image_grid_thw"].tolist(),
                            model.config.image_token_id)
    t = torch.tensor([ids])
    with torch.no_grad():
        hf = model.generate(input_ids=t, attention_mask=torch.ones_like(t), pixel_values=px["pixel_values"],
                            image_grid_thw=px["image_grid_thw"], mm_token_type_ids=(t == model.config.image_token_id).int(),
                            max_new_tokens=n, min_new_tokens=n, do_sample=False)[0, len(ids):].tolist()
    assert r.outputs[0].token_ids == hf
    assert r.prompt_token_ids == ids  # the expanded prompt, as upstream's input processor returns it
    # another size: the processor's resize, counted by the same rule (a 300×200 image → 10×7 tokens of 28 px)
    r2 = _run(llm, {"prompt": prompt, "multi_modal_data": {"image": _image(300, 200, seed=2)}}, 1)
    assert r2.image_tokens == vgeo.qwen2_vl_image_tokens(200, 300, min_pixels=56 * 56, max_pixels=448 * 448)


def test_facade_refuses_images_it_cannot_take(tiny, llm):
    from pipeline.cpu_runtime.llm import LLM, SamplingParams

    _, prompt = _prompt(tiny[0])
    with pytest.raises(ValueError, match="2 images in one request"):
        llm.generate_async({"prompt": _prompt(tiny[0], 2)[1], "multi_modal_data": {"image": [_image(56, 56)] * 2}},
                           SamplingParams(max_tokens=1))
    with pytest.raises(ValueError, match="0 image placeholders for 1 images"):
        llm.generate_async({"prompt": "no placeholder", "multi_modal_data": {"image": [_image(56, 56)]}})
    with pytest.raises(ValueError, match="modality 'video'"):
        llm.generate_async({"prompt": prompt, "multi_modal_data": {"video": [b""]}})
    with LLM(str(tiny[2])) as text_only, pytest.raises(ValueError, match="text-only model"):
        text_only.generate_async({"prompt": prompt, "multi_modal_data": {"image": [_image(56, 56)]}})


def _data_url(img, fmt="PNG"):
    buf = BytesIO()
    img.save(buf, fmt)
    return f"data:image/{fmt.lower()};base64," + base64.b64encode(buf.getvalue()).decode()


def _png_header(w, h):
    """A PNG whose header says ``w × h`` (IHDR with a valid CRC) and no pixel data."""
    def chunk(kind, body):
        return struct.pack(">I", len(body)) + kind + body + struct.pack(">I", zlib.crc32(kind + body))

    return b"\x89PNG\r\n\x1a\n" + chunk(b"IHDR", struct.pack(">IIBBBBB", w, h, 8, 2, 0, 0, 0)) + chunk(b"IEND", b"")


def _chat(client, urls, max_tokens=2):
    parts = [{"type": "image_url", "image_url": {"url": u}} for u in urls] + [{"type": "text", "text": "Describe it."}]
    return client.post("/v1/chat/completions", json={"model": "m", "max_tokens": max_tokens,
                                                     "messages": [{"role": "user", "content": parts}]})


def test_stand_in_image_url_parts_and_each_bad_input_is_one_line_400(tiny, llm):
    from fastapi.testclient import TestClient

    from pipeline.cpu_runtime.llm import LLM
    from pipeline.cpu_runtime.openai.routes import create_app

    client = TestClient(create_app(llm, "m", str(tiny[1])))
    ok = _chat(client, [_data_url(_image(448, 448))], max_tokens=3)
    assert ok.status_code == 200, ok.text
    body = ok.json()
    assert body["usage"]["completion_tokens"] == 3 and body["choices"][0]["message"]["content"]
    text_only_prompt = _chat(client, [], max_tokens=1).json()["usage"]["prompt_tokens"]
    assert body["usage"]["prompt_tokens"] - text_only_prompt == 256 + 2  # the image tokens + vision start/end
    bad = {
        "cannot decode the image": [_data_url(_image(8, 8)).split(",")[0] + "," + base64.b64encode(b"not an image").decode()],
        "2 images in one request": [_data_url(_image(56, 56))] * 2,
        "exceeds the 178956970-pixel limit": ["data:image/png;base64," + base64.b64encode(_png_header(20000, 20000)).decode()],
        "not an image \\(media type text/plain\\)": ["data:text/plain;base64," + base64.b64encode(b"hello").decode()],
        "local files are not served": ["/etc/hostname"],
        "unsupported URL scheme 'ftp'": ["ftp://example.com/a.png"],
    }
    for message, urls in bad.items():
        r = _chat(client, urls)
        assert r.status_code == 400, (message, r.text)
        err = r.json()["message"]
        assert "\n" not in err and __import__("re").search(message, err), (message, err)
    assert _chat(client, [_data_url(_image(56, 56))]).status_code == 200  # still serving
    with LLM(str(tiny[2])) as text_only:
        r = _chat(TestClient(create_app(text_only, "m", str(tiny[2]))), [_data_url(_image(56, 56))])
        assert r.status_code == 400 and "text-only model" in r.json()["message"]
