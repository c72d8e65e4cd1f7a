"""Quantize stage: ModelOpt 0.47 post-training quantization and both checkpoint exports.

``run(recipe, out_dir, *, recipe_dir)`` loads the source checkpoint (:mod:`pipeline.sources`),
calibrates with ``mtq.quantize(model, cfg, forward_loop)`` on text from :mod:`calib`, measures
quality on held-out text with the fake-quant forward, casts the whole model to the export dtype
and writes, atomically::

    out_dir/trtllm_ckpt/   config.json + rank{N}.safetensors   (export_tensorrt_llm_checkpoint)
    out_dir/hf_ckpt/       unified HF checkpoint + tokenizer + chat template (export_hf_checkpoint)
    out_dir/manifest.json  cache key, hashes, versions, quantizers, timings, peak RSS, quality

The TensorRT-LLM checkpoint is exported first because ``export_hf_checkpoint`` packs weights
in place (reference cpu-stack.md §3). ModelOpt 0.47 facts the manifest records: the TensorRT-LLM
export writes float16 when asked for float32 (``trtllm_dtype``); the unified HF export cannot
carry an INT8 KV cache, so with ``kv_cache_dtype: int8`` hf_ckpt has no KV scales
(``hf_ckpt_kv_cache_quant_algo: null``); ``int4_wo`` exports as ``W4A16_AWQ`` (``exported``). With ``dry_run`` no model is loaded: the equivalent
TensorRT-LLM ``examples/quantization/quantize.py`` command is written to
``out_dir/quantize_command.sh`` (flags: reference quantization.md §2.1).
"""

from __future__ import annotations

import contextlib
import copy
import json
import math
import os
import shlex
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from pipeline import artifacts
from pipeline.artifacts import StageResult
from pipeline.errors import StageError, UserError
from pipeline.recipe import Recipe

STAGE = "quantize"
#: Bump when the stage's output for the same inputs changes (invalidates cached results).
STAGE_VERSION = 1
#: qformat → ModelOpt 0.47 config constant name (TensorRT-LLM quantize.py / ModelOpt hf_ptq.py).
QFORMAT_CFG = {
    "fp8": "FP8_DEFAULT_CFG", "int8_sq": "INT8_SMOOTHQUANT_CFG", "int4_awq": "INT4_AWQ_CFG",
    "w4a8_awq": "W4A8_AWQ_BETA_CFG", "int8_wo": "INT8_WEIGHT_ONLY_CFG", "int4_wo": "INT4_BLOCKWISE_WEIGHT_ONLY_CFG",
    "nvfp4": "NVFP4_DEFAULT_CFG", "full_prec": None,
}
#: INT8 KV cache: the FP8_KV_CFG entry with num_bits 8 (what TensorRT-LLM quantize.py uses for int8).
INT8_KV_QUANT_CFG = [{"quantizer_name": "*[kv]_bmm_quantizer", "cfg": {"num_bits": 8, "axis": None}}]
EVAL_BATCH = 4  # sequences per evaluation forward (bounds the [B, T, vocab] logits in memory)
VERSIONED = ("nvidia-modelopt", "torch", "transformers")


def cache_key(recipe: Recipe, *, source_hash: str | None, dataset_hash: str | None, dry_run: bool) -> str:
    """Hash of everything the output depends on: the model/target/quantization sections, the
    source and calibration-text hashes, library versions and ``dry_run``."""
    return artifacts.stable_hash({
        "stage_version": STAGE_VERSION, "recipe": recipe_hash(recipe), "source": source_hash,
        "dataset": dataset_hash, "versions": artifacts.library_versions(*VERSIONED), "dry_run": dry_run,
    })


def recipe_hash(recipe: Recipe) -> str:
    """Hash of the recipe's ``model``, ``target`` and ``quantization`` sections (JSON form)."""
    return artifacts.stable_hash(recipe.model_dump(mode="json", include={"model", "target", "quantization"}))


