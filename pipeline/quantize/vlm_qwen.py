"""The quantize stage for a Qwen2-VL-family recipe (issue #47 item 7): the decoder-only ModelOpt path, vision tower
and merger excluded, processor files kept in the export, calibrated with images.

What upstream does (ModelOpt ``examples/llm_ptq/hf_ptq.py``@5a4242fa, shared/reference/multimodal-vlm.md §4, and the
mllama path of :mod:`pipeline.quantize.vlm`, which restates the same lines):

- :348-368: for a VLM only the language model is quantized: ``get_language_model_from_vl`` finds it
  (``model.model.language_model`` for Qwen2-VL) and every sibling module of its lineage (here ``visual`` — the vision
  tower with its merger, the projector of this family — and ``lm_head``) gets ``{"default": {"enable": False}}``;
- :622-644: the original ``config.json`` and the processor are saved next to the weights; :689-692: the unified HF
  checkpoint of the whole model (``export_hf_checkpoint``), which the PyTorch backend serves, re-setting its
  QuantConfig to keep the vision tower unquantized (modeling_qwen2vl.py@000a01de);
- calibration: hf_ptq calibrates this family with text (:348-368 default datasets). trtpipe calibrates with images
  as it does for mllama (:mod:`pipeline.quantize.vlm`): each sample is the chat template of an image part + the
  calibration text, through the checkpoint's image processor with one bundled photograph
  (:func:`pipeline.vision.images.bundled_samples`), so the decoder's quantizers see the image tokens' activations the
  served requests carry. The manifest records it (``image_calibration``).
"""

from __future__ import annotations

import inspect
import json
import shutil
import time
from pathlib import Path
from typing import Any

from pipeline.core import artifacts
from pipeline.core.errors import StageError
from pipeline.core.layout import HF_CKPT
from pipeline.quantize import ptq
from pipeline.recipe import Recipe, derived

#: files of the source checkpoint the export must carry for the backend and the CPU engine's facade (hf_ptq.py:622-644)
PROCESSOR_FILES = ("preprocessor_config.json", "chat_template.jinja", "chat_template.json", "generation_config.json")
#: vision_config fields the export must keep (the CPU engine's vision tower and the token rule read them)
VISION_FIELDS = ("depth", "embed_dim", "hidden_size", "num_heads", "patch_size", "spatial_merge_size", "temporal_patch_size")


def image_batches(tok: Any, proc: Any, texts: list[str], max_tokens: int, image_token_id: int) -> list[dict[str, Any]]:
    """One calibration batch per text with one bundled photograph (cycled): the chat template of
    ``[{"type": "image"}, {"type": "text", "text": …}]`` with the generation prompt, each ``<|image_pad|>`` expanded
    to the image's tokens (:func:`pipeline.vision.tiny_qwen2_vl.expand_image_pads`, as ``Qwen2VLProcessor`` does).

    Returns:
        dicts of ``input_ids``/``attention_mask``/``mm_token_type_ids`` [1, T], ``pixel_values`` [patches, C·2·14·14],
        ``image_grid_thw`` [1, 3].
    """
    import torch

    from pipeline.vision.images import bundled_samples
    from pipeline.vision.tiny_qwen2_vl import expand_image_pads

    images, out = bundled_samples(), []
    for i, text in enumerate(texts):
        question = tok.decode(tok(text, add_special_tokens=False)["input_ids"][:max_tokens])
        msgs = [{"role": "user", "content": [{"type": "image"}, {"type": "text", "text": question}]}]
        ids = tok.apply_chat_template(msgs, add_generation_prompt=True, tokenize=True)
        ids = list(ids["input_ids"] if hasattr(ids, "keys") else ids)
        px = proc(images=[images[i % len(images)].convert("RGB")], return_tensors="pt")
        ids = expand_image_pads(ids, px["image_grid_thw"].tolist(), image_token_id)
        t = torch.tensor([ids])
        out.append({"input_ids": t, "attention_mask": torch.ones_like(t),
                    "mm_token_type_ids": (t == image_token_id).to(torch.int32),
                    "pixel_values": px["pixel_values"], "image_grid_thw": px["image_grid_thw"]})
    return out


