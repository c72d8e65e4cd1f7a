"""The quantize stage for a vision-language recipe (``vision.family: mllama``, issue #46 item 2): the decoder quantized
as ModelOpt's ``examples/llm_ptq/hf_ptq.py`` does it, calibrated WITH images.

What upstream does (NVIDIA/TensorRT-Model-Optimizer@5a4242fa, ``examples/llm_ptq/hf_ptq.py``; re-read at that commit):

- :320-327: an mllama checkpoint gets the processor of the checkpoint itself (``get_processor`` →
  ``AutoProcessor.from_pretrained(ckpt)`` wrapped in ModelOpt's ``MllamaImageProcessor``);
- :443-453: mllama is calibrated with images (``get_vlm_dataset_dataloader``, one dataset, default ``scienceqa``);
  each sample is the chat template of ``[{"type": "image"}, {"type": "text", "text": question}]`` with the
  generation prompt, run through that processor with its image (modelopt/torch/utils/image_processor.py@5a4242fa:
  49-71), one sample per batch (:95-112);
- :348-368: for VLMs only the language model is quantized: every sibling of ``get_language_model_from_vl``'s
  lineage (vision tower, projector, ``lm_head``) gets ``{"default": {"enable": False}}`` and the language model is
  the module ``mtq.quantize`` converts. At 5a4242fa that branch is the non-mllama one; for mllama it quantizes the
  whole model, which is then exported as ``model.language_model`` (:646-651) — the vision tower's quantizers exist
  but its weights never reach the TensorRT-LLM checkpoint. trtpipe applies the :348-368 rule to mllama too, so the
  unified HF checkpoint of the WHOLE model (:689-692) carries a full-precision vision tower and projector, as the
  issue asks ("vision tower and projector excluded") and the vision engine is built in the model dtype anyway.
- :622-644: for VLMs the original ``config.json`` and the processor are saved into the export directory.

trtpipe's calibration images are scikit-image's bundled photographs (:func:`pipeline.vision.images.bundled_samples`,
never a hub dataset); the question texts are the recipe's calibration text (``quantization.calibration``). The
calibration forward runs the FULL model (images → vision tower → projector → cross-attention), so the cross-attention
layers' quantizers see real image features; the manifest records that (``image_calibration``).

ModelOpt behaviour relied on (nvidia-modelopt 0.47.0 here): ``mtq.quantize`` on the language-model submodule with a
``forward_loop`` that calls the full model; ``export_hf_checkpoint`` of the full ``MllamaForConditionalGeneration``
writes ``hf_quant_config.json`` whose ``exclude_modules`` lists ``vision_model*`` and ``multi_modal_projector``.
0.47's default config already disables ``*vision_model*`` / ``*multi_modal_projector*``; 0.37 (the TensorRT-LLM 1.2.1
pin) does not, so the explicit disabling above is what makes both behave the same.
"""

from __future__ import annotations

import json
import shutil
import time
from pathlib import Path
from typing import Any

from pipeline.core import artifacts
from pipeline.core.errors import StageError, UserError
from pipeline.core.layout import HF_CKPT
from pipeline.quantize import ptq
from pipeline.recipe import Recipe, derived

#: vision_config / text_config fields the unified HF export must keep from the source (the vision stage and the
#: CPU engine read them from hf_ckpt)
VISION_GEOMETRY_FIELDS = ("image_size", "patch_size", "max_num_tiles", "hidden_size", "num_hidden_layers",
                          "num_global_layers", "vision_output_dim", "intermediate_layers_indices")
TEXT_GEOMETRY_FIELDS = ("cross_attention_layers", "num_hidden_layers", "hidden_size", "vocab_size")


