"""The ``build.engine: cpu`` stage and the dequantization it relies on, on real ModelOpt exports.

Fixture exports come from tests/support.py (ModelOpt PTQ of SmolLM2-135M on CPU,
cached under the repo-local ``.trtpipe-cache/``; first FP8 run ~1 min, later runs reuse it).
"""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path

import pytest
import torch
from support import quantized_stage

from pipeline.core.artifacts import file_hashes, sha256_file
from pipeline.core.errors import UserError
from pipeline.core.layout import BuildLayout
from pipeline.cpu_runtime import dequant
from pipeline.engine import cpu as cpu_stage
from pipeline.engine.result import EngineResult
from pipeline.quantize.result import QuantizeResult
from pipeline.recipe import load_recipe

REPO = Path(__file__).resolve().parents[1]
FIXTURES = Path(os.environ.get("TRTPIPE_CACHE_DIR", REPO / ".trtpipe-cache")) / "cpu-engine-fixtures"
FP8_RECIPE = REPO / "recipes" / "smollm2_135m_cpu_fp8.yaml"


@pytest.fixture(scope="session", autouse=True)
def _one_thread():
    torch.set_num_threads(1)  # a shared 2-core machine: the tests run beside other work


@pytest.fixture(scope="session")
def fp8_export() -> QuantizeResult:
    return quantized_stage(FIXTURES, "fp8", kv_cache_dtype="fp8")


def _assert_matches_fakequant(export: QuantizeResult, step_of, reference: Path | None = None) -> None:
    """Every dequantized Linear equals ModelOpt's fake-quant weight, except at rounding ties.

    ModelOpt's fake-quant kernels round halfway cases away from zero; the export's torch casts
    round half to even. SmolLM2 comes from a Q4_1 GGUF, so exact ties are common (~0.2 %). A
    mismatch must therefore be (a) rare and (b) exactly one quantization step (``step_of``). ``reference``: the
    fake-quant weights (default: the export's ``reference.safetensors``).
    """
    from safetensors.torch import load_file

    ref = load_file(str(reference or export.path / "reference.safetensors"))
    got = dequant.dequantize_checkpoint(export.path / "hf_ckpt")
    assert len(ref) >= 7 * 30, f"only {len(ref)} quantized Linear weights in the reference"
    for name, r in ref.items():
        d = got[name]
        assert d.shape == r.shape and d.dtype == torch.float32, name
        diff = (d - r).abs()
        tol = 1e-5 * r.abs().max()
        bad = diff > tol
        assert bad.float().mean() < 0.01, f"{name}: {bad.float().mean():.2%} elements differ"
        if bad.any():
            step = step_of(name, torch.maximum(d.abs(), r.abs()))
            assert torch.all(diff[bad] <= step[bad] * 1.001 + tol), f"{name}: a difference exceeds one quantization step"
        assert ((d - r).norm() / r.norm()) < 1e-2, name  # vs ~3 % (FP8) / ~13 % (INT4) quantization error


def test_dequant_fp8_matches_modelopt_fakequant(fp8_export: QuantizeResult) -> None:
    from safetensors import safe_open

    h = safe_open(str(fp8_export.path / "hf_ckpt" / "model.safetensors"), "pt")

    def fp8_step(name: str, mag: torch.Tensor) -> torch.Tensor:
        scale = h.get_tensor(name + "_scale").float()
        codes = mag / scale  # e4m3: 3 mantissa bits, min normal exponent -6
        exp = torch.floor(torch.log2(codes.clamp_min(2.0**-6)))
        return torch.exp2(exp - 3) * scale

    _assert_matches_fakequant(fp8_export, fp8_step)


