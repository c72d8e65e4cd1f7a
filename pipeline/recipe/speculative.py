"""``build.pytorch.speculative_config``: speculative decoding, named as the TensorRT-LLM 1.2.1 LLM API names it.

One section per ``decoding_type`` (the key ``DecodingBaseConfig.from_dict`` dispatches on, llm_args.py@c292b9f9:728-738;
pipeline/data/trtllm_1.2.1_llmapi_contract.yaml ``speculative_decoding``), each with the fields of that config class:

* ``Eagle`` — EAGLE-3 with a draft head (``speculative_model_dir``: local path or HF id). 1.2.1 spells it ``Eagle``:
  the PyTorch backend runs it as EAGLE-3 (spec_dec_mode EAGLE3 / EAGLE3_ONE_MODEL, :903-909); ``Eagle3`` is a later
  release's spelling.
* ``MTP`` — the model's own multi-token-prediction layers (``num_nextn_predict_layers``), only for models that have them.
* ``NGram`` — drafts from n-grams already seen (no draft model); the only type the CPU engine runs, for real
  (:mod:`pipeline.cpu_runtime.speculative`, on the cpu target's LLM-API path).
* ``DraftTarget`` — a separate small draft model sharing the target's tokenizer.

:func:`speculative_problems` holds the cross-field rules (draft vocabulary / hidden size against the target, MTP
layers present, NGram only on the cpu target). Only the PyTorch LLM-API backend reads the section (``build.pytorch``).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Annotated, Literal, Union

from pydantic import Field

from pipeline.recipe.base import StrictModel
from pipeline.recipe.bounds import INT32_MAX

if TYPE_CHECKING:
    from pipeline.core.geometry import ModelGeometry

#: trtpipe's limit on draft tokens per step (upstream has none; EAGLE-3 runs use 3-5, NVIDIA's examples at most 8)
MAX_DRAFT_LEN = 64
FIELD = "build.pytorch.speculative_config"


class _DraftBase(StrictModel):
    max_draft_len: int = Field(ge=1, le=MAX_DRAFT_LEN, description="Draft tokens proposed per step (DecodingBaseConfig.max_draft_len; upstream asserts > 0).")
    max_concurrency: int | None = Field(
        default=None, ge=1, le=INT32_MAX,
        description="Speculation switches off at batch sizes above this (DecodingBaseConfig.max_concurrency; default None = always on).",
    )


class EagleSpec(_DraftBase):
    """EAGLE-3 (``EagleDecodingConfig``, llm_args.py@c292b9f9:810)."""

    decoding_type: Literal["Eagle"] = Field(description="EAGLE-3 draft head (1.2.1 spelling; later releases also take Eagle3).")
    speculative_model_dir: str = Field(
        min_length=1,
        description="The EAGLE-3 head: a local directory (relative to the recipe) or a HF id, fetched like model.source.",
    )
    eagle3_one_model: bool = Field(default=True, description="Draft head as a submodule of the target (one model; upstream default true).")


class DraftTargetSpec(_DraftBase):
    """A separate draft model (``DraftTargetDecodingConfig``, llm_args.py@c292b9f9:1031; PyTorch backend only)."""

    decoding_type: Literal["DraftTarget"] = Field(description="Draft/target speculative decoding.")
    speculative_model_dir: str = Field(
        min_length=1, description="The draft model: a local directory (relative to the recipe) or a HF id; same tokenizer as the target.",
    )


class NGramSpec(_DraftBase):
    """N-gram drafting (``NGramDecodingConfig``, llm_args.py@c292b9f9:992; PyTorch backend only)."""

    decoding_type: Literal["NGram"] = Field(description="Drafts from n-grams seen in the prompt and output.")
    max_matching_ngram_size: int = Field(ge=1, le=MAX_DRAFT_LEN, description="Longest n-gram searched (upstream default 0 is refused at LLM(): > 0).")
    is_keep_all: bool = Field(default=True, description="Keep every candidate match per pattern (default true).")
    is_use_oldest: bool = Field(default=True, description="Use the oldest match (default true).")
    is_public_pool: bool = Field(default=True, description="One pool shared by all requests (default true).")


class MTPSpec(StrictModel):
    """Multi-token prediction (``MTPDecodingConfig``, llm_args.py@c292b9f9:1047; PyTorch backend only)."""

    decoding_type: Literal["MTP"] = Field(description="The model's own MTP layers.")
    num_nextn_predict_layers: int = Field(default=1, ge=1, le=MAX_DRAFT_LEN, description="MTP layers used = draft tokens per step (default 1).")
    max_concurrency: int | None = Field(default=None, ge=1, le=INT32_MAX, description="Speculation off above this batch size (default None).")


SpeculativeSpec = Annotated[Union[EagleSpec, MTPSpec, NGramSpec, DraftTargetSpec], Field(discriminator="decoding_type")]


def draft_source(spec: object) -> str | None:
    """The draft model a speculative section names (``speculative_model_dir``), or ``None`` (MTP, NGram)."""
    return getattr(spec, "speculative_model_dir", None)


def speculative_problems(spec: object, target_geo: ModelGeometry | None, draft_geo: ModelGeometry | None,
                         *, gpu_target: bool, source: str) -> list[tuple[str, str]]:
    """``[(field, message)]`` for a speculative section that cannot run with this model (empty = fine).

    Args:
        spec: the recipe's ``build.pytorch.speculative_config`` (None: nothing to check).
        target_geo / draft_geo: the target's and the draft's geometry (``None`` when unknown: not checked).
        gpu_target: False on the cpu target (the CPU engine runs ``NGram`` only: pipeline/cpu_runtime/speculative.py).
        source: the target's ``model.source`` (for messages).

    Rules: a draft (Eagle, DraftTarget) proposes token ids the target verifies, so its ``vocab_size`` must equal
    the target's; an EAGLE-3 head reads the target's hidden states, so its ``hidden_size`` must equal the target's
    and it must be an EAGLE head (architecture name contains ``Eagle``); MTP needs ``num_nextn_predict_layers``
    MTP layers in the model's config.json.
    """
    if spec is None:
        return []
    if not gpu_target and spec.decoding_type != "NGram":  # type: ignore[attr-defined]
        return [(f"{FIELD}.decoding_type", f"{spec.decoding_type}: the CPU engine speculates with NGram only (no draft "  # type: ignore[attr-defined]
                                           "model runs there); the other types are for GPU targets")]
    out: list[tuple[str, str]] = []
    kind = spec.decoding_type  # type: ignore[attr-defined]
    where = f"{FIELD}.speculative_model_dir"
    if draft_geo is not None and target_geo is not None and kind in ("Eagle", "DraftTarget"):
        if draft_geo.vocab_size != target_geo.vocab_size:
            out.append((where, f"draft vocabulary {draft_geo.vocab_size} ≠ the target's {target_geo.vocab_size}: a draft "
                               "must share the target's tokenizer"))
        elif kind == "Eagle" and "eagle" not in draft_geo.architecture.lower():
            out.append((where, f"{draft_geo.architecture} is not an EAGLE-3 head (architecture *Eagle3*): use decoding_type "
                               "DraftTarget for a separate draft model"))
        elif kind == "Eagle" and draft_geo.hidden_size != target_geo.hidden_size:
            out.append((where, f"EAGLE-3 head hidden_size {draft_geo.hidden_size} ≠ the target's {target_geo.hidden_size}: "
                               "the head reads the target's hidden states (a head trained for another model)"))
    if kind == "MTP" and target_geo is not None:
        have = target_geo.num_nextn_predict_layers
        if have == 0:
            out.append((f"{FIELD}.decoding_type", f"MTP needs a model with MTP layers (config.json num_nextn_predict_layers); "
                                                  f"{source} has none: use Eagle, NGram or DraftTarget"))
        elif spec.num_nextn_predict_layers > have:  # type: ignore[attr-defined]
            out.append((f"{FIELD}.num_nextn_predict_layers",
                        f"{spec.num_nextn_predict_layers} exceeds the model's {have} MTP layer(s)"))  # type: ignore[attr-defined]
    return out