def run(recipe: Recipe, out_dir: Path, *, recipe_dir: Path, force: bool = False, dry_run: bool = False) -> StageResult:
    """Quantize ``recipe.model`` with ModelOpt and export both checkpoints into ``out_dir``.

    Args:
        recipe: validated recipe (model, target, quantization sections are used).
        out_dir: stage directory (replaced atomically; nothing is left behind on failure).
        recipe_dir: directory of the recipe file (relative model/dataset paths).
        force: recompute even when ``out_dir`` holds a result with the same cache key.
        dry_run: load nothing; write ``quantize_command.sh`` and the manifest only.

    Returns:
        :class:`StageResult` (``cached=True`` when reused).

    Raises:
        UserError: source or calibration data unavailable (see :mod:`pipeline.sources`, :mod:`calib`).
        StageError: ModelOpt calibration or export failed.
    """
    out_dir = Path(out_dir)
    _remove_stale_tmp(out_dir)
    if dry_run:
        key = cache_key(recipe, source_hash=None, dataset_hash=None, dry_run=True)
        if not force and (hit := artifacts.cached_result(STAGE, out_dir, key)):
            return hit
        return _dry_run(recipe, out_dir, key, recipe_dir)
    from pipeline.quiet import quiet_libraries
    from pipeline.sources import resolve_source

    with quiet_libraries():
        source = resolve_source(recipe.model, Path(recipe_dir))
    key = cache_key(recipe, source_hash=source.content_hash, dataset_hash=_dataset_hash(recipe, recipe_dir), dry_run=False)
    if not force and (hit := artifacts.cached_result(STAGE, out_dir, key)):
        return hit
    with _threads(), artifacts.atomic_dir(out_dir) as tmp:
        with quiet_libraries() as library_log:
            manifest = _quantize(recipe, tmp, key, source, Path(recipe_dir))
        manifest["library_log"] = library_log
        manifest["paths"] = {"trtllm_ckpt": str(out_dir / "trtllm_ckpt"), "hf_ckpt": str(out_dir / "hf_ckpt")}
        artifacts.write_manifest(tmp, manifest)
    return StageResult(STAGE, out_dir, manifest, cached=False)


