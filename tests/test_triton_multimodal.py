"""The multimodal Triton repository (issue #46 item 4): its configs held to upstream's multimodal contract data
(pipeline/data/triton_multimodal_contract.yaml, read at tensorrtllm_backend@c2e65b8), and the image-input rules of its
python models (models/_vision.py: one of three forms, data: URLs, http refused, undecodable images, too many images)
checked on real images, without Triton. The served path is tests/test_vision_served.py (slow tier).
"""

from __future__ import annotations

import base64
import importlib.util
from pathlib import Path

import numpy as np
import pytest

from pipeline.recipe import load_recipe
from pipeline.triton_repo.stage import model_configs
from pipeline.trtllm import triton_contract
from pipeline.vision import images as vimages

REPO = Path(__file__).resolve().parents[1]
GPU_VISION = REPO / "recipes" / "llama32_11b_vision_h200_fp8.yaml"
CPU_VISION = REPO / "recipes" / "tiny_mllama_cpu.yaml"


def _load(name: str, rel: str):
    spec = importlib.util.spec_from_file_location(name, REPO / rel)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


V = _load("trtpipe_models_vision", "pipeline/triton_repo/models/_vision.py")


def _data_url(img, fmt: str) -> str:
    return f"data:image/{fmt};base64," + base64.b64encode(vimages.encode(img, fmt)).decode()


