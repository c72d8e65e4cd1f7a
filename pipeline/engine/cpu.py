"""``build.engine: cpu``: turn the quantized HF checkpoint into a CPU engine directory.

Output (``<build>/engine/``, written atomically)::

    model.safetensors    dequantized weights in build.cpu.dtype (they carry the weight-quantization
                         error of the exported format; see pipeline/cpu_runtime/dequant.py); for mllama the
                         language model only, renamed (pipeline/cpu_runtime/cross_attention.py: the vision
                         tower and projector stay out, they run in the vision encoder's ONNX model), and
                         engine_config.json gains encoder_len_per_image / max_encoder_input_len; for the
                         Qwen2-VL family the decoder only, plus vision/ (the tower the LLM facade runs;
                         pipeline/engine/cpu_vision.py) and engine_config.json's ``vision``
    config.json          plain transformers config (no quantization_config)
    tokenizer files      copied from <build>/quantize/hf_ckpt/ (tokenizer.json, chat template, …)
    engine_config.json   what pipeline.cpu_runtime.CpuEngine needs: runtime, limits, KV-cache rule, precision, and
                         the LoRA adapters (``lora``: max_lora_rank, target modules, each adapter's name, task id, dir)
    lora/<name>/         each ``build.lora`` adapter's adapter_config.json + adapter_model.safetensors, copied
    manifest.json        stage, cache_key, versions, per-file sha256, timings, peak RSS
    llm_api_config.{yaml,json}   only for ``build.engine: pytorch`` on the cpu target: the ``LLM()`` kwargs
                         (:func:`pipeline.trtllm.llmapi.llm_api_kwargs`, ``model``/``tokenizer`` = this directory) that the
                         ``llmapi`` Triton model passes to :class:`pipeline.cpu_runtime.llm.LLM`

The engine limits keep their TensorRT-LLM names (max_batch_size, max_num_tokens, max_seq_len,
max_input_len) so the Triton layer and the benchmark read one vocabulary for every engine kind.

What the CPU engine honours from the recipe, and what it refuses (one line, at build time):

- ``build.kv_cache_config.max_tokens`` and ``free_gpu_memory_fraction``: on CPU the fraction is a
  share of the host RAM available when the engine loads (after its weights); the KV cache holds
  min(max_tokens, fraction × available / fp32 K+V bytes per token) tokens, in slots of
  ``max_seq_len`` tokens, at most ``max_batch_size`` slots (:func:`pipeline.cpu_runtime.kv.kv_slots`).
  ``max_tokens`` below ``max_seq_len`` is refused.
- ``build.enable_chunked_prefill``: prompts longer than the step budget (``max_num_tokens``) are split
  across steps when true, admitted whole otherwise.
- ``enable_block_reuse: true``: prompt-prefix KV reuse, on the LLM-API path (``build.engine: pytorch``) only
  (pipeline/cpu_runtime/prefix.py; the facade passes it to the engine); refused with ``build.engine: cpu``.
- refused: ``max_attention_window``,
  ``host_cache_size``, ``kv_cache_type`` other than paged, ``max_beam_width`` > 1, the
  ``MAX_UTILIZATION`` scheduler (the slot cache guarantees every admitted request its KV:
  ``GUARANTEED_NO_EVICT``), and models the decoder does not implement
  (:func:`pipeline.cpu_runtime.model.check_supported`).
"""

from __future__ import annotations

import json
import os
import shutil
import time
from pathlib import Path
from typing import Any

from pipeline.core.artifacts import (
    MANIFEST,
    atomic_dir,
    base_manifest,
    file_hashes,
    library_versions,
    peak_rss_bytes,
    read_manifest,
    sha256_file,
    sha256_tree,
    stable_hash,
    write_manifest,
)
from pipeline.core.disk import cpu_engine_bytes
from pipeline.core.errors import StageError, UserError
from pipeline.core.geometry import geometry_from_dict
from pipeline.core.layout import BuildLayout
from pipeline.cpu_runtime.multimodal import decoder_config, is_image_token_model
from pipeline.engine.cpu_vision import vision_section, write_image_model
from pipeline.engine.result import EngineResult
from pipeline.quantize.result import QuantizeResult
from pipeline.recipe import Recipe, derived
from pipeline.recipe.consumers import consumed
from pipeline.recipe.serving_path import serving_path
from pipeline.recipe.vision import cross_attention

