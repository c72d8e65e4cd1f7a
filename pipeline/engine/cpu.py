"""``build.engine: cpu``: turn the quantized HF checkpoint into a CPU engine directory.

Output (``<build>/engine/``, written atomically)::

    model.safetensors    dequantized weights in build.cpu.dtype (they carry the weight-quantization
                         error of the exported format; see pipeline/cpu_runtime/dequant.py)
    config.json          plain transformers config (no quantization_config)
    tokenizer files      copied from <build>/quantize/hf_ckpt/ (tokenizer.json, chat template, …)
    engine_config.json   what pipeline.cpu_runtime.CpuEngine needs: limits, paged-KV pool, dtype
    manifest.json        stage, cache_key, versions, per-file sha256, timings, peak RSS

The engine limits keep their TensorRT-LLM names (max_batch_size, max_num_tokens, max_seq_len,
max_input_len, tokens_per_block, kv_cache_config.max_tokens) so the Triton layer and the
benchmark read one vocabulary for every engine kind.
"""

from __future__ import annotations

import json
import math
import shutil
import time
from pathlib import Path
from typing import Any

from pipeline.artifacts import (
    atomic_dir,
    base_manifest,
    file_hashes,
    library_versions,
    peak_rss_bytes,
    sha256_tree,
    stable_hash,
    write_manifest,
)
from pipeline.errors import StageError, UserError
from pipeline.layout import BuildLayout
from pipeline.models import geometry_from_dict
from pipeline.recipe import Recipe, derived
from pipeline.recipe.consumers import consumed
from pipeline.stages.results import EngineResult, QuantizeResult

STAGE = EngineResult.STAGE
ENGINE_CONFIG = "engine_config.json"
#: Bump when the engine directory layout or engine_config.json fields change.
BUILDER_VERSION = 1
#: Files of hf_ckpt/ that are not copied: weights and quantization metadata are rewritten here.
_SKIP = ("hf_quant_config.json", "config.json", "model.safetensors.index.json")
_DTYPE_BYTES = {"float32": 4, "bfloat16": 2}


def _model_config(hf_ckpt: Path, recipe: Recipe, dry_run: bool) -> dict[str, Any]:
    """The checkpoint's config.json (its ``text_config`` for multimodal wrappers). In a dry run
    without a checkpoint, the known geometry of ``model.source`` stands in (pipeline/data/models.yaml)."""
    path = hf_ckpt / "config.json"
    if not path.is_file() and dry_run:
        from pipeline.models import geometry_for_source

        geo = geometry_for_source(recipe.model.source)
        if geo is not None:
            return {**geo.model_dump(), "architectures": [geo.architecture]}
    if not path.is_file():
        raise StageError(f"{path} is missing: the quantize stage output is incomplete; rebuild it with --force")
    cfg = json.loads(path.read_text())
    return cfg.get("text_config", cfg)


def engine_config(recipe: Recipe, model_cfg: dict[str, Any]) -> dict[str, Any]:
    """The ``engine_config.json`` dict for ``recipe`` and the checkpoint's ``config.json``.

    KV pool: :func:`pipeline.recipe.derived.cpu_kv_pool_tokens` (``kv_cache_config.max_tokens``, else
    ``free_gpu_memory_fraction`` of physical RAM, at most ``max_batch_size × max_seq_len``), in whole blocks of
    ``tokens_per_block``. Raises :class:`UserError` when the pool cannot hold one ``max_seq_len``
    sequence or ``max_seq_len`` exceeds the model's ``max_position_embeddings``.
    """
    b = recipe.build
    max_seq_len = derived.require_max_seq_len(b, model_cfg.get("max_position_embeddings"))
    dtype = b.cpu.dtype
    per_tok = geometry_from_dict(model_cfg).kv_bytes_per_token(_DTYPE_BYTES[dtype])
    import psutil

    tokens, _ = derived.cpu_kv_pool_tokens(recipe, kv_bytes_per_token=per_tok, ram_bytes=psutil.virtual_memory().total,
                                           max_seq_len=max_seq_len)
    blocks = math.ceil(tokens / b.tokens_per_block)
    if blocks * b.tokens_per_block < max_seq_len:
        raise UserError(
            f"build.kv_cache_config.max_tokens {tokens} is smaller than max_seq_len {max_seq_len}: "
            "a full-length request would not fit the KV cache"
        )
    q = recipe.quantization
    return {
        "kind": "cpu",
        "builder_version": BUILDER_VERSION,
        "architecture": (model_cfg.get("architectures") or ["unknown"])[0],
        "dtype": dtype,
        "num_threads": b.cpu.num_threads,
        "attn_implementation": "sdpa",
        "scheduler": "fifo",
        "max_batch_size": b.max_batch_size,
        "max_num_tokens": b.max_num_tokens,
        "max_seq_len": max_seq_len,
        "max_input_len": b.max_input_len,
        "max_beam_width": 1,
        "tokens_per_block": b.tokens_per_block,
        "kv_cache_blocks": blocks,
        "kv_cache_tokens": blocks * b.tokens_per_block,
        "kv_cache_bytes": blocks * b.tokens_per_block * per_tok,
        "enable_block_reuse": b.kv_cache_config.enable_block_reuse,
        "enable_chunked_prefill": True,  # transformers' scheduler always splits prefills > max_num_tokens
        "qformat": q.qformat,
        "quant_algo": q.quant_algo,
        "kv_cache_dtype": q.kv_cache_dtype,
        "emulated": {"weights": q.qformat != "full_prec", "activations": False, "kv_cache": False},
        "vocab_size": model_cfg["vocab_size"],
    }


