"""Quantize stage: ModelOpt post-training quantization, both checkpoint exports and the geometry check.

``run(recipe, layout, *, recipe_dir)`` loads the source checkpoint (:mod:`pipeline.quantize.sources`), calibrates
with ``mtq.quantize(model, cfg, forward_loop)`` (:mod:`pipeline.quantize.ptq`) on text from :mod:`calib`, measures
quality on held-out text with the fake-quant forward, casts the whole model to the export dtype and
writes ``layout.quantize`` atomically::

    trtllm_ckpt/   config.json + rank{N}.safetensors   (export_tensorrt_llm_checkpoint)
    hf_ckpt/       unified HF checkpoint + tokenizer + chat template (export_hf_checkpoint)
    manifest.json  cache key, hashes, versions, quantizers, timings, peak RSS, quality, adjustments

Runs on nvidia-modelopt 0.47 (development) and 0.37 + transformers 4.57.3 (what TensorRT-LLM 1.2.1 pins,
the Triton container's stack; CI checks both). The TensorRT-LLM checkpoint is exported first because
``export_hf_checkpoint`` packs weights in place (docs/reference/cpu-stack.md §3), then checked against the
source model's config (:mod:`pipeline.trtllm.checkpoint`): fields the exporter dropped (RoPE under transformers 5)
are filled in and recorded as ``adjustments``; any other mismatch fails the stage. Facts the manifest
records: the TensorRT-LLM export writes float16 when asked for float32 (``trtllm_dtype``); the unified
HF export cannot carry an INT8 KV cache, so with ``kv_cache_dtype: int8`` hf_ckpt has no KV scales
(``hf_ckpt_kv_cache_quant_algo: null``); ``int4_wo`` exports as ``W4A16_AWQ`` (``exported``). With
``dry_run`` no model is loaded: the equivalent TensorRT-LLM ``examples/quantization/quantize.py``
command is written to ``quantize_command.sh`` (flags: docs/reference/quantization.md §2.1).
"""

from __future__ import annotations

import contextlib
import json
import os
import shlex
import shutil
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from pipeline.core import artifacts
from pipeline.core.disk import quantize_bytes
from pipeline.core.errors import StageError
from pipeline.core.layout import HF_CKPT, TRTLLM_CKPT, BuildLayout
from pipeline.core.recipe_paths import recipe_path
from pipeline.core.scripts import save_tokenizer
from pipeline.quantize import ptq
from pipeline.quantize.common import (  # shared with the vision-language path (pipeline/quantize/vlm.py)
    HF_GEOMETRY_FIELDS,
    TRANSFORMERS5_TOKENIZER_CLASSES,  # noqa: F401 (tests read it here)
    VERSIONED,
    consumed_fields,
    hf_geometry_problems,
    portable_tokenizer,
    recipe_hash,
)
from pipeline.quantize.common import checkpoint_dtype as _checkpoint_dtype
from pipeline.quantize.common import export_errors as _export_errors
from pipeline.quantize.common import runtime_transformers as _runtime_transformers
from pipeline.quantize.common import warn as _warn
from pipeline.quantize.result import QuantizeResult
from pipeline.quantize.vlm_command import vlm_quantize_args
from pipeline.recipe import Recipe, derived
from pipeline.recipe.serving_path import serving_path
from pipeline.recipe.vision import cross_attention
from pipeline.trtllm.checkpoint import check_checkpoint_dir

STAGE = QuantizeResult.STAGE
#: Bump when the stage's output for the same inputs changes (invalidates cached results).
STAGE_VERSION = 3  # 3: hf_ckpt's tokenizer_config.json names a class the serving image's transformers has


def cache_key(recipe: Recipe, *, source_hash: str | None, dataset_hash: str | None, dry_run: bool,
              source_path: str | None = None) -> str:
    """Hash of everything the output depends on: the model/target/quantization sections, the
    source and calibration-text hashes, library versions and ``dry_run``; for a dry run, ``source_path`` (the local
    ``model.source`` resolved against the recipe's directory, which the command names: a recipe copied elsewhere
    writes a new command)."""
    return artifacts.stable_hash({
        "stage_version": STAGE_VERSION, "recipe": recipe_hash(recipe), "source": source_hash,
        "dataset": dataset_hash, "versions": artifacts.library_versions(*VERSIONED), "dry_run": dry_run,
        **({"source_path": source_path} if source_path else {}),
        **({"vision": recipe.vision.family} if recipe.vision is not None else {}),  # images in calibration (vlm.py, vlm_qwen.py)
    })


