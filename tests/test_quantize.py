"""The quantize stage on the real SmolLM2-135M: ModelOpt FP8 (+ FP8 KV) calibration, both exports,
the quality report, caching and atomicity; INT4 AWQ under ``slow``; dry runs of GPU recipes."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from safetensors import safe_open

from pipeline.core.errors import UserError
from pipeline.core.layout import BuildLayout
from pipeline.quantize import ptq
from pipeline.quantize import stage as quantize
from pipeline.quantize.sources import SMOLLM2_GGUF_SHA256
from pipeline.recipe import load_recipe

REPO = Path(__file__).resolve().parents[1]
RECIPES = REPO / "recipes"
SMALL = ["quantization.calibration.size=16", "quantization.calibration.max_seq_length=128",
         "quantization.calibration.batch_size=8", "quantization.calibration.eval_samples=4"]


def _tensors(path: Path) -> dict[str, torch.Tensor]:
    with safe_open(str(path), "pt") as f:
        return {k: f.get_tensor(k) for k in f.keys()}


def _rel_err(approx: torch.Tensor, exact: torch.Tensor) -> float:
    return float((approx.float() - exact.float()).norm() / exact.float().norm())


@pytest.fixture(scope="module")
def original(smollm2_dir: Path) -> dict[str, torch.Tensor]:
    return _tensors(smollm2_dir / "model.safetensors")


@pytest.fixture(scope="module")
def fp8(tmp_path_factory, smollm2_dir, quant_one_thread):
    """One real FP8 + FP8-KV quantize run of the shipped CPU recipe with a small calibration."""
    recipe = load_recipe(RECIPES / "smollm2_135m_cpu_fp8.yaml", SMALL)
    out = tmp_path_factory.mktemp("fp8") / "quantize"
    t = time.perf_counter()
    res = quantize.run(recipe, BuildLayout(out.parent), recipe_dir=RECIPES)
    return recipe, res, time.perf_counter() - t


def test_fp8_trtllm_checkpoint(fp8, original) -> None:
    _, res, _ = fp8
    ckpt = res.path / "trtllm_ckpt"
    cfg = json.loads((ckpt / "config.json").read_text())
    assert cfg["quantization"]["quant_algo"] == "FP8" and cfg["quantization"]["kv_cache_quant_algo"] == "FP8"
    assert cfg["mapping"]["world_size"] == 1 and cfg["architecture"] == "LlamaForCausalLM"
    w = _tensors(ckpt / "rank0.safetensors")
    layer = "transformer.layers.3"
    qkv = w[f"{layer}.attention.qkv.weight"]
    assert qkv.dtype == torch.float8_e4m3fn and qkv.shape == (576 + 2 * 192, 576)
    for name in ("attention.qkv", "attention.dense", "mlp.fc", "mlp.gate", "mlp.proj"):
        assert w[f"{layer}.{name}.weight"].dtype == torch.float8_e4m3fn
        for s in ("weights_scaling_factor", "activation_scaling_factor"):
            assert w[f"{layer}.{name}.{s}"].dtype == torch.float32 and w[f"{layer}.{name}.{s}"].item() > 0
    assert w[f"{layer}.attention.kv_cache_scaling_factor"].item() > 0
    # dequantized fused qkv vs the original q/k/v: FP8 e4m3 error is a few percent (docs/reference/cpu-stack.md §3: ≈2.7 %)
    ref = torch.cat([original[f"model.layers.3.self_attn.{p}_proj.weight"] for p in "qkv"])
    err = _rel_err(qkv.float() * w[f"{layer}.attention.qkv.weights_scaling_factor"], ref)
    assert 0.005 < err < 0.06, err


def test_fp8_hf_checkpoint(fp8, original) -> None:
    _, res, _ = fp8
    ckpt = res.path / "hf_ckpt"
    cfg = json.loads((ckpt / "config.json").read_text())
    assert cfg["quantization_config"]["quant_method"] == "modelopt"
    assert json.loads((ckpt / "hf_quant_config.json").read_text())["quantization"]["kv_cache_quant_algo"] == "FP8"
    for f in ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja"):
        assert (ckpt / f).is_file(), f
    w = _tensors(ckpt / "model.safetensors")
    p = "model.layers.3.self_attn"
    assert w[f"{p}.k_proj.k_scale"].item() > 0 and w[f"{p}.v_proj.v_scale"].item() > 0
    for name in ("self_attn.q_proj", "self_attn.o_proj", "mlp.gate_proj", "mlp.down_proj"):
        key = f"model.layers.3.{name}"
        assert w[f"{key}.weight"].dtype == torch.float8_e4m3fn
        assert w[f"{key}.input_scale"].item() > 0
        err = _rel_err(w[f"{key}.weight"].float() * w[f"{key}.weight_scale"], original[f"{key}.weight"])
        assert 0.005 < err < 0.06, (name, err)
    assert w["model.embed_tokens.weight"].dtype == torch.float32  # cpu target keeps fp32 (recipe dtype)


def test_fp8_quality_report_and_manifest(fp8) -> None:
    recipe, res, _ = fp8
    m = res.manifest
    qual = m["quality"]
    assert qual["sequences"] == 4 and qual["tokens"] > 4 * 100
    for k in ("ppl_unquantized", "ppl_quantized"):
        assert 1.0 < qual[k] < 200.0, qual
    assert 0.0 < qual["kl_mean_nats"] < 1.0
    assert 0.5 < qual["top1_agreement"] <= 1.0
    assert m["quantizers"]["enabled"] == {"input": 210, "k_bmm": 30, "v_bmm": 30, "weight": 210}
    assert m["exported"] == {"quant_algo": "FP8", "kv_cache_quant_algo": "FP8"} and m["status"] == "built"
    assert m["source"]["content_hash"] == SMOLLM2_GGUF_SHA256 and m["source"]["kind"] == "embedded"
    assert m["recipe_hash"] == quantize.recipe_hash(recipe)
    assert set(m["timings_s"]) == {"load", "calibrate", "evaluate", "export_trtllm", "export_hf", "total"}
    assert 0 < m["peak_rss_bytes"] < 8 << 30
    assert set(m["versions"]) >= {"nvidia-modelopt", "torch", "transformers"}
    assert m["calibration"]["calib_samples"] == 16 and m["calibration"]["eval_samples"] == 4


def _no_quantization(*args, **kwargs):
    raise AssertionError("the stage ran ModelOpt where it had nothing to calibrate")


def test_rerun_reuses_result(fp8, monkeypatch) -> None:
    recipe, res, _ = fp8
    stamp = (res.path / "manifest.json").stat().st_mtime_ns
    monkeypatch.setattr(quantize, "_quantize", _no_quantization)  # a reuse never calibrates
    again = quantize.run(recipe, BuildLayout(res.path.parent), recipe_dir=RECIPES)
    assert again.cached and again.manifest == res.manifest
    assert (res.path / "manifest.json").stat().st_mtime_ns == stamp
    changed = load_recipe(RECIPES / "smollm2_135m_cpu_fp8.yaml", SMALL + ["quantization.calibration.seed=1"])
    assert quantize.cache_key(changed, source_hash="s", dataset_hash=None, dry_run=False) != \
        quantize.cache_key(recipe, source_hash="s", dataset_hash=None, dry_run=False)


def test_interrupted_run_leaves_nothing(tmp_path: Path, smollm2_dir) -> None:
    """SIGINT during the run: no out_dir, no temp dir (atomic_dir cleans up on KeyboardInterrupt)."""
    out = tmp_path / "quantize"
    # Ctrl-C as at a terminal: a CI job started in the background inherits SIGINT ignored, and Python then never
    # raises KeyboardInterrupt (the run finished with exit 0), so the child restores Python's own handler first
    code = ("import signal; signal.signal(signal.SIGINT, signal.default_int_handler);"
            "import sys; from pathlib import Path; from pipeline.recipe import load_recipe; from pipeline.quantize import stage as quantize;"
            f"r = load_recipe({str(RECIPES / 'smollm2_135m_cpu_fp8.yaml')!r}, {SMALL!r});"
            f"from pipeline.core.layout import BuildLayout; quantize.run(r, BuildLayout(Path({str(out.parent)!r})), recipe_dir=Path({str(RECIPES)!r}))")
    env = os.environ | {"TRTPIPE_NUM_THREADS": "1"}
    proc = subprocess.Popen([sys.executable, "-c", code], cwd=REPO, env=env,
                            stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    try:
        deadline = time.monotonic() + 180
        while not list(tmp_path.glob(".quantize.tmp-*")):
            assert proc.poll() is None, proc.stderr.read().decode()[-2000:]
            assert time.monotonic() < deadline, "the run never started writing"
            time.sleep(0.2)
        time.sleep(1.0)
        proc.send_signal(signal.SIGINT)
        proc.wait(timeout=120)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait(timeout=30)
    assert proc.returncode != 0
    assert "KeyboardInterrupt" in proc.stderr.read().decode()
    assert not out.exists() and list(tmp_path.iterdir()) == []


def test_dry_run_gpu_recipe_writes_quantize_command(tmp_path: Path, monkeypatch) -> None:
    recipe = load_recipe(RECIPES / "llama31_8b_l40s_int4_awq.yaml")
    monkeypatch.setattr(quantize, "_quantize", _no_quantization)  # no model, no ModelOpt
    res = quantize.run(recipe, BuildLayout(tmp_path), recipe_dir=RECIPES, dry_run=True)
    script = (res.path / "quantize_command.sh").read_text()
    for flag in ("--model_dir meta-llama/Llama-3.1-8B-Instruct", "--dtype bfloat16", "--qformat int4_awq",
                 "--kv_cache_dtype fp8", "--calib_dataset cnn_dailymail", "--calib_size 512",
                 "--calib_max_seq_length 512", "--batch_size 1", "--awq_block_size 128", "--tp_size 1", "--pp_size 1",
                 "--seed 1234", "--output_dir ${OUT_DIR}/trtllm_ckpt"):
        assert flag in script.replace(" \\\n    ", " "), flag
    assert os.access(res.path / "quantize_command.sh", os.X_OK)
    subprocess.run(["bash", "-n", str(res.path / "quantize_command.sh")], check=True, timeout=30)
    m = res.manifest
    assert m["status"] == "dry_run" and m["exported"] == {"quant_algo": "W4A16_AWQ", "kv_cache_quant_algo": "FP8"}
    assert not (res.path / "trtllm_ckpt").exists()
    assert quantize.run(recipe, BuildLayout(tmp_path), recipe_dir=RECIPES, dry_run=True).cached


def test_gpu_recipe_without_weights_is_a_user_error(tmp_path: Path) -> None:
    recipe = load_recipe(RECIPES / "llama31_8b_h200_fp8.yaml")
    with pytest.raises(UserError, match="hf download meta-llama/Llama-3.1-8B-Instruct"):
        quantize.run(recipe, BuildLayout(tmp_path), recipe_dir=RECIPES)
    assert not (tmp_path / "quantize").exists()


def _quantizer_entries(quant_cfg) -> dict:
    """``{quantizer wildcard: attributes}`` of a ModelOpt ``quant_cfg``: a list of entries (0.47) or a dict (0.37);
    the last entry of a name wins, as ModelOpt applies them in order."""
    if isinstance(quant_cfg, dict):
        return dict(quant_cfg)
    out = {}
    for e in quant_cfg:
        if "parent_class" not in e:
            out[e["quantizer_name"]] = e.get("cfg") if "cfg" in e else {"enable": e.get("enable")}
    return out


def test_quant_config_copies_modelopt_constants() -> None:
    import modelopt.torch.quantization as mtq

    before = json.dumps(mtq.INT4_AWQ_CFG, default=str)
    r = load_recipe(RECIPES / "smollm2_135m_cpu_int4_awq.yaml")
    cfg = ptq.quant_config(r.quantization)
    assert json.dumps(mtq.INT4_AWQ_CFG, default=str) == before  # module constant untouched
    entries = _quantizer_entries(cfg["quant_cfg"])
    assert entries["*weight_quantizer"]["block_sizes"][-1] == 64
    assert entries["*[kv]_bmm_quantizer"]["num_bits"] == (4, 3)
    assert entries["*input_quantizer"]["enable"] is False  # INT4 AWQ weights only: the KV merge switched nothing else
    r8 = load_recipe(RECIPES / "llama31_8b_a100_int8_sq.yaml")
    assert _quantizer_entries(ptq.quant_config(r8.quantization)["quant_cfg"])["*[kv]_bmm_quantizer"]["num_bits"] == 8
    full = load_recipe(RECIPES / "smollm2_135m_cpu_fp8.yaml", ["quantization.qformat=full_prec", "quantization.kv_cache_dtype=none"])
    assert ptq.quant_config(full.quantization) is None


@pytest.mark.slow
def test_int4_awq_quantize_and_export(int4_awq) -> None:
    """The shipped INT4 AWQ recipe through the stage (the session's run, tests/conftest.py): W4A16_AWQ with group size
    64 and pre-quant scales in the TensorRT-LLM checkpoint, packed INT4 with per-group scales in hf_ckpt."""
    res = int4_awq.quantized
    assert res.manifest["calibration"]["calib_samples"] == 4 and res.manifest["exported"]["quant_algo"] == "W4A16_AWQ"
    cfg = json.loads((res.path / "trtllm_ckpt" / "config.json").read_text())["quantization"]
    assert cfg["quant_algo"] == "W4A16_AWQ" and cfg["group_size"] == 64 and cfg["pre_quant_scale"] is True
    w = _tensors(res.path / "hf_ckpt" / "model.safetensors")
    key = "model.layers.3.mlp.down_proj"
    packed, scale = w[f"{key}.weight"], w[f"{key}.weight_scale"]
    assert packed.dtype == torch.uint8 and packed.shape == (576 // 2, 1536) and scale.shape == (576, 1536 // 64)
    assert f"{key}.pre_quant_scale" in w
    q = res.manifest["quality"]
    assert 0.3 < q["top1_agreement"] <= 1.0 and q["kl_mean_nats"] > 0 and q["ppl_quantized"] < 1000


def test_calibration_shows_progress_when_piped(capfd) -> None:
    """#44: piped, the stage's rich bar draws nothing and quantize was silent for minutes: a line per tenth."""
    from pipeline.quantize import ptq

    class Body(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.w = torch.nn.Parameter(torch.ones(1))
            self.seen: list[int] = []

        def forward(self, input_ids: torch.Tensor, use_cache: bool) -> None:
            self.seen.append(int(input_ids[0, 0]))

    model = Body()
    ptq.forward_loop(model, [{"input_ids": torch.tensor([[i]])} for i in range(20)])
    assert model.seen == list(range(20))  # every batch forwarded once, in order
    lines = [ln for ln in capfd.readouterr().err.splitlines() if ln.startswith("quantize: calibrate")]
    assert [ln.split()[2] for ln in lines] == [f"{i}/20" for i in range(2, 21, 2)], lines


def test_evaluate_without_quantizers_forwards_each_batch_once() -> None:
    """``full_prec`` has no enabled quantizer, so the "unquantized" and "quantized" models are one model: one forward
    per evaluation batch (two with quantizers), KL exactly 0, agreement 1, both perplexities equal."""
    from types import SimpleNamespace

    class Lm(torch.nn.Module):  # a real (tiny, seeded) torch language model: embedding → logits
        def __init__(self) -> None:
            super().__init__()
            torch.manual_seed(0)
            self.emb = torch.nn.Embedding(16, 16)
            self.calls = 0

        def forward(self, input_ids: torch.Tensor, attention_mask: torch.Tensor, use_cache: bool) -> SimpleNamespace:
            self.calls += 1
            return SimpleNamespace(logits=self.emb(input_ids))

    model = Lm()
    batches = [{"input_ids": torch.tensor([[1, 5, 7, 2]]), "attention_mask": torch.ones(1, 4, dtype=torch.long)}] * 3
    q = ptq.evaluate(model, batches)
    assert model.calls == 3 and q["tokens"] == 9
    assert q["kl_mean_nats"] == 0.0 and q["top1_agreement"] == 1.0 and q["ppl_quantized"] == q["ppl_unquantized"] > 1


def test_full_prec_still_exports_both_checkpoints(tmp_path: Path, original, quant_one_thread, capfd) -> None:
    recipe = load_recipe(RECIPES / "smollm2_135m_cpu_fp8.yaml", [
        "quantization.qformat=full_prec", "quantization.kv_cache_dtype=none", "quantization.calibration.size=1", "quantization.calibration.batch_size=1",
        "quantization.calibration.max_seq_length=32", "quantization.calibration.eval_samples=2"])
    res = quantize.run(recipe, BuildLayout(tmp_path), recipe_dir=RECIPES)
    m = res.manifest
    assert m["exported"] == {"quant_algo": None, "kv_cache_quant_algo": None}
    assert m["quantizers"]["enabled_total"] == 0 and m["timings_s"]["calibrate"] < 1.0
    assert m["quality"]["kl_mean_nats"] == 0.0 and m["quality"]["top1_agreement"] == 1.0
    err = capfd.readouterr().err  # a line per phase on stderr, piped as here
    assert all(f"quantize: {p}" in err for p in ("load embedded:", "evaluate", "export")), err
    w = _tensors(res.path / "hf_ckpt" / "model.safetensors")
    key = "model.layers.3.mlp.down_proj.weight"
    assert w[key].dtype == torch.float32 and torch.equal(w[key], original[key])
    trt = _tensors(res.path / "trtllm_ckpt" / "rank0.safetensors")
    assert trt["transformer.layers.3.mlp.proj.weight"].dtype == torch.float16  # ModelOpt: fp32 → fp16 for TRT-LLM
