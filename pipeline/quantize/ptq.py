"""ModelOpt post-training quantization on a loaded model: config, calibration loop, quality, summary.

Only this module and :mod:`pipeline.quantize.stage` import ``modelopt``. The qformat → ModelOpt config
names are those of TensorRT-LLM ``examples/quantization/quantize.py`` and ModelOpt ``hf_ptq.py``
(docs/reference/quantization.md §2).
"""

from __future__ import annotations

import copy
import math
import sys
import time
from typing import Any

from pipeline.recipe.quant import BLOCK_QFORMATS, QuantSpec

#: qformat → ModelOpt config constant name (TensorRT-LLM quantize.py / ModelOpt hf_ptq.py).
QFORMAT_CFG = {
    "fp8": "FP8_DEFAULT_CFG", "int8_sq": "INT8_SMOOTHQUANT_CFG", "int4_awq": "INT4_AWQ_CFG",
    "w4a8_awq": "W4A8_AWQ_BETA_CFG", "int8_wo": "INT8_WEIGHT_ONLY_CFG", "int4_wo": "INT4_BLOCKWISE_WEIGHT_ONLY_CFG",
    "nvfp4": "NVFP4_DEFAULT_CFG", "full_prec": None,
}
#: INT8 KV cache: the FP8_KV_CFG entry with num_bits 8 (what TensorRT-LLM quantize.py uses for int8).
INT8_KV_QUANT_CFG = [{"quantizer_name": "*[kv]_bmm_quantizer", "cfg": {"num_bits": 8, "axis": None}}]
#: sequences per evaluation forward (bounds the [B, T, vocab] logits in memory)
EVAL_BATCH = 4


def quant_config(quant: QuantSpec) -> dict[str, Any] | None:
    """The ModelOpt config for a recipe's ``quantization`` section, or ``None`` for full_prec without KV quantization.

    A deep copy of the qformat's ModelOpt constant (never mutated) with the AWQ / int4 block size set to
    ``awq_block_size`` and KV-cache quantization added. Works with both ModelOpt lines trtpipe runs on:

    * 0.47 (what trtpipe develops against): ``quant_cfg`` is a list of ``{quantizer_name, cfg | enable}``
      entries and ``update_quant_cfg_with_kv_cache_quant`` exists;
    * 0.37 (what TensorRT-LLM 1.2.1 pins, the Triton 26.04 container): ``quant_cfg`` is a dict keyed by
      quantizer wildcard, and KV entries are merged into it directly (nvidia-modelopt 0.37.0
      ``torch/quantization/config.py``; ``INT8_WEIGHT_ONLY_CFG`` does not exist there).

    Raises:
        UserError: the qformat has no config in the installed ModelOpt (e.g. ``int8_wo`` on 0.37).
    """
    import modelopt.torch.quantization as mtq

    from pipeline.core.errors import UserError

    name = QFORMAT_CFG[quant.qformat]
    if name is None and quant.kv_cache_dtype == "none":
        return None
    if name is not None and not hasattr(mtq, name):
        raise UserError(f"quantization.qformat: {quant.qformat!r} needs ModelOpt's {name}, which this nvidia-modelopt lacks")
    if name:
        cfg = copy.deepcopy(getattr(mtq, name))
    else:  # full_prec + a quantized KV cache: every other quantizer off
        off = {"enable": False}
        cfg = {"quant_cfg": [{"quantizer_name": "*", **off}] if _list_format() else {"*": off}, "algorithm": "max"}
    if quant.qformat in BLOCK_QFORMATS:  # int4_wo: 128 in quantize.py; here the recipe's
        for sub in _weight_quantizer_cfgs(cfg["quant_cfg"]):
            if isinstance(sub.get("block_sizes"), dict) and -1 in sub["block_sizes"]:
                sub["block_sizes"][-1] = quant.awq_block_size
    if quant.kv_cache_dtype != "none":
        if _list_format():
            kv = copy.deepcopy(mtq.FP8_KV_CFG["quant_cfg"] if quant.kv_cache_dtype == "fp8" else INT8_KV_QUANT_CFG)
            cfg = mtq.update_quant_cfg_with_kv_cache_quant(cfg, kv)
        else:  # 0.37: merge the K/V bmm quantizer entries only (FP8_KV_CFG's "default" would switch the rest off)
            kv = {k: dict(v) for k, v in mtq.FP8_KV_CFG["quant_cfg"].items() if k != "default"}
            if quant.kv_cache_dtype == "int8":
                kv = {k: {**v, "num_bits": 8} for k, v in kv.items()}
            cfg["quant_cfg"] = {**cfg["quant_cfg"], **copy.deepcopy(kv)}
    return cfg


def _list_format() -> bool:
    """True when the installed ModelOpt writes ``quant_cfg`` as a list of entries (0.47), False for a dict (0.37)."""
    import modelopt.torch.quantization as mtq

    return isinstance(mtq.FP8_DEFAULT_CFG["quant_cfg"], list)


def _weight_quantizer_cfgs(quant_cfg: Any) -> list[dict[str, Any]]:
    """The ``*weight_quantizer`` attribute dicts of a ``quant_cfg`` (list or dict form; W4A8 nests a list)."""
    if isinstance(quant_cfg, list):
        entries = [e.get("cfg") for e in quant_cfg if e.get("quantizer_name") == "*weight_quantizer"]
    else:
        entries = [quant_cfg.get("*weight_quantizer")]
    out: list[dict[str, Any]] = []
    for e in entries:
        if isinstance(e, list):
            out += [x for x in e if isinstance(x, dict)]
        elif isinstance(e, dict):
            out.append(e)
    return out