# ------------------------------------------------------------------------------------------- configs vs contract
@pytest.fixture(scope="module")
def gpu_configs(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("mm")
    return model_configs(load_recipe(GPU_VISION), tmp / "engine", repo_dir=tmp / "repo")


def _inputs(cfg) -> dict:
    from tritonclient.grpc import model_config_pb2

    return {x.name: (model_config_pb2.DataType.Name(x.data_type), list(x.dims)) for x in cfg.input}


def test_the_gpu_vision_repository_is_upstreams_multimodal_layout(gpu_configs):
    assert sorted(gpu_configs) == sorted(["ensemble", "preprocessing", "multimodal_encoders", "tensorrt_llm",
                                          "postprocessing", "tensorrt_llm_bls"])
    assert triton_contract.repository_problems(gpu_configs, "cpp") == []
    ens = _inputs(gpu_configs["ensemble"])
    # upstream's names and types (multimodal/ensemble/config.pbtxt@c2e65b8:43-58)
    assert ens["image_input"] == ("TYPE_FP16", [-1, -1, -1, -1])
    assert ens["image_bytes_input"] == ("TYPE_UINT8", [-1, -1, -1, -1])
    assert ens["image_url_input"][0] == "TYPE_STRING"
    assert _inputs(gpu_configs["tensorrt_llm_bls"])["image_input"] == ("TYPE_FP16", [-1, 3, -1, -1])
    assert not {"image_bytes_input", "image_url_input"} & set(_inputs(gpu_configs["tensorrt_llm_bls"]))
    trt = _inputs(gpu_configs["tensorrt_llm"])
    assert trt["encoder_input_features"] == ("TYPE_BF16", [-1, -1])  # mllama: TYPE_BF16 (docs/multimodal.md@efb8a497:229)
    assert trt["cross_attention_mask"] == ("TYPE_BOOL", [-1, -1]) and "skip_cross_attn_blocks" in trt
    params = {k: v.string_value for k, v in gpu_configs["tensorrt_llm"].parameters.items()}
    assert params["cross_kv_cache_fraction"] == "0.5"
    enc = {k: v.string_value for k, v in gpu_configs["multimodal_encoders"].parameters.items()}
    assert enc["encoder_runtime"] == "tensorrt" and enc["multimodal_model_path"].endswith("/vision")
    steps = [s.model_name for s in gpu_configs["ensemble"].ensemble_scheduling.step]
    assert steps == ["preprocessing", "multimodal_encoders", "tensorrt_llm", "postprocessing"]


def test_every_ensemble_step_tensor_is_produced_or_an_ensemble_input(gpu_configs):
    """Triton refuses an ensemble whose step reads a tensor nothing writes; checked here, at generation time."""
    ens = gpu_configs["ensemble"]
    have = {x.name for x in ens.input}
    for step in ens.ensemble_scheduling.step:
        cfg = gpu_configs[step.model_name]
        declared_in, declared_out = {x.name for x in cfg.input}, {x.name for x in cfg.output}
        for key, value in step.input_map.items():
            assert key in declared_in, (step.model_name, key)
            assert value in have, (step.model_name, key, value)
        for key, value in step.output_map.items():
            assert key in declared_out, (step.model_name, key)
            have.add(value)


def test_the_contract_check_is_not_vacuous(gpu_configs):
    from tritonclient.grpc import model_config_pb2

    bad = {k: type(v)() for k, v in gpu_configs.items()}
    for k, v in gpu_configs.items():
        bad[k].CopyFrom(v)
    x = next(i for i in bad["ensemble"].input if i.name == "image_bytes_input")
    x.data_type = model_config_pb2.TYPE_FP16
    y = next(o for o in bad["multimodal_encoders"].output if o.name == "SKIP_CROSS_ATTN_BLOCKS")
    y.dims[:] = [-1]
    z = bad["multimodal_encoders"].input.add(name="IMAGE_WRONG", data_type=model_config_pb2.TYPE_FP16, dims=[1], optional=True)
    assert z is not None
    problems = triton_contract.repository_problems(bad, "cpp")
    assert any("'image_bytes_input' is TYPE_FP16, upstream declares TYPE_UINT8" in p for p in problems)
    assert any("'SKIP_CROSS_ATTN_BLOCKS' has dims [-1]" in p for p in problems)
    assert any("'IMAGE_WRONG' does not exist in upstream multimodal_encoders" in p for p in problems)


def test_the_contract_data_cites_upstream_at_a_commit():
    data = triton_contract.contract()
    for name in ("multimodal_ensemble", "multimodal_encoders"):
        t = data["templates"][name]
        assert "@c2e65b88d85255be30cf50440a91662abeb497dd" in t["source"]
        assert all("line" in x for x in t["inputs"] + t["outputs"] if not x.get("from_inflight_ensemble"))
    assert {d for t in data["deviations"].values() for d in t["inputs"]} == {"IMAGE_URL", "image_url_input"}


def test_a_text_recipe_keeps_the_text_repository(tmp_path):
    cfgs = model_configs(load_recipe(REPO / "recipes" / "smollm2_135m_cpu_fp8.yaml"), tmp_path / "engine")
    assert "multimodal_encoders" not in cfgs
    assert not {"image_input", "image_bytes_input", "image_url_input"} & set(_inputs(cfgs["ensemble"]))
    assert "encoder_input_features" not in _inputs(cfgs["tensorrt_llm"])


def test_deploy_launch_flags_are_upstreams():
    from pipeline.triton_repo.vision import launch_flags

    flags = launch_flags(load_recipe(GPU_VISION))
    # docs/multimodal.md@efb8a497:235
    assert flags == ["--tensorrt_llm_model_name", "tensorrt_llm,multimodal_encoders",
                     "--multimodal_gpu0_cuda_mem_pool_bytes", "300000000"]
    assert launch_flags(load_recipe(REPO / "recipes" / "smollm2_135m_cpu_fp8.yaml")) == []


# ------------------------------------------------------------------------------------------- the image rules
def test_exactly_one_of_three_image_forms():
    px = np.zeros((1, 1, 8, 8, 3), np.uint8)
    url = np.array([[b"data:image/png;base64,xx"]], dtype=object)
    assert V.one_image_form({}) is None
    assert V.one_image_form({"image_bytes_input": np.zeros((1, 0, 8, 8, 3), np.uint8)}) is None  # empty = absent
    assert V.one_image_form({"image_bytes_input": px}) == "image_bytes_input"
    assert V.one_image_form({"image_url_input": url}) == "image_url_input"
    for pair in (("image_bytes_input", "image_url_input"), ("image_input", "image_url_input"),
                 ("image_input", "image_bytes_input")):
        given = {"image_input": np.zeros((1, 4, 3, 8, 8), np.float16), "image_bytes_input": px, "image_url_input": url}
        with pytest.raises(V.ImageInputError) as e:
            V.one_image_form({k: given[k] for k in pair})
        assert "exactly one of image_input, image_bytes_input, image_url_input" in str(e.value)
        assert "\n" not in str(e.value)


@pytest.mark.parametrize("fmt", ["png", "jpeg"])
def test_a_data_url_decodes_to_the_image(fmt):
    img = vimages.synthetic_image(40, 30, seed=3)
    got = V.load_image_url(_data_url(img, fmt), allow_http=False)
    assert got.size == (40, 30) and got.mode == "RGB"
    import io

    from PIL import Image

    # the pixels PIL decodes from the same bytes (PNG: the source itself, lossless)
    ref = img.convert("RGB") if fmt == "png" else Image.open(io.BytesIO(vimages.encode(img, fmt))).convert("RGB")
    assert np.array_equal(np.asarray(got), np.asarray(ref))


def test_image_bytes_are_decoded_pixels_as_upstreams_client_sends_them():
    img = vimages.synthetic_image(20, 12, seed=1).convert("RGB")
    arr = np.array([[img]])  # tools/multimodal/client.py@c2e65b8:305: np.array([[raw_image]])
    assert arr.shape == (1, 1, 12, 20, 3) and arr.dtype == np.uint8
    (got,) = V.images_from_bytes(arr)
    assert np.array_equal(np.asarray(got), np.asarray(img))
    (chw,) = V.images_from_bytes(np.moveaxis(arr, -1, 2))  # [batch, images, C, H, W] (docs/multimodal.md@efb8a497:337)
    assert np.array_equal(np.asarray(chw), np.asarray(img))


@pytest.mark.parametrize("url, fragment", [
    ("data:image/png;base64," + base64.b64encode(b"not a png at all").decode(), "not a decodable image"),
    ("data:image/png;base64,@@@###", "not valid base64"),
    ("data:text/plain;base64," + base64.b64encode(b"hello").decode(), "media type 'text/plain', not an image"),
    ("data:image/png,rawbytes", "not base64-encoded"),
    ("https://example.com/cat.png", "http(s) image URLs are refused"),
    ("http://127.0.0.1:9/cat.png", "http(s) image URLs are refused"),
    ("file:///etc/passwd", "URL scheme 'file' is not accepted"),
])
def test_each_bad_image_url_is_one_line_naming_the_input(url, fragment):
    with pytest.raises(V.ImageInputError) as e:
        V.images_from_urls(np.array([[url.encode()]], dtype=object), allow_http=False)
    msg = str(e.value)
    assert msg.startswith("image_url_input: ") and fragment in msg and "\n" not in msg


def test_an_allowed_http_url_that_is_not_an_image_is_refused(tmp_path):
    import functools
    import http.server
    import threading

    (tmp_path / "page.html").write_text("<html>not an image</html>")
    handler = functools.partial(http.server.SimpleHTTPRequestHandler, directory=str(tmp_path))
    http.server.SimpleHTTPRequestHandler.log_message = lambda *a: None
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), handler)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    try:
        url = f"http://127.0.0.1:{server.server_address[1]}/page.html"
        with pytest.raises(V.ImageInputError, match="not a decodable image"):
            V.load_image_url(url, allow_http=True)
        vimages.synthetic_image(8, 8, seed=0).save(tmp_path / "ok.png")
        assert V.load_image_url(url.replace("page.html", "ok.png"), allow_http=True).size == (8, 8)
    finally:
        server.shutdown()


