"""Issue #46's served Done-when on the CPU VLM, from the CLI as a user runs it (slow tier: one real build of
``recipes/tiny_mllama_cpu.yaml``, ~minutes, reused by every test here):

    trtpipe build recipes/tiny_mllama_cpu.yaml      quantize (images) → vision (ONNX + parity) → engine → repository
    trtpipe serve --detach                          real Triton: the multimodal ensemble on the CPU
    trtpipe bench --isl 100 --osl 64 --image-width-mean 560 --image-height-mean 560 --concurrency 1,4

and stock ``tritonclient`` requests to ``ensemble``: ``image_bytes_input`` as upstream's client builds it
(tools/multimodal/client.py@c2e65b8:301-306), a ``data:`` URL in ``image_url_input``, a text-only request; each bad
image input answered INVALID_ARGUMENT (gRPC) / 400 (HTTP) while the server keeps serving.
"""

from __future__ import annotations

import base64
import json
import os
import queue
import subprocess
import sys
import urllib.error
import urllib.request
from pathlib import Path

import numpy as np
import pytest
from support import free_ports

from pipeline.core.layout import BuildLayout
from pipeline.vision import images as vimages

pytestmark = [pytest.mark.slow, pytest.mark.triton, pytest.mark.xdist_group("mllama_build")]  # conftest mllama_build

REPO = Path(__file__).resolve().parents[1]
TRTPIPE = str(Path(sys.executable).parent / "trtpipe")
RECIPE = REPO / "recipes" / "tiny_mllama_cpu.yaml"
PROMPT = "<|image|>Describe the picture in one sentence."


def trtpipe(*args: str, cwd: Path, timeout: float = 1800) -> subprocess.CompletedProcess:
    return subprocess.run([TRTPIPE, *args], cwd=cwd, capture_output=True, text=True, timeout=timeout, check=False,
                          env={**os.environ, "COLUMNS": "200"})


@pytest.fixture(scope="module")
def vision_build(mllama_build) -> Path:
    """``trtpipe build recipes/tiny_mllama_cpu.yaml`` once per session, from a temp working directory (its
    ``artifacts/``; tests/conftest.py ``mllama_build``, shared with tests/test_vision_stage.py)."""
    return mllama_build[1]


@pytest.fixture(scope="module")
def served(vision_build: Path):
    """``trtpipe serve --detach`` on free ports; ``(work dir, http port, grpc port)``; stopped at the end."""
    work = vision_build.parent.parent
    http, grpc, metrics = free_ports(3)
    up = trtpipe("serve", "--detach", "--http-port", str(http), "--grpc-port", str(grpc), "--metrics-port", str(metrics),
                 cwd=work, timeout=600)
    assert up.returncode == 0, up.stdout + up.stderr
    try:
        yield work, http, grpc
    finally:
        down = trtpipe("serve", "--stop", cwd=work, timeout=120)
        assert down.returncode == 0, down.stderr


def _grpc_generate(grpc: int, inputs: dict[str, np.ndarray], max_tokens: int = 16) -> tuple[str | None, object]:
    """One streamed request to ``ensemble`` with a stock tritonclient: ``(text, error)``."""
    import tritonclient.grpc as grpcclient
    from tritonclient.utils import np_to_triton_dtype

    arrays = {"text_input": np.array([[PROMPT.encode()]], dtype=object),
              "max_tokens": np.array([[max_tokens]], dtype=np.int32), **inputs}
    tensors = []
    for name, arr in arrays.items():
        t = grpcclient.InferInput(name, list(arr.shape), "BYTES" if arr.dtype == object else np_to_triton_dtype(arr.dtype))
        t.set_data_from_numpy(arr)
        tensors.append(t)
    got: queue.Queue = queue.Queue()
    client = grpcclient.InferenceServerClient(f"127.0.0.1:{grpc}")
    client.start_stream(callback=lambda result, error: got.put((result, error)))
    try:
        client.async_stream_infer("ensemble", tensors, request_id="vlm-test",
                                  outputs=[grpcclient.InferRequestedOutput("text_output")],
                                  enable_empty_final_response=True)
        text = []
        while True:
            result, error = got.get(timeout=300)
            if error is not None:
                return None, error
            resp = result.get_response()
            out = result.as_numpy("text_output")
            if out is not None:
                text += [x.decode() if isinstance(x, bytes) else str(x) for x in out.reshape(-1)]
            if resp.parameters.get("triton_final_response") and resp.parameters["triton_final_response"].bool_param:
                return "".join(text), None
    finally:
        client.stop_stream()
        client.close()


