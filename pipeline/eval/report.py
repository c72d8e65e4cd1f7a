"""The tables ``trtpipe eval`` prints: scores per metric with the verdict, and the power analysis."""

from __future__ import annotations

from typing import Any


def result_tables(result: Any) -> list[Any]:
    """The scores table (per metric: candidate, baseline, delta, CI, threshold, verdict) and the power table."""
    from rich.table import Table

    m, rule = result.means, result.rule
    t = Table(title=f"trtpipe eval — task {result.task}, n={result.n}, rule {rule.rule}", title_justify="left")
    for col in ("metric", "candidate", "baseline", "delta", "CI of delta", "threshold", "verdict"):
        t.add_column(col, justify="right" if col != "metric" else "left")
    checked = {c.metric: c for c in rule.checks}
    for k in [*m["candidate"]]:
        c = checked.get(k)
        cand, base = m["candidate"][k], m["baseline"].get(k)
        ci = "-" if c is None else f"[{c.ci[0] - (c.reference if rule.rule.startswith('mlperf') else 0):+.2f}, " \
                                   f"{c.ci[1] - (c.reference if rule.rule.startswith('mlperf') else 0):+.2f}]"
        if c is not None and rule.rule == "trtllm":
            ci = "-"
        thr = "-" if c is None else f"{c.threshold:+.2f}" if rule.rule == "paired" else f"{c.threshold:.2f}"
        t.add_row(k, f"{cand:.2f}", "-" if base is None else f"{base:.2f}", "-" if base is None else f"{cand - base:+.2f}",
                  ci, thr, "-" if c is None else c.verdict)
    a = m["agreement"]
    t.caption = (f"ROUGE F x100, gen_len in characters; agreement with the baseline: exact {a['exact_match_pct']:.0f} %, "
                 f"ROUGE-L {a['rougeL_vs_baseline']:.1f}, median first divergent token "
                 f"{'-' if a['median_first_divergent_token'] is None else int(a['median_first_divergent_token'])}")
    p = Table(title="power analysis", title_justify="left")
    for col in ("metric", "n", "threshold", "margin", "std error", "min detectable effect", "n for MDE <= margin", "supported"):
        p.add_column(col, justify="right" if col != "metric" else "left")
    for row in rule.power:
        p.add_row(row.metric, str(row.n), f"{row.threshold:.2f}", f"{row.margin:.3f}", f"{row.se:.3f}", f"{row.mde:.3f}",
                  "-" if row.n_required is None else f"{row.n_required:,}", "yes" if row.supported else "no")
    p.caption = "one-sided alpha %g, beta %g (power %g)" % (result.spec.alpha, result.spec.beta, 1 - result.spec.beta)
    return [t, p] if rule.power else [t]
