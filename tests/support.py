"""Test support (not shipped): free ports, and a small real ModelOpt export of SmolLM2 for the CPU-engine tests.

:func:`quantized_stage` builds, once and cached under a caller-given directory (the tests use the
repo-local ``.trtpipe-cache/``), a quantize-stage-shaped directory when the quantize stage is not the
thing under test: ``mtq.quantize`` with the stage's own config (:func:`pipeline.quantize.ptq.quant_config`; a short
calibration on CPython's ``pydoc_data`` prose) + ``export_hf_checkpoint`` into ``<dir>/hf_ckpt/``, with
``manifest.json``, plus ``reference.safetensors``: ModelOpt's own fake-quant *effective* weights
(``weight_quantizer(weight)``, times the input ``pre_quant_scale`` when there is one), taken after
ModelOpt's export pre-processing (q/k/v resmoothing, pre-quant-scale fusion into layernorms) and before
the in-place packing, to check :mod:`pipeline.cpu_runtime.dequant` (docs/reference/cpu-stack.md §3–§4).
"""

from __future__ import annotations

import shutil
import socket
from pathlib import Path

from pipeline.core.artifacts import (
    atomic_dir,
    base_manifest,
    stable_hash,
    write_manifest,
)
from pipeline.core.lock import exclusive
from pipeline.quantize.result import QuantizeResult

_FIXTURE_VERSION = 2
#: the prompts and generation of the real eval gates on the CPU default (tests/test_eval.py, tests/test_eval_kld.py):
#: one set, so the eval output cache (keyed on weights, prompts and generation parameters) serves the second file
EVAL_PROMPTS = dict(n=4, max_output_tokens=16, max_input_tokens=96, concurrency=4)


