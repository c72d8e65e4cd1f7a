"""Token-level KL divergence of a candidate's next-token distributions from a baseline's (the ``kld`` rule).

Per scored position ``t`` (teacher forcing: both models see the same tokens, the baseline's greedy output after
the prompt), with ``P`` the baseline's and ``Q`` the candidate's softmax of the logits at ``t`` (natural log):

* ``KLD_t = sum_v P_v (ln P_v - ln Q_v)`` (nats; ``KL(P || Q)``, the direction llama.cpp's
  ``llama-perplexity --kl-divergence`` reports: baseline first);
* ``top1_t = argmax P == argmax Q``;
* ``nll_t = -ln Q(token_{t+1})`` and ``-ln P(token_{t+1})`` (the per-token log-perplexity of each side).

Per sequence the sums are kept (:class:`SeqStats`), and every statistic is a ratio of sums over sequences, so
a long sequence weighs by its positions: mean KLD, same-top-1 % (x 100), Δ log-perplexity = mean nll(Q) - mean
nll(P) (= ln(PPL(Q)/PPL(P))) and the 99th percentile of the per-position KLDs. Their confidence intervals are
a percentile bootstrap over sequences (positions of one sequence are not independent): ``resamples`` draws of
``n`` sequences with replacement, ``numpy.random.default_rng(seed)``, interval ``[q(alpha), q(1 - alpha)]``.

Decision (non-inferiority against limits, as :mod:`pipeline.eval.stats` reports its rules): mean KLD PASS when
the CI's upper end is ``<= kld_max``, FAIL when its lower end is ``> kld_max``; same-top-1 PASS when the CI's
lower end is ``>= same_top1_min``, FAIL when its upper end is below; a PASS whose minimum detectable effect
(``(z(1-alpha) + z(1-beta)) x SE``, SE = the bootstrap standard deviation) exceeds its margin (``kld_max``; ``100 -
same_top1_min``) is INCONCLUSIVE. Δ log-perplexity and the 99th percentile are reported, not gated.

Default limits (:data:`THRESHOLDS`): what llama.cpp measured for the llama.cpp quantization of the same weight
width on LLaMA-3-8B — ggml-org/llama.cpp ``examples/perplexity/README.md`` @
0b8d056692ed8650b9461b000245277c466dd27e (the commit adding its "LLaMA 3 8b Scoreboard"; table "LLaMA 2 vs.
LLaMA 3 Quantization comparison", columns ``L3 8b q8_0`` and ``L3 8b q4_K_M``: Mean KLD 0.000753 ± 0.000005 /
0.031046 ± 0.000249, Same top p 98.467 ± 0.032 % / 92.162 ± 0.071 %; Wikitext-2 test, FP16 base). 8-bit formats
(and a 16-bit compute or 8-bit KV-cache change) must be as close to full precision as q8_0 is; 4-bit formats as
close as q4_K_M. A recipe overrides them with ``eval.kld_max`` / ``eval.same_top1_min``.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Sequence
from typing import Any

import numpy as np

from pipeline.eval import stats

#: published (mean KLD nats, same-top-1 %) per llama.cpp type (README table cited in the module docstring)
LLAMACPP_L3_8B = {"q8_0": (0.000753, 98.467), "q4_K_M": (0.031046, 92.162)}
#: the llama.cpp type whose figures limit each qformat (by weight width: 8-bit → q8_0, 4-bit → q4_K_M); full_prec
#: (a compute-dtype or KV-cache change only) is held to the 8-bit figures
QFORMAT_CLASS = {"full_prec": "q8_0", "fp8": "q8_0", "int8_sq": "q8_0", "int8_wo": "q8_0",
                 "int4_awq": "q4_K_M", "w4a8_awq": "q4_K_M", "int4_wo": "q4_K_M", "nvfp4": "q4_K_M"}
SOURCE = ("ggml-org/llama.cpp examples/perplexity/README.md @ 0b8d056692ed8650b9461b000245277c466dd27e, "
          "'LLaMA 2 vs. LLaMA 3 Quantization comparison', L3 8b {kind}")
METRICS = ("mean_kld", "same_top1_pct", "delta_log_ppl", "p99_kld")


@dataclasses.dataclass(frozen=True)
class Limits:
    """The limits of one gate and where they come from."""

    kld_max: float
    same_top1_min: float
    source: str


def limits(qformat: str | None, kld_max: float | None = None, same_top1_min: float | None = None) -> Limits:
    """The default limits of ``qformat`` (unknown / ``None``: the 8-bit ones), each replaced when given."""
    kind = QFORMAT_CLASS.get(qformat or "full_prec", "q8_0")
    k, t = LLAMACPP_L3_8B[kind]
    src = SOURCE.format(kind=kind)
    if kld_max is not None or same_top1_min is not None:
        src = f"recipe eval section (defaults: {src})"
    return Limits(k if kld_max is None else kld_max, t if same_top1_min is None else same_top1_min, src)


@dataclasses.dataclass
class SeqStats:
    """Sums over the scored positions of one sequence (see the module docstring); ``kld`` keeps each position's."""

    n: int
    kld_sum: float
    top1_same: int
    nll_base: float
    nll_cand: float
    kld: list[float]

    def to_json(self) -> dict[str, Any]:
        """Plain JSON (per-position KLDs rounded to 7 significant digits)."""
        return {"positions": self.n, "mean_kld": self.kld_sum / self.n if self.n else None,
                "same_top1_pct": 100.0 * self.top1_same / self.n if self.n else None,
                "delta_log_ppl": (self.nll_cand - self.nll_base) / self.n if self.n else None}


