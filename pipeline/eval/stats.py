"""Statistics of the accuracy gate: paired bootstrap CIs, power analysis and the four rules.

Every score here is on the 0-100 scale (ROUGE x 100, as MLPerf and TensorRT-LLM report it); generated
length is in characters per sample. A rule returns a :class:`RuleResult` whose ``verdict`` is ``PASS``,
``FAIL`` or ``INCONCLUSIVE`` and whose ``power`` rows say, per metric, the threshold, the standard error
and the minimum detectable effect (MDE) at this ``n``. A rule the sample size cannot support (MDE larger
than the margin it must resolve) is ``INCONCLUSIVE``, never ``PASS``; a clear failure stays ``FAIL``.

Sources of the constants:

* MLPerf: accuracy targets are ``reference x 0.99`` (``x 0.999`` for the high-accuracy variants) per ROUGE,
  and the generated length must lie within ``0.9 .. 1.1 x`` the reference — mlcommons/inference
  ``tools/submission/submission_checker/constants.py`` @ 9e3d1054ec143c87c06a0a305f6eca4a37fe662e
  (``accuracy-target`` / ``accuracy-upper-limit`` of ``llama3.1-8b``: ROUGE1 38.7792, ROUGE2 15.9075,
  ROUGEL 24.4957, ROUGELSUM 35.793, GEN_LEN 8167644 characters over 13,368 samples).
* TensorRT-LLM: a one-sided test with threshold ``ref + z(alpha) x sqrt(2 sigma^2 / n)`` and minimum
  detectable effect ``theta = -(z(alpha) + z(beta)) x sqrt(2 sigma^2 / n)``; CNN/DailyMail uses alpha 0.002,
  beta 0.2, sigma 11.06, n 512 — NVIDIA/TensorRT-LLM ``tests/integration/defs/accuracy/accuracy_core.py``
  @ 3e906a0ed7c66ed4df90aa4856bf1a6c98ca7df6 (``compute_theta``, ``compute_threshold``, ``CnnDailymail``).
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Mapping, Sequence
from statistics import NormalDist
from typing import Any

import numpy as np

#: the ROUGE variants every rule checks (rouge-score names)
ROUGE_KEYS = ("rouge1", "rouge2", "rougeL", "rougeLsum")
GEN_LEN = "gen_len"
PASS, FAIL, INCONCLUSIVE = "PASS", "FAIL", "INCONCLUSIVE"
#: MLPerf Inference llama3.1-8b reference (constants.py @ 9e3d1054, see the module docstring)
MLPERF_LLAMA31_8B = {"rouge1": 38.7792, "rouge2": 15.9075, "rougeL": 24.4957, "rougeLsum": 35.793}
MLPERF_LLAMA31_8B_GEN_LEN_TOTAL = 8167644  # characters, summed over the accuracy set
MLPERF_LLAMA31_8B_SAMPLES = 13368
#: the published reference sets ``trtpipe eval --reference`` knows, per-sample gen_len in characters
PUBLISHED = {
    "llama3.1-8b": {**MLPERF_LLAMA31_8B, GEN_LEN: MLPERF_LLAMA31_8B_GEN_LEN_TOTAL / MLPERF_LLAMA31_8B_SAMPLES},
}
MLPERF_RATIO = {"mlperf": 0.99, "mlperf_high": 0.999}
MLPERF_GEN_LEN_BAND = (0.9, 1.1)
#: TensorRT-LLM CnnDailymail.NUM_SAMPLES (accuracy_core.py @ 3e906a0e): the design point of its test
TRTLLM_CNN_NUM_SAMPLES = 512
_Z = NormalDist()


def z(p: float) -> float:
    """The standard normal quantile at ``p`` (``z(0.002) = -2.878``)."""
    return _Z.inv_cdf(p)


@dataclasses.dataclass(frozen=True)
class Power:
    """Power analysis of one metric: what this ``n`` can resolve.

    ``threshold`` is the margin (or bound) the rule checks against, ``se`` the standard error of the
    tested mean, ``mde`` the smallest true effect detected with probability ``1 - beta`` at one-sided
    level ``alpha`` (``(z(1-alpha) + z(1-beta)) x se``) and ``n_required`` the ``n`` at which ``mde``
    would equal the margin (``None`` when the margin is 0 or the spread is 0). Units: the metric's.
    """

    metric: str
    n: int
    threshold: float
    margin: float
    se: float
    mde: float
    n_required: int | None

    @property
    def supported(self) -> bool:
        """True when this ``n`` resolves the margin (``mde <= margin``)."""
        return self.mde <= self.margin + 1e-12


@dataclasses.dataclass(frozen=True)
class MetricCheck:
    """One metric's test: point estimate, CI, threshold and its own verdict."""

    metric: str
    candidate: float
    reference: float
    delta: float
    ci: tuple[float, float]
    threshold: float
    verdict: str