def free_port(host: str = "127.0.0.1") -> int:
    """A TCP port that is free on ``host`` right now (the OS picks it)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind((host, 0))
        return s.getsockname()[1]


def free_ports(n: int, host: str = "127.0.0.1") -> list[int]:
    """``n`` distinct TCP ports free on ``host`` right now (all held open together while the OS picks them)."""
    socks = [socket.socket(socket.AF_INET, socket.SOCK_STREAM) for _ in range(n)]
    try:
        for s in socks:
            s.bind((host, 0))
        return [s.getsockname()[1] for s in socks]
    finally:
        for s in socks:
            s.close()


def smollm2_hf_dir() -> Path:
    """SmolLM2-135M-Instruct as a plain fp32 HF checkpoint (the source stage's embedded conversion)."""
    from pipeline.quantize.sources import embedded_smollm2_dir

    return embedded_smollm2_dir()


def _calibration_batches(tokenizer, n: int, seq_len: int) -> list:
    """``n`` token-id tensors of shape [1, seq_len] from CPython's ``pydoc_data.topics`` prose (PSF)."""
    from pydoc_data.topics import topics

    text = "\n\n".join(topics[k] for k in sorted(topics))
    ids = tokenizer(text, return_tensors="pt").input_ids[0]
    return [ids[i * seq_len : (i + 1) * seq_len].unsqueeze(0) for i in range(n)]


def save_fakequant_reference(model, path: Path) -> None:
    """Write ModelOpt's fake-quant *effective* weight of every enabled weight quantizer of ``model`` to ``path``
    (``<module>.weight`` → ``weight_quantizer(weight)``, times the input ``pre_quant_scale`` when there is one), after
    the export's own pre-processing (:func:`requantize_resmooth_fused_llm_layers`, idempotent) and before
    ``export_hf_checkpoint`` packs the weights in place."""
    import torch
    from modelopt.torch.export.unified_export_hf import (
        requantize_resmooth_fused_llm_layers,
    )
    from safetensors.torch import save_file

    with torch.no_grad():
        requantize_resmooth_fused_llm_layers(model)  # what the export does first (idempotent)
        ref = {}
        for name, mod in model.named_modules():
            wq = getattr(mod, "weight_quantizer", None)
            if wq is None or not getattr(wq, "is_enabled", False):
                continue
            w = wq(mod.weight).float()
            pqs = getattr(getattr(mod, "input_quantizer", None), "pre_quant_scale", None)
            if pqs is not None:
                w = w * pqs.float().reshape(1, -1)
            ref[f"{name}.weight"] = w.contiguous()
    save_file(ref, str(path))


def quantized_stage(
    cache_root: Path,
    qformat: str = "fp8",
    *,
    kv_cache_dtype: str = "fp8",
    awq_block_size: int = 64,
    calib_size: int = 8,
    calib_seq_len: int = 128,
) -> QuantizeResult:
    """A quantize-stage result at ``cache_root/quantize-<qformat>-kv<kv>`` (see the module docstring).

    ``qformat`` is a recipe qformat (``full_prec`` included). FP8 calibration on 8 × 128 tokens takes
    ~10–30 s on 2 cores; INT4 AWQ several minutes. Raises ``pydantic.ValidationError`` for an unknown qformat.
    """
    out = Path(cache_root) / f"quantize-{qformat}-kv{kv_cache_dtype}"
    key = stable_hash(
        {"q": qformat, "kv": kv_cache_dtype, "bs": awq_block_size, "n": calib_size, "l": calib_seq_len, "v": _FIXTURE_VERSION}
    )
    with exclusive(out.parent / f".{out.name}.lock"):  # two xdist workers: one calibrates, the other reads it
        hit = QuantizeResult.load(out, key)
        return hit or _quantize_fixture(out, key, qformat, kv_cache_dtype, awq_block_size, calib_size, calib_seq_len)


def _quantize_fixture(out: Path, key: str, qformat: str, kv_cache_dtype: str, awq_block_size: int, calib_size: int,
                      calib_seq_len: int) -> QuantizeResult:
    """:func:`quantized_stage`'s calibration and export into ``out`` (its lock held)."""
    from pipeline.recipe.quant import QuantSpec

    spec = QuantSpec(qformat=qformat, kv_cache_dtype=kv_cache_dtype, awq_block_size=awq_block_size)
    src = smollm2_hf_dir()

    import modelopt.torch.quantization as mtq
    import torch
    from modelopt.torch.export import export_hf_checkpoint
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from pipeline.quantize.ptq import quant_config

    tok = AutoTokenizer.from_pretrained(src)
    model = AutoModelForCausalLM.from_pretrained(src, dtype=torch.float32).eval()
    with atomic_dir(out) as tmp:
        cfg = quant_config(spec)
        if cfg is not None:
            batches = _calibration_batches(tok, calib_size, calib_seq_len)

            def forward_loop(m):
                for b in batches:
                    m(b)

            with torch.no_grad():
                model = mtq.quantize(model, cfg, forward_loop)
            save_fakequant_reference(model, tmp / "reference.safetensors")
        with torch.no_grad():
            export_hf_checkpoint(model, export_dir=tmp / "hf_ckpt")
        tok.save_pretrained(tmp / "hf_ckpt")
        for extra in ("generation_config.json",):
            if (src / extra).exists() and not (tmp / "hf_ckpt" / extra).exists():
                shutil.copy2(src / extra, tmp / "hf_ckpt" / extra)
        write_manifest(tmp, base_manifest(QuantizeResult.STAGE, key, status="built", qformat=qformat,
                                          kv_cache_dtype=kv_cache_dtype, fixture=True))
    hit = QuantizeResult.load(out, key)
    assert hit is not None
    return hit


#: the shipped recipes (recipes/*.yaml)
RECIPES = Path(__file__).resolve().parents[1] / "recipes"


def shipped_recipe(name: str, overrides: list[str] | tuple[str, ...] = ()):
    """``recipes/<name>.yaml`` loaded and validated with ``--set``-style ``overrides`` (the planner tests' preamble:
    tests/test_plan_kv_runtime.py, tests/test_plan_speculative.py)."""
    from pipeline.recipe import load_recipe

    return load_recipe(RECIPES / f"{name}.yaml", list(overrides))


def cpu_engine_fixtures() -> Path:
    """Where the CPU-engine tests keep their cached quantize and engine stages: ``$TRTPIPE_CACHE_DIR/cpu-engine-fixtures``
    (tests/conftest.py points TRTPIPE_CACHE_DIR at the repo-local ``.trtpipe-cache/``)."""
    import os

    return Path(os.environ.get("TRTPIPE_CACHE_DIR", Path(__file__).resolve().parents[1] / ".trtpipe-cache")) / "cpu-engine-fixtures"


#: the CPU tests' shared engine (tests/conftest.py ``engine_dir``): batch 8, 1,024-token sequences, 16,384 KV tokens
CPU_BS8 = ("build.max_batch_size=8", "build.max_seq_len=1024", "build.kv_cache_config.max_tokens=16384")


def cpu_fp8_build(name: str, overrides: list[str] | tuple[str, ...] = ()) -> Path:
    """The engine directory of ``recipes/smollm2_135m_cpu_fp8.yaml`` with ``overrides``, built by the real ``cpu`` engine
    stage on the cached FP8 quantize stage (:func:`quantized_stage`) into ``cpu_engine_fixtures()/name`` — once: the
    stage reuses a build whose content key matches."""
    from pipeline.core.layout import BuildLayout
    from pipeline.engine import cpu as cpu_stage

    root = cpu_engine_fixtures()
    q = quantized_stage(root, "fp8", kv_cache_dtype="fp8")
    with exclusive(root / f".{name}.lock"):  # two xdist workers: one builds, the other reuses it by its key
        return cpu_stage.run(shipped_recipe("smollm2_135m_cpu_fp8", overrides), BuildLayout(root / name), quantized=q).path