def position_stats(base_logits: Any, cand_logits: Any, targets: Sequence[int]) -> SeqStats:
    """:class:`SeqStats` of ``R`` positions: float logits ``[R, vocab]`` of each side at the positions that
    predict ``targets`` (``R`` token ids). Computed in float64 on CPU (torch), one sequence at a time.

    Raises:
        ValueError: shapes differ, or the number of rows is not ``len(targets)``.
    """
    import torch

    b = torch.from_numpy(np.asarray(base_logits, dtype=np.float64))  # a converted copy: the response's buffer is read-only
    c = torch.from_numpy(np.asarray(cand_logits, dtype=np.float64))
    if b.shape != c.shape or b.dim() != 2 or b.shape[0] != len(targets):
        raise ValueError(f"logits {tuple(b.shape)} vs {tuple(c.shape)} for {len(targets)} target tokens")
    lp, lq = torch.log_softmax(b, -1), torch.log_softmax(c, -1)
    kld = (lp.exp() * (lp - lq)).sum(-1).clamp_min(0.0)  # rounding can give -1e-17 where P == Q
    tgt = torch.as_tensor(list(targets), dtype=torch.int64).unsqueeze(1)
    same = int((b.argmax(-1) == c.argmax(-1)).sum())
    return SeqStats(len(targets), float(kld.sum()), same, float(-lp.gather(1, tgt).sum()), float(-lq.gather(1, tgt).sum()),
                    kld.tolist())


def _estimates(seqs: Sequence[SeqStats], idx: np.ndarray, arrays: dict[str, np.ndarray]) -> np.ndarray:
    """Rows of (mean KLD, same-top-1 %, Δ log-ppl) for each row of sequence indices ``idx`` ``[B, n]``."""
    n = arrays["n"][idx].sum(axis=1)
    return np.stack([arrays["kld"][idx].sum(axis=1) / n, 100.0 * arrays["top1"][idx].sum(axis=1) / n,
                     (arrays["nll_c"][idx].sum(axis=1) - arrays["nll_b"][idx].sum(axis=1)) / n], axis=1)


def summarize(seqs: Sequence[SeqStats], *, alpha: float, resamples: int, seed: int) -> dict[str, dict[str, Any]]:
    """Per metric of :data:`METRICS`: ``{"value", "ci": [lo, hi], "se"}`` over ``seqs`` (module docstring).

    Raises:
        ValueError: fewer than 2 sequences with a scored position.
    """
    seqs = [s for s in seqs if s.n]
    if len(seqs) < 2:
        raise ValueError(f"{len(seqs)} sequences with scored positions: at least 2 are needed")
    arrays = {"n": np.array([s.n for s in seqs], float), "kld": np.array([s.kld_sum for s in seqs]),
              "top1": np.array([s.top1_same for s in seqs], float), "nll_b": np.array([s.nll_base for s in seqs]),
              "nll_c": np.array([s.nll_cand for s in seqs])}
    full = np.arange(len(seqs))[None, :]
    point = _estimates(seqs, full, arrays)[0]
    rng = np.random.default_rng(seed)
    idx = rng.integers(0, len(seqs), size=(resamples, len(seqs)))
    boot = _estimates(seqs, idx, arrays)
    per_pos = [np.asarray(s.kld) for s in seqs]
    p99 = float(np.quantile(np.concatenate(per_pos), 0.99))
    p99_boot = np.array([np.quantile(np.concatenate([per_pos[i] for i in row]), 0.99) for row in idx])
    out = {}
    for j, m in enumerate(METRICS[:3]):
        out[m] = {"value": float(point[j]), "ci": [float(np.quantile(boot[:, j], alpha)), float(np.quantile(boot[:, j], 1 - alpha))],
                  "se": float(boot[:, j].std(ddof=1))}
    out["p99_kld"] = {"value": p99, "ci": [float(np.quantile(p99_boot, alpha)), float(np.quantile(p99_boot, 1 - alpha))],
                      "se": float(p99_boot.std(ddof=1))}
    out["positions"] = {"value": int(arrays["n"].sum()), "sequences": len(seqs)}
    return out