def check_source(recipe: Recipe, hf_dir: Path) -> None:
    """The resolved checkpoint against the recipe's vision section, before anything loads.

    Raises:
        UserError: one line naming the field at fault: ``vision.family`` when the checkpoint's ``model_type``
            differs, ``vision.tile_size`` / ``patch_size`` / ``max_tiles`` when its ``vision_config`` disagrees
            (:func:`pipeline.recipe.vision.vision_problems`' rules, applied to the resolved directory); or
            ``build.engine`` when the engine reads a TensorRT-LLM checkpoint (``tensorrt``): ModelOpt 0.47's
            ``export_tensorrt_llm_checkpoint`` of the mllama language model fails here (ZeroDivisionError in
            ``postprocess.check_weight_shape_valid``), so that checkpoint comes from TensorRT-LLM's own
            ``quantize.py`` in the container (``trtpipe build --dry-run`` writes the command).
    """
    from pipeline.recipe.serving_path import serving_path
    from pipeline.recipe.vision import vision_problems

    if serving_path(recipe).reads_trtllm_checkpoint:
        raise UserError(f"build.engine: {recipe.build.engine} reads an mllama TensorRT-LLM checkpoint, which trtpipe's "
                        "ModelOpt run does not write: run `trtpipe build --dry-run` and the quantize_command.sh it writes "
                        "(TensorRT-LLM quantize.py) in the container")

    problems = [p for p in vision_problems(recipe.model_copy(update={"model": recipe.model.model_copy(
        update={"source": str(hf_dir)})}), None) if p[0] != "build.engine" and p[0] != "target.tensorrt_llm"]
    if problems:
        raise UserError("; ".join(f"{f}: {m}" for f, m in problems).replace(str(hf_dir), recipe.model.source))


def geometry_problems(source_config: Path, exported_config: Path) -> list[str]:
    """``"section.field: source → exported"`` for each vision/text geometry field the export changed (empty = kept)."""
    a, b = json.loads(source_config.read_text()), json.loads(exported_config.read_text())
    out = []
    for sec, fields in (("vision_config", VISION_GEOMETRY_FIELDS), ("text_config", TEXT_GEOMETRY_FIELDS)):
        sa, sb = a.get(sec) or {}, b.get(sec) or {}
        out += [f"{sec}.{k}: {sa.get(k)!r} → {sb.get(k)!r}" for k in fields if sa.get(k) != sb.get(k)]
    for k in ("model_type", "image_token_index"):
        if a.get(k) != b.get(k):
            out.append(f"{k}: {a.get(k)!r} → {b.get(k)!r}")
    return out


def processor(hf_dir: Path) -> Any:
    """The checkpoint's own mllama processor (tokenizer + image processor + chat template), as hf_ptq.py:320-327.

    ``AutoProcessor`` first; transformers 5 without torchvision cannot build the torchvision image processor, so
    the PIL one (:func:`pipeline.vision.tiny_mllama.image_processor_class`) is loaded from the same
    ``preprocessor_config.json`` then.

    Raises:
        UserError: the checkpoint has no tokenizer or image processor files.
    """
    from transformers import AutoProcessor, AutoTokenizer, MllamaProcessor

    from pipeline.vision.tiny_mllama import image_processor_class

    try:
        return AutoProcessor.from_pretrained(hf_dir, local_files_only=True)
    except (ImportError, OSError, ValueError, TypeError):
        pass
    try:
        tok = AutoTokenizer.from_pretrained(hf_dir, local_files_only=True)
        img = image_processor_class().from_pretrained(hf_dir, local_files_only=True)
    except (OSError, ValueError) as e:
        raise UserError(f"{hf_dir}: no mllama processor (tokenizer + preprocessor_config.json): {str(e).splitlines()[0]}") from None
    return MllamaProcessor(image_processor=img, tokenizer=tok, chat_template=getattr(tok, "chat_template", None))


def image_batches(proc: Any, texts: list[str], max_tokens: int) -> list[dict[str, Any]]:
    """One calibration batch per text, each with one bundled photograph (cycled), as ModelOpt's mllama processor
    builds them (image_processor.py@5a4242fa:49-71): the chat template of an image + the text with the generation
    prompt (``<|image|>`` + text without a template), through the checkpoint's processor.

    Args:
        proc: the mllama processor (:func:`processor`).
        texts: the question texts (the recipe's calibration samples).
        max_tokens: texts are cut to this many tokens first (the recipe's ``calibration.max_seq_length``).

    Returns:
        dicts of ``input_ids``/``attention_mask`` [1, T], ``pixel_values`` [1, 1, tiles, 3, tile, tile],
        ``aspect_ratio_ids`` [1, 1], ``aspect_ratio_mask`` [1, 1, tiles], ``cross_attention_mask`` [1, T, 1, tiles].
    """
    from pipeline.vision.images import bundled_samples

    tok = proc.tokenizer
    images = bundled_samples()
    out = []
    for i, text in enumerate(texts):
        ids = tok(text, add_special_tokens=False)["input_ids"][:max_tokens]
        question = tok.decode(ids)
        if getattr(proc, "chat_template", None) or getattr(tok, "chat_template", None):
            msgs = [{"role": "user", "content": [{"type": "image"}, {"type": "text", "text": question}]}]
            prompt = proc.apply_chat_template(msgs, add_generation_prompt=True)
        else:
            prompt = f"<|image|>{question}"
        enc = proc(text=prompt, images=[images[i % len(images)]], return_tensors="pt")
        out.append({k: enc[k] for k in ("input_ids", "attention_mask", "pixel_values", "aspect_ratio_ids",
                                        "aspect_ratio_mask", "cross_attention_mask")})
    return out


