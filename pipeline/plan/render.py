"""Rich rendering of a :class:`PlanResult` (the human output of ``trtpipe plan``) and of a GPU comparison."""

from __future__ import annotations

from rich.console import Console, Group
from rich.table import Table
from rich.text import Text

from pipeline.plan.achievable import Prediction
from pipeline.plan.memory import GIB
from pipeline.plan.result import PlanResult


def _io(s) -> str:
    """``ISL/OSL`` of a scenario; ``ISL+IMG/OSL`` when its requests carry image tokens (Qwen2-VL family)."""
    img = getattr(s, "image_tokens", 0)
    return f"{s.isl}+{img} img/{s.osl}" if img else f"{s.isl}/{s.osl}"

def _g(b: float) -> str:
    return f"{b / GIB:,.2f}"


def _tps(x: float | None) -> str:
    return "—" if x is None else f"{x:,.0f}"


def _pred(p: Prediction | None) -> str:
    """``12,345 ±14%``: predicted output tokens/s and its expected relative error (1 σ)."""
    return "—" if p is None else f"{p.output_tokens_per_s:,.0f} ±{p.rel_error:.0%}"


def _ms(x: float | None) -> str:
    return "—" if x is None else (f"{x:,.1f}" if x < 100 else f"{x:,.0f}")


_SHORT = {"kv_cache": "KV", "max_batch_size": "batch", "max_num_tokens": "tokens", "compute": "compute", "concurrency": "conc."}


def _memory_table(plan: PlanResult) -> Table:
    """Memory budget (GiB) per GPU or of the host: total, weights, reserve, free, KV cache, unused."""
    m, w = plan.memory, plan.memory.weights
    gpu = plan.target != "host"
    mt = Table(title=f"Memory ({'per GPU' if gpu else 'host'}, GiB)", title_justify="left", show_edge=False)
    mt.add_column("item")
    mt.add_column("GiB", justify="right")
    mt.add_column("how")
    mt.add_row("device memory" if gpu else "host memory", _g(m.total_bytes), "nvidia-smi total" if gpu else "psutil total")
    mt.add_row("weights", _g(w.per_gpu_bytes),
               f"{w.qformat} Linear {_g(w.linear_bytes + w.scale_bytes)} + embed {_g(w.embedding_bytes)} + "
               f"lm_head {_g(w.lm_head_bytes)} (= {w.total_bytes / 1e9:.2f} GB)")
    mt.add_row("activations (est.)", _g(m.activation_bytes), "∝ max_num_tokens, logits ∝ max_batch_size")
    mt.add_row("runtime (est.)", _g(m.overhead_bytes), "CUDA context + workspaces" if gpu else "Python/torch/Triton stubs")
    mt.add_row("free after load", _g(m.free_bytes), "× free_gpu_memory_fraction → KV" if gpu else "")
    how = (f"{m.kv_tokens:,} tokens × {m.kv_token_bytes:,} B/token ({m.kv_limited_by.replace('_', ' ')}"
           + (f" {m.kv_fraction}" if m.kv_limited_by == "fraction" else "") + ")")
    mt.add_row("KV cache", _g(m.kv_pool_bytes), how)
    mt.add_row("unused", _g(m.unused_bytes), f"{m.full_sequences_at_max_seq_len} full sequences of max_seq_len {m.max_seq_len:,} fit")
    return mt


def _scenario_tables(plan: PlanResult) -> tuple[Table, Table]:
    """Capacity per ISL/OSL (KV sequences, concurrency, its limit, prefill, saturation) and output tokens/s at
    maximum load (roofline bound, prediction, batch, TTFT, ITL, the 90 % knee)."""
    st = Table(title="Capacity per ISL/OSL (tokens)", title_justify="left", show_edge=False)
    for col in ("ISL/OSL", "KV seqs", "conc.", "limit", "prefill ms", "saturates"):
        st.add_column(col, justify="left" if col in ("ISL/OSL", "limit") else "right", no_wrap=True)
    pt = Table(title="Output tokens/s at maximum load: roofline bound and predicted (± expected error); "
                     "'90 % at': the concurrency that reaches 90 % of it (a starting max_batch_size)",
               title_justify="left", show_edge=False)
    for col in ("ISL/OSL", "bound", "predicted", "batch", "TTFT ms", "ITL ms", "90 % at"):
        pt.add_column(col, justify="left" if col == "ISL/OSL" else "right", no_wrap=True)
    for s in plan.scenarios:
        sat = "—" if s.saturation_batch is None else f"{s.saturation_batch} ({_SHORT[s.saturated_by]})"
        st.add_row(_io(s), f"{s.kv_max_sequences:,}" if s.kv_max_sequences is not None else "—",
                   f"{s.max_concurrency:,}", _SHORT[s.concurrency_limited_by],
                   "—" if s.prefill_ms is None else f"{s.prefill_ms:,.1f}", sat)
        p = s.predicted
        pt.add_row(_io(s), _tps(s.peak_output_tokens_per_s), _pred(p),
                   "—" if p is None else f"{p.batch:,} ({_SHORT[p.limited_by]})", _ms(p and p.ttft_ms), _ms(p and p.itl_ms),
                   "—" if s.knee_batch is None else f"{s.knee_batch:,}")
    return st, pt