STAGE = EngineResult.STAGE
ENGINE_CONFIG = "engine_config.json"
#: The LLM() kwargs of ``build.engine: pytorch`` on the cpu target (the name pipeline/engine/pytorch.py writes).
LLM_API_CONFIG = "llm_api_config.yaml"
#: Bump when the engine directory layout or engine_config.json fields change.
BUILDER_VERSION = 6  # 6: kv_cache.dtype follows build.cpu.dtype (bfloat16 KV cache for bfloat16 builds)
#: Files of hf_ckpt/ that are not copied: weights and quantization metadata are rewritten here.
_SKIP = ("hf_quant_config.json", "config.json", "model.safetensors.index.json")
#: The runtime that serves the engine directory (pipeline/cpu_runtime/engine.py RUNTIME).
RUNTIME = "trtpipe-torch"


def _model_config(quantized: QuantizeResult, recipe: Recipe, dry_run: bool) -> dict[str, Any]:
    """The checkpoint's config.json (its ``text_config`` for multimodal wrappers but mllama, whose cross-attention
    layers the CPU engine runs: the whole config). In a dry run without a checkpoint, the geometry of ``model.source``
    stands in (pipeline/data/models.yaml, else the local source directory the quantize stage resolved against the
    recipe's directory: :meth:`QuantizeResult.source_geometry`)."""
    path = quantized.hf_ckpt / "config.json"
    if not path.is_file() and dry_run:
        geo = quantized.source_geometry(recipe.model.source)
        if geo is not None:
            return {**geo.model_dump(), "architectures": [geo.architecture]}
    if not path.is_file():
        raise StageError(f"{path} is missing: the quantize stage output is incomplete; rebuild it with --force")
    cfg = json.loads(path.read_text())
    if is_image_token_model(cfg):  # Qwen2-VL family: the decoder as a Qwen2ForCausalLM (pipeline/engine/cpu_vision.py)
        return decoder_config(cfg)
    return cfg if (cfg.get("architectures") or [""])[0] == "MllamaForConditionalGeneration" else cfg.get("text_config", cfg)


