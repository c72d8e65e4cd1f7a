"""Issue #47 Done-when, CPU half (slow tier, ≈ 2 min): ``trtpipe build recipes/tiny_qwen2_vl_cpu_llmapi.yaml`` from a
fresh working directory, ``trtpipe serve --detach`` (the trtllm-serve stand-in), the official ``openai`` client's chat
call with an image, and the Done-when bench with images over the OpenAI chat route: every request exactly 64
tokens, 256 image tokens each (:func:`pipeline.vision.geometry.qwen2_vl_image_tokens` at 448 × 448)."""

from __future__ import annotations

import base64
import json
import os
import subprocess
import sys
from io import BytesIO
from pathlib import Path

import numpy as np
import pytest
from support import free_ports

from pipeline.vision import geometry as vgeo

pytestmark = [pytest.mark.slow, pytest.mark.xdist_group("qwen2vl_build")]  # conftest qwen2vl_build

REPO = Path(__file__).resolve().parents[1]
TRTPIPE = str(Path(sys.executable).parent / "trtpipe")
RECIPE = REPO / "recipes" / "tiny_qwen2_vl_cpu_llmapi.yaml"


def trtpipe(*args: str, cwd: Path, timeout: float = 900) -> subprocess.CompletedProcess:
    return subprocess.run([TRTPIPE, *args], cwd=cwd, capture_output=True, text=True, timeout=timeout, check=False,
                          env={**os.environ, "COLUMNS": "200"})


@pytest.fixture(scope="module")
def served(qwen2vl_build):
    """(work dir, http port) of a detached stand-in serving a fresh build of the recipe (conftest's ``qwen2vl_build``,
    named explicitly: another test may build a variant in the same work dir); stopped at the end."""
    work, build = qwen2vl_build
    http, grpc, metrics = free_ports(3)
    up = trtpipe("serve", str(build), "--detach", "--http-port", str(http), "--grpc-port", str(grpc), "--metrics-port", str(metrics),
                 cwd=work, timeout=600)
    assert up.returncode == 0, up.stdout + up.stderr
    try:
        yield work, http
    finally:
        assert trtpipe("serve", "--stop", cwd=work, timeout=120).returncode == 0


def test_openai_client_chat_with_an_image_returns_text(served):
    from openai import OpenAI
    from PIL import Image

    _, http = served
    buf = BytesIO()
    Image.fromarray(np.random.default_rng(0).integers(0, 256, (448, 448, 3), dtype=np.uint8)).save(buf, "PNG")
    url = "data:image/png;base64," + base64.b64encode(buf.getvalue()).decode()
    client = OpenAI(base_url=f"http://127.0.0.1:{http}/v1", api_key="unused")
    model = client.models.list().data[0].id
    r = client.chat.completions.create(model=model, max_tokens=8, messages=[{"role": "user", "content": [
        {"type": "image_url", "image_url": {"url": url}}, {"type": "text", "text": "Describe the picture."}]}])
    assert r.choices[0].message.content and r.usage.completion_tokens == 8
    text = client.chat.completions.create(model=model, max_tokens=1, messages=[{"role": "user", "content": [
        {"type": "text", "text": "Describe the picture."}]}])
    assert r.usage.prompt_tokens - text.usage.prompt_tokens == 256 + 2  # image tokens + vision start/end


def test_the_done_when_bench_over_the_openai_chat_route(served, tmp_path):
    work, http = served
    out = tmp_path / "bench"
    run = trtpipe("bench", "--api", "openai", "--url", f"http://127.0.0.1:{http}",
                  "--isl", "100", "--osl", "64", "--image-width-mean", "448", "--image-height-mean", "448",
                  "--concurrency", "1,4", "--out", str(out), cwd=work)
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-3000:]
    measured = [r for r in json.loads((out / "bench.json").read_text())["requests"] if not r.get("warmup")]
    assert measured and {r["output_tokens"] for r in measured} == {64}
    assert all(r.get("ok", True) and not r.get("error") for r in measured)
    rule = vgeo.qwen2_vl_image_tokens(448, 448, min_pixels=56 * 56, max_pixels=448 * 448)
    assert {r["image_tokens"] for r in measured} == {rule} == {256}