@dataclasses.dataclass(frozen=True)
class RuleResult:
    """The outcome of a rule: the verdict, per-metric checks, power rows and one-line reasons."""

    rule: str
    verdict: str
    checks: list[MetricCheck]
    power: list[Power]
    reasons: list[str]

    def to_json(self) -> dict[str, Any]:
        """Plain-JSON form (for ``eval.json``)."""
        return {"rule": self.rule, "verdict": self.verdict, "reasons": self.reasons,
                "checks": [dataclasses.asdict(c) for c in self.checks],
                "power": [{**dataclasses.asdict(p), "supported": p.supported} for p in self.power]}


def bootstrap_ci(values: Sequence[float], *, alpha: float, resamples: int, seed: int) -> tuple[float, float]:
    """Percentile bootstrap CI of the mean of ``values``: ``[q(alpha), q(1 - alpha)]`` of ``resamples`` means.

    Seeded (``numpy.random.default_rng(seed)``): the same inputs give the same interval.

    Raises:
        ValueError: fewer than 2 values.
    """
    x = np.asarray(values, dtype=float)
    if x.size < 2:
        raise ValueError(f"a bootstrap CI needs at least 2 values, got {x.size}")
    rng = np.random.default_rng(seed)
    means = x[rng.integers(0, x.size, size=(resamples, x.size))].mean(axis=1)
    return float(np.quantile(means, alpha)), float(np.quantile(means, 1 - alpha))


def power(metric: str, values: Sequence[float], *, margin: float, threshold: float, alpha: float, beta: float) -> Power:
    """Power row for a mean of ``values`` (sample SD, ``ddof=1``) against ``margin`` (see :class:`Power`)."""
    x = np.asarray(values, dtype=float)
    n = int(x.size)
    sd = float(x.std(ddof=1)) if n > 1 else math.inf
    se = sd / math.sqrt(n) if n > 0 else math.inf
    k = z(1 - alpha) + z(1 - beta)
    need = None if margin <= 0 or not math.isfinite(sd) or sd == 0 else math.ceil((k * sd / margin) ** 2)
    return Power(metric, n, threshold, margin, se, k * se, need)


def _mean(x: Sequence[float]) -> float:
    return float(np.mean(np.asarray(x, dtype=float)))