def run(recipe: Recipe, layout: BuildLayout, *, recipe_dir: Path, force: bool = False, dry_run: bool = False) -> QuantizeResult:
    """Quantize ``recipe.model`` with ModelOpt and export both checkpoints into ``layout.quantize``.

    Args:
        recipe: validated recipe (model, target, quantization sections are used).
        layout: the build directory; the stage writes ``layout.quantize`` (replaced atomically;
            nothing is left behind on failure).
        recipe_dir: directory of the recipe file (relative model/dataset paths).
        force: recompute even when ``out_dir`` holds a result with the same cache key.
        dry_run: load nothing; write ``quantize_command.sh`` and the manifest only.

    Returns:
        :class:`QuantizeResult` (``cached=True`` when reused; ``status`` ``built`` or ``dry_run``).

    Raises:
        UserError: source or calibration data unavailable (see :mod:`pipeline.quantize.sources`, :mod:`calib`).
        StageError: ModelOpt calibration or export failed; less free disk than both exports need
            (:func:`pipeline.core.disk.quantize_bytes`; checked before the model loads), or the disk filled.
    """
    out_dir = layout.quantize
    if dry_run:
        local = recipe_path(recipe.model.source, recipe_dir)
        key = cache_key(recipe, source_hash=None, dataset_hash=None, dry_run=True,
                        source_path=str(local.resolve()) if local.exists() else None)
        if not force and (hit := QuantizeResult.load(out_dir, key)):
            return hit
        return _dry_run(recipe, out_dir, key, local)
    from pipeline.core.quiet import quiet_libraries
    from pipeline.quantize.sources import resolve_source

    with quiet_libraries():
        source = resolve_source(recipe.model, Path(recipe_dir))
    if cross_attention(recipe.vision):  # issue #46: the checkpoint is the vision family and geometry (one line, nothing loaded)
        from pipeline.quantize import vlm

        vlm.check_source(recipe, Path(source.hf_dir))
    key = cache_key(recipe, source_hash=source.content_hash, dataset_hash=_dataset_hash(recipe, recipe_dir), dry_run=False)
    if not force and (hit := QuantizeResult.load(out_dir, key)):
        return hit
    export_dtype = derived.model_dtype(recipe.model, recipe.target, _checkpoint_dtype(source.hf_dir))
    q, t = recipe.quantization, recipe.target
    need = quantize_bytes(Path(source.hf_dir) / "config.json", q.qformat, export_dtype, awq_block_size=q.awq_block_size,
                          tp_size=t.tp_size, pp_size=t.pp_size)
    with _threads(), artifacts.atomic_dir(out_dir, need_bytes=need) as tmp:
        with quiet_libraries() as library_log:
            if cross_attention(recipe.vision):  # the decoder with images, the vision tower excluded (pipeline/quantize/vlm.py)
                from pipeline.quantize import vlm

                manifest = vlm.quantize_mllama(recipe, tmp, key, source, Path(recipe_dir))
            elif recipe.vision is not None:  # Qwen2-VL family: the decoder only, images in calibration (vlm_qwen.py)
                from pipeline.quantize import vlm_qwen

                manifest = vlm_qwen.quantize_qwen2_vl(recipe, tmp, key, source, Path(recipe_dir))
            else:
                manifest = _quantize(recipe, tmp, key, source, Path(recipe_dir))
        manifest["library_log"] = library_log
        artifacts.write_manifest(tmp, manifest)
    return QuantizeResult.from_manifest(out_dir, manifest)