@pytest.mark.parametrize("arr, fragment", [
    (np.zeros((1, 1, 8, 8, 3), np.float32), "must be UINT8"),
    (np.zeros((1, 1, 8, 8, 2), np.uint8), "with C in 1, 3, 4"),
    (np.zeros((2, 1, 8, 8, 3), np.uint8), "one request carries batch 1"),
    (np.zeros((1, 8, 3), np.uint8)[0], "expected [batch, num_images, H, W, C]"),
])
def test_each_bad_image_bytes_tensor_is_one_line(arr, fragment):
    with pytest.raises(V.ImageInputError) as e:
        V.images_from_bytes(arr)
    assert str(e.value).startswith("image_bytes_input: ") and fragment in str(e.value)


def test_more_images_than_max_num_images_is_refused():
    V.check_image_count(1, 1, "image_bytes_input")
    V.check_image_count(5, None, "image_bytes_input")
    with pytest.raises(V.ImageInputError, match=r"image_bytes_input: 2 images in one request, more than max_num_images=1"):
        V.check_image_count(2, 1, "image_bytes_input")


# ------------------------------------------------------------------------------------------- tensors for the engine
def test_the_cross_attention_mask_is_transformers_mllama_rule():
    """Against transformers' MllamaProcessor semantics: rows before the first <|image|> see nothing, rows from it on
    see that image's real tiles only."""
    img_tok = 99
    ids = [1, 5, img_tok, 7, 8]
    m = V.cross_attention_mask(ids, img_tok, [2], max_tiles=4, n=1)
    assert m.shape == (5, 1, 4) and m.dtype == np.int64
    assert m[:2].sum() == 0 and (m[2:, 0, :2] == 1).all() and m[2:, 0, 2:].sum() == 0
    assert V.cross_attention_mask(ids, img_tok, [], max_tiles=4, n=0).shape == (5, 0, 4)


