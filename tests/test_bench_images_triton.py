"""Image workloads through the real Triton 2.51 (CPU) on ``tests/data/image_llm_repo``: an ensemble stand-in that
declares upstream's image inputs, decodes them as upstream's preprocessing does and refuses a request whose images or
``<|image|>`` tokens are wrong. Both Triton routes — gRPC ``image_bytes_input`` and HTTP ``image_url_input`` data
URLs — give every request exactly OSL tokens, none failed, and the image tokens of the checkpoint's geometry."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from support import free_ports

from pipeline.bench import stage as bench
from pipeline.bench.results import check_outcome
from pipeline.bench.stage import BenchTarget
from pipeline.recipe.bench import BenchSpec
from pipeline.triton.server import TritonServer

pytestmark = pytest.mark.triton

REPO = Path(__file__).resolve().parents[1]
IMAGE_REPO = REPO / "tests" / "data" / "image_llm_repo"
#: the checkpoint geometry beside the tokenizer: mllama at the CPU recipe's 56 px tiles of 14 px patches, 4 tiles
VISION = {"image_size": 56, "patch_size": 14, "max_num_tiles": 4}


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    http, grpc, metrics = free_ports(3)
    log = tmp_path_factory.mktemp("triton") / "server.log"
    with TritonServer(IMAGE_REPO, http_port=http, grpc_port=grpc, metrics_port=metrics, log_file=log,
                      ready_timeout_s=90) as srv:
        yield srv


@pytest.fixture(scope="module")
def mllama_tokenizer_dir(tmp_path_factory) -> Path:
    """SmolLM2's tokenizer with `<|image|>` added (as the CPU mllama checkpoint ships it) and an mllama config.json."""
    from pipeline.bench.prompts import load_tokenizer
    from pipeline.quantize.sources import embedded_smollm2_dir

    out = tmp_path_factory.mktemp("tok")
    tok = load_tokenizer(embedded_smollm2_dir())
    tok.add_special_tokens({"additional_special_tokens": ["<|image|>"]})
    tok.save_pretrained(out)
    (out / "config.json").write_text(json.dumps({"model_type": "mllama", "vision_config": VISION,
                                                 "image_token_index": tok.convert_tokens_to_ids("<|image|>")}))
    return out


@pytest.mark.parametrize("api", ["grpc", "triton-http"])
def test_images_reach_the_ensemble_on_both_triton_routes(server, mllama_tokenizer_dir, api, tmp_path):
    spec = BenchSpec(model="ensemble", scenarios=[{"isl": 24, "osl": 6}], concurrency=[2], num_requests=4,
                     warmup_requests=1, image_width_mean=120, image_width_stddev=30, image_height_mean=90,
                     image_height_stddev=20, image_batch_size=2, image_format="jpeg" if api == "grpc" else "png")
    url = server.grpc_url if api == "grpc" else f"http://{server.http_url}"
    run = bench.run(spec, BenchTarget(url=url, api=api, tokenizer=mllama_tokenizer_dir, out=tmp_path / api))
    check_outcome(run, run.run_dir)  # no request failed: every image decoded, every <|image|> in place
    doc = json.loads((run.run_dir / "bench.json").read_text())
    per_image = VISION["max_num_tiles"] * ((VISION["image_size"] // VISION["patch_size"]) ** 2 + 1)
    assert {r["output_tokens"] for r in doc["requests"]} == {6}  # exact OSL
    assert {(r["input_tokens"], r["images"], r["image_tokens"]) for r in doc["requests"]} == {(24, 2, 2 * per_image)}
    assert doc["images"]["route"] == ("image_bytes_input" if api == "grpc" else "image_url_input")
    assert doc["load_points"][0]["summary"]["images"]["total_image_tokens"] == 4 * 2 * per_image


def test_the_stand_in_refuses_a_request_without_its_images(server, mllama_tokenizer_dir, tmp_path):
    """The check above is real: the same ensemble fails every text-only request (no image input)."""
    from pipeline.core.errors import StageError

    spec = BenchSpec(model="ensemble", scenarios=[{"isl": 24, "osl": 6}], concurrency=[1], num_requests=2, warmup_requests=0)
    run = bench.run(spec, BenchTarget(url=server.grpc_url, tokenizer=mllama_tokenizer_dir, out=tmp_path / "t"))
    with pytest.raises(StageError, match="exactly one of image_bytes_input, image_url_input"):
        check_outcome(run, run.run_dir)