def test_unpack_int4_inverts_modelopt_packing() -> None:
    from modelopt.torch.export.quant_utils import pack_int4_in_uint8

    g = torch.Generator().manual_seed(0)
    out, inp, group = 6, 8, 4
    scale = torch.rand(out, inp // group, generator=g) + 0.5
    codes = torch.randint(-8, 8, (out, inp), generator=g)
    w = codes.float() * scale.repeat_interleave(group, dim=1)
    packed = pack_int4_in_uint8(w, scale, group)
    assert packed.dtype == torch.uint8 and tuple(packed.shape) == (out // 2, inp)
    assert torch.equal(dequant.unpack_int4(packed), codes.to(torch.int8))
    pqs = torch.rand(inp, generator=g) + 0.5
    eff = dequant.dequantize_weight(packed, scale, pre_quant_scale=pqs)
    torch.testing.assert_close(eff, w * pqs[None, :], rtol=0, atol=1e-6)
    # W4A8: the INT4 weight is then FP8-quantized per tensor with weight_scale_2 = amax / 448
    s2 = w.abs().max() / 448
    w4a8 = dequant.dequantize_weight(packed, scale, weight_scale_2=s2)
    torch.testing.assert_close(w4a8, (w / s2).to(torch.float8_e4m3fn).float() * s2)


def test_dequant_int8_and_errors() -> None:
    w = torch.tensor([[1, -2], [3, 127]], dtype=torch.int8)
    s = torch.tensor([0.5, 2.0])
    pqs = torch.tensor([1.0, 4.0])
    got = dequant.dequantize_weight(w, s, pre_quant_scale=pqs)
    assert torch.equal(got, torch.tensor([[0.5, -4.0], [6.0, 1016.0]]))
    with pytest.raises(dequant.DequantError, match="per-channel"):
        dequant.dequantize_weight(w, torch.ones(3))
    nvfp4_scale = torch.ones(2, 1).to(torch.float8_e4m3fn)
    with pytest.raises(dequant.DequantError, match="NVFP4"):
        dequant.dequantize_weight(torch.zeros(2, 1, dtype=torch.uint8), nvfp4_scale)


@pytest.mark.slow
def test_dequant_int4_awq_matches_modelopt_fakequant(int4_awq) -> None:
    """The quantize stage's own INT4 AWQ hf_ckpt (the session's run of the shipped recipe, tests/conftest.py),
    dequantized, equals ModelOpt's fake-quant weights of that run up to one step at rounding ties."""
    export = int4_awq.quantized
    info = dequant.read_quant_info(export.path / "hf_ckpt")
    assert info["quant_algo"] == "W4A16_AWQ"
    from safetensors import safe_open

    h = safe_open(str(export.path / "hf_ckpt" / "model.safetensors"), "pt")
    keys = set(h.keys())

    def int4_step(name: str, mag: torch.Tensor) -> torch.Tensor:
        base = name[: -len("weight")]
        step = h.get_tensor(base + "weight_scale").float()
        step = step.repeat_interleave(mag.shape[1] // step.shape[1], dim=1)
        if base + "pre_quant_scale" in keys:
            step = step * h.get_tensor(base + "pre_quant_scale").float()[None, :]
        return step

    _assert_matches_fakequant(export, int4_step, int4_awq.reference)


# ---------------------------------------------------------------------------------------- the stage
def _recipe(*overrides: str):
    return load_recipe(FP8_RECIPE, list(overrides))


@pytest.fixture(scope="session")
def fp8_engine(fp8_export: QuantizeResult) -> EngineResult:
    return cpu_stage.run(_recipe(), BuildLayout(FIXTURES / "build-fp8"), quantized=fp8_export)


def test_stage_writes_engine_dir(fp8_engine: EngineResult, fp8_export: QuantizeResult) -> None:
    d = fp8_engine.path
    for f in ("model.safetensors", "config.json", "engine_config.json", "tokenizer.json", "manifest.json"):
        assert (d / f).is_file(), f
    assert not (d / "hf_quant_config.json").exists()
    assert "quantization_config" not in json.loads((d / "config.json").read_text())
    ec = json.loads((d / "engine_config.json").read_text())
    assert ec["kind"] == "cpu" and ec["qformat"] == "fp8" and ec["kv_cache_dtype"] == "fp8"
    assert (ec["max_batch_size"], ec["max_input_len"], ec["max_seq_len"], ec["max_num_tokens"]) == (32, 512, 2304, 1024)
    assert ec["kv_cache"]["max_tokens"] == 36864 and ec["kv_cache"]["free_memory_fraction"] == 0.9
    assert ec["kv_cache"]["bytes_per_token"] == 2 * 30 * 3 * 64 * 4  # SmolLM2: 30 layers, 3 KV heads × 64, fp32
    assert ec["enable_chunked_prefill"] is False  # the recipe's value (TensorRT-LLM default), honoured by the engine
    m = fp8_engine.manifest
    assert m["stage"] == "engine" and m["engine_kind"] == "cpu" and m["runtime"] == "trtpipe-torch"
    assert m["precision"] == {"weights": "fp8 dequantized to float32", "activations": "float32", "kv_cache": "float32"}
    assert m["versions"]["torch"] and m["versions"]["transformers"]
    assert m["files"]["model.safetensors"] == sha256_file(d / "model.safetensors")
    assert m["inputs"]["quantize_cache_key"] == fp8_export.manifest["cache_key"]
    assert m["timings_s"]["total"] > 0 and m["peak_rss_bytes"] > 0


def test_engine_dir_loads_offline_and_answers(fp8_engine: EngineResult) -> None:
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tok = AutoTokenizer.from_pretrained(fp8_engine.path, local_files_only=True)
    model = AutoModelForCausalLM.from_pretrained(fp8_engine.path, local_files_only=True, dtype=torch.float32)
    enc = tok("The capital of France is", return_tensors="pt")
    with torch.no_grad():
        out = model.generate(**enc, max_new_tokens=8, do_sample=False)
    text = tok.decode(out[0, enc.input_ids.shape[1] :])
    assert "Paris" in text, text


def test_stage_reuses_and_rebuilds(fp8_engine: EngineResult, fp8_export: QuantizeResult, tmp_path: Path) -> None:
    again = cpu_stage.run(_recipe(), BuildLayout(fp8_engine.path.parent), quantized=fp8_export)
    assert again.cached and again.manifest["cache_key"] == fp8_engine.manifest["cache_key"]
    # a changed build section (not the weights) rebuilds: dry-run to keep it cheap
    out = BuildLayout(tmp_path).engine
    a = cpu_stage.run(_recipe("build.max_batch_size=8"), BuildLayout(out.parent), quantized=fp8_export, dry_run=True)
    assert not a.cached and json.loads((out / "engine_config.json").read_text())["max_batch_size"] == 8
    assert not (out / "model.safetensors").exists()
    assert cpu_stage.run(_recipe("build.max_batch_size=8"), BuildLayout(out.parent), quantized=fp8_export, dry_run=True).cached
    b = cpu_stage.run(_recipe("build.max_batch_size=4"), BuildLayout(out.parent), quantized=fp8_export, dry_run=True)
    assert not b.cached and b.manifest["cache_key"] != a.manifest["cache_key"]
    assert not cpu_stage.run(_recipe("build.max_batch_size=4"), BuildLayout(out.parent), quantized=fp8_export, dry_run=True, force=True).cached


def test_a_limits_only_rebuild_links_the_weights(fp8_engine: EngineResult, fp8_export: QuantizeResult, tmp_path: Path) -> None:
    """A new max_batch_size rewrites engine_config.json and hard-links the weights; a file that lost its recorded
    sha256, or --force, makes the builder dequantize again."""
    layout = BuildLayout(tmp_path)
    shutil.copytree(fp8_engine.path, layout.engine, copy_function=os.link)
    weights = fp8_engine.path / "model.safetensors"
    r = cpu_stage.run(_recipe("build.max_batch_size=8"), layout, quantized=fp8_export)
    assert not r.cached and "link_weights" in r.manifest["timings_s"] and "dequantize" not in r.manifest["timings_s"]
    assert (layout.engine / "model.safetensors").stat().st_ino == weights.stat().st_ino
    assert json.loads((layout.engine / "engine_config.json").read_text())["max_batch_size"] == 8
    assert r.manifest["files"] == file_hashes(layout.engine)
    assert r.manifest["files"]["model.safetensors"] == fp8_engine.manifest["files"]["model.safetensors"]

    tok = layout.engine / "tokenizer.json"
    text = tok.read_text()
    tok.unlink()  # a new inode: the fixture's file stays intact
    tok.write_text(text + " ")
    r2 = cpu_stage.run(_recipe("build.max_batch_size=4"), layout, quantized=fp8_export)
    assert "dequantize" in r2.manifest["timings_s"] and "link_weights" not in r2.manifest["timings_s"]
    assert (layout.engine / "model.safetensors").stat().st_ino != weights.stat().st_ino
    assert r2.manifest["files"] == fp8_engine.manifest["files"] | {"engine_config.json": sha256_file(layout.engine / "engine_config.json")}

    before = (layout.engine / "model.safetensors").stat().st_ino
    r3 = cpu_stage.run(_recipe("build.max_batch_size=2"), layout, quantized=fp8_export, force=True)
    assert "dequantize" in r3.manifest["timings_s"] and (layout.engine / "model.safetensors").stat().st_ino != before


def test_stage_rejects_kv_pool_smaller_than_a_sequence(fp8_export: QuantizeResult, tmp_path: Path) -> None:
    with pytest.raises(UserError, match="max_tokens 512 is smaller than max_seq_len 2304"):
        cpu_stage.run(_recipe("build.kv_cache_config.max_tokens=512"), BuildLayout(tmp_path / "b"), quantized=fp8_export, dry_run=True)
    assert not (tmp_path / "b").exists()


@pytest.mark.slow
def test_stage_on_the_real_quantize_stage_output(cpu_build: Path) -> None:
    """End to end with the quantize stage itself (pipeline.quantize): the session's ``trtpipe build`` of the shipped
    recipe ran that stage, then this engine stage on its output."""
    from pipeline.core.artifacts import read_manifest

    layout = BuildLayout(cpu_build)
    q, e = read_manifest(layout.stage_dir("quantize")), read_manifest(layout.stage_dir("engine"))
    assert q["stage"] == "quantize" and e["engine_kind"] == "cpu"
    assert e["inputs"]["quantize_cache_key"] == q["cache_key"]
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tok = AutoTokenizer.from_pretrained(layout.stage_dir("engine"), local_files_only=True)
    model = AutoModelForCausalLM.from_pretrained(layout.stage_dir("engine"), local_files_only=True, dtype=torch.float32)
    enc = tok("The capital of France is", return_tensors="pt")
    with torch.no_grad():
        out = model.generate(**enc, max_new_tokens=8, do_sample=False)
    assert "Paris" in tok.decode(out[0, enc.input_ids.shape[1] :])