def paired(cand: Mapping[str, Sequence[float]], base: Mapping[str, Sequence[float]], *, ratio: float, alpha: float,
           beta: float, resamples: int, seed: int) -> RuleResult:
    """Non-inferiority of the candidate on paired per-sample ROUGE scores (0-100).

    Per metric: deltas ``d_i = cand_i - base_i``, margin ``(1 - ratio) x mean(base)``, a bootstrap CI of
    ``mean(d)`` at one-sided level ``alpha`` per bound. PASS when every lower bound ``>= -margin``; FAIL
    when any upper bound ``< -margin``; else INCONCLUSIVE. A PASS whose MDE exceeds its margin is
    INCONCLUSIVE (this ``n`` cannot support the claim).

    Raises:
        ValueError: fewer than 2 samples, or unequal lengths.
    """
    checks, rows, reasons = [], [], []
    for m in ROUGE_KEYS:
        c, b = np.asarray(cand[m], dtype=float), np.asarray(base[m], dtype=float)
        if c.shape != b.shape:
            raise ValueError(f"{m}: {c.size} candidate scores vs {b.size} baseline scores")
        d = c - b
        margin = (1 - ratio) * float(b.mean())
        lo, hi = bootstrap_ci(d, alpha=alpha, resamples=resamples, seed=seed)
        v = PASS if lo >= -margin else FAIL if hi < -margin else INCONCLUSIVE
        checks.append(MetricCheck(m, float(c.mean()), float(b.mean()), float(d.mean()), (lo, hi), -margin, v))
        rows.append(power(m, d, margin=margin, threshold=-margin, alpha=alpha, beta=beta))
    return _combine("paired", checks, rows, reasons)


def _combine(rule: str, checks: list[MetricCheck], rows: list[Power], reasons: list[str]) -> RuleResult:
    verdicts = {c.verdict for c in checks}
    if FAIL in verdicts:
        verdict = FAIL
        what = "CI of the mean delta" if rule == "paired" else "CI"
        reasons += [f"{c.metric}: {c.candidate:.2f} vs {c.reference:.2f}, {what} [{c.ci[0]:.2f}, {c.ci[1]:.2f}] "
                    f"outside the threshold {c.threshold:.2f}" for c in checks if c.verdict == FAIL]
    elif verdicts == {PASS}:
        weak = [p for p in rows if not p.supported]
        verdict = INCONCLUSIVE if weak else PASS
        reasons += [f"{p.metric}: n={p.n} resolves {p.mde:.2f}, not the margin {p.margin:.2f} "
                    f"(needs n >= {p.n_required})" for p in weak]
    else:
        verdict = INCONCLUSIVE
        reasons += [f"{c.metric}: CI [{c.ci[0]:.2f}, {c.ci[1]:.2f}] straddles {c.threshold:.2f}"
                    for c in checks if c.verdict == INCONCLUSIVE]
    return RuleResult(rule, verdict, checks, rows, reasons)


def mlperf_thresholds(reference: Mapping[str, float], *, high: bool = False) -> dict[str, tuple[float, float]]:
    """MLPerf's acceptance band per metric: ROUGE ``(ref x 0.99 (0.999 high), inf)``, ``gen_len``
    ``(0.9 x ref, 1.1 x ref)`` (constants.py @ 9e3d1054). Keys: those of ``reference``."""
    r = MLPERF_RATIO["mlperf_high" if high else "mlperf"]
    out = {m: (reference[m] * r, math.inf) for m in ROUGE_KEYS if m in reference}
    if GEN_LEN in reference:
        lo, hi = MLPERF_GEN_LEN_BAND
        out[GEN_LEN] = (reference[GEN_LEN] * lo, reference[GEN_LEN] * hi)
    return out


