"""The mllama vision encoder stage's parts (issue #46 item 3) on a tiny random mllama built here: the checkpoint
directory, the processor's tiling, ONNX export + onnx.checker, onnxruntime vs PyTorch parity over several batch sizes
(the batch axis really dynamic), the refusal of a graph that disagrees, and the GPU host's TensorRT build script run
against stand-in ``tensorrt`` / ``tensorrt_llm`` modules that record what it asks of them."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap

import onnx
import pytest
import torch

from pipeline.core.errors import StageError, UserError
from pipeline.vision import geometry, onnx_export, trt_build
from pipeline.vision.images import bundled_sample, synthetic_image
from pipeline.vision.tiny_mllama import (
    TINY_TEXT,
    TINY_VISION,
    build_tiny_mllama,
    image_processor,
    load_mllama,
)

TILE, TILES = TINY_VISION["image_size"], TINY_VISION["max_num_tiles"]
PER_TILE = (TINY_VISION["image_size"] // TINY_VISION["patch_size"]) ** 2 + 1  # counted here, not by the module


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    """(checkpoint dir, loaded model, wrapper, processor, exported ONNX path, batch-1 example)."""
    root = tmp_path_factory.mktemp("tiny_mllama")
    ckpt = build_tiny_mllama(root / "hf")
    model = load_mllama(ckpt)
    wrapper = onnx_export.vision_wrapper(model)
    proc = image_processor(TILE, TILES)
    example = onnx_export.encoder_inputs(proc(images=[[bundled_sample("astronaut")]], return_tensors="pt"))
    onnx_path = onnx_export.export_vision_onnx(wrapper, example, root / "vision" / "onnx" / "model.onnx")
    return ckpt, model, wrapper, proc, onnx_path, example


def _batch(proc, images):
    return onnx_export.encoder_inputs(proc(images=[[im] for im in images], return_tensors="pt"))


def test_tiny_checkpoint_is_an_hf_directory_and_seeded(tiny, tmp_path):
    ckpt = tiny[0]
    assert {"config.json", "model.safetensors", "preprocessor_config.json"} <= {p.name for p in ckpt.iterdir()}
    cfg = json.loads((ckpt / "config.json").read_text())
    assert cfg["model_type"] == "mllama" and cfg["vision_config"]["image_size"] == TILE
    assert cfg["text_config"]["cross_attention_layers"] == TINY_TEXT["cross_attention_layers"]
    pre = json.loads((ckpt / "preprocessor_config.json").read_text())
    assert pre["max_image_tiles"] == TILES and pre["size"] == {"height": TILE, "width": TILE}
    from safetensors.torch import load_file

    again = build_tiny_mllama(tmp_path / "again")  # same seed → same tensors
    a, b = load_file(ckpt / "model.safetensors"), load_file(again / "model.safetensors")
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


def test_load_refuses_a_non_mllama_directory(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "llama"}))
    with pytest.raises(UserError, match="model_type is 'llama'"):
        load_mllama(tmp_path)
    with pytest.raises(UserError, match="no config.json"):
        load_mllama(tmp_path / "missing")


def test_processor_pads_every_image_to_max_tiles(tiny):
    """A 2:1 image covers 2 tiles, yet the tensor has all 4 (the mask says which are real): the encoder length per
    image is fixed, as geometry.mllama_encoder_len assumes."""
    proc = tiny[3]
    wide = proc(images=[[synthetic_image(2 * TILE, TILE, seed=3)]], return_tensors="pt")
    assert list(wide["pixel_values"].shape) == [1, 1, TILES, 3, TILE, TILE]
    assert wide["aspect_ratio_mask"].tolist() == [[[1, 1, 0, 0]]]


def test_onnx_graph_has_upstreams_signature(tiny):
    onnx_path = tiny[4]
    model = onnx.load(str(onnx_path))
    assert [o.version for o in model.opset_import if o.domain in ("", "ai.onnx")] == [17]
    sig = onnx_export.onnx_signature(onnx_path)
    assert list(sig) == ["pixel_values", "aspect_ratio_ids", "aspect_ratio_mask", "encoder_output"]
    assert sig["pixel_values"] == ["batch", 1, TILES, 3, TILE, TILE]
    assert sig["aspect_ratio_ids"] == ["batch", 1] and sig["aspect_ratio_mask"] == ["batch", 1, TILES]
    # the output's batch dim is dynamic too (the exporter names it; upstream names only the inputs' axes)
    assert isinstance(sig["encoder_output"][0], str) and len(sig["encoder_output"]) == 5


def test_onnxruntime_matches_pytorch_over_dynamic_batches(tiny):
    """Batches of 1, 2 and 3 real/synthetic images with different aspect ratios (different ids and tile masks)."""
    _, model, wrapper, proc, onnx_path, example = tiny
    batches = [example,
               _batch(proc, [bundled_sample("chelsea"), synthetic_image(TILE, 3 * TILE, seed=5)]),
               _batch(proc, [bundled_sample("coffee"), bundled_sample("rocket"), synthetic_image(90, 70, seed=6)])]
    assert len({tuple(b["aspect_ratio_ids"].flatten().tolist()) for b in batches[1:]}) == 2
    parity = onnx_export.check_parity(onnx_path, wrapper, batches)
    assert parity.batch_sizes == (1, 2, 3)
    assert parity.max_abs_diff <= parity.tolerance
    assert parity.ref_max_abs > 0.01  # a real signal, not zeros compared with zeros
    # [B, images, tiles, vectors per tile, text hidden]; images × tiles × vectors = the decoder's encoder length
    assert parity.output_shape == (3, 1, TILES, PER_TILE, model.config.text_config.hidden_size)
    assert 1 * TILES * PER_TILE == geometry.mllama_encoder_len(1, TILES, TILE, TINY_VISION["patch_size"])
    assert json.loads(json.dumps(parity.as_dict()))["max_abs_diff"] == parity.max_abs_diff


def test_parity_refuses_a_graph_that_disagrees(tiny):
    """The same graph against a projector nudged by 1e-2: the check must fail and name both numbers."""
    import copy

    _, _, wrapper, _, onnx_path, example = tiny
    other = copy.deepcopy(wrapper)
    with torch.no_grad():
        other.output_proj.weight.add_(1e-2)
    with pytest.raises(StageError) as err:
        onnx_export.check_parity(onnx_path, other, [example])
    msg = str(err.value)
    assert "differs from PyTorch by" in msg and "tolerance" in msg and "\n" not in msg


def test_profile_is_one_batch_range_as_upstream():
    per_sample = {"pixel_values": (1, 4, 3, 560, 560), "aspect_ratio_ids": (1,), "aspect_ratio_mask": (1, 4)}
    prof = trt_build.profile_shapes(per_sample, 8)
    assert prof["pixel_values"] == ((1, 1, 4, 3, 560, 560), (4, 1, 4, 3, 560, 560), (8, 1, 4, 3, 560, 560))
    assert prof["aspect_ratio_ids"] == ((1, 1), (4, 1), (8, 1))
    assert trt_build.profile_shapes({"x": (2,)}, 1)["x"] == ((1, 2), (1, 2), (1, 2))
    with pytest.raises(UserError, match="max_batch_size"):
        trt_build.profile_shapes(per_sample, 0)
    with pytest.raises(UserError, match="encoder_dtype"):
        trt_build.render_build_script(per_sample, 8, precision="int8")


_FAKE_TRT = '''
import json, os, onnx
REC = os.environ["FAKE_TRT_RECORD"]
def _log(**kw):
    with open(REC, "a") as f: f.write(json.dumps(kw) + "\\n")
class Logger:
    INFO = 1
    def __init__(self, level): pass
class NetworkDefinitionCreationFlag:
    EXPLICIT_BATCH = 0
class _In:
    def __init__(self, name): self.name = name
class _Net:
    inputs = []
    num_inputs = property(lambda self: len(self.inputs))
    def get_input(self, i): return _In(self.inputs[i])
class _Profile:
    def set_shape(self, name, lo, opt, hi): _log(set_shape=[name, list(lo), list(opt), list(hi)])
class Builder:
    def __init__(self, logger): pass
    def create_network(self, flags): _log(network_flags=flags); return _Net()
    def create_optimization_profile(self): return _Profile()
    def build_serialized_network(self, net, config): _log(profiles=config.profiles); return b"ENGINE"
class OnnxParser:
    def __init__(self, net, logger): self.net = net
    def parse(self, data, path):
        g = onnx.load_from_string(data).graph
        self.net.inputs = [v.name for v in g.input]
        _log(parsed=path)
        return True
class _Engine:
    def get_tensor_shape(self, name): _log(output=name); return (-1, 1, 4, 17, 32)
class Runtime:
    def __init__(self, logger): pass
    def deserialize_cuda_engine(self, data): return _Engine()
'''

_FAKE_TRTLLM_BUILDER = '''
import json
class _TrtConfig:
    def __init__(self): self.profiles = 0
    def add_optimization_profile(self, p): self.profiles += 1
class _Wrapper:
    def __init__(self, kw): self.kw = kw; self.trt_builder_config = _TrtConfig()
class Builder:
    def create_builder_config(self, **kw): return _Wrapper(kw)
    @staticmethod
    def save_config(w, path):
        with open(path, "w") as f: json.dump({"builder_config": {**w.kw, "output_shape": w.output_shape}}, f)
'''


def test_build_script_drives_the_tensorrt_builder_as_upstream(tiny, tmp_path):
    """Runs the written script against stand-in modules that record the calls: the parser gets the real ONNX
    bytes, one profile with batch 1/opt/max on every graph input, the config carries upstream's fields, and
    model.engine + config.json land in the output directory."""
    onnx_path, example = tiny[4], tiny[5]
    per_sample = {n: tuple(t.shape[1:]) for n, t in example.items()}
    script, argv = trt_build.write_build_script(tmp_path / "vision", per_sample, 8, precision="bfloat16",
                                                onnx_path=str(onnx_path), engine_dir=str(tmp_path / "vision"))
    compile(script.read_text(), str(script), "exec")
    fakes = tmp_path / "fakes"
    (fakes / "tensorrt_llm").mkdir(parents=True)
    (fakes / "tensorrt.py").write_text(textwrap.dedent(_FAKE_TRT))
    (fakes / "tensorrt_llm" / "__init__.py").write_text("")
    (fakes / "tensorrt_llm" / "builder.py").write_text(textwrap.dedent(_FAKE_TRTLLM_BUILDER))
    record = tmp_path / "record.jsonl"
    env = {**os.environ, "PYTHONPATH": str(fakes), "FAKE_TRT_RECORD": str(record)}
    assert argv[:2] == ["python3", trt_build.SCRIPT_NAME]
    proc = subprocess.run([sys.executable, *argv[1:]], cwd=script.parent, env=env, capture_output=True, text=True, check=False,
                          timeout=120)
    assert proc.returncode == 0, proc.stderr
    calls = [json.loads(line) for line in record.read_text().splitlines()]
    shapes = {c["set_shape"][0]: c["set_shape"][1:] for c in calls if "set_shape" in c}
    assert set(shapes) == set(onnx_export.INPUT_NAMES)
    for name, (lo, opt, hi) in shapes.items():
        assert (lo[0], opt[0], hi[0]) == (1, 4, 8) and lo[1:] == opt[1:] == hi[1:] == list(per_sample[name])
    assert {"profiles": 1} in calls and {"parsed": str(onnx_path)} in calls
    cfg = json.loads((tmp_path / "vision" / "config.json").read_text())["builder_config"]
    assert cfg == {"precision": "bfloat16", "model_type": "mllama", "strongly_typed": False, "max_batch_size": 8,
                   "model_name": "multiModal", "output_shape": [-1, 1, 4, 17, 32]}
    assert (tmp_path / "vision" / "model.engine").read_bytes() == b"ENGINE"
    assert json.loads(proc.stdout.strip().splitlines()[-1])["bytes"] == len(b"ENGINE")


def test_build_script_fails_on_a_missing_onnx_file(tmp_path):
    script, _ = trt_build.write_build_script(tmp_path, {"x": (2,)}, 2)
    fakes = tmp_path / "fakes"
    (fakes / "tensorrt_llm").mkdir(parents=True)
    (fakes / "tensorrt.py").write_text("")
    (fakes / "tensorrt_llm" / "__init__.py").write_text("")
    (fakes / "tensorrt_llm" / "builder.py").write_text("class Builder: pass\n")
    proc = subprocess.run([sys.executable, str(script), "--onnx", str(tmp_path / "nope.onnx"), "--output-dir",
                           str(tmp_path / "out")], env={**os.environ, "PYTHONPATH": str(fakes)},
                          capture_output=True, text=True, timeout=60, check=False)
    assert proc.returncode == 1 and "does not exist" in proc.stderr and not (tmp_path / "out").exists()


def test_export_failure_is_a_stage_error(tmp_path, tiny):
    wrapper, example = tiny[2], tiny[5]
    bad = {**example, "pixel_values": example["pixel_values"][..., :7, :7]}  # a tile the patch conv cannot cover
    with pytest.raises(StageError, match="ONNX export"):
        onnx_export.export_vision_onnx(wrapper, bad, tmp_path / "bad.onnx")


def test_paths_in_dry_run_listing_are_quoted(tmp_path):
    _, argv = trt_build.write_build_script(tmp_path, {"x": (2,)}, 2, onnx_path="my dir/model.onnx")
    assert trt_build.command_line(argv) == "python3 build_vision_engine.py --onnx 'my dir/model.onnx' --output-dir ."
    assert os.access(tmp_path / trt_build.SCRIPT_NAME, os.X_OK)