# --------------------------------------------------------------------------------- the real run
def _quantize(recipe: Recipe, tmp: Path, key: str, source: Any, recipe_dir: Path) -> dict[str, Any]:
    t0 = time.perf_counter()
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from pipeline.quantize import calib

    q = recipe.quantization
    device = "cuda" if torch.cuda.is_available() else "cpu"
    export_dtype = getattr(torch, derived.model_dtype(recipe.model, recipe.target, _checkpoint_dtype(source.hf_dir)))
    calib_dtype = torch.float32 if device == "cpu" else export_dtype  # fp32 is ~2× faster on CPU (docs/reference/cpu-stack.md §3)
    timings: dict[str, float] = {}
    tok = AutoTokenizer.from_pretrained(source.hf_dir, local_files_only=True, trust_remote_code=recipe.model.trust_remote_code)
    data = calib.prepare(q.calibration, tok, recipe_dir)
    if len(data.calib) < data.requested:
        _warn(f"{data.source.name}: {len(data.calib)} calibration samples of {data.max_seq_length} tokens "
              f"available, {data.requested} requested")
    ptq.phase(f"load {recipe.model.source} ({str(calib_dtype).removeprefix('torch.')}, {device})")
    model = AutoModelForCausalLM.from_pretrained(
        source.hf_dir, dtype=calib_dtype, local_files_only=True, trust_remote_code=recipe.model.trust_remote_code,
        **({"device_map": "auto"} if device == "cuda" else {}),
    ).eval()
    import modelopt.torch.quantization as mtq  # ~8 s of imports: counted in "load"

    timings["load"] = time.perf_counter() - t0
    t = time.perf_counter()
    cfg = ptq.quant_config(recipe.quantization)
    if cfg is not None:
        batches = data.calib_batches(tok)
        ptq.phase(f"calibrate {q.qformat}: {len(data.calib)} samples of ≤ {data.max_seq_length} tokens, "
                  f"{len(batches)} batches (load took {time.perf_counter() - t0:.0f} s)")
        try:
            model = mtq.quantize(model, cfg, lambda m: ptq.forward_loop(m, batches))
        except Exception as e:
            raise StageError(f"ModelOpt calibration ({q.qformat}) failed: {type(e).__name__}: {e}") from e
    timings["calibrate"] = time.perf_counter() - t

    t = time.perf_counter()
    ptq.phase(f"evaluate the quantized model against full precision ({q.calibration.eval_samples} samples)")
    quality = ptq.evaluate(model, data.eval_batches(tok, ptq.EVAL_BATCH))
    timings["evaluate"] = time.perf_counter() - t

    model.to(export_dtype)  # cast the WHOLE model (weights, norms, amax buffers) before export
    quantizers = ptq.quantizer_summary(model)
    trt_dir, hf_dir = tmp / TRTLLM_CKPT, tmp / HF_CKPT
    ptq.phase("export the TensorRT-LLM and HF checkpoints")
    t = time.perf_counter()
    decoder, trt_skipped = None, None
    try:
        with _export_errors("TensorRT-LLM checkpoint"):
            from modelopt.torch.export import export_tensorrt_llm_checkpoint
            from modelopt.torch.export.model_utils import get_model_type

            decoder = get_model_type(model)
            if decoder is None:
                raise StageError(f"ModelOpt has no TensorRT-LLM decoder type for {type(model).__name__}")
            export_tensorrt_llm_checkpoint(model, decoder, dtype=export_dtype, export_dir=trt_dir,
                                           inference_tensor_parallel=recipe.target.tp_size,
                                           inference_pipeline_parallel=recipe.target.pp_size)
    except StageError as e:  # e.g. ModelOpt 0.47 exports MoE blocks of llama/dbrx/phi3/deepseek/qwen only, not Qwen3-MoE
        if serving_path(recipe).reads_trtllm_checkpoint:
            raise
        trt_skipped = f"{e}; only build.engine: tensorrt reads it, this recipe's engine reads hf_ckpt"
        shutil.rmtree(trt_dir, ignore_errors=True)
        _warn(f"no TensorRT-LLM checkpoint: {trt_skipped}")
    timings["export_trtllm"] = time.perf_counter() - t
    geometry = None if trt_skipped else check_checkpoint_dir(trt_dir, Path(source.hf_dir) / "config.json")
    if geometry is not None and geometry.problems:
        raise StageError("the TensorRT-LLM checkpoint does not match the source model: " + "; ".join(geometry.problems))
    for adj in geometry.adjustments if geometry is not None else ():
        _warn(f"TensorRT-LLM checkpoint: {adj['key']} = {adj['value']!r} filled in (the exporter left it out; "
              f"TensorRT-LLM would use {adj['default']!r})")
    t = time.perf_counter()
    hf_kv = q.kv_cache_quant_algo
    if q.kv_cache_dtype == "int8":  # ModelOpt 0.47's unified HF export knows FP8/NVFP4 KV only
        ptq.disable_quantizers(model, ("k_bmm_quantizer", "v_bmm_quantizer"))
        hf_kv = None
    with _export_errors("unified HF checkpoint"):
        from modelopt.torch.export import export_hf_checkpoint

        export_hf_checkpoint(model, dtype=export_dtype, export_dir=hf_dir)  # packs weights in place: last
        tok.save_pretrained(hf_dir)  # tokenizer files + chat_template.jinja
    tokenizer_adjustments = portable_tokenizer(hf_dir, _runtime_transformers())
    timings["export_hf"] = time.perf_counter() - t
    timings["total"] = time.perf_counter() - t0
    hf_geometry = hf_geometry_problems(Path(source.hf_dir) / "config.json", hf_dir / "config.json")
    if hf_geometry:
        raise StageError("the unified HF checkpoint does not match the source model: " + "; ".join(hf_geometry))

    trt_cfg = {} if trt_skipped else json.loads((trt_dir / "config.json").read_text())
    if trt_skipped:  # the unified export's quantization record stands in (hf_quant_config.json)
        trt_cfg = {"quantization": json.loads((hf_dir / "hf_quant_config.json").read_text()).get("quantization")
                   if (hf_dir / "hf_quant_config.json").is_file() else {}}
    trt_quant = trt_cfg.get("quantization") or {}
    trt_dtype = trt_cfg.get("dtype")
    exported = {"quant_algo": trt_quant.get("quant_algo"), "kv_cache_quant_algo": trt_quant.get("kv_cache_quant_algo")}
    expected = {"quant_algo": q.quant_algo, "kv_cache_quant_algo": q.kv_cache_quant_algo}
    if exported != expected:  # the export is the truth downstream stages must read (e.g. int4_wo → W4A16_AWQ)
        _warn(f"ModelOpt exported {exported}; the recipe's table says {expected}")
    return artifacts.base_manifest(
        STAGE, key, status="built", recipe_hash=recipe_hash(recipe), consumed=consumed_fields(recipe), source=source.to_manifest(),
        calibration=data.summary(), versions=artifacts.library_versions(*VERSIONED),
        qformat=q.qformat, kv_cache_dtype=q.kv_cache_dtype, modelopt_config=ptq.QFORMAT_CFG[q.qformat],
        device=device, calib_dtype=str(calib_dtype).removeprefix("torch."), export_dtype=str(export_dtype).removeprefix("torch."),
        torch_threads=torch.get_num_threads(), decoder_type=decoder, exported=exported, trtllm_quantization=trt_quant,
        recipe_quant_algo=expected,
        # ModelOpt writes fp16 for an fp32 TensorRT-LLM export; the HF export keeps export_dtype
        trtllm_dtype=trt_dtype, hf_ckpt_kv_cache_quant_algo=hf_kv,
        quantizers=quantizers, quality=quality, timings_s={k: round(v, 3) for k, v in timings.items()},
        adjustments=(geometry.adjustments if geometry else []) + tokenizer_adjustments,
        geometry_checked=geometry.checked if geometry else [], hf_geometry_checked=list(HF_GEOMETRY_FIELDS),
        trtllm_ckpt_skipped=trt_skipped, peak_rss_bytes=artifacts.peak_rss_bytes(),
        outputs={**({} if trt_skipped else {TRTLLM_CKPT: artifacts.file_hashes(trt_dir)}), HF_CKPT: artifacts.file_hashes(hf_dir)},
    )