def phase(message: str) -> None:
    """One progress line on stderr, ``quantize: <message>``, on a terminal and piped alike (the stage takes minutes
    on CPU: load, calibrate, evaluate, export each get a line)."""
    print(f"quantize: {message}", file=sys.stderr, flush=True)


def forward_loop(model: Any, batches: list[dict[str, Any]]) -> None:
    """ModelOpt's calibration loop: one no-grad forward of the decoder (lm_head is never
    quantized, so it is skipped) per batch, with a rich progress bar on a terminal's stderr; piped (CI, ``| tee``),
    where rich draws nothing, a :func:`phase` line every tenth of the batches (``calibrate i/n batches (s)``)."""
    import torch
    from rich.console import Console
    from rich.progress import (
        BarColumn,
        MofNCompleteColumn,
        Progress,
        TextColumn,
        TimeElapsedColumn,
    )

    body = model.get_decoder() if hasattr(model, "get_decoder") else model
    device = next(model.parameters()).device
    cols = (TextColumn("calibrate"), BarColumn(), MofNCompleteColumn(), TimeElapsedColumn())
    if not sys.stderr.isatty():
        t0, every = time.monotonic(), max(1, len(batches) // 10)
        with torch.no_grad():
            for i, batch in enumerate(batches, 1):
                body(**{k: v.to(device) for k, v in batch.items()}, use_cache=False)
                if i % every == 0 or i == len(batches):
                    phase(f"calibrate {i}/{len(batches)} batches ({time.monotonic() - t0:.0f} s)")
        return
    with torch.no_grad(), Progress(*cols, console=Console(stderr=True), transient=True) as bar:
        for batch in bar.track(batches):
            body(**{k: v.to(device) for k, v in batch.items()}, use_cache=False)



def evaluate(model: Any, batches: list[dict[str, Any]]) -> dict[str, Any]:
    """Quality of the fake-quant model against itself with every quantizer disabled (= unquantized:
    SmoothQuant/AWQ pre_quant_scale is applied even by a disabled quantizer, so the product is exact).

    Over next-token predictions at unmasked positions of ``batches``: perplexity (exp of mean NLL)
    of both, mean KL(unquant ‖ quant) in nats per token, and top-1 agreement (share of positions
    where both argmax tokens agree, in [0, 1]). On CPU, NVFP4/MXFP8 fake quant fails (needs CUDA):
    the report then holds ``error``. With no enabled quantizer (``full_prec`` without a quantized KV cache) both
    models are the same one: one forward per batch, KL 0 and agreement 1 by construction (half the time).
    """
    import torch
    import torch.nn.functional as F
    from modelopt.torch.quantization.nn import TensorQuantizer

    enabled = [m for m in model.modules() if isinstance(m, TensorQuantizer) and m.is_enabled]
    device = next(model.parameters()).device
    nll_ref = nll_q = kl = agree = 0.0
    n = 0
    try:
        with torch.no_grad():
            for batch in batches:
                batch = {k: v.to(device) for k, v in batch.items()}
                mask = (batch["attention_mask"][:, 1:] * batch["attention_mask"][:, :-1]).bool()
                target = batch["input_ids"][:, 1:][mask]
                for qz in enabled:
                    qz.disable()
                try:
                    ref = F.log_softmax(model(**batch, use_cache=False).logits[:, :-1][mask].float(), -1)
                finally:
                    for qz in enabled:
                        qz.enable()
                quant = F.log_softmax(model(**batch, use_cache=False).logits[:, :-1][mask].float(), -1) if enabled else ref
                nll_ref -= ref.gather(1, target[:, None]).sum().item()
                nll_q -= quant.gather(1, target[:, None]).sum().item()
                kl += F.kl_div(quant, ref, log_target=True, reduction="sum").item()
                agree += (ref.argmax(-1) == quant.argmax(-1)).sum().item()
                n += int(target.numel())
    except (RuntimeError, AssertionError) as e:
        return {"error": f"{type(e).__name__}: {str(e).splitlines()[0]}", "tokens": n}
    if n == 0:
        return {"error": "no evaluation tokens", "tokens": 0}
    return {
        "tokens": n, "sequences": sum(int(b["input_ids"].shape[0]) for b in batches),
        "ppl_unquantized": math.exp(nll_ref / n), "ppl_quantized": math.exp(nll_q / n),
        "kl_mean_nats": kl / n, "top1_agreement": agree / n,
    }



def quantizer_summary(model: Any) -> dict[str, Any]:
    """Counts of enabled ModelOpt quantizers by kind (``weight``, ``input``, ``output``, ``k_bmm``,
    ``v_bmm``, …), the number disabled, and a few example module names."""
    from modelopt.torch.quantization.nn import TensorQuantizer

    counts: dict[str, int] = {}
    disabled = 0
    examples: list[str] = []
    for name, m in model.named_modules():
        if not isinstance(m, TensorQuantizer):
            continue
        if not m.is_enabled:
            disabled += 1
            continue
        kind = name.rsplit(".", 1)[-1].removesuffix("_quantizer")
        counts[kind] = counts.get(kind, 0) + 1
        if len(examples) < 4:
            examples.append(f"{name}: {m}")
    return {"enabled": dict(sorted(counts.items())), "enabled_total": sum(counts.values()), "disabled": disabled,
            "examples": examples}



def disable_quantizers(model: Any, suffixes: tuple[str, ...]) -> None:
    """Disable the ModelOpt quantizers whose module name ends with one of ``suffixes`` and drop their amax."""
    from modelopt.torch.quantization.nn import TensorQuantizer

    for name, m in model.named_modules():
        if isinstance(m, TensorQuantizer) and name.endswith(suffixes):
            m.disable()
            m.reset_amax()  # the export keys on the amax buffer, enabled or not