# --------------------------------------------------------------------------------- the real run
def _quantize(recipe: Recipe, tmp: Path, key: str, source: Any, recipe_dir: Path) -> dict[str, Any]:
    t0 = time.perf_counter()
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    import calib

    q = recipe.quantization
    device = "cuda" if torch.cuda.is_available() else "cpu"
    export_dtype = _export_dtype(recipe, source.hf_dir)
    calib_dtype = torch.float32 if device == "cpu" else export_dtype  # fp32 is ~2× faster on CPU (cpu-stack §3)
    timings: dict[str, float] = {}
    tok = AutoTokenizer.from_pretrained(source.hf_dir, local_files_only=True, trust_remote_code=recipe.model.trust_remote_code)
    data = calib.prepare(q.calibration, tok, recipe_dir)
    if len(data.calib) < data.requested:
        _warn(f"{data.source.name}: {len(data.calib)} calibration samples of {data.max_seq_length} tokens "
              f"available, {data.requested} requested")
    model = AutoModelForCausalLM.from_pretrained(
        source.hf_dir, dtype=calib_dtype, local_files_only=True, trust_remote_code=recipe.model.trust_remote_code,
        **({"device_map": "auto"} if device == "cuda" else {}),
    ).eval()
    import modelopt.torch.quantization as mtq  # ~8 s of imports: counted in "load"

    timings["load"] = time.perf_counter() - t0
    t = time.perf_counter()
    cfg = quant_config(recipe)
    if cfg is not None:
        batches = data.calib_batches(tok)
        try:
            model = mtq.quantize(model, cfg, lambda m: _forward_loop(m, batches))
        except Exception as e:
            raise StageError(f"ModelOpt calibration ({q.qformat}) failed: {type(e).__name__}: {e}") from e
    timings["calibrate"] = time.perf_counter() - t

    t = time.perf_counter()
    quality = evaluate(model, data.eval_batches(tok, EVAL_BATCH))
    timings["evaluate"] = time.perf_counter() - t

    model.to(export_dtype)  # cast the WHOLE model (weights, norms, amax buffers) before export
    quantizers = quantizer_summary(model)
    trt_dir, hf_dir = tmp / "trtllm_ckpt", tmp / "hf_ckpt"
    t = time.perf_counter()
    with _export_errors("TensorRT-LLM checkpoint"):
        from modelopt.torch.export import export_tensorrt_llm_checkpoint
        from modelopt.torch.export.model_utils import get_model_type

        decoder = get_model_type(model)
        if decoder is None:
            raise StageError(f"ModelOpt 0.47 has no TensorRT-LLM decoder type for {type(model).__name__}")
        export_tensorrt_llm_checkpoint(model, decoder, dtype=export_dtype, export_dir=trt_dir,
                                       inference_tensor_parallel=recipe.target.tp_size,
                                       inference_pipeline_parallel=recipe.target.pp_size)
    timings["export_trtllm"] = time.perf_counter() - t
    t = time.perf_counter()
    hf_kv = q.kv_cache_quant_algo
    if q.kv_cache_dtype == "int8":  # ModelOpt 0.47's unified HF export knows FP8/NVFP4 KV only
        _disable(model, ("k_bmm_quantizer", "v_bmm_quantizer"))
        hf_kv = None
    with _export_errors("unified HF checkpoint"):
        from modelopt.torch.export import export_hf_checkpoint

        export_hf_checkpoint(model, dtype=export_dtype, export_dir=hf_dir)  # packs weights in place: last
        tok.save_pretrained(hf_dir)  # tokenizer files + chat_template.jinja
    timings["export_hf"] = time.perf_counter() - t
    timings["total"] = time.perf_counter() - t0

    trt_quant = json.loads((trt_dir / "config.json").read_text()).get("quantization") or {}
    trt_dtype = json.loads((trt_dir / "config.json").read_text()).get("dtype")
    exported = {"quant_algo": trt_quant.get("quant_algo"), "kv_cache_quant_algo": trt_quant.get("kv_cache_quant_algo")}
    expected = {"quant_algo": q.quant_algo, "kv_cache_quant_algo": q.kv_cache_quant_algo}
    if exported != expected:  # the export is the truth downstream stages must read (e.g. int4_wo → W4A16_AWQ)
        _warn(f"ModelOpt exported {exported}; the recipe's table says {expected}")
    return artifacts.base_manifest(
        STAGE, key, dry_run=False, recipe_hash=recipe_hash(recipe), source=source.to_manifest(),
        calibration=data.summary(), versions=artifacts.library_versions(*VERSIONED),
        qformat=q.qformat, kv_cache_dtype=q.kv_cache_dtype, modelopt_config=QFORMAT_CFG[q.qformat],
        device=device, calib_dtype=str(calib_dtype).removeprefix("torch."), export_dtype=str(export_dtype).removeprefix("torch."),
        torch_threads=torch.get_num_threads(), decoder_type=decoder, exported=exported, trtllm_quantization=trt_quant,
        recipe_quant_algo=expected,
        # ModelOpt writes fp16 for an fp32 TensorRT-LLM export; the HF export keeps export_dtype
        trtllm_dtype=trt_dtype, hf_ckpt_kv_cache_quant_algo=hf_kv,
        quantizers=quantizers, quality=quality, timings_s={k: round(v, 3) for k, v in timings.items()},
        peak_rss_bytes=artifacts.peak_rss_bytes(), outputs={
            "trtllm_ckpt": artifacts.file_hashes(trt_dir), "hf_ckpt": artifacts.file_hashes(hf_dir)},
    )


def quant_config(recipe: Recipe) -> dict[str, Any] | None:
    """The ModelOpt config for the recipe: a deep copy of the qformat's constant (never mutated),
    block size of int4_awq/w4a8_awq/int4_wo set to ``awq_block_size``, KV-cache quantization added. ``None`` for full_prec
    without KV quantization. In ModelOpt 0.47 ``cfg["quant_cfg"]`` is a list of entries."""
    import modelopt.torch.quantization as mtq

    q = recipe.quantization
    name = QFORMAT_CFG[q.qformat]
    if name is None and q.kv_cache_dtype == "none":
        return None
    cfg = copy.deepcopy(getattr(mtq, name)) if name else {"quant_cfg": [{"quantizer_name": "*", "enable": False}], "algorithm": "max"}
    if q.qformat in ("int4_awq", "w4a8_awq", "int4_wo"):  # int4_wo: 128 in quantize.py; here the recipe's
        for entry in cfg["quant_cfg"]:
            if entry.get("quantizer_name") == "*weight_quantizer":
                for sub in entry["cfg"] if isinstance(entry["cfg"], list) else [entry["cfg"]]:
                    if isinstance(sub.get("block_sizes"), dict) and -1 in sub["block_sizes"]:
                        sub["block_sizes"][-1] = q.awq_block_size
    if q.kv_cache_dtype != "none":
        kv = copy.deepcopy(mtq.FP8_KV_CFG["quant_cfg"] if q.kv_cache_dtype == "fp8" else INT8_KV_QUANT_CFG)
        cfg = mtq.update_quant_cfg_with_kv_cache_quant(cfg, kv)
    return cfg