def engine_config(recipe: Recipe, model_cfg: dict[str, Any]) -> dict[str, Any]:
    """The ``engine_config.json`` dict for ``recipe`` and the checkpoint's ``config.json``.

    The KV cache is sized when the engine loads, by :func:`pipeline.cpu_runtime.kv.kv_slots` (it depends
    on the host RAM available then, as TensorRT-LLM's ``free_gpu_memory_fraction`` depends on free GPU memory);
    this records the rule's inputs (``kv_cache.max_tokens``, ``kv_cache.free_memory_fraction``), the KV cache's
    dtype (``build.cpu.dtype``: float32, or bfloat16 with bfloat16 GEMMs) and its K+V bytes per token.
    Settings the engine cannot honour are refused when the recipe loads
    (:func:`pipeline.recipe.derived.cpu_engine_problems`). Raises :class:`UserError` (one line naming the field)
    for an unsupported model, ``kv_cache_config.max_tokens`` below ``max_seq_len``, or ``max_seq_len`` above the
    model's ``max_position_embeddings``.
    """
    from pipeline.cpu_runtime.cross_attention import checked_view
    from pipeline.cpu_runtime.model import (
        COMPUTE_DTYPES,
        UnsupportedModelError,
        check_supported,
    )

    b = recipe.build
    try:
        check_supported(model_cfg)
        full_cfg, model_cfg = model_cfg, checked_view(model_cfg, UnsupportedModelError)  # mllama: its self-attn stack
    except UnsupportedModelError as e:
        raise UserError(f"model.source: {e}") from None
    max_seq_len = derived.require_max_seq_len(b, model_cfg.get("max_position_embeddings"))
    kv = b.kv_cache_config
    if kv.max_tokens is not None and kv.max_tokens < max_seq_len:
        raise UserError(
            f"build.kv_cache_config.max_tokens {kv.max_tokens} is smaller than max_seq_len {max_seq_len}: "
            "a full-length request would not fit the KV cache"
        )
    q = recipe.quantization
    compute = b.cpu.dtype
    return {
        "kind": "cpu",
        "runtime": RUNTIME,
        "builder_version": BUILDER_VERSION,
        "architecture": (full_cfg.get("architectures") or ["unknown"])[0],
        "dtype": b.cpu.dtype,
        "compute_dtype": compute,
        "num_threads": b.cpu.num_threads,
        "max_batch_size": b.max_batch_size,
        "max_num_tokens": b.max_num_tokens,
        "max_seq_len": max_seq_len,
        "max_input_len": b.max_input_len,
        "max_beam_width": 1,
        "kv_cache": {
            "layout": "slots",
            "max_tokens": kv.max_tokens,
            "free_memory_fraction": kv.free_gpu_memory_fraction,
            # the KV cache in the compute dtype, as TensorRT-LLM keeps an unquantized KV cache in the model's dtype
            # (``_create_kv_cache_manager`` in tensorrt_llm/_torch/pyexecutor/_util.py@0004396)
            "dtype": compute,
            "bytes_per_token": geometry_from_dict(model_cfg).kv_bytes_per_token(COMPUTE_DTYPES[compute].itemsize),
        },
        "enable_chunked_prefill": b.enable_chunked_prefill,
        "scheduler": "GUARANTEED_NO_EVICT",
        "qformat": q.qformat,
        "quant_algo": q.quant_algo,
        "kv_cache_dtype": q.kv_cache_dtype,
        "precision": {
            "weights": "float32" if q.qformat == "full_prec" and b.cpu.dtype == "float32" else
            (f"{q.qformat} dequantized to {b.cpu.dtype}" if q.qformat != "full_prec" else b.cpu.dtype),
            "activations": compute,  # the GEMMs' inputs; residual stream, norms, RoPE and attention stay float32
            "kv_cache": compute,
        },
        "emulated": {"weights": q.qformat != "full_prec", "activations": False, "kv_cache": False},
        "vocab_size": model_cfg["vocab_size"],
        **(_encoder_limits(recipe, full_cfg) if full_cfg is not model_cfg else {}),
    }


def _encoder_limits(recipe: Recipe, cfg: dict[str, Any]) -> dict[str, int]:
    """mllama: ``encoder_len_per_image`` and ``max_encoder_input_len`` (vectors per request: the recipe's
    ``vision.max_images_per_request``, one image without a vision section), by the one rule of
    :func:`pipeline.vision.geometry.mllama_encoder_len` on the checkpoint's ``vision_config`` (``recipe validate``
    checks that the recipe's vision section agrees with it)."""
    from pipeline.vision.geometry import mllama_encoder_len

    vc = cfg["vision_config"]
    vision = getattr(recipe, "vision", None)
    images = vision.max_images_per_request if vision is not None else 1
    geo = (int(vc["max_num_tiles"]), int(vc["image_size"]), int(vc["patch_size"]))
    return {"encoder_len_per_image": mllama_encoder_len(1, *geo), "max_encoder_input_len": mllama_encoder_len(images, *geo)}