def _photo() -> np.ndarray:
    return np.asarray(vimages.bundled_sample("astronaut").convert("RGB").resize((320, 240)))


def test_the_build_has_the_multimodal_repository(vision_build: Path):
    from pipeline.trtllm import triton_contract

    layout = BuildLayout(vision_build)
    assert (layout.triton_repo / "multimodal_encoders" / "config.pbtxt").is_file()
    assert triton_contract.repository_problems(triton_contract.load_repository(layout.triton_repo), "cpu") == []
    parity = json.loads((layout.vision / "manifest.json").read_text())
    assert "parity" in json.dumps(parity)


def test_stock_tritonclient_image_bytes_url_and_text_only(served):
    _, _, grpc = served
    img = _photo()
    text, err = _grpc_generate(grpc, {"image_bytes_input": np.array([[img]], dtype=np.uint8)})  # [1, 1, H, W, 3]
    assert err is None and text and text.strip(), err
    url = "data:image/png;base64," + base64.b64encode(vimages.encode(vimages.bundled_sample("chelsea"), "png")).decode()
    text_url, err = _grpc_generate(grpc, {"image_url_input": np.array([[url.encode()]], dtype=object)})
    assert err is None and text_url and text_url.strip(), err
    text_only, err = _grpc_generate(grpc, {})
    assert err is None and text_only and text_only.strip(), err


@pytest.mark.parametrize("inputs, fragment", [
    ({"image_url_input": np.array([[b"data:image/png;base64," + base64.b64encode(b"garbage")]], dtype=object)},
     "not a decodable image"),
    ({"image_url_input": np.array([[b"data:text/plain;base64,aGVsbG8="]], dtype=object)}, "not an image"),
    ({"image_url_input": np.array([[b"https://example.com/cat.png"]], dtype=object)}, "http(s) image URLs are refused"),
    ({"image_bytes_input": np.zeros((1, 2, 32, 32, 3), np.uint8)}, "more than max_num_images=1"),
    ({"image_bytes_input": np.zeros((1, 1, 32, 32, 3), np.uint8),
      "image_url_input": np.array([[b"data:image/png;base64,xx"]], dtype=object)}, "send exactly one of"),
])
def test_a_bad_image_is_one_line_and_the_server_keeps_serving(served, inputs, fragment):
    """On the gRPC stream an error carries its message only (tritonclient grpc/_infer_stream.py@58a44caa:152-153:
    ``InferenceServerException(msg=response.error_message)``); the models raise it as INVALID_ARG, which the HTTP
    route answers 400 (next test)."""
    _, _, grpc = served
    text, err = _grpc_generate(grpc, inputs)
    assert text is None and err is not None
    assert fragment in err.message() and "\n" not in err.message(), err.message()
    ok, err = _grpc_generate(grpc, {}, max_tokens=4)
    assert err is None and ok


def test_a_bad_image_url_over_http_is_400(served):
    _, http, _ = served
    body = json.dumps({"text_input": PROMPT, "max_tokens": 4, "image_url_input": "data:text/plain;base64,aGVsbG8="})
    req = urllib.request.Request(f"http://127.0.0.1:{http}/v2/models/ensemble/generate_stream", data=body.encode(),
                                 headers={"Content-Type": "application/json"})
    with pytest.raises(urllib.error.HTTPError) as e:
        urllib.request.urlopen(req, timeout=120).read()
    assert e.value.code == 400 and "not an image" in e.value.read().decode()


def test_the_done_when_bench_with_images(served, tmp_path: Path):
    work, _, grpc = served
    out = tmp_path / "bench"
    run = trtpipe("bench", "--url", f"127.0.0.1:{grpc}", "--isl", "100", "--osl", "64", "--image-width-mean", "560",
                  "--image-height-mean", "560", "--concurrency", "1,4", "--out", str(out), cwd=work)
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-3000:]
    doc = json.loads((out / "bench.json").read_text())
    measured = [r for r in doc["requests"] if not r.get("warmup")]
    assert measured and {r["output_tokens"] for r in measured} == {64}
    assert all(r.get("ok", True) and not r.get("error") for r in measured)
    assert {r["images"] for r in measured} == {1} and {r["image_tokens"] for r in measured} == {68}  # 4 tiles × 17