def _concurrency_table(plan: PlanResult, conc: list[int]) -> Table:
    """Per bench concurrency: the roofline bound, the prediction, per-user tokens/s, TTFT and ITL."""
    ct = Table(title="Per concurrency (closed loop of identical requests): output tokens/s bound and predicted, per-user "
                     "tokens/s, TTFT (mean, p99), ITL", title_justify="left", show_edge=False)
    for col in ("ISL/OSL", "conc.", "bound", "predicted", "per user", "TTFT ms", "TTFT p99", "ITL ms"):
        ct.add_column(col, justify="left" if col == "ISL/OSL" else "right", no_wrap=True)
    for s in plan.scenarios:
        bound = {pt.batch: pt.output_tokens_per_s for pt in s.curve}
        for p in s.predicted_by_concurrency:
            if p.concurrency not in conc:
                continue
            b = bound.get(p.concurrency) if p.concurrency is not None and p.concurrency <= s.max_concurrency else None
            ct.add_row(_io(s), f"{p.concurrency}" + (" (queues)" if p.limited_by != "concurrency" else ""),
                       _tps(b) if s.curve else "—", _pred(p), f"{p.per_user_tokens_per_s:,.0f}", _ms(p.ttft_ms),
                       _ms(p.ttft_p99_ms), _ms(p.itl_ms))
    return ct


def _slo_table(plan: PlanResult) -> Table | None:
    """Per ISL/OSL: the largest concurrency predicted to meet the SLOs, its TTFT p99 / ITL / throughput, what stops it."""
    rows = [s for s in plan.scenarios if s.within_slo is not None]
    if not rows:
        return None
    slo = ", ".join(f"{k} ≤ {v:g} ms" for k, v in rows[0].within_slo.slo.items())
    t = Table(title=f"Largest concurrency within the SLO ({slo}; TTFT and E2E at p99)", title_justify="left", show_edge=False)
    for col in ("ISL/OSL", "concurrency", "TTFT p99 ms", "ITL ms", "predicted tok/s", "per user", "stops at"):
        t.add_column(col, justify="left" if col in ("ISL/OSL", "stops at") else "right", no_wrap=True)
    for s in rows:
        a, p = s.within_slo, s.within_slo.prediction
        stop = ("the engine's max concurrency" if a.limited_by == "max_concurrency" else f"{a.limited_by} SLO")
        t.add_row(_io(s), "none" if a.concurrency is None else f"{a.concurrency:,}",
                  _ms(p and p.ttft_p99_ms), _ms(p and p.itl_ms), _pred(p) if a.concurrency else "—",
                  "—" if p is None or a.concurrency is None else f"{p.per_user_tokens_per_s:,.0f}",
                  ("even 1 client misses the " if a.concurrency is None else "") + stop)
    return t


def _prediction_line(plan: PlanResult) -> Text | None:
    """How the prediction was made: the host's measured rates, or the calibrated GPU efficiencies and error."""
    if plan.efficiency is None:
        return None
    e = plan.efficiency
    extra = ", ".join(f"{k} ±{v:.0%}" for k, v in plan.error_terms.items())
    if plan.target == "host":
        how = (f"  prediction: the host's measured bandwidth and GEMM rate, CPU-engine overheads {e.step_overhead_ms:.1f} ms "
               f"per step + {e.seq_overhead_us:.0f} µs per sequence (measured); ±{e.rel_error:.0%}: not calibrated "
               "against served throughput (trtpipe plan --against RUN_DIR) — docs/plan.md")
    else:
        how = (f"  prediction ({e.name or 'fitted model'}): η_bw {e.bw_frac:.2f}, η_gemm {e.gemm_frac:.2f}, η_attn {e.attn_frac:.2f}, "
               f"{e.seq_overhead_us:.1f} µs/sequence + {e.step_overhead_ms:g} ms per step; error ±{e.rel_error:.0%} where "
               "calibrated" + (f" (+ uncalibrated: {extra})" if extra else "") + " — docs/plan.md")
    return Text(how, style="dim")


