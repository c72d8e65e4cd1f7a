"""The multimodal repository's recipe → Triton translation (issue #46 item 4): what a recipe with a ``vision:``
section adds to the ``inflight_batcher_llm`` repository, as upstream's multimodal how-to fills it
(tensorrtllm_backend docs/multimodal.md@efb8a497:200-217; tensors in ``pipeline/data/triton_multimodal_contract.yaml``).

- ``preprocessing``: ``multimodal_model_path`` (the build's ``vision/`` directory: the checkpoint's
  ``preprocessor_config.json``), ``max_num_images`` = ``vision.max_images_per_request`` (:208, :227), and trtpipe's
  ``allow_http_image_urls`` (``vision.allow_http_image_urls``; default false: only ``data:`` URLs);
- ``multimodal_encoders`` (:217): ``multimodal_model_path``, ``encoder_runtime`` (``layouts.yaml`` ``multimodal``:
  TensorRT engine on a GPU, onnxruntime on the same ONNX file on the CPU) and ``max_num_images``;
- ``tensorrt_llm``: the encoder inputs, typed ``encoder_input_features_data_type`` (:206, :229; FP32 on the CPU
  target, whose python backend has no BF16), and on the C++ backend ``cross_kv_cache_fraction`` (:206, :230);
- the launch: ``--tensorrt_llm_model_name tensorrt_llm,multimodal_encoders --multimodal_gpu0_cuda_mem_pool_bytes N``
  (:235, :241): :func:`launch_flags`.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from pipeline.recipe.serving_path import serving_path
from pipeline.recipe.vision import cross_attention
from pipeline.triton_repo import layouts


def _bool(value: bool) -> str:
    return "true" if value else "false"


def vision_dir_of(engine_dir: Path) -> Path:
    """The build's ``vision/`` directory (the vision-encoder stage's output) beside its engine directory."""
    return Path(engine_dir).resolve().parent / "vision"


def template_context(recipe: Any, vision_dir: Path | None) -> dict[str, Any]:
    """The template variables of the multimodal repository: ``vision`` (bool) and, for a vision recipe,
    ``features_data_type`` and the ``preprocessing`` / ``multimodal_encoders`` / extra ``tensorrt_llm`` parameters.

    Args:
        recipe: the validated recipe; a text recipe gives ``{"vision": False, "features_data_type": "TYPE_FP16"}``.
        vision_dir: the vision stage's directory (absolute in the parameters).
    """
    path = serving_path(recipe)
    v = recipe.vision
    if v is None or "multimodal_encoders" not in path.repo_models:
        return {"vision": False, "features_data_type": "TYPE_FP16"}
    mm = layouts()["multimodal"]
    target = path.target
    vdir = str(Path(vision_dir).resolve()) if vision_dir is not None else "vision"
    images = str(v.max_images_per_request)
    encoders = {"multimodal_model_path": vdir, "encoder_runtime": mm["encoder_runtime"][target], "max_num_images": images}
    if path.on_cpu and recipe.build.cpu.num_threads is not None:
        encoders["cpu_num_threads"] = str(recipe.build.cpu.num_threads)
    return {
        "vision": True,
        "features_data_type": mm["cpu_features_data_type"] if path.on_cpu else v.encoder_input_features_data_type,
        "preprocessing": {"multimodal_model_path": vdir, "max_num_images": images,
                          "allow_http_image_urls": _bool(getattr(v, "allow_http_image_urls", False))},
        "multimodal_encoders": encoders,
        "tensorrt_llm_bls": {"multimodal_encoders_name": mm["model_name"], "multimodal_model_path": vdir},
        "tensorrt_llm": {} if path.on_cpu else {"cross_kv_cache_fraction": repr(float(v.cross_kv_cache_fraction))},
    }


def tritonserver_options(recipe: Any) -> dict[str, Any]:
    """The keyword arguments of :func:`pipeline.triton.server.triton_command` for ``recipe``: ``load_models`` (the
    models ranks ≠ 0 load: ``tensorrt_llm``, plus ``multimodal_encoders`` for a vision recipe) and
    ``cuda_pool_gpu0_bytes`` (``vision.multimodal_gpu0_cuda_mem_pool_bytes`` on a GPU; 0 for a text recipe or on the
    CPU target, which has no CUDA pool) — the ``tritonserver`` flags upstream's ``launch_triton_server.py`` makes of
    :func:`launch_flags` (scripts/launch_triton_server.py@c2e65b88d852:173-182)."""
    if recipe.vision is None or "multimodal_encoders" not in serving_path(recipe).repo_models:
        return {"load_models": ("tensorrt_llm",), "cuda_pool_gpu0_bytes": 0}
    pool = 0 if serving_path(recipe).on_cpu else int(recipe.vision.multimodal_gpu0_cuda_mem_pool_bytes)
    return {"load_models": ("tensorrt_llm", layouts()["multimodal"]["model_name"]), "cuda_pool_gpu0_bytes": pool}


def launch_flags(recipe: Any) -> list[str]:
    """The ``launch_triton_server.py`` flags the multimodal repository needs on a GPU (docs/multimodal.md@efb8a497:235,
    241): ``--tensorrt_llm_model_name tensorrt_llm,multimodal_encoders --multimodal_gpu0_cuda_mem_pool_bytes N``;
    ``[]`` for a text recipe."""
    if not cross_attention(recipe.vision):
        return []
    return ["--tensorrt_llm_model_name", f"tensorrt_llm,{layouts()['multimodal']['model_name']}",
            "--multimodal_gpu0_cuda_mem_pool_bytes", str(recipe.vision.multimodal_gpu0_cuda_mem_pool_bytes)]
