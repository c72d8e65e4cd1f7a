"""Helpers the quantize stage's two paths share (text decoders: :mod:`pipeline.quantize.stage`; vision-language:
:mod:`pipeline.quantize.vlm`): the consumed recipe fields, the export geometry check, the tokenizer portability fix,
the checkpoint dtype and the one-line export errors."""

from __future__ import annotations

import contextlib
import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from pipeline.core import artifacts
from pipeline.core.errors import StageError, UserError
from pipeline.recipe import Recipe
from pipeline.recipe.consumers import consumed
from pipeline.recipe.serving_path import serving_path

VERSIONED = ("nvidia-modelopt", "torch", "transformers")


def consumed_fields(recipe: Recipe) -> dict[str, Any]:
    """The recipe fields this stage consumes (:mod:`pipeline.recipe.consumers`), plus whether the target is the
    CPU (it decides the export dtype of an fp32 checkpoint: :func:`pipeline.recipe.derived.model_dtype`)."""
    return {**consumed(recipe, "quantize"), "target.is_cpu": serving_path(recipe).on_cpu}


def recipe_hash(recipe: Recipe) -> str:
    """Hash of :func:`consumed_fields`."""
    return artifacts.stable_hash(consumed_fields(recipe))


#: geometry fields the unified HF export must keep from the source config (experts included)
HF_GEOMETRY_FIELDS = ("architecture", "num_hidden_layers", "hidden_size", "num_attention_heads", "num_key_value_heads",
                      "head_dim", "intermediate_size", "vocab_size", "num_experts", "num_experts_per_tok",
                      "num_shared_experts", "moe_intermediate_size")


def hf_geometry_problems(source_config: Path, exported_config: Path) -> list[str]:
    """``"field: source → exported"`` for each of :data:`HF_GEOMETRY_FIELDS` the unified HF export changed (empty = kept).
    Both configs are read with :func:`pipeline.core.geometry.geometry_from_config` (either HF spelling of the expert
    count)."""
    from pipeline.core.geometry import geometry_from_config

    a, b = geometry_from_config(source_config), geometry_from_config(exported_config)
    return [f"{k}: {getattr(a, k)!r} → {getattr(b, k)!r}" for k in HF_GEOMETRY_FIELDS if getattr(a, k) != getattr(b, k)]


#: ``tokenizer_class`` values transformers 5 writes that transformers 4.x does not define (transformers 5.14
#: tokenization_utils_tokenizers.py ``class TokenizersBackend``, tokenization_utils_sentencepiece.py
#: ``class SentencePieceBackend``), and the 4.x class that loads the same files (``None``: none does)
TRANSFORMERS5_TOKENIZER_CLASSES = {"TokenizersBackend": "PreTrainedTokenizerFast", "SentencePieceBackend": None}


def runtime_transformers() -> str | None:
    """The transformers of the serving image (release matrix, default TensorRT-LLM), e.g. ``4.57.3``."""
    from pipeline.trtllm.release import default_release

    return default_release().transformers


def portable_tokenizer(hf_dir: Path, runtime_transformers: str | None) -> list[dict[str, Any]]:
    """Make ``hf_dir/tokenizer_config.json`` loadable by ``runtime_transformers``; return what was changed.

    transformers 5 saves a generic fast tokenizer as ``"tokenizer_class": "TokenizersBackend"``; transformers 4.57.3
    (what TensorRT-LLM 1.2.1 pins) refuses that name ("Tokenizer class TokenizersBackend does not exist"). With a
    ``tokenizer.json`` present the 4.x generic fast class loads the same files, so the name is rewritten to it.

    Raises:
        StageError: the tokenizer is one the runtime's transformers cannot load (a transformers-5-only class with
            no 4.x equivalent, or no tokenizer.json for the fast class).
    """
    cfg_path = hf_dir / "tokenizer_config.json"
    major = int(str(runtime_transformers).split(".")[0]) if runtime_transformers and str(runtime_transformers)[0].isdigit() else None
    if major is None or major >= 5 or not cfg_path.is_file():
        return []
    cfg = json.loads(cfg_path.read_text())
    cls = cfg.get("tokenizer_class")
    if cls not in TRANSFORMERS5_TOKENIZER_CLASSES:
        return []
    target = TRANSFORMERS5_TOKENIZER_CLASSES[cls]
    if target is None or (target.endswith("Fast") and not (hf_dir / "tokenizer.json").is_file()):
        raise StageError(f"hf_ckpt/tokenizer_config.json: tokenizer_class {cls!r} does not exist in transformers "
                         f"{runtime_transformers} (the serving image's); quantize with transformers "
                         f"{runtime_transformers} or give the model a tokenizer.json")
    cfg["tokenizer_class"] = target
    cfg_path.write_text(json.dumps(cfg, indent=2, ensure_ascii=False) + "\n")
    return [{"key": "tokenizer_config.json:tokenizer_class", "value": target, "default": cls,
             "reason": f"transformers {runtime_transformers} (serving image) has no {cls}"}]


def warn(msg: str) -> None:
    from rich.console import Console

    Console(stderr=True).print(f"[yellow]warning:[/] {msg}", highlight=False)


def checkpoint_dtype(hf_dir: Path) -> str | None:
    """The ``dtype``/``torch_dtype`` a HF ``config.json`` states (its ``text_config``'s for multimodal wrappers)."""
    cfg = json.loads((Path(hf_dir) / "config.json").read_text())
    for c in (cfg, cfg.get("text_config") or {}):
        if c.get("dtype") or c.get("torch_dtype"):
            return str(c.get("dtype") or c.get("torch_dtype"))
    return None


@contextlib.contextmanager
def export_errors(what: str) -> Iterator[None]:
    try:
        yield
    except (StageError, UserError):
        raise
    except Exception as e:
        first = (str(e).strip().splitlines() or ["(no message)"])[0]
        raise StageError(f"ModelOpt export of the {what} failed: {type(e).__name__}: {first}") from e


def language_model_only(model: Any, where: str) -> tuple[Any, list[str]]:
    """Disable ModelOpt's quantizers on every module of VLM ``model`` outside its language model, as hf_ptq.py does
    (TensorRT-Model-Optimizer examples/llm_ptq/hf_ptq.py@5a4242fa:348-368: ``get_language_model_from_vl`` finds the
    language model; each sibling on the way to it gets a config with every quantizer off).

    Returns:
        ``(language_model, excluded)``: the module to calibrate, and the names of the children that were switched off.

    Raises:
        StageError: ModelOpt finds no language model in ``model`` (``where`` names the checkpoint).
    """
    import modelopt.torch.quantization as mtq
    from modelopt.torch.export.model_utils import get_language_model_from_vl

    lineage = get_language_model_from_vl(model)
    if lineage is None:
        raise StageError(f"{where}: ModelOpt finds no language model in {type(model).__name__}")
    lm, ancestors = lineage[-1], lineage[:-1]
    off: dict[str, Any] = {"quant_cfg": {"default": {"enable": False}}, "algorithm": "max"}
    if isinstance(mtq.FP8_DEFAULT_CFG["quant_cfg"], list):  # 0.47's list form of the same config
        off = {"quant_cfg": [{"quantizer_name": "*", "enable": False}], "algorithm": "max"}
    memo, excluded = set(ancestors) | {lm}, []
    for anc in ancestors:
        for name, mod in anc.named_children():
            if mod not in memo:
                mtq.quantize(mod, off, forward_loop=None)
                memo.add(mod)
                excluded.append(name)
    return lm, excluded