def test_the_expanded_mask_equals_upstreams_torch_code():
    torch = pytest.importorskip("torch")
    rng = np.random.default_rng(0)
    cam = rng.integers(0, 2, size=(6, 2, 4))  # [seq, images, tiles]
    patches, max_tokens = 5, 3
    got = V.expand_cross_attention_mask(cam, patches, max_tokens)
    # multimodal_encoders/1/model.py@c2e65b8:381-389, with bs = 1
    t = torch.from_numpy(cam)[None].repeat_interleave(patches, dim=3).to(torch.bool).view(1, -1, 2 * 4 * patches)
    t = torch.concat([t] + [t[:, -1:, :] for _ in range(max_tokens)], dim=1)
    assert np.array_equal(got, t[0].numpy())


def test_encoder_kwargs_for_the_cpu_engine():
    assert V.encoder_kwargs(None, None, None, None) == {}  # a text repository: the engine call is unchanged
    skip = V.encoder_kwargs(np.zeros((1, 4, 8), np.float32), np.array([[4]]), np.zeros((1, 3, 4), bool), np.array([[True]]))
    assert skip == {"encoder_input_features": None, "cross_attention_mask": None, "skip_cross_attn_blocks": True}
    feats = np.arange(2 * 10 * 8, dtype=np.float32).reshape(2, 10, 8)[:1]
    kw = V.encoder_kwargs(feats, np.array([[6]], np.int32), np.ones((1, 9, 10), bool), np.array([[False]]))
    assert kw["encoder_input_features"].shape == (6, 8) and kw["cross_attention_mask"].shape == (9, 6)
    assert kw["skip_cross_attn_blocks"] is False


def test_a_prompt_without_the_image_tag_gets_it_after_bos():
    assert V.insert_image_tokens([1, 5, 6], 1, 99, bos_id=1) == [1, 99, 5, 6]
    assert V.insert_image_tokens([5, 6], 1, 99, bos_id=None) == [99, 5, 6]
    assert V.insert_image_tokens([1, 99, 5], 1, 99, bos_id=1) == [1, 99, 5]


def test_deploy_k8s_renders_the_multimodal_launch(tmp_path):
    """`trtpipe deploy k8s` of the 8-GPU vision recipe: every rank's tritonserver argv as launch_triton_server.py makes
    it of --tensorrt_llm_model_name tensorrt_llm,multimodal_encoders --multimodal_gpu0_cuda_mem_pool_bytes 300000000
    (scripts/launch_triton_server.py@c2e65b8:173-182): ranks ≠ 0 load both models, rank 0 gets the pool on GPU 0."""
    pytest.importorskip("kubernetes_validate")
    import yaml

    from pipeline.deploy.spec import resolve
    from pipeline.deploy.stage import run

    recipe = REPO / "recipes" / "llama32_90b_vision_h200_tp8_fp8.yaml"
    out = run(recipe, tmp_path / "helm").out
    dep = next(d for d in yaml.safe_load_all((out / "rendered" / "deployment.yaml").read_text()) if d)
    argv = dep["spec"]["template"]["spec"]["containers"][0]["command"]
    ranks = " ".join(argv).split(" : ")
    assert len(ranks) == 8
    assert "--cuda-memory-pool-byte-size=0:300000000" in ranks[0] and "--load-model" not in ranks[0]
    for r in ranks[1:]:
        assert "--load-model=tensorrt_llm --load-model=multimodal_encoders" in r and "cuda-memory-pool" not in r
    admin = "model-repository,shared-memory,logging,trace:triton-admin-key=$(TRITON_ADMIN_KEY)"
    assert argv == resolve(recipe).triton_argv(extra_args=[f"--http-restricted-api={admin}",
                                                           f"--grpc-restricted-protocol={admin}"])