def quantize_qwen2_vl(recipe: Recipe, tmp: Path, key: str, source: Any, recipe_dir: Path) -> dict[str, Any]:
    """Quantize a Qwen2-VL checkpoint's language model with images and export the whole model into ``tmp/hf_ckpt``
    (``full_prec``: no quantizers, the same export).

    Args:
        recipe: a recipe with a Qwen2-VL-family ``vision`` section.
        tmp: the stage's temp directory.
        key: the stage's cache key.
        source: the :class:`pipeline.quantize.sources.ResolvedSource`.
        recipe_dir: the recipe's directory (calibration text paths).

    Returns:
        the stage manifest (quantizers, quality on held-out text, image calibration facts, timings).

    Raises:
        StageError: ModelOpt found no language model, calibration or export failed, or the export changed the
            checkpoint's geometry.
    """
    import modelopt.torch.quantization as mtq
    import torch
    from modelopt.torch.export import export_hf_checkpoint
    from transformers import AutoModelForImageTextToText, AutoTokenizer

    from pipeline.quantize import calib, common
    from pipeline.quantize.result import QuantizeResult
    from pipeline.vision.tiny_qwen2_vl import load_image_processor

    t0, q, timings = time.perf_counter(), recipe.quantization, {}
    src = Path(source.hf_dir)
    device = "cuda" if torch.cuda.is_available() else "cpu"
    export_dtype = getattr(torch, derived.model_dtype(recipe.model, recipe.target, common.checkpoint_dtype(src)))
    calib_dtype = torch.float32 if device == "cpu" else export_dtype
    tok = AutoTokenizer.from_pretrained(src, local_files_only=True)
    proc = load_image_processor(src)
    data = calib.prepare(q.calibration, tok, recipe_dir)
    ptq.phase(f"load {recipe.model.source} ({recipe.vision.family}, {str(calib_dtype).removeprefix('torch.')}, {device})")
    model = AutoModelForImageTextToText.from_pretrained(src, dtype=calib_dtype, local_files_only=True).eval().to(device)
    timings["load"] = time.perf_counter() - t0
    lm, excluded = common.language_model_only(model, str(src))
    cfg, t = ptq.quant_config(q), time.perf_counter()
    texts = [s.text for s in data.calib]  # full_prec calibrates nothing: 4 samples for the manifest's image facts
    batches = image_batches(tok, proc, texts if cfg is not None else texts[:4], data.max_seq_length,
                            int(model.config.image_token_id))
    takes_types = "mm_token_type_ids" in inspect.signature(model.forward).parameters  # transformers 5.x; 4.57 has none

    def loop(_m: Any) -> None:
        with torch.no_grad():
            for b in batches:
                model(**{k: v.to(device) for k, v in b.items() if takes_types or k != "mm_token_type_ids"}, use_cache=False)

    if cfg is not None:
        ptq.phase(f"calibrate {q.qformat} with images: {len(batches)} samples (bundled photographs + calibration text)")
        try:
            mtq.quantize(lm, cfg, forward_loop=loop)
        except Exception as e:  # ModelOpt raises many types; one line for the stage
            raise StageError(f"ModelOpt calibration of the {recipe.vision.family} language model failed: "
                             f"{type(e).__name__}: {(str(e).splitlines() or [''])[0]}") from e
    timings["calibrate"] = time.perf_counter() - t
    image_facts = {"images": len(batches) if cfg is not None else 0, "image_sources": "scikit-image bundled samples",
                   "image_tokens_per_sample": [int(b["mm_token_type_ids"].sum()) for b in batches][:4],
                   "excluded_from_quantization": excluded}
    t = time.perf_counter()
    quality = ptq.evaluate(model, data.eval_batches(tok, ptq.EVAL_BATCH))
    timings["evaluate"] = time.perf_counter() - t
    model.to(export_dtype)
    quantizers = ptq.quantizer_summary(model)
    hf_dir, t = tmp / HF_CKPT, time.perf_counter()
    with common.export_errors("unified HF checkpoint"):
        export_hf_checkpoint(model, dtype=export_dtype, export_dir=hf_dir)  # hf_ptq.py:689-692: the whole model
        tok.save_pretrained(hf_dir)
    proc.save_pretrained(hf_dir)  # hf_ptq.py:622-644: the processor next to the weights
    for name in PROCESSOR_FILES:
        if (src / name).is_file() and not (hf_dir / name).is_file():
            shutil.copyfile(src / name, hf_dir / name)
    tokenizer_adjustments = common.portable_tokenizer(hf_dir, common.runtime_transformers())
    timings["export_hf"] = time.perf_counter() - t
    timings["total"] = time.perf_counter() - t0
    problems = common.hf_geometry_problems(src / "config.json", hf_dir / "config.json") + _vision_problems(src, hf_dir)
    if problems:
        raise StageError("the unified HF checkpoint does not match the source model: " + "; ".join(problems))
    hf_quant = (json.loads((hf_dir / "hf_quant_config.json").read_text()).get("quantization") or {}) \
        if (hf_dir / "hf_quant_config.json").is_file() else {}
    exported = {"quant_algo": hf_quant.get("quant_algo"), "kv_cache_quant_algo": hf_quant.get("kv_cache_quant_algo")}
    expected = {"quant_algo": q.quant_algo, "kv_cache_quant_algo": q.kv_cache_quant_algo}
    if exported != expected:
        common.warn(f"ModelOpt exported {exported}; the recipe's table says {expected}")
    return artifacts.base_manifest(
        QuantizeResult.STAGE, key, status="built", recipe_hash=common.recipe_hash(recipe), consumed=common.consumed_fields(recipe),
        source=source.to_manifest(), calibration=data.summary(), versions=artifacts.library_versions(*common.VERSIONED),
        qformat=q.qformat, kv_cache_dtype=q.kv_cache_dtype, modelopt_config=ptq.QFORMAT_CFG[q.qformat], device=device,
        calib_dtype=str(calib_dtype).removeprefix("torch."), export_dtype=str(export_dtype).removeprefix("torch."),
        torch_threads=torch.get_num_threads(), decoder_type=recipe.vision.family, exported=exported, recipe_quant_algo=expected,
        hf_quantization=hf_quant, hf_ckpt_kv_cache_quant_algo=exported["kv_cache_quant_algo"], image_calibration=image_facts,
        quantizers=quantizers, quality=quality, timings_s={k: round(v, 3) for k, v in timings.items()},
        adjustments=tokenizer_adjustments, hf_geometry_checked=[*common.HF_GEOMETRY_FIELDS, *(f"vision_config.{k}" for k in VISION_FIELDS)],
        trtllm_ckpt_skipped="the PyTorch backend reads hf_ckpt (the vision tower stays in it, unquantized)",
        peak_rss_bytes=artifacts.peak_rss_bytes(), outputs={HF_CKPT: artifacts.file_hashes(hf_dir)},
    )


def _vision_problems(src: Path, hf_dir: Path) -> list[str]:
    """``"field: source → exported"`` for each vision_config field / token id the export changed (empty = kept)."""
    a, b = (json.loads((d / "config.json").read_text()) for d in (src, hf_dir))
    va, vb = a.get("vision_config") or {}, b.get("vision_config") or {}
    out = [f"vision_config.{k}: {va.get(k)!r} → {vb.get(k)!r}" for k in VISION_FIELDS if va.get(k) != vb.get(k)]
    return out + [f"{k}: {a.get(k)!r} → {b.get(k)!r}" for k in ("model_type", "image_token_id", "vision_start_token_id")
                  if a.get(k) != b.get(k)]