def _cross_attention_calibrated(lm: Any) -> dict[str, Any]:
    """Which cross-attention layers' key projections got an input amax in calibration (they only see input when
    image features reached them)."""
    seen, total = [], 0
    for name, m in lm.named_modules():
        if name.endswith("cross_attn.k_proj") and hasattr(m, "input_quantizer"):
            total += 1
            amax = getattr(m.input_quantizer, "amax", None)
            if amax is not None and float(amax.max()) > 0:
                seen.append(name)
    return {"cross_attention_k_proj_calibrated": seen, "cross_attention_layers": total}


def quantize_mllama(recipe: Recipe, tmp: Path, key: str, source: Any, recipe_dir: Path) -> dict[str, Any]:
    """Quantize an mllama checkpoint's language model with images and export the whole model into ``tmp/hf_ckpt``.

    Args:
        recipe: a recipe with ``vision.family: mllama``.
        tmp: the stage's temp directory.
        key: the stage's cache key.
        source: the :class:`pipeline.quantize.sources.ResolvedSource`.
        recipe_dir: the recipe's directory (calibration text paths).

    Returns:
        the stage manifest (quantizers, quality on held-out text, image calibration facts, timings).

    Raises:
        StageError: ModelOpt calibration or export failed, or the export changed the checkpoint's geometry.
    """
    import modelopt.torch.quantization as mtq
    import torch
    from modelopt.torch.export import export_hf_checkpoint
    from transformers import AutoConfig, MllamaForConditionalGeneration

    from pipeline.quantize import calib, common
    from pipeline.quantize.result import QuantizeResult

    t0 = time.perf_counter()
    q, timings = recipe.quantization, {}
    device = "cuda" if torch.cuda.is_available() else "cpu"
    export_dtype = getattr(torch, derived.model_dtype(recipe.model, recipe.target, common.checkpoint_dtype(source.hf_dir)))
    calib_dtype = torch.float32 if device == "cpu" else export_dtype
    proc = processor(Path(source.hf_dir))
    data = calib.prepare(q.calibration, proc.tokenizer, recipe_dir)
    ptq.phase(f"load {recipe.model.source} (mllama, {str(calib_dtype).removeprefix('torch.')}, {device})")
    model = MllamaForConditionalGeneration.from_pretrained(source.hf_dir, dtype=calib_dtype, local_files_only=True).eval()
    model.to(device)
    timings["load"] = time.perf_counter() - t0
    lm, excluded = common.language_model_only(model, str(source.hf_dir))
    cfg = ptq.quant_config(q)
    t = time.perf_counter()
    batches = image_batches(proc, [s.text for s in data.calib], data.max_seq_length)
    ptq.phase(f"calibrate {q.qformat} with images: {len(batches)} samples (bundled photographs + calibration text)")

    def loop(_m: Any) -> None:
        with torch.no_grad():
            for b in batches:
                model(**{k: v.to(device) for k, v in b.items()}, use_cache=False)

    try:
        if cfg is not None:
            mtq.quantize(lm, cfg, forward_loop=loop)
    except Exception as e:  # ModelOpt raises many types; one line for the stage
        raise StageError(f"ModelOpt calibration of the mllama language model failed: {type(e).__name__}: "
                         f"{(str(e).splitlines() or [''])[0]}") from e
    timings["calibrate"] = time.perf_counter() - t
    image_facts = {"images": len(batches), "image_sources": "scikit-image bundled samples",
                   "tokens_per_sample_max": max(int(b["input_ids"].shape[1]) for b in batches),
                   "excluded_from_quantization": excluded, **_cross_attention_calibrated(lm)}
    t = time.perf_counter()
    quality = ptq.evaluate(model, data.eval_batches(proc.tokenizer, ptq.EVAL_BATCH))
    timings["evaluate"] = time.perf_counter() - t
    model.to(export_dtype)
    quantizers = ptq.quantizer_summary(model)
    hf_dir = tmp / HF_CKPT
    t = time.perf_counter()
    with common.export_errors("unified HF checkpoint"):
        export_hf_checkpoint(model, dtype=export_dtype, export_dir=hf_dir)  # hf_ptq.py:689-692: the full model
    # hf_ptq.py:622-644: the original config's VLM fields and the processor next to the weights
    exported = json.loads((hf_dir / "config.json").read_text())
    original = AutoConfig.from_pretrained(source.hf_dir, local_files_only=True).to_dict()
    for k in ("vision_config", "image_token_index"):
        if k in original and k not in exported:
            exported[k] = original[k]
    (hf_dir / "config.json").write_text(json.dumps(exported, indent=2, sort_keys=True) + "\n")
    proc.save_pretrained(hf_dir)
    for name in ("preprocessor_config.json", "chat_template.json"):  # transformers 5 folds them into processor_config.json;
        if (Path(source.hf_dir) / name).is_file() and not (hf_dir / name).is_file():  # 4.57 and the repository read them
            shutil.copyfile(Path(source.hf_dir) / name, hf_dir / name)
    tokenizer_adjustments = common.portable_tokenizer(hf_dir, common.runtime_transformers())
    timings["export_hf"] = time.perf_counter() - t
    timings["total"] = time.perf_counter() - t0
    problems = common.hf_geometry_problems(Path(source.hf_dir) / "config.json", hf_dir / "config.json")
    problems += geometry_problems(Path(source.hf_dir) / "config.json", hf_dir / "config.json")
    if problems:
        raise StageError("the unified HF checkpoint does not match the source model: " + "; ".join(problems))
    hf_quant = json.loads((hf_dir / "hf_quant_config.json").read_text()).get("quantization") \
        if (hf_dir / "hf_quant_config.json").is_file() else {}
    exported_algos = {"quant_algo": (hf_quant or {}).get("quant_algo"), "kv_cache_quant_algo": (hf_quant or {}).get("kv_cache_quant_algo")}
    expected = {"quant_algo": q.quant_algo, "kv_cache_quant_algo": q.kv_cache_quant_algo}
    if exported_algos != expected:
        common.warn(f"ModelOpt exported {exported_algos}; the recipe's table says {expected}")
    return artifacts.base_manifest(
        QuantizeResult.STAGE, key, status="built", recipe_hash=common.recipe_hash(recipe), consumed=common.consumed_fields(recipe),
        source=source.to_manifest(), calibration=data.summary(), versions=artifacts.library_versions(*common.VERSIONED),
        qformat=q.qformat, kv_cache_dtype=q.kv_cache_dtype, modelopt_config=ptq.QFORMAT_CFG[q.qformat], device=device,
        calib_dtype=str(calib_dtype).removeprefix("torch."), export_dtype=str(export_dtype).removeprefix("torch."),
        torch_threads=torch.get_num_threads(), decoder_type="mllama", exported=exported_algos, recipe_quant_algo=expected,
        hf_quantization=hf_quant, hf_ckpt_kv_cache_quant_algo=exported_algos["kv_cache_quant_algo"],
        image_calibration=image_facts, quantizers=quantizers, quality=quality,
        timings_s={k: round(v, 3) for k, v in timings.items()}, adjustments=tokenizer_adjustments,
        hf_geometry_checked=[*common.HF_GEOMETRY_FIELDS, *(f"vision_config.{k}" for k in VISION_GEOMETRY_FIELDS),
                             *(f"text_config.{k}" for k in TEXT_GEOMETRY_FIELDS)],
        trtllm_ckpt_skipped="an mllama TensorRT-LLM checkpoint comes from TensorRT-LLM's own quantize.py in the "
                            "container (quantize_command.sh of a dry run); this recipe's engine reads hf_ckpt",
        peak_rss_bytes=artifacts.peak_rss_bytes(), outputs={HF_CKPT: artifacts.file_hashes(hf_dir)},
    )
