"""The vision encoder stage (issue #46 item 3): the checkpoint's vision model + projector → ONNX → (GPU) TensorRT.

``run(recipe, layout, *, recipe_dir)`` runs between quantize and engine for a recipe with a ``vision`` section and
writes ``layout.vision`` atomically (nothing half-written on failure)::

    onnx/model.onnx            vision_model + multi_modal_projector (:mod:`pipeline.vision.onnx_export`: upstream's
                               wrapper, opset 17, inputs pixel_values / aspect_ratio_ids / aspect_ratio_mask,
                               output encoder_output, batch-dynamic), in the encoder dtype
    config.json                ``builder_config`` as the Triton ``multimodal_encoders`` model reads it (model_type,
                               precision, max_batch_size, output_shape; multimodal_encoders/1/model.py@54821769);
                               on a GPU host the TensorRT build script rewrites it with Builder.save_config
    preprocessor_config.json   the checkpoint's image processor parameters (the preprocessing model reads them)
    build_vision_engine.py     GPU target: the TensorRT build (:mod:`pipeline.vision.trt_build`), run when TensorRT
                               is here (``model.engine``), else status ``not_built``
    export_vision_onnx.py, vision_command.sh   dry run: the two steps a user runs in the container
    manifest.json              cache key, status, the ORT-vs-PyTorch parity, the graph's signature, hashes, timings

The vision tower comes from the SOURCE checkpoint, not the quantize stage's output: ModelOpt leaves it unquantized
(:mod:`pipeline.quantize.vlm`) and upstream builds the vision engine from the HF checkpoint in its own dtype
(multimodal_builder.py@b35ac1b64368 ``build_mllama_engine``). So the stage's content key is the source's content hash,
the vision section, ``build.max_batch_size`` (the engine's batch = requests × images), the target and the versions of
torch / transformers / onnx / onnxruntime — a quantization change does not rebuild it.

Parity: onnxruntime runs a float32 export of the same wrapper against PyTorch on photographs at batch 1 and 2
(different aspect ratios) and the max abs difference goes into the manifest; above the tolerance of
:mod:`pipeline.vision.onnx_export` the stage fails (StageError naming both numbers). For a bfloat16/float16 encoder
(GPU targets) the float32 graph is the parity witness and the kept graph is the same trace in the encoder dtype.
"""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

from pipeline.core import artifacts
from pipeline.core.errors import StageError
from pipeline.core.layout import BuildLayout
from pipeline.core.recipe_paths import recipe_path
from pipeline.recipe import Recipe
from pipeline.recipe.consumers import consumed
from pipeline.recipe.serving_path import serving_path
from pipeline.recipe.vision import cross_attention
from pipeline.vision import geometry as vgeo
from pipeline.vision.result import (
    CONFIG_FILE,
    ONNX_FILE,
    PREPROCESSOR_FILE,
    VisionResult,
)

STAGE = VisionResult.STAGE
#: Bump when the stage's output for the same inputs changes (invalidates cached results).
STAGE_VERSION = 1
VERSIONED = ("torch", "transformers", "onnx", "onnxruntime")
#: the photographs the parity batches use (scikit-image's bundled samples; different sizes and aspects)
PARITY_BATCHES = (("astronaut",), ("chelsea", "rocket"))


def consumed_fields(recipe: Recipe) -> dict[str, Any]:
    """The recipe fields this stage reads: ``model.*``, the engine-side ``vision.*`` fields, ``build.max_batch_size``
    and ``target.gpu`` (flattened, :mod:`pipeline.recipe.consumers`)."""
    q, e = consumed(recipe, "quantize"), consumed(recipe, "engine")
    return {**{k: v for k, v in q.items() if k.startswith("model.")},
            **{k: v for k, v in e.items() if k.startswith("vision.") or k in ("build.max_batch_size", "target.gpu")}}


def encoder_dtype(recipe: Recipe) -> str:
    """The graph's dtype: the recipe's ``vision.encoder_dtype`` (float32 on the CPU target, where onnxruntime runs it)."""
    assert recipe.vision is not None
    return recipe.vision.encoder_dtype


def per_sample_shapes(recipe: Recipe) -> dict[str, tuple[int, ...]]:
    """The encoder inputs' shapes without the batch axis, from the vision section (one image per sample, the processor
    pads to ``max_tiles``): pixel_values (1, tiles, 3, tile, tile), aspect_ratio_ids (1,), aspect_ratio_mask (1, tiles)."""
    v = recipe.vision
    assert v is not None
    return {"pixel_values": (1, v.max_tiles, 3, v.tile_size, v.tile_size), "aspect_ratio_ids": (1,),
            "aspect_ratio_mask": (1, v.max_tiles)}


def encoder_len_per_image(recipe: Recipe) -> int:
    """Encoder vectors one image yields (:func:`pipeline.vision.geometry.mllama_encoder_len` of one image)."""
    v = recipe.vision
    assert v is not None
    return vgeo.mllama_encoder_len(1, v.max_tiles, v.tile_size, v.patch_size)