def _power(metric: str, n: int, se: float, margin: float, threshold: float, k: float) -> stats.Power:
    need = None if margin <= 0 or se == 0 else math.ceil(n * (k * se / margin) ** 2)
    return stats.Power(metric, n, threshold, margin, se, k * se, need)


def decide(summary: dict[str, dict[str, Any]], lim: Limits, *, alpha: float, beta: float) -> stats.RuleResult:
    """The ``kld`` rule on :func:`summarize`'s output against ``lim`` (module docstring)."""
    k = stats.z(1 - alpha) + stats.z(1 - beta)
    n = int(summary["positions"]["sequences"])
    kl, top = summary["mean_kld"], summary["same_top1_pct"]
    (klo, khi), (tlo, thi) = kl["ci"], top["ci"]
    kv = stats.PASS if khi <= lim.kld_max else stats.FAIL if klo > lim.kld_max else stats.INCONCLUSIVE
    tv = stats.PASS if tlo >= lim.same_top1_min else stats.FAIL if thi < lim.same_top1_min else stats.INCONCLUSIVE
    checks = [stats.MetricCheck("mean_kld", kl["value"], 0.0, kl["value"], (klo, khi), lim.kld_max, kv),
              stats.MetricCheck("same_top1_pct", top["value"], 100.0, top["value"] - 100.0, (tlo, thi), lim.same_top1_min, tv)]
    rows = [_power("mean_kld", n, kl["se"], lim.kld_max, lim.kld_max, k),
            _power("same_top1_pct", n, top["se"], 100.0 - lim.same_top1_min, lim.same_top1_min, k)]
    res = stats._combine("kld", checks, rows, [])
    why = {stats.FAIL: "beyond", stats.INCONCLUSIVE: "straddles"}
    reasons = [f"{c.metric} {c.candidate:.4g}: CI [{c.ci[0]:.4g}, {c.ci[1]:.4g}] {why[c.verdict]} the limit {c.threshold:.4g}"
               for c in checks if c.verdict in why and (res.verdict == c.verdict)]
    if res.verdict == stats.INCONCLUSIVE and all(c.verdict == stats.PASS for c in checks):
        reasons = [f"{p.metric}: n={p.n} sequences resolve {p.mde:.4g}, not the margin {p.margin:.4g} (needs n >= "
                   f"{p.n_required})" for p in rows if not p.supported]
    return dataclasses.replace(res, reasons=reasons)