def _spec_lines(plan: PlanResult) -> list[Text]:
    """Speculative decoding: the draft's memory, the acceptance length and the predicted speed-up per ISL/OSL."""
    sp = plan.speculative
    if sp is None:
        return []
    d = sp.draft
    out = [Text(f"  speculative decoding ({d.decoding_type}, max_draft_len {d.max_draft_len}): draft memory "
                f"{d.weight_bytes / 2**30:.2f} GiB per GPU + {d.kv_token_bytes:,} B/token KV + {d.extra_kv_tokens_per_seq} extra KV "
                f"tokens per sequence; acceptance length {sp.acceptance_length:g} tokens/step ({sp.acceptance_source})")]
    for isl, osl in dict.fromkeys((p.isl, p.osl) for p in sp.points):
        parts = [f"×{p.speedup:.2f} at {'max load' if p.concurrency is None else p.concurrency} "
                 f"(ITL {p.plain_itl_ms:.2f} → {p.itl_ms:.2f} ms)" for p in sp.points if (p.isl, p.osl) == (isl, osl)]
        out.append(Text(f"    {isl}/{osl}: predicted speed-up " + ", ".join(parts)))
    return out


def render(plan: PlanResult, concurrency: list[int] | None = None) -> Group:
    """Tables for memory, per-scenario capacity with throughput bound and prediction, the prediction per
    bench concurrency, then the verdict lines."""
    w = plan.memory.weights
    par = f" × tp{plan.tp_size} pp{plan.pp_size}" if plan.tp_size * plan.pp_size > 1 else ""
    title = Text.assemble((plan.recipe, "bold"), (
        f": {plan.model_source} ({w.total_params / 1e9:.2f} B params stored) · {plan.qformat} "
        f"(KV {plan.kv_cache_dtype}) · {plan.engine} engine · {plan.gpu_name}{par}"
    ))
    st, pt = _scenario_tables(plan)
    lines: list = [title, _memory_table(plan), Text(""), st, Text(""), pt]
    conc = sorted(set(concurrency or []))
    if conc and any(s.predicted_by_concurrency for s in plan.scenarios):
        lines += [Text(""), _concurrency_table(plan, conc)]
    slo = _slo_table(plan)
    lines += [Text(""), slo] if slo is not None else []
    how = _prediction_line(plan)
    lines += [how] if how is not None else []
    lines += _spec_lines(plan)
    v = plan.verdict
    lines.append(Text.from_markup("[bold green]fits[/]" if v.ok else "[bold red]does not fit[/]"))
    lines += [Text.assemble(("  error: ", "red"), e) for e in v.errors]
    lines += [Text.assemble(("  warning: ", "yellow"), x) for x in v.warnings]
    lines += [Text(f"  note: {n}", style="dim") for n in plan.notes]
    return Group(*lines)


def render_comparison(plans: list[PlanResult]) -> Group:
    """The same recipe on several GPUs: per GPU and ISL/OSL, the predicted output tokens/s at maximum load
    ± error next to the roofline bound, the batch, TTFT and ITL; weights and KV tokens per GPU. A GPU the
    recipe does not fit is marked ✗ with its first error below the table."""
    first = plans[0]
    title = Text.assemble((first.recipe, "bold"), f": {first.model_source} · {first.qformat} (KV {first.kv_cache_dtype}) · "
                                                  f"{first.engine} engine — GPU comparison at maximum load")
    t = Table(show_edge=False)
    for col in ("GPU", "weights GiB", "KV tokens", "ISL/OSL", "bound", "predicted", "batch", "TTFT ms", "ITL ms"):
        t.add_column(col, justify="left" if col in ("GPU", "ISL/OSL") else "right", no_wrap=True)
    for p in plans:
        for i, s in enumerate(p.scenarios):
            head = [p.target + ("" if p.verdict.ok else " ✗"), _g(p.memory.weights.per_gpu_bytes), f"{p.memory.kv_tokens:,}"] if i == 0 else ["", "", ""]
            q = s.predicted
            t.add_row(*head, _io(s), _tps(s.peak_output_tokens_per_s), _pred(q),
                      "—" if q is None else f"{q.batch:,} ({_SHORT[q.limited_by]})", _ms(q and q.ttft_ms), _ms(q and q.itl_ms),
                      end_section=i == len(p.scenarios) - 1)
    lines: list = [title, t]
    for p in plans:
        if not p.verdict.ok:
            lines.append(Text.assemble((f"  {p.target}: ", "red"), p.verdict.errors[0]))
    lines.append(Text("  output tokens/s: predicted = achievable-throughput model (± expected error, 1 σ); bound = datasheet "
                      "roofline — docs/plan.md", style="dim"))
    return Group(*lines)


def print_plan(plan: PlanResult, console: Console, concurrency: list[int] | None = None) -> None:
    """Print :func:`render` on ``console``."""
    console.print(render(plan, concurrency), highlight=False)