def multimodal_config(recipe: Recipe, output_shape: list[int], max_batch_size: int) -> dict[str, Any]:
    """``config.json`` in the form ``Builder.save_config`` writes and the Triton ``multimodal_encoders`` model reads
    (``builder_config.model_type`` / ``precision``; multimodal_encoders/1/model.py@54821769), with the keys
    ``build_trt_engine`` passes to ``create_builder_config`` (multimodal_builder.py@b35ac1b64368)."""
    assert recipe.vision is not None
    return {"builder_config": {"model_type": recipe.vision.family, "precision": encoder_dtype(recipe),
                               "max_batch_size": max_batch_size, "output_shape": output_shape,
                               "strongly_typed": False, "model_name": "multiModal"}}


def cache_key(recipe: Recipe, *, source_hash: str | None, dry_run: bool) -> str:
    """Hash of what the output depends on (module docstring)."""
    return artifacts.stable_hash({"stage_version": STAGE_VERSION, "recipe": consumed_fields(recipe), "source": source_hash,
                                  "on_cpu": serving_path(recipe).on_cpu,
                                  "versions": artifacts.library_versions(*VERSIONED), "dry_run": dry_run})


def run(recipe: Recipe, layout: BuildLayout, *, recipe_dir: Path, force: bool = False, dry_run: bool = False) -> VisionResult:
    """Export (and on a GPU host build) the vision encoder of ``recipe`` into ``layout.vision``.

    Args:
        recipe: a validated recipe with a ``vision`` section.
        layout: the build directory.
        recipe_dir: the recipe's directory (a relative ``model.source``).
        force: rebuild even when the stored result has the same cache key.
        dry_run: load nothing; write the container's export + build scripts and the manifest.

    Returns:
        :class:`VisionResult` (``cached=True`` when reused; ``status`` built | not_built | dry_run).

    Raises:
        UserError: the source cannot be resolved or is not the vision family (:func:`pipeline.vision.tiny_mllama.load_mllama`).
        StageError: the export or ``onnx.checker`` failed, onnxruntime differs from PyTorch beyond the tolerance
            (both numbers named), or the TensorRT build script failed on this GPU host.
    """
    if not cross_attention(recipe.vision):
        raise ValueError("the vision stage needs a recipe with a vision section")
    out_dir = layout.vision
    if dry_run:
        key = cache_key(recipe, source_hash=None, dry_run=True)
        if not force and (hit := VisionResult.load(out_dir, key)):
            return hit
        return _dry_run(recipe, out_dir, key, recipe_dir)
    from pipeline.core.quiet import quiet_libraries
    from pipeline.quantize.sources import resolve_source

    with quiet_libraries():
        source = resolve_source(recipe.model, Path(recipe_dir))
    key = cache_key(recipe, source_hash=source.content_hash, dry_run=False)
    if not force and (hit := VisionResult.load(out_dir, key)) and hit.status in ("built", "not_built"):
        return hit
    with artifacts.atomic_dir(out_dir) as tmp:
        with quiet_libraries() as library_log:
            manifest = _export(recipe, tmp, key, source)
        manifest["library_log"] = library_log
        artifacts.write_manifest(tmp, manifest)
    return VisionResult.from_manifest(out_dir, manifest)