def write_weights(hf_ckpt: Path, out_dir: Path, dtype: str) -> None:
    """``out_dir/model.safetensors`` + ``config.json`` from the (quantized) checkpoint: dequantized to ``dtype``
    (pipeline/cpu_runtime/dequant.py); an mllama checkpoint's language model only, renamed to the engine's layout
    (:func:`pipeline.cpu_runtime.cross_attention.engine_tensor_name`: the vision tower and projector stay out — they
    run in the vision encoder). Raises :class:`StageError` for a layout that cannot be dequantized."""
    import torch
    from safetensors.torch import save_file

    from pipeline.cpu_runtime.cross_attention import engine_tensor_name
    from pipeline.cpu_runtime.dequant import (
        DequantError,
        iter_dequantized,
        plain_config,
    )

    cfg = plain_config(hf_ckpt, dtype)
    if is_image_token_model(cfg):  # decoder + vision/ (the facade runs the tower: pipeline/engine/cpu_vision.py)
        return write_image_model(hf_ckpt, out_dir, dtype, cfg)
    try:
        state = {new: t for name, t in iter_dequantized(hf_ckpt, getattr(torch, dtype))
                 if (new := engine_tensor_name(name, cfg)) is not None}
    except (DequantError, FileNotFoundError) as e:
        raise StageError(f"cannot dequantize {hf_ckpt}: {e}") from e
    save_file(state, str(out_dir / "model.safetensors"), metadata={"format": "pt"})
    (out_dir / "config.json").write_text(json.dumps(cfg, indent=2) + "\n")


def _cache_key(recipe: Recipe, quantized: QuantizeResult, dry_run: bool) -> str:
    versions = library_versions("torch", "transformers", "safetensors")
    return stable_hash(
        {
            "stage": STAGE,
            "engine_kind": recipe.build.engine,  # pytorch: the same directory plus llm_api_config.{yaml,json}
            "builder_version": BUILDER_VERSION,
            "recipe": consumed(recipe, "engine", "engine_cpu", "runtime"),  # engine_config.json holds the KV/scheduler limits too
            "quantize_cache_key": quantized.cache_key,
            "versions": versions,
            "dry_run": dry_run,
            **({"lora_files": _lora_hashes(recipe)} if recipe.build.lora else {}),  # the adapters' bytes, not only paths
            **({"vision": recipe.vision.model_dump()} if recipe.vision is not None else {}),  # engine_config's vision
        }
    )


def _lora_hashes(recipe: Recipe) -> dict[str, str]:
    """``{adapter name: sha256 of its two files}`` of ``build.lora`` (empty without LoRA)."""
    from pipeline.core.lora import CONFIG_FILE, WEIGHTS_FILE

    spec = recipe.build.lora
    return {a.name: stable_hash([sha256_file(Path(a.path) / f) for f in (CONFIG_FILE, WEIGHTS_FILE)])
            for a in (spec.adapters if spec else ())}


def lora_section(recipe: Recipe) -> dict[str, Any] | None:
    """engine_config.json's ``lora``: ``max_lora_rank``, ``target_modules`` (transformers names) and per adapter
    ``name``, ``task_id`` (what a request's ``lora_task_id`` selects), ``dir`` (``lora/<name>``, relative to the
    engine directory), ``rank`` and ``alpha`` (from its adapter_config.json); ``None`` without ``build.lora``.
    Raises :class:`UserError` for an adapter that cannot be served (paths must be absolute: the build resolves them)."""
    from pipeline.core.lora import AdapterError, read_adapter_config
    from pipeline.recipe.lora import target_modules, task_ids

    spec = recipe.build.lora
    if spec is None:
        return None
    adapters = []
    for i, (a, tid) in enumerate(zip(spec.adapters, task_ids(spec))):
        try:
            cfg = read_adapter_config(Path(a.path))
        except AdapterError as e:
            raise UserError(f"build.lora.adapters.{i}.path: {e}") from None
        adapters.append({"name": a.name, "task_id": tid, "dir": f"lora/{a.name}", "rank": cfg.rank, "alpha": cfg.alpha,
                         "target_modules": list(cfg.target_modules)})
    return {"max_lora_rank": spec.max_lora_rank, "target_modules": target_modules(spec, [tuple(a["target_modules"]) for a in adapters]),
            "adapters": adapters}


def _weights_key(hf_ckpt_sha256: str, dtype: str) -> str:
    """What ``model.safetensors``, ``config.json`` and the tokenizer files depend on: the quantized checkpoint
    (by its content, :func:`pipeline.core.artifacts.sha256_tree`), the weight dtype, this builder and the libraries
    that write them. The limits in ``engine_config.json`` are not part of it."""
    return stable_hash(
        {
            "builder_version": BUILDER_VERSION,
            "hf_ckpt_sha256": hf_ckpt_sha256,
            "dtype": dtype,
            "versions": library_versions("torch", "transformers", "safetensors"),
        }
    )