def _forward_loop(model: Any, batches: list[dict[str, Any]]) -> None:
    """ModelOpt's calibration loop: one no-grad forward of the decoder (lm_head is never
    quantized, so it is skipped) per batch, with a rich progress bar on stderr."""
    import torch
    from rich.console import Console
    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

    body = model.get_decoder() if hasattr(model, "get_decoder") else model
    device = next(model.parameters()).device
    cols = (TextColumn("calibrate"), BarColumn(), MofNCompleteColumn(), TimeElapsedColumn())
    with torch.no_grad(), Progress(*cols, console=Console(stderr=True), transient=True) as bar:
        for batch in bar.track(batches):
            body(**{k: v.to(device) for k, v in batch.items()}, use_cache=False)


def evaluate(model: Any, batches: list[dict[str, Any]]) -> dict[str, Any]:
    """Quality of the fake-quant model against itself with every quantizer disabled (= unquantized:
    SmoothQuant/AWQ pre_quant_scale is applied even by a disabled quantizer, so the product is exact).

    Over next-token predictions at unmasked positions of ``batches``: perplexity (exp of mean NLL)
    of both, mean KL(unquant ‖ quant) in nats per token, and top-1 agreement (share of positions
    where both argmax tokens agree, in [0, 1]). On CPU, NVFP4/MXFP8 fake quant fails (needs CUDA):
    the report then holds ``error``.
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
                quant = F.log_softmax(model(**batch, use_cache=False).logits[:, :-1][mask].float(), -1)
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


# --------------------------------------------------------------------------------- helpers
def _warn(msg: str) -> None:
    from rich.console import Console

    Console(stderr=True).print(f"[yellow]warning:[/] {msg}", highlight=False)


def _disable(model: Any, suffixes: tuple[str, ...]) -> None:
    """Disable the ModelOpt quantizers whose module name ends with one of ``suffixes`` and drop their amax."""
    from modelopt.torch.quantization.nn import TensorQuantizer

    for name, m in model.named_modules():
        if isinstance(m, TensorQuantizer) and name.endswith(suffixes):
            m.disable()
            m.reset_amax()  # the export keys on the amax buffer, enabled or not


def _export_dtype(recipe: Recipe, hf_dir: Path) -> Any:
    """recipe.model.dtype; ``auto`` → the checkpoint's dtype, except that fp32 sources become
    float16 on GPU targets (TensorRT-LLM quantize.py behaviour) and stay float32 on ``cpu``."""
    import torch

    name = recipe.model.dtype
    if name == "auto":
        cfg = json.loads((Path(hf_dir) / "config.json").read_text())
        cfg = cfg.get("text_config", cfg) | {k: v for k, v in cfg.items() if k in ("dtype", "torch_dtype")}
        name = str(cfg.get("dtype") or cfg.get("torch_dtype") or "float16")
        if name == "float32" and recipe.target.gpu != "cpu":
            name = "float16"
    return getattr(torch, name)


def _dataset_hash(recipe: Recipe, recipe_dir: Path) -> str | None:
    """Content hash of local calibration text (embedded corpus or file); ``None`` for HF names."""
    ds = recipe.quantization.calibration.dataset
    if ds == "embedded":
        import calib

        return calib.open_source(ds, text_field=None, base_dir=recipe_dir, seed=0).content_hash
    path = Path(ds).expanduser()
    path = path if path.is_absolute() else Path(recipe_dir) / path
    return artifacts.sha256_file(path) if path.is_file() else None


@contextlib.contextmanager
def _threads() -> Iterator[None]:
    """torch intra-op threads for the run: ``$TRTPIPE_NUM_THREADS`` or the CPUs this process may use."""
    import torch

    before = torch.get_num_threads()
    torch.set_num_threads(int(os.environ.get("TRTPIPE_NUM_THREADS") or len(os.sched_getaffinity(0))))
    try:
        yield
    finally:
        torch.set_num_threads(before)


@contextlib.contextmanager
def _export_errors(what: str) -> Iterator[None]:
    try:
        yield
    except (StageError, UserError):
        raise
    except Exception as e:
        raise StageError(f"ModelOpt export of the {what} failed: {type(e).__name__}: {str(e).splitlines()[0]}") from e


def _remove_stale_tmp(out_dir: Path) -> None:
    """Remove ``.<name>.tmp-<pid>-*`` dirs left by killed runs (SIGKILL skips atomic_dir's cleanup)."""
    import shutil

    for p in out_dir.parent.glob(f".{out_dir.name}.tmp-*") if out_dir.parent.is_dir() else ():
        try:
            pid = int(p.name.split(".tmp-")[1].split("-")[0])
            os.kill(pid, 0)
        except ProcessLookupError:
            shutil.rmtree(p, ignore_errors=True)
        except (ValueError, IndexError, PermissionError):
            continue


def _dry_run(recipe: Recipe, out_dir: Path, key: str, recipe_dir: Path) -> StageResult:
    q, c, t = recipe.quantization, recipe.quantization.calibration, recipe.target
    src = recipe.model.source
    local = Path(src).expanduser() if Path(src).is_absolute() else Path(recipe_dir) / src
    model_dir = str(local.resolve()) if local.exists() else src
    dataset = c.dataset if c.dataset != "embedded" else "cnn_dailymail"
    args = ["python3", "${TRTLLM_EXAMPLES}/quantization/quantize.py", "--model_dir", model_dir,
            "--dtype", recipe.model.dtype, "--qformat", q.qformat]
    if q.kv_cache_dtype != "none":
        args += ["--kv_cache_dtype", q.kv_cache_dtype]
    args += ["--calib_dataset", dataset, "--calib_size", str(c.size), "--calib_max_seq_length", str(c.max_seq_length),
             "--batch_size", str(c.batch_size), "--seed", str(c.seed)]
    if q.qformat in ("int4_awq", "w4a8_awq"):
        args += ["--awq_block_size", str(q.awq_block_size)]
    args += ["--tp_size", str(t.tp_size), "--pp_size", str(t.pp_size), "--output_dir", "${OUT_DIR}/trtllm_ckpt"]
    quoted = " \\\n    ".join(a if a.startswith(("${", "python3")) else shlex.quote(a) for a in args)
    note = ("# calibration.dataset is trtpipe's offline 'embedded' text; quantize.py has no equivalent, so its\n"
            "# default cnn_dailymail is used.\n" if c.dataset == "embedded" else "")
    if q.qformat == "int4_wo" and q.awq_block_size != 128:
        note += f"# quantize.py uses group size 128 for int4_wo; trtpipe uses awq_block_size {q.awq_block_size}.\n"
    script = ("#!/usr/bin/env bash\n# The TensorRT-LLM 1.2.1 equivalent of this quantize stage (made by trtpipe, dry run).\n"
              f"# Recipe: {recipe.name}\n{note}set -euo pipefail\n"
              "TRTLLM_EXAMPLES=${TRTLLM_EXAMPLES:-/app/tensorrt_llm/examples}\n"
              f'OUT_DIR=${{OUT_DIR:-"$(cd "$(dirname "$0")" && pwd)"}}\n{quoted}\n')
    with artifacts.atomic_dir(out_dir) as tmp:
        (tmp / "quantize_command.sh").write_text(script)
        (tmp / "quantize_command.sh").chmod(0o755)
        manifest = artifacts.base_manifest(
            STAGE, key, dry_run=True, recipe_hash=recipe_hash(recipe), source={"spelling": src},
            qformat=q.qformat, kv_cache_dtype=q.kv_cache_dtype, modelopt_config=QFORMAT_CFG[q.qformat],
            exported={"quant_algo": q.quant_algo, "kv_cache_quant_algo": q.kv_cache_quant_algo},
            command=args, versions=artifacts.library_versions(*VERSIONED), timings_s={"total": 0.0},
            peak_rss_bytes=artifacts.peak_rss_bytes(),
            paths={"quantize_command": str(out_dir / "quantize_command.sh"), "trtllm_ckpt": str(out_dir / "trtllm_ckpt")},
        )
        artifacts.write_manifest(tmp, manifest)
    return StageResult(STAGE, out_dir, manifest, cached=False)