def _cache_key(recipe: Recipe, quantized: QuantizeResult, dry_run: bool) -> str:
    versions = library_versions("torch", "transformers", "safetensors")
    return stable_hash(
        {
            "stage": STAGE,
            "builder_version": BUILDER_VERSION,
            "recipe": consumed(recipe, "engine", "engine_cpu", "runtime"),  # engine_config.json holds the KV/scheduler limits too
            "quantize_cache_key": quantized.cache_key,
            "versions": versions,
            "dry_run": dry_run,
        }
    )


def run(recipe: Recipe, layout: BuildLayout, *, quantized: QuantizeResult, force: bool = False, dry_run: bool = False) -> EngineResult:
    """Build the CPU engine directory ``layout.engine`` from ``quantized.hf_ckpt``.

    Reuses ``out_dir`` when its manifest's cache key (recipe ``build`` section, quantization
    format, the quantize manifest's cache key, torch/transformers versions) matches, unless
    ``force``. ``dry_run`` writes ``engine_config.json`` and the manifest only (no weights).

    Raises:
        UserError: the recipe's limits do not fit the model (see :func:`engine_config`).
        StageError: ``hf_ckpt/`` is missing or holds a tensor layout that cannot be dequantized.
    """
    import torch

    from pipeline.cpu_runtime.dequant import DequantError, iter_dequantized, plain_config

    out_dir = layout.engine
    key = _cache_key(recipe, quantized, dry_run)
    if not force:
        hit = EngineResult.load(out_dir, key)
        if hit:
            return hit
    t0 = time.perf_counter()
    hf_ckpt = quantized.hf_ckpt
    model_cfg = _model_config(hf_ckpt, recipe, dry_run)
    ecfg = engine_config(recipe, model_cfg)
    timings: dict[str, float] = {}
    with atomic_dir(out_dir) as tmp:
        (tmp / ENGINE_CONFIG).write_text(json.dumps(ecfg, indent=2, sort_keys=True) + "\n")
        inputs: dict[str, Any] = {"quantize_cache_key": quantized.cache_key}
        if not dry_run:
            from safetensors.torch import save_file

            t = time.perf_counter()
            try:
                state = dict(iter_dequantized(hf_ckpt, getattr(torch, ecfg["dtype"])))
            except (DequantError, FileNotFoundError) as e:
                raise StageError(f"cannot dequantize {hf_ckpt}: {e}") from e
            timings["dequantize"] = time.perf_counter() - t
            t = time.perf_counter()
            save_file(state, str(tmp / "model.safetensors"), metadata={"format": "pt"})
            del state
            (tmp / "config.json").write_text(json.dumps(plain_config(hf_ckpt, ecfg["dtype"]), indent=2) + "\n")
            for f in sorted(hf_ckpt.iterdir()):
                if f.is_file() and f.suffix != ".safetensors" and f.name not in _SKIP:
                    shutil.copy2(f, tmp / f.name)
            timings["write"] = time.perf_counter() - t
            inputs["hf_ckpt_sha256"] = sha256_tree(hf_ckpt)
        timings["total"] = time.perf_counter() - t0
        manifest = base_manifest(
            STAGE,
            key,
            engine_kind="cpu",
            status="dry_run" if dry_run else "built",
            consumed=consumed(recipe, "engine", "engine_cpu", "runtime"),
            world_size=1,
            max_seq_len=ecfg["max_seq_len"],
            versions=library_versions("torch", "transformers", "safetensors", "nvidia-modelopt"),
            files=file_hashes(tmp),
            inputs=inputs,
            engine_config=ecfg,
            timings_s=timings,
            peak_rss_bytes=peak_rss_bytes(),
        )
        write_manifest(tmp, manifest)
    return EngineResult.from_manifest(out_dir, manifest)