def _link_weights(old: Path, weights_key: str, tmp: Path) -> dict[str, str]:
    """Hard-link the weight and tokenizer files of the engine already in ``old`` into ``tmp`` when it was built
    (not a dry run) from the same weights (:func:`_weights_key`) and every file still has the sha256 its
    manifest recorded. Returns ``{file name: sha256}`` of the linked files, ``{}`` when nothing was reusable
    (then ``tmp`` is left as it was). Falls back to a copy across filesystems."""
    m = read_manifest(old)
    if not m or m.get("status") != "built" or (m.get("inputs") or {}).get("weights_key") != weights_key:
        return {}
    limits = (ENGINE_CONFIG, LLM_API_CONFIG, LLM_API_CONFIG.replace(".yaml", ".json"))  # rewritten, never linked
    want = {name: sha for name, sha in (m.get("files") or {}).items() if name not in limits and not name.startswith("lora/")}
    if "model.safetensors" not in want or any("/" in n for n in want):
        return {}
    for name, sha in want.items():
        src = old / name
        if not src.is_file() or sha256_file(src) != sha:
            for n in want:
                (tmp / n).unlink(missing_ok=True)
            return {}
        try:
            os.link(src, tmp / name)
        except OSError:
            shutil.copy2(src, tmp / name)
    return want


def _write_llm_api_config(tmp: Path, recipe: Recipe, out_dir: Path) -> dict[str, Any]:
    """``build.engine: pytorch`` on the cpu target: write ``llm_api_config.{yaml,json}`` into ``tmp`` — the LLM-API
    kwargs of the recipe with ``model``/``tokenizer`` = the engine directory's final path — and return them."""
    import yaml

    from pipeline.trtllm.llmapi import kwargs_problems, llm_api_kwargs

    final = str(out_dir.resolve())
    kwargs = {**llm_api_kwargs(recipe, tmp), "model": final, "tokenizer": final}
    if recipe.build.lora is not None:  # the adapters' copies in this directory (hashed in its manifest)
        kwargs["lora_config"]["lora_dir"] = [str(out_dir.resolve() / "lora" / a.name) for a in recipe.build.lora.adapters]
    problems = kwargs_problems(kwargs)
    if problems:  # a programming error: the contract table and llm_api_kwargs disagree
        raise StageError("LLM-API config: " + "; ".join(problems))
    (tmp / LLM_API_CONFIG).write_text(yaml.safe_dump(kwargs, sort_keys=False))
    (tmp / LLM_API_CONFIG.replace(".yaml", ".json")).write_text(json.dumps(kwargs, indent=2) + "\n")
    return kwargs


