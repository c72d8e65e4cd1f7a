"""The container command that quantizes a token-family VLM's decoder (Qwen2-VL, Qwen2.5-VL; issue #47 item 7).

TensorRT-LLM's ``examples/quantization/quantize.py`` loads a checkpoint by ``model_type``
(``tensorrt_llm/quantization/quantize_by_modelopt.py@042c510d`` ``get_model``): ``qwen2_vl`` loads
``Qwen2VLForConditionalGeneration`` and exports ``model.model`` plus ``lm_head`` only ("WAR for Qwen2-VL because its
lm_head is outside of LLM"), and ``qwen2_5_vl`` is not in its table at all. The PyTorch backend, though, loads the
vision tower from the served checkpoint itself (``modeling_qwen2vl.py@000a01de`` ``Qwen2VisionModelBase``:
``model_class.from_pretrained(model_path)`` → ``model.visual``), so the export must keep the tower (unquantized) and the
processor files. ModelOpt's own ``examples/llm_ptq/hf_ptq.py`` does exactly that for a VLM: it quantizes only the
language model (every sibling module gets ``{"enable": False}``, hf_ptq.py@5a4242fa:348-368), calibrates the
Qwen2-VL family with text (cnn_dailymail; only mllama is calibrated with images, :443-453), exports the whole model as
a unified HF checkpoint (``export_hf_checkpoint(full_model)``, :689-692) and saves the original ``config.json`` and the
processor next to it (:622-644). Its flags (``--pyt_ckpt_path``, ``--qformat``, ``--kv_cache_qformat``, ``--dataset``,
``--calib_size``, ``--batch_size``, ``--export_path``) are read at hf_ptq.py@05ab9484 (argparse at the end of the file).

The examples are not in the serving image (only the ``nvidia-modelopt`` wheel is), so the script asks for
``MODELOPT_EXAMPLES``: the ``examples/`` folder of NVIDIA/TensorRT-Model-Optimizer at the release the image pins
(``nvidia_modelopt`` of pipeline/data/release_matrix.yaml; a tag per release [inference: the repository tags its
releases by version]).
"""

from __future__ import annotations

from typing import Any

from pipeline.recipe.vision import QwenVLVision

#: hf_ptq.py's --kv_cache_qformat for the recipe's kv_cache_dtype (KV_QUANT_CFG_CHOICES: none, fp8, nvfp4, …)
_KV = {"none": "none", "fp8": "fp8", "nvfp4": "nvfp4"}


def vlm_quantize_args(recipe: Any, model_dir: str, out_dir: str) -> tuple[list[str], str] | None:
    """``(argv, note)`` of ModelOpt's hf_ptq.py for a recipe whose vision family splices image tokens; ``None`` for
    any other recipe (text, or mllama). ``argv`` starts with ``python3 ${MODELOPT_EXAMPLES}/llm_ptq/hf_ptq.py``;
    ``note`` is the script's comment lines.

    Raises:
        ValueError: a ``kv_cache_dtype`` hf_ptq.py has no choice for (int8: the recipe refuses it for the PyTorch
            backend before this runs).
    """
    if not isinstance(recipe.vision, QwenVLVision):
        return None
    q, c = recipe.quantization, recipe.quantization.calibration
    if q.kv_cache_dtype not in _KV:
        raise ValueError(f"quantization.kv_cache_dtype {q.kv_cache_dtype!r}: hf_ptq.py has no KV format for it")
    dataset = c.dataset if c.dataset != "embedded" else "cnn_dailymail"
    argv = ["python3", "${MODELOPT_EXAMPLES}/llm_ptq/hf_ptq.py", "--pyt_ckpt_path", model_dir, "--qformat", q.qformat,
            "--kv_cache_qformat", _KV[q.kv_cache_dtype], "--dataset", dataset, "--calib_size", str(c.size),
            "--batch_size", str(c.batch_size), "--export_path", out_dir]
    if q.qformat in ("int4_awq", "w4a8_awq"):
        argv += ["--awq_block_size", str(q.awq_block_size)]
    note = ("# A vision-language model (vision.family " + recipe.vision.family + "): ModelOpt's hf_ptq.py quantizes the language\n"
            "# model only (vision tower + merger stay " + recipe.vision.encoder_dtype + ") and exports the whole model with its\n"
            "# processor: the PyTorch backend loads the vision tower from this checkpoint. TensorRT-LLM's quantize.py\n"
            "# keeps only the language model of Qwen2-VL (quantize_by_modelopt.py@042c510d get_model).\n"
            "# MODELOPT_EXAMPLES: examples/ of NVIDIA/TensorRT-Model-Optimizer at the image's nvidia-modelopt release.\n")
    return argv, note
