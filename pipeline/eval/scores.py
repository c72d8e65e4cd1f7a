"""Per-sample scores: ROUGE-1/2/L/Lsum (PyPI ``rouge-score``), label-free agreement, generated length.

ROUGE uses Google's ``rouge_score.RougeScorer`` with the Porter stemmer on (as MLPerf's and
TensorRT-LLM's CNN/DailyMail evaluations do); ``rougeLsum`` wants one sentence per line, so both texts
are split into sentences by PyPI ``pysbd`` (rule-based, nothing downloads) and joined with newlines.
Every ROUGE value is an F-measure x 100 (0-100). Generated length is in characters.
"""

from __future__ import annotations

import functools
from typing import Any

from pipeline.eval.stats import GEN_LEN, ROUGE_KEYS


@functools.lru_cache(maxsize=1)
def _scorer() -> Any:
    from rouge_score import rouge_scorer

    return rouge_scorer.RougeScorer(list(ROUGE_KEYS), use_stemmer=True)


@functools.lru_cache(maxsize=1)
def _segmenter() -> Any:
    import pysbd

    return pysbd.Segmenter(language="en", clean=False)


def sentences_per_line(text: str) -> str:
    """``text`` with one sentence per line (pysbd, English rules), each stripped."""
    text = " ".join(text.split())
    return "\n".join(s.strip() for s in _segmenter().segment(text) if s.strip()) if text else ""


def rouge(prediction: str, target: str) -> dict[str, float]:
    """ROUGE-1/2/L/Lsum F-measures x 100 of ``prediction`` against ``target`` (stemmed)."""
    scores = _scorer().score(sentences_per_line(target), sentences_per_line(prediction))
    return {k: 100.0 * scores[k].fmeasure for k in ROUGE_KEYS}


def first_divergence(a: list[int], b: list[int]) -> int | None:
    """Index of the first position where token lists ``a`` and ``b`` differ (a length counts:
    one a strict prefix of the other diverges at the shorter length); ``None`` when identical."""
    for i, (x, y) in enumerate(zip(a, b)):
        if x != y:
            return i
    return None if len(a) == len(b) else min(len(a), len(b))


def sample_scores(candidate: str, baseline: str, reference: str | None, tokenizer: Any = None) -> dict[str, Any]:
    """All scores of one sample.

    Returns ``{"candidate": {rouge…, gen_len}, "baseline": {…}, "agreement": {exact, rougeL,
    first_divergent_token}}``; the ROUGE entries are absent when there is no ``reference`` (label-free
    task); ``first_divergent_token`` counts tokens of ``tokenizer`` (characters without one).
    """
    out: dict[str, Any] = {"candidate": {GEN_LEN: len(candidate)}, "baseline": {GEN_LEN: len(baseline)}}
    if reference is not None:
        out["candidate"].update(rouge(candidate, reference))
        out["baseline"].update(rouge(baseline, reference))
    if tokenizer is not None:
        ca = tokenizer(candidate, add_special_tokens=False)["input_ids"]
        ba = tokenizer(baseline, add_special_tokens=False)["input_ids"]
    else:
        ca, ba = list(map(ord, candidate)), list(map(ord, baseline))
    out["agreement"] = {
        "exact": candidate == baseline,
        "rougeL": rouge(candidate, baseline)["rougeL"] if candidate or baseline else 100.0,
        "first_divergent_token": first_divergence(ca, ba),
    }
    return out
