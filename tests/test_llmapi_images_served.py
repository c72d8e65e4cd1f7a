"""The tiny Qwen2-VL CPU recipe served through trtpipe's ``llmapi`` Triton model (issue #47 items 4-5, slow): ``trtpipe
build`` with ``serving.frontend=triton`` (the repository gets upstream's ``image_url`` input and the
``triton_config.multimodal`` switch), a real Triton on it, the Done-when bench over gRPC and HTTP generate (every request
exactly OSL tokens, image tokens per request = ``pipeline.vision.geometry.qwen2_vl_image_tokens``), the server's own
``num_image_tokens`` equal to the rule, and each bad image input answered in one line while the server keeps serving.
"""

from __future__ import annotations

import base64
import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import yaml
from support import free_ports

from pipeline.core.layout import BuildLayout
from pipeline.vision import geometry as vgeo

REPO = Path(__file__).resolve().parents[1]
RECIPE = REPO / "recipes" / "tiny_qwen2_vl_cpu_llmapi.yaml"
WAIT_S = 180

pytestmark = [pytest.mark.slow, pytest.mark.triton, pytest.mark.xdist_group("qwen2vl_build"),  # conftest qwen2vl_build
              pytest.mark.skipif(not RECIPE.is_file(), reason="needs recipes/tiny_qwen2_vl_cpu_llmapi.yaml (issue #47 item 5)")]


@pytest.fixture(scope="module")
def served(qwen2vl_build):
    """(layout, TritonServer) of the tiny Qwen2-VL recipe built with serving.frontend=triton, in the work dir of
    conftest's trtllm-serve build (its quantize and engine stages are reused: only the repository differs)."""
    from pipeline.triton.server import TritonServer

    work, _ = qwen2vl_build
    out = work / "artifacts" / "qwen2vl-triton"
    env = dict(os.environ, PYTHONPATH=str(REPO))
    subprocess.run([sys.executable, "-m", "pipeline.cli", "build", str(RECIPE), "--out", str(out),
                    "--set", "serving.frontend=triton"], check=True, env=env, cwd=work, timeout=900)
    layout = BuildLayout(out)
    http, grpc, metrics = free_ports(3)
    with TritonServer(layout.triton_repo, log_file=out / "triton.log", ready_timeout_s=240, http_port=http,
                      grpc_port=grpc, metrics_port=metrics) as srv:
        yield layout, srv


def _png_url(w: int, h: int) -> str:
    import io

    from PIL import Image

    buf = io.BytesIO()
    Image.fromarray((np.arange(w * h * 3) % 251).astype(np.uint8).reshape(h, w, 3)).save(buf, format="PNG")
    return "data:image/png;base64," + base64.b64encode(buf.getvalue()).decode()


def _infer(srv, urls, max_tokens=4):
    """One request with ``image_url`` ``urls`` through Triton's HTTP generate endpoint (the model is decoupled):
    (status code, JSON body)."""
    import requests

    body = {"text_input": "Describe the image.", "sampling_param_max_tokens": max_tokens,
            **({"image_url": urls} if urls is not None else {})}
    r = requests.post(f"http://{srv.http_url}/v2/models/tensorrt_llm/generate", json=body, timeout=WAIT_S)
    return r.status_code, r.json()


def test_repository_declares_the_image_input_and_the_switch(served):
    layout, _ = served
    cfg = (layout.triton_repo / "tensorrt_llm" / "config.pbtxt").read_text()
    assert '"image_url"' in cfg and '"num_image_tokens"' in cfg
    assert yaml.safe_load((layout.triton_repo / "tensorrt_llm" / "1" / "model.yaml").read_text())["triton_config"]["multimodal"] is True


def test_server_counts_the_rules_image_tokens(served):
    _, srv = served
    code, body = _infer(srv, [_png_url(448, 448)])
    assert code == 200, body
    assert body["num_image_tokens"] == vgeo.qwen2_vl_image_tokens(448, 448) == 256 and body["text_output"]


@pytest.mark.parametrize(("urls", "why"), [
    (["data:image/png;base64," + base64.b64encode(b"\x89PNG\r\n\x1a\n broken").decode()], "not a decodable image"),
    (["data:text/plain;base64," + base64.b64encode(b"hello").decode()], "not an image"),
    (["file:///etc/hostname"], "file:// URLs are refused"),
    (["/etc/hostname"], "local paths are refused"),
])
def test_bad_image_inputs_are_one_line_errors_and_the_server_keeps_serving(served, urls, why):
    _, srv = served
    code, body = _infer(srv, urls)
    assert code == 400 and why in body["error"] and "\n" not in body["error"]
    code, body = _infer(srv, None)  # a text request right after
    assert code == 200 and body["text_output"]


def test_too_many_images_are_refused(served):
    layout, srv = served
    most = yaml.safe_load(layout.recipe_file.read_text())["vision"].get("max_images_per_request", 1)
    code, body = _infer(srv, [_png_url(56, 56)] * (most + 1))
    assert code == 400 and f"more than max_num_images={most}" in body["error"]


@pytest.mark.parametrize("api", ["grpc"])  # the bench refuses triton-http for the llmapi model (cumulative text)
def test_done_when_bench_through_the_llmapi_triton_model(served, api, tmp_path):
    """``trtpipe bench --api grpc --isl 100 --osl 64 --image-width-mean 448 --image-height-mean 448 --concurrency 1,4``."""
    layout, srv = served
    url = srv.grpc_url if api == "grpc" else srv.http_url
    env = dict(os.environ, PYTHONPATH=str(REPO))
    subprocess.run([sys.executable, "-m", "pipeline.cli", "bench", "--url", url, "--api", api, "--model", "tensorrt_llm",
                    "--tokenizer", str(layout.engine), "--warmup", "1",
                    "--isl", "100", "--osl", "64", "--image-width-mean", "448", "--image-height-mean", "448",
                    "--concurrency", "1,4", "--out", str(tmp_path / "run")], check=True, env=env,
                   cwd=layout.root.parents[1], timeout=600)  # the work dir: its last build is this one
    doc = json.loads(next((tmp_path / "run").rglob("bench.json")).read_text())
    reqs = [r for r in doc["requests"] if not r.get("warmup")]
    assert reqs and all(r["output_tokens"] == 64 for r in reqs)
    assert {r["image_tokens"] for r in reqs} == {vgeo.qwen2_vl_image_tokens(448, 448)}
    assert doc["images"]["route"] == "image_url"