def run(recipe: Recipe, layout: BuildLayout, *, quantized: QuantizeResult, force: bool = False, dry_run: bool = False) -> EngineResult:
    """Build the CPU engine directory ``layout.engine`` from ``quantized.hf_ckpt`` (``build.engine: pytorch`` on the
    cpu target: the same directory plus the ``LLM()`` kwargs, :func:`_write_llm_api_config`).

    Reuses ``out_dir`` when its manifest's cache key (recipe ``build`` section, quantization
    format, the quantize manifest's cache key, torch/transformers versions) matches, unless
    ``force``. ``dry_run`` writes ``engine_config.json`` and the manifest only (no weights). When only
    the limits changed (the engine already in ``out_dir`` was built from the same quantized checkpoint,
    dtype and libraries) and ``force`` is not set, its weight and tokenizer files are hard-linked instead of
    rewritten (a rebuild for a new max_batch_size takes about a second and no new disk).

    Raises:
        UserError: the recipe's limits do not fit the model (see :func:`engine_config`).
        StageError: ``hf_ckpt/`` is missing or holds a tensor layout that cannot be dequantized; less free disk
            than the dequantized weights need (:func:`pipeline.core.disk.cpu_engine_bytes`), or the disk filled.
    """
    out_dir = layout.engine
    if not dry_run:
        # the runtime's native kernels are built once per machine (pipeline/cpu_runtime/native.py), here so that
        # `serve` finds them ready; where they cannot be built, the engine runs its torch path and says so
        from pipeline.cpu_runtime import native

        native.kernels()
    key = _cache_key(recipe, quantized, dry_run)
    if not force:
        hit = EngineResult.load(out_dir, key)
        if hit:
            return hit
    t0 = time.perf_counter()
    hf_ckpt = quantized.hf_ckpt
    model_cfg = _model_config(quantized, recipe, dry_run)
    ecfg = engine_config(recipe, model_cfg)
    lora = lora_section(recipe)
    if lora:
        ecfg["lora"] = lora
    if recipe.vision is not None and not cross_attention(recipe.vision):  # image tokens: the facade's image limits
        ecfg["vision"] = vision_section(recipe.vision, ecfg["dtype"])
    timings: dict[str, float] = {}
    need = None if dry_run else cpu_engine_bytes(hf_ckpt / "config.json", ecfg["dtype"])
    with atomic_dir(out_dir, need_bytes=need) as tmp:
        (tmp / ENGINE_CONFIG).write_text(json.dumps(ecfg, indent=2, sort_keys=True) + "\n")
        if lora and not dry_run:
            from pipeline.core.lora import CONFIG_FILE, WEIGHTS_FILE

            for a, entry in zip(recipe.build.lora.adapters, lora["adapters"]):
                (tmp / entry["dir"]).mkdir(parents=True)
                for f in (CONFIG_FILE, WEIGHTS_FILE):
                    shutil.copy2(Path(a.path) / f, tmp / entry["dir"] / f)
        inputs: dict[str, Any] = {"quantize_cache_key": quantized.cache_key}
        linked: dict[str, str] = {}
        if not dry_run:
            inputs["hf_ckpt_sha256"] = sha256_tree(hf_ckpt)
            inputs["weights_key"] = _weights_key(inputs["hf_ckpt_sha256"], ecfg["dtype"])
            t = time.perf_counter()
            linked = {} if force else _link_weights(out_dir, inputs["weights_key"], tmp)  # only the limits changed
            if linked:
                timings["link_weights"] = time.perf_counter() - t
        if not dry_run and not linked:
            t = time.perf_counter()
            write_weights(hf_ckpt, tmp, ecfg["dtype"])
            timings["dequantize"] = time.perf_counter() - t
            for f in sorted(hf_ckpt.iterdir()):
                if f.is_file() and f.suffix != ".safetensors" and f.name not in _SKIP:
                    shutil.copy2(f, tmp / f.name)
        extra: dict[str, Any] = {}
        if serving_path(recipe).llm_api:  # pytorch on the cpu target: the LLM facade's LLM() arguments
            extra = {"llm_api_config": LLM_API_CONFIG, "llm_api_kwargs": _write_llm_api_config(tmp, recipe, out_dir)}
        timings["total"] = time.perf_counter() - t0
        manifest = base_manifest(
            STAGE,
            key,
            engine_kind=recipe.build.engine,
            serving_path=serving_path(recipe).key,
            runtime=RUNTIME,
            precision=ecfg["precision"],
            status="dry_run" if dry_run else "built",
            consumed=consumed(recipe, "engine", "engine_cpu", "runtime"),
            world_size=1,
            max_seq_len=ecfg["max_seq_len"],
            versions=library_versions("torch", "transformers", "safetensors", "nvidia-modelopt"),
            files={**file_hashes(tmp, exclude=(MANIFEST, *linked)), **linked},
            inputs=inputs,
            engine_config=ecfg,
            timings_s=timings,
            peak_rss_bytes=peak_rss_bytes(),
            **extra,
        )
        write_manifest(tmp, manifest)
    return EngineResult.from_manifest(out_dir, manifest)