def _export(recipe: Recipe, tmp: Path, key: str, source: Any) -> dict[str, Any]:
    import torch

    from pipeline.vision import onnx_export as ox
    from pipeline.vision import trt_build
    from pipeline.vision.images import bundled_sample
    from pipeline.vision.tiny_mllama import image_processor_class, load_mllama

    t0, timings = time.perf_counter(), {}
    hf_dir = Path(source.hf_dir)
    model = load_mllama(hf_dir)
    wrapper = ox.vision_wrapper(model)
    proc = image_processor_class().from_pretrained(hf_dir, local_files_only=True)
    timings["load"] = time.perf_counter() - t0

    def feeds(names: tuple[str, ...], dtype: torch.dtype = torch.float32) -> dict[str, torch.Tensor]:
        return ox.encoder_inputs(proc(images=[[bundled_sample(n)] for n in names], return_tensors="pt"), dtype)

    dtype = encoder_dtype(recipe)
    onnx_path = tmp / ONNX_FILE
    fp32_path = onnx_path if dtype == "float32" else tmp / "parity" / "model.onnx"
    t = time.perf_counter()
    ox.export_vision_onnx(wrapper, feeds(PARITY_BATCHES[0]), fp32_path)
    timings["export_onnx"] = time.perf_counter() - t
    t = time.perf_counter()
    parity = ox.check_parity(fp32_path, wrapper, [feeds(b) for b in PARITY_BATCHES])  # StageError above tolerance
    timings["parity"] = time.perf_counter() - t
    if dtype != "float32":  # the kept graph: the same trace in the encoder dtype (what TensorRT builds)
        shutil.rmtree(fp32_path.parent)
        t = time.perf_counter()
        ox.export_vision_onnx(wrapper.to(getattr(torch, dtype)), feeds(PARITY_BATCHES[0], getattr(torch, dtype)), onnx_path)
        timings["export_onnx_" + dtype] = time.perf_counter() - t
    signature = ox.onnx_signature(onnx_path)
    expected_len = encoder_len_per_image(recipe)
    out_shape = [-1, *parity.output_shape[1:]]  # [batch, images, tiles, P, text hidden]; the graph names batch only
    if out_shape[1] * out_shape[2] * out_shape[3] != expected_len:
        raise StageError(f"{ONNX_FILE}: encoder_output {out_shape} holds {out_shape[1] * out_shape[2] * out_shape[3]} "
                         f"vectors per image, the vision section derives {expected_len}")
    batch = vgeo.vision_max_batch_size(recipe.build.max_batch_size, recipe.vision.max_images_per_request)
    (tmp / CONFIG_FILE).write_text(json.dumps(multimodal_config(recipe, out_shape, batch), indent=2, sort_keys=True) + "\n")
    shutil.copyfile(hf_dir / PREPROCESSOR_FILE, tmp / PREPROCESSOR_FILE)
    status, engine = "built", None
    if not serving_path(recipe).on_cpu:
        script, argv = trt_build.write_build_script(tmp, per_sample_shapes(recipe), batch, precision=dtype,
                                                    onnx_path=ONNX_FILE.as_posix())
        engine = {"script": script.name, "command": argv}
        status = _maybe_build_engine(tmp, argv, timings)
    timings["total"] = time.perf_counter() - t0
    return artifacts.base_manifest(
        STAGE, key, status=status, consumed=consumed_fields(recipe), source=source.to_manifest(), family=recipe.vision.family,
        dtype=dtype, onnx=ONNX_FILE.as_posix(), onnx_sha256=artifacts.sha256_file(onnx_path), opset=ox.OPSET,
        signature=signature, parity={**parity.as_dict(), "dtype": "float32", "images": [list(b) for b in PARITY_BATCHES]},
        encoder_len_per_image=expected_len, max_batch_size=batch, engine=engine,
        versions=artifacts.library_versions(*VERSIONED), timings_s={k: round(v, 3) for k, v in timings.items()},
        peak_rss_bytes=artifacts.peak_rss_bytes(), outputs=artifacts.file_hashes(tmp),
    )


def _maybe_build_engine(tmp: Path, argv: list[str], timings: dict[str, float]) -> str:
    """Run the TensorRT build script when TensorRT and a GPU are here (``built``); else ``not_built``."""
    import importlib.util

    import torch

    if importlib.util.find_spec("tensorrt") is None or not torch.cuda.is_available():
        return "not_built"
    t = time.perf_counter()
    proc = subprocess.run([sys.executable, *argv[1:]], cwd=tmp, capture_output=True, text=True, check=False)
    timings["tensorrt_build"] = time.perf_counter() - t
    if proc.returncode != 0:
        last = (proc.stderr.strip().splitlines() or ["(no output)"])[-1]
        raise StageError(f"the vision encoder's TensorRT build failed (exit {proc.returncode}): {last}")
    return "built"


def _dry_run(recipe: Recipe, out_dir: Path, key: str, recipe_dir: Path) -> VisionResult:
    from pipeline.vision import export_script, trt_build

    assert recipe.vision is not None
    src = recipe.model.source
    local = recipe_path(src, recipe_dir)  # the one model.source rule (pipeline/core/recipe_paths.py)
    model_dir = str(local.resolve()) if local.exists() else src
    dtype = encoder_dtype(recipe)
    batch = vgeo.vision_max_batch_size(recipe.build.max_batch_size, recipe.vision.max_images_per_request)
    with artifacts.atomic_dir(out_dir) as tmp:
        _script, build_argv = trt_build.write_build_script(tmp, per_sample_shapes(recipe), batch, precision=dtype,
                                                           onnx_path=ONNX_FILE.as_posix())
        chain, argvs = export_script.write_chain(tmp, model_dir=model_dir, dtype=dtype, build_argv=build_argv)
        manifest = artifacts.base_manifest(
            STAGE, key, status="dry_run", consumed=consumed_fields(recipe), source={"spelling": src},
            family=recipe.vision.family, dtype=dtype, onnx=ONNX_FILE.as_posix(), encoder_len_per_image=encoder_len_per_image(recipe),
            max_batch_size=batch, script=chain.name, commands=argvs, versions=artifacts.library_versions(*VERSIONED),
            timings_s={"total": 0.0}, peak_rss_bytes=artifacts.peak_rss_bytes(),
        )
        artifacts.write_manifest(tmp, manifest)
    return VisionResult.from_manifest(out_dir, manifest)