# --------------------------------------------------------------------------------- helpers
#: TensorRT-LLM's examples in the Triton trtllm image: tensorrtllm_backend dockerfile/
#: Dockerfile.triton.trt_llm_backend@ce68ff5fd0a7:170,175 copies them to /app/examples
TRTLLM_EXAMPLES = "/app/examples"
def _dataset_hash(recipe: Recipe, recipe_dir: Path) -> str | None:
    """Content hash of local calibration text (embedded corpus or file); ``None`` for HF names."""
    ds = recipe.quantization.calibration.dataset
    if ds == "embedded":
        from pipeline.quantize import calib

        return calib.open_source(ds, text_field=None, base_dir=recipe_dir, seed=0).content_hash
    path = recipe_path(ds, recipe_dir)
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


def _dry_run(recipe: Recipe, out_dir: Path, key: str, local: Path) -> QuantizeResult:
    """The quantize command and a dry-run manifest; ``local``: ``model.source`` as a path against the recipe's
    directory (:func:`pipeline.core.recipe_paths.recipe_path`, resolved once by :func:`run`)."""
    q, c, t = recipe.quantization, recipe.quantization.calibration, recipe.target
    src = recipe.model.source
    model_dir = str(local.resolve()) if local.exists() else src
    # mllama is calibrated with images: quantize.py's VLM dataset, scienceqa (examples/models/core/multimodal/README.md
    # @89fd9b74 §MLLaMA FP8: --calib_dataset scienceqa; hf_ptq.py@5a4242fa:443-453)
    default_ds = "scienceqa" if cross_attention(recipe.vision) else "cnn_dailymail"
    dataset = c.dataset if c.dataset != "embedded" else default_ds
    args = ["python3", "${TRTLLM_EXAMPLES}/quantization/quantize.py", "--model_dir", model_dir,
            "--dtype", recipe.model.dtype, "--qformat", q.qformat]
    if q.kv_cache_dtype != "none":
        args += ["--kv_cache_dtype", q.kv_cache_dtype]
    args += ["--calib_dataset", dataset, "--calib_size", str(c.size), "--calib_max_seq_length", str(c.max_seq_length),
             "--batch_size", str(c.batch_size), "--seed", str(c.seed)]
    if q.qformat in ("int4_awq", "w4a8_awq"):
        args += ["--awq_block_size", str(q.awq_block_size)]
    # build.engine pytorch loads the unified HF checkpoint (quantize/hf_ckpt, as the LLM-API config and trtllm-serve
    # name it): quantize.py --export_format hf (default tensorrt_llm: quantize.py@059c97c1, docs/reference/quantization.md §2.1)
    ckpt = TRTLLM_CKPT if serving_path(recipe).reads_trtllm_checkpoint else HF_CKPT
    args += ["--tp_size", str(t.tp_size), "--pp_size", str(t.pp_size)]
    args += ["--export_format", "hf"] if ckpt == HF_CKPT else []
    args += ["--output_dir", f"${{OUT_DIR}}/{ckpt}"]
    vlm = vlm_quantize_args(recipe, model_dir, f"${{OUT_DIR}}/{ckpt}")  # a token-family VLM: ModelOpt hf_ptq.py
    args = vlm[0] if vlm else args
    quoted = " \\\n    ".join(a if a.startswith(("${", "python3")) else shlex.quote(a) for a in args)
    if ckpt == HF_CKPT:  # the LLM API and trtllm-serve read the tokenizer from the checkpoint (--tokenizer hf_ckpt)
        quoted += ("\n# the tokenizer next to the weights: the LLM API / trtllm-serve load it from hf_ckpt (--tokenizer)\n"
                   + save_tokenizer(model_dir, f"${{OUT_DIR}}/{HF_CKPT}", trust_remote_code=recipe.model.trust_remote_code))
    nxt = "../engine/trtllm_build.sh" if ckpt == TRTLLM_CKPT else "../triton_repo (or trtpipe serve --print-command)"
    chain = f"# The chain (run top to bottom in the container): this script writes ${{OUT_DIR}}/{ckpt}/; next: {nxt}.\n"
    note = ("# calibration.dataset is trtpipe's offline 'embedded' text; quantize.py has no equivalent, so its\n"
            f"# {'image dataset' if cross_attention(recipe.vision) else 'default'} {default_ds} is used.\n" if c.dataset == "embedded" else "")
    note = chain + (vlm[1] if vlm else note)
    if q.qformat == "int4_wo" and q.awq_block_size != 128:
        note += f"# quantize.py uses group size 128 for int4_wo; trtpipe uses awq_block_size {q.awq_block_size}.\n"
    script = ("#!/usr/bin/env bash\n# The TensorRT-LLM 1.2.1 equivalent of this quantize stage (made by trtpipe, dry run).\n"
              f"# Recipe: {recipe.name}\n{note}set -euo pipefail\n"
              + ("MODELOPT_EXAMPLES=${MODELOPT_EXAMPLES:?set it to examples/ of NVIDIA/TensorRT-Model-Optimizer at the image's nvidia-modelopt release}\n"
                 if vlm else f"TRTLLM_EXAMPLES=${{TRTLLM_EXAMPLES:-{TRTLLM_EXAMPLES}}}\n")
              + f'OUT_DIR=${{OUT_DIR:-"$(cd "$(dirname "$0")" && pwd)"}}\n{quoted}\n')
    with artifacts.atomic_dir(out_dir) as tmp:
        (tmp / "quantize_command.sh").write_text(script)
        (tmp / "quantize_command.sh").chmod(0o755)
        manifest = artifacts.base_manifest(
            STAGE, key, status="dry_run", recipe_hash=recipe_hash(recipe), consumed=consumed_fields(recipe),
            source={"spelling": src, **({"hf_dir": model_dir} if local.is_dir() else {})},  # QuantizeResult.source_dir
            qformat=q.qformat, kv_cache_dtype=q.kv_cache_dtype, modelopt_config=ptq.QFORMAT_CFG[q.qformat],
            exported={"quant_algo": q.quant_algo, "kv_cache_quant_algo": q.kv_cache_quant_algo},
            command=args, versions=artifacts.library_versions(*VERSIONED), timings_s={"total": 0.0},
            peak_rss_bytes=artifacts.peak_rss_bytes(),
        )
        artifacts.write_manifest(tmp, manifest)
    return QuantizeResult.from_manifest(out_dir, manifest)
