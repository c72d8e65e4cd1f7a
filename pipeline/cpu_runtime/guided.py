"""Guided decoding on the CPU engine with xgrammar, as TensorRT-LLM's executor does it on a GPU.

:class:`Guides` holds one xgrammar ``GrammarCompiler`` (with its cache: the same schema compiles once) built from
the upstream tokenizer-info format (:mod:`pipeline.trtllm.guided`) the way the executor builds it:
``TokenizerInfo::FromHuggingFace(encoded_vocab, tokenizer_str, vocab_size, stop_token_ids)``
(guidedDecoder.cpp@000a01de66f0:45-50) — vocabulary type and prefix space detected from ``tokenizer_str``, the
mask as wide as the MODEL's vocabulary. :meth:`Guides.matcher` compiles one request's guide into a
``GrammarMatcher`` (guide types as the executor maps them, :data:`pipeline.trtllm.guided.GUIDE_TYPES`).

The engine calls :func:`mask` once per step before its greedy argmax (every guided sequence's next-token bitmask,
``-inf`` on the logits of tokens the grammar forbids) and :func:`advance` with each chosen token. A grammar that
has completed allows only its stop tokens; accepting one terminates the matcher, and the engine then ends the
sequence as on ``end_id`` (the stop token is not returned).
"""

from __future__ import annotations

import dataclasses
import json
import logging
from typing import TYPE_CHECKING, Any

from pipeline.trtllm.guided import GUIDE_TYPES

if TYPE_CHECKING:
    import torch

log = logging.getLogger(__name__)


class Guides:
    """Compiles per-request guides for a model of ``vocab_size`` logits.

    Args:
        info: the tokenizer info (``encoded_vocab``, ``tokenizer_str``, ``stop_token_ids``; upstream's file format).
        vocab_size: the model's vocabulary (logits per token; ≥ ``len(encoded_vocab)``).

    Raises ``ImportError`` when xgrammar is not installed (the ``cpu`` extra) and ``ValueError`` for an unusable info.
    """

    def __init__(self, info: dict[str, Any], vocab_size: int):
        import xgrammar as xgr

        self._xgr = xgr
        vocab = list(info["encoded_vocab"])
        if len(vocab) > vocab_size:
            raise ValueError(f"the tokenizer has {len(vocab)} tokens, more than the model's {vocab_size} logits")
        meta = xgr.TokenizerInfo._detect_metadata_from_hf(info["tokenizer_str"])
        self.tokenizer_info = xgr.TokenizerInfo(
            vocab, meta["vocab_type"], vocab_size=vocab_size,
            stop_token_ids=[int(t) for t in info["stop_token_ids"]], add_prefix_space=meta["add_prefix_space"])
        self.vocab_size = vocab_size
        self._compiler = xgr.GrammarCompiler(self.tokenizer_info)

    def matcher(self, guide_type: str, guide: str | None) -> Any:
        """A fresh ``GrammarMatcher`` for one request.

        Args:
            guide_type: one of :data:`~pipeline.trtllm.guided.GUIDE_TYPES`.
            guide: the JSON schema / regex / EBNF grammar text (ignored for ``json``: any JSON value).

        Raises:
            ValueError: an unknown type, a missing guide, or a guide xgrammar cannot compile (message for the client).
        """
        if guide_type not in GUIDE_TYPES:
            raise ValueError(f"guided_decoding_guide_type {guide_type!r} is not one of {', '.join(GUIDE_TYPES)}")
        if guide_type != "json" and not guide:
            raise ValueError(f"guided_decoding_guide is required with guided_decoding_guide_type {guide_type!r}")
        c, xgr = self._compiler, self._xgr
        try:
            if guide_type == "json":
                compiled = c.compile_builtin_json_grammar()
            elif guide_type == "json_schema":
                compiled = c.compile_json_schema(guide)
            elif guide_type == "regex":
                compiled = c.compile_grammar(xgr.Grammar.from_regex(guide))
            else:
                compiled = c.compile_grammar(xgr.Grammar.from_ebnf(guide))
        except Exception as e:  # xgrammar raises RuntimeError/ValueError subclasses for a bad guide
            first = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
            raise ValueError(f"guided_decoding_guide ({guide_type}) does not compile: {first}") from None
        return xgr.GrammarMatcher(compiled)


@dataclasses.dataclass(kw_only=True)
class GuidedDecodingParams:
    """``tensorrt_llm.sampling_params.GuidedDecodingParams`` (sampling_params.py@a98a9061d72f:14-30): at most one of
    ``json`` (a JSON schema: str, dict or pydantic model), ``regex``, ``grammar`` (EBNF), ``json_object`` (any JSON),
    ``structural_tag`` (not supported by the CPU engine)."""

    json: Any = None
    regex: str | None = None
    grammar: str | None = None
    json_object: bool = False
    structural_tag: str | None = None

    def guide(self) -> tuple[str, str | None] | None:
        """``(guide type, guide)`` in the Triton inputs' terms, as ``_get_guided_decoding_params`` maps them (None: no
        guide). Raises ValueError for two guides at once (upstream's ``_validate``) or a structural tag."""
        given = [f.name for f in dataclasses.fields(self) if getattr(self, f.name)]
        if len(given) > 1:
            raise ValueError(f"Only one guide can be used for a request, but got {len(given)}.")
        if self.structural_tag:
            raise ValueError("guided_decoding.structural_tag is not supported by the CPU engine")
        if self.json_object:
            return "json", None
        if self.json is not None:
            schema = self.json.model_json_schema() if hasattr(self.json, "model_json_schema") else self.json
            return "json_schema", schema if isinstance(schema, str) else json.dumps(schema)
        if self.regex is not None:
            return "regex", self.regex
        return ("ebnf_grammar", self.grammar) if self.grammar is not None else None


def request_matcher(guides: Guides | None, params: GuidedDecodingParams | None) -> Any:
    """The matcher of a request's ``SamplingParams.guided_decoding`` (None without one). Raises ValueError for a guide
    the LLM was not loaded to honour (``guided_decoding_backend`` unset) or one that does not compile."""
    guide = params.guide() if params is not None else None
    if guide is None:
        return None
    if guides is None:
        raise ValueError("guided decoding needs LLM(guided_decoding_backend='xgrammar')")
    return guides.matcher(*guide)


def mask(logits: torch.Tensor, matchers: list[Any]) -> None:
    """Set to ``-inf``, in place, the logits each row's grammar forbids next.

    Args:
        logits: ``[rows, vocab]`` float logits of one step.
        matchers: one entry per row: a ``GrammarMatcher`` or ``None`` (row not guided).
    """
    rows = [r for r, m in enumerate(matchers) if m is not None]
    if not rows:
        return
    import xgrammar as xgr

    bitmask = xgr.allocate_token_bitmask(len(matchers), logits.shape[-1])
    for r in rows:
        matchers[r].fill_next_token_bitmask(bitmask, r)
    xgr.apply_token_bitmask_inplace(logits, bitmask, indices=rows)


def advance(matcher: Any, token: int) -> bool:
    """Feed ``token`` to ``matcher`` (``None``: not guided); True when the sequence must end here: the grammar accepted
    a stop token (terminated), or it refused the token (only when every allowed token was banned, e.g. by
    ``min_tokens`` masking the end token after the grammar completed)."""
    if matcher is None:
        return False
    if not matcher.accept_token(int(token)):
        log.warning("guided decoding: the grammar refused token %d; ending the sequence", token)
        return True
    return matcher.is_terminated()