def judge(spec: Any, seqs: Sequence[SeqStats], rows: Sequence[dict[str, Any]], recipe: Any = None
          ) -> tuple[stats.RuleResult, dict[str, Any]]:
    """The ``kld`` rule of an eval: limits of the candidate ``recipe``'s qformat (or ``spec.kld_max`` /
    ``spec.same_top1_min``), :func:`summarize` and :func:`decide`; plus, per sequence, Spearman's rho between its mean
    KLD and the text-level agreement of the two outputs (ROUGE-L of the candidate's output vs the baseline's) and,
    on a labelled task, the ROUGE-L delta vs the reference. Returns ``(rule, summary)`` (summary: ``eval.json``'s
    ``means.kld``). Fewer than 2 scored sequences is INCONCLUSIVE.
    """
    qformat = recipe.quantization.qformat if recipe is not None else None
    lim = limits(qformat, spec.kld_max, spec.same_top1_min)
    try:
        summary: dict[str, Any] = summarize(seqs, alpha=spec.alpha, resamples=spec.resamples, seed=spec.seed)
    except ValueError as e:
        return stats.RuleResult("kld", stats.INCONCLUSIVE, [], [], [str(e)]), {"limits": dataclasses.asdict(lim)}
    rule = decide(summary, lim, alpha=spec.alpha, beta=spec.beta)
    if rule.verdict != stats.PASS and (spec.kld_max is None or spec.same_top1_min is None):
        rule = dataclasses.replace(rule, reasons=rule.reasons + default_limit_advice(
            qformat, summary, _parameters(recipe), custom=(spec.kld_max is not None, spec.same_top1_min is not None)))
    keep = [i for i, s in enumerate(seqs) if s.n]
    per = [seqs[i].kld_sum / seqs[i].n for i in keep]
    agree = [rows[i]["scores"]["agreement"]["rougeL"] for i in keep]
    relation = {"spearman_kld_vs_agreement_rougeL": rank_correlation(per, agree)}
    if all("rougeL" in rows[i]["scores"]["candidate"] for i in keep):
        delta = [rows[i]["scores"]["candidate"]["rougeL"] - rows[i]["scores"]["baseline"]["rougeL"] for i in keep]
        relation["spearman_kld_vs_rougeL_delta"] = rank_correlation(per, delta)
    summary.update(limits=dataclasses.asdict(lim), relation=relation)
    return rule, summary


def _parameters(recipe: Any) -> int | None:
    """The candidate model's parameter count (known-model table or a local config.json), ``None`` when unknown."""
    from pipeline.core.geometry import geometry_for_source

    if recipe is None:
        return None
    try:
        geo = geometry_for_source(str(recipe.model.source))
    except (OSError, ValueError):
        return None
    return geo.num_parameters if geo is not None else None


def default_limit_advice(qformat: str | None, summary: dict[str, Any], parameters: int | None, *,
                         custom: tuple[bool, bool] = (False, False)) -> list[str]:
    """Two lines for a gate that did not PASS against the default limits: where they come from (llama.cpp's
    measurement of its same-width type on LLaMA-3-8B, Wikitext-2 vs FP16; not on a model this size) and how to set
    limits that fit this model (``--kld-max`` / ``--same-top1-min``, or ``eval.kld_max`` / ``eval.same_top1_min``),
    with what this run measured (the upper CI bound of mean KLD, the lower bound of same-top-1 %). ``custom`` says
    which of the two limits the recipe already set (those are not explained)."""
    kind = QFORMAT_CLASS.get(qformat or "full_prec", "q8_0")
    k, t = LLAMACPP_L3_8B[kind]
    named = [f"kld_max {k:g} nats" if not custom[0] else "", f"same_top1_min {t:g} %" if not custom[1] else ""]
    size = f"{parameters / 1e9:.2g} B parameters" if parameters and parameters >= 1e9 else (
        f"{parameters / 1e6:.0f} M parameters" if parameters else "a size not known here")
    khi, tlo = summary["mean_kld"]["ci"][1], summary["same_top1_pct"]["ci"][0]
    return [
        (f"the default limit ({' and '.join(n for n in named if n)}) is what llama.cpp measured for its "
         f"{'8-bit' if kind == 'q8_0' else '4-bit'} type {kind} on LLaMA-3-8B (Wikitext-2, against FP16; "
         f"{SOURCE.format(kind=kind)}) — the only published per-format table; no one published what a model of this one's size ({size}) reaches (docs/eval.md: FP8 on "
        f"SmolLM2-135M measured ~20× q8_0's KLD on LLaMA-3-8B)"),
        (f"to gate this model on its own terms: judge its outputs (the agreement scores above, or --rule paired), then "
        f"set the limits you accept — --kld-max X --same-top1-min Y here, or eval.kld_max / eval.same_top1_min in the "
        f"recipe; this run measured mean KLD ≤ {khi:.3g} and same-top-1 ≥ {tlo:.3g} % (upper / lower CI bounds)"),
    ]


def rank_correlation(x: Sequence[float], y: Sequence[float]) -> float | None:
    """Spearman's rho (Pearson correlation of average ranks); ``None`` below 3 pairs or with a constant side."""
    from scipy.stats import spearmanr

    if len(x) < 3 or len(set(x)) < 2 or len(set(y)) < 2:
        return None
    return float(spearmanr(x, y).statistic)
