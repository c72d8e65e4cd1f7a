"""The tables ``trtpipe eval`` prints: scores per metric with the verdict, and the power analysis."""

from __future__ import annotations

from typing import Any


def result_tables(result: Any) -> list[Any]:
    """The scores table (per metric: candidate, baseline, delta, CI, threshold, verdict) and the power table."""
    from rich.table import Table

    m, rule = result.means, result.rule
    if rule.rule == "kld":
        return [_kld_table(result), _power_table(result)] if rule.power else [_kld_table(result)]
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
    return [t, _power_table(result)] if rule.power else [t]


def _power_table(result: Any) -> Any:
    from rich.table import Table

    rule = result.rule
    p = Table(title="power analysis", title_justify="left")
    for col in ("metric", "n", "threshold", "margin", "std error", "min detectable effect", "n for MDE <= margin", "supported"):
        p.add_column(col, justify="right" if col != "metric" else "left")
    for row in rule.power:
        p.add_row(row.metric, str(row.n), f"{row.threshold:.4g}", f"{row.margin:.4g}", f"{row.se:.4g}", f"{row.mde:.4g}",
                  "-" if row.n_required is None else f"{row.n_required:,}", "yes" if row.supported else "no")
    p.caption = "one-sided alpha %g, beta %g (power %g)" % (result.spec.alpha, result.spec.beta, 1 - result.spec.beta)
    if rule.rule == "kld":
        p.caption += "; n = sequences, SE = bootstrap standard deviation over sequences"
    return p


def _kld_table(result: Any) -> Any:
    """Mean KLD, same-top-1 %, Δ log-perplexity and the 99th-percentile KLD with their bootstrap CIs and limits."""
    from rich.table import Table

    k, rule = result.means["kld"], result.rule
    t = Table(title=f"trtpipe eval — task {result.task}, n={result.n}, rule kld "
                    f"({k['positions']['value']:,} positions)", title_justify="left")
    for col in ("metric", "candidate vs baseline", "CI", "limit", "verdict"):
        t.add_column(col, justify="right" if col != "metric" else "left")
    checked = {c.metric: c for c in rule.checks}
    for name in ("mean_kld", "same_top1_pct", "delta_log_ppl", "p99_kld"):
        v, c = k[name], checked.get(name)
        t.add_row(name, f"{v['value']:.4g}", f"[{v['ci'][0]:.4g}, {v['ci'][1]:.4g}]",
                  "-" if c is None else f"{c.threshold:.4g}", "-" if c is None else c.verdict)
    rel, a = k["relation"], result.means["agreement"]
    rho = ", ".join(f"{name.removeprefix('spearman_kld_vs_')} {'-' if r is None else f'{r:+.2f}'}" for name, r in rel.items())
    t.caption = (f"KLD in nats per token (baseline || candidate); limits: {k['limits']['source']}; agreement of the "
                 f"generated texts: exact {a['exact_match_pct']:.0f} %, ROUGE-L {a['rougeL_vs_baseline']:.1f}; "
                 f"Spearman rho of a sequence's KLD with {rho}")
    return t