def mlperf(cand: Mapping[str, Sequence[float]], reference: Mapping[str, float] | None = None,
           base: Mapping[str, Sequence[float]] | None = None, *, high: bool = False, alpha: float, beta: float,
           resamples: int, seed: int) -> RuleResult:
    """MLPerf's accuracy check on a sample: every ROUGE mean ``>= r x ref`` and mean generated length within
    ``0.9 .. 1.1 x ref``, where ``ref`` is ``reference`` (published numbers) or the baseline's means.

    MLPerf checks the point estimate on its full accuracy set; on a sample the estimate has an error, so
    a metric passes when its CI (paired vs the baseline when given, else of the candidate's mean) lies
    inside the band, fails when it lies outside, and is INCONCLUSIVE otherwise; a PASS whose MDE exceeds
    the band's margin is INCONCLUSIVE.

    Raises:
        ValueError: neither ``reference`` nor ``base`` given.
    """
    if reference is None and base is None:
        raise ValueError("mlperf needs a reference: published numbers or the baseline's scores")
    ref = dict(reference) if reference is not None else {m: _mean(base[m]) for m in (*ROUGE_KEYS, GEN_LEN)}
    band = mlperf_thresholds(ref, high=high)
    checks, rows = [], []
    for m, (lo_t, hi_t) in band.items():
        c = np.asarray(cand[m], dtype=float)
        x = c - np.asarray(base[m], dtype=float) + ref[m] if base is not None and reference is None else c
        lo, hi = bootstrap_ci(x, alpha=alpha, resamples=resamples, seed=seed)
        if lo >= lo_t and hi <= hi_t:
            v = PASS
        elif hi < lo_t or lo > hi_t:
            v = FAIL
        else:
            v = INCONCLUSIVE
        margin = min(ref[m] - lo_t, hi_t - ref[m])
        checks.append(MetricCheck(m, float(c.mean()), ref[m], float(x.mean()) - ref[m], (lo, hi), lo_t, v))
        rows.append(power(m, x, margin=margin, threshold=lo_t, alpha=alpha, beta=beta))
    return _combine("mlperf_high" if high else "mlperf", checks, rows, [])


def trtllm_threshold(ref: float, n: int, *, sigma: float, alpha: float) -> float:
    """TensorRT-LLM's pass threshold (higher is better): ``ref + z(alpha) x sqrt(2 sigma^2 / n)``."""
    return ref + z(alpha) * math.sqrt(2 * sigma**2 / n)


def trtllm_theta(n: int, *, sigma: float, alpha: float, beta: float) -> float:
    """TensorRT-LLM's minimum detectable effect: ``-(z(alpha) + z(beta)) x sqrt(2 sigma^2 / n)``."""
    return -(z(alpha) + z(beta)) * math.sqrt(2 * sigma**2 / n)


def trtllm(cand: Sequence[float], ref: float, *, sigma: float, alpha: float, beta: float,
           design_n: int = TRTLLM_CNN_NUM_SAMPLES) -> RuleResult:
    """TensorRT-LLM's accuracy-suite test on ROUGE-1 (0-100): PASS when ``mean(cand) >= threshold``.

    The threshold loosens as ``n`` shrinks, so a PASS at an ``n`` whose ``theta`` is larger than at the
    upstream design point (``design_n``, 512 for CNN/DailyMail) is INCONCLUSIVE here; below the
    threshold is FAIL at any ``n``.
    """
    x = np.asarray(cand, dtype=float)
    n = int(x.size)
    thr = trtllm_threshold(ref, n, sigma=sigma, alpha=alpha)
    theta = trtllm_theta(n, sigma=sigma, alpha=alpha, beta=beta)
    design = trtllm_theta(design_n, sigma=sigma, alpha=alpha, beta=beta)
    acc = float(x.mean())
    v = PASS if acc >= thr else FAIL
    se = math.sqrt(2 * sigma**2 / n)
    need = math.ceil(2 * sigma**2 * ((z(alpha) + z(beta)) / design) ** 2 - 1e-6)  # = design_n
    row = Power("rouge1", n, thr, design, se, theta, need)
    reasons = []
    if v == FAIL:
        reasons.append(f"rouge1 {acc:.2f} < threshold {thr:.2f} (reference {ref:.2f}, n={n}, sigma={sigma}, alpha={alpha})")
    elif theta > design + 1e-12:
        v = INCONCLUSIVE
        reasons.append(f"rouge1: n={n} gives theta {theta:.2f} > {design:.2f} at TensorRT-LLM's n={design_n}")
    check = MetricCheck("rouge1", acc, ref, acc - ref, (acc, acc), thr, v)
    return RuleResult("trtllm", v, [check], [row], reasons)
