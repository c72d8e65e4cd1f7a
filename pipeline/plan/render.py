"""Rich rendering of a :class:`PlanResult` (the human output of ``trtpipe plan``)."""

from __future__ import annotations

from rich.console import Console, Group
from rich.table import Table
from rich.text import Text

from pipeline.plan.memory import GIB
from pipeline.plan.planner import PlanResult


def _g(b: float) -> str:
    return f"{b / GIB:,.2f}"


def _tps(x: float | None) -> str:
    return "—" if x is None else f"{x:,.0f}"


def render(plan: PlanResult, concurrency: list[int] | None = None) -> Group:
    """Tables for memory, per-scenario capacity and throughput bounds, then the verdict lines."""
    m, w = plan.memory, plan.memory.weights
    par = f" × tp{plan.tp_size} pp{plan.pp_size}" if plan.tp_size * plan.pp_size > 1 else ""
    title = Text.assemble((plan.recipe, "bold"), (
        f": {plan.model_source} ({w.total_params / 1e9:.2f} B params stored) · {plan.qformat} "
        f"(KV {plan.kv_cache_dtype}) · {plan.engine} engine · {plan.gpu_name}{par}"
    ))
    where = "per GPU" if plan.target != "host" else "host"
    mt = Table(title=f"Memory ({where}, GiB)", title_justify="left", show_edge=False)
    mt.add_column("item")
    mt.add_column("GiB", justify="right")
    mt.add_column("how")
    mt.add_row("device memory" if plan.target != "host" else "host memory", _g(m.total_bytes),
               "nvidia-smi total" if plan.target != "host" else "psutil total")
    mt.add_row("weights", _g(w.per_gpu_bytes),
               f"{w.qformat} Linear {_g(w.linear_bytes + w.scale_bytes)} + embed {_g(w.embedding_bytes)} + "
               f"lm_head {_g(w.lm_head_bytes)} (= {w.total_bytes / 1e9:.2f} GB)")
    mt.add_row("activations (est.)", _g(m.activation_bytes), "∝ max_num_tokens, logits ∝ max_batch_size")
    mt.add_row("runtime (est.)", _g(m.overhead_bytes), "CUDA context + workspaces" if plan.target != "host" else "Python/torch/Triton stubs")
    mt.add_row("free after load", _g(m.free_bytes), "× free_gpu_memory_fraction → KV" if plan.target != "host" else "")
    how = (f"{m.kv_tokens:,} tokens × {m.kv_token_bytes:,} B/token ({m.kv_limited_by.replace('_', ' ')}"
           + (f" {m.kv_fraction}" if m.kv_limited_by == "fraction" else "") + ")")
    mt.add_row("KV cache", _g(m.kv_pool_bytes), how)
    mt.add_row("unused", _g(m.unused_bytes), f"{m.full_sequences_at_max_seq_len} full sequences of max_seq_len {m.max_seq_len:,} fit")

    short = {"kv_cache": "KV", "max_batch_size": "batch", "max_num_tokens": "tokens", "compute": "compute"}
    st = Table(title="Capacity per ISL/OSL (tokens) and peak output tokens/s bound", title_justify="left", show_edge=False)
    for col in ("ISL/OSL", "KV seqs", "conc.", "limit", "prefill ms", "saturates", "max tok/s"):
        st.add_column(col, justify="left" if col in ("ISL/OSL", "limit") else "right", no_wrap=True)
    for s in plan.scenarios:
        sat = "—" if s.saturation_batch is None else f"{s.saturation_batch} ({short[s.saturated_by]})"
        st.add_row(f"{s.isl}/{s.osl}", f"{s.kv_max_sequences:,}" if s.kv_max_sequences is not None else "—",
                   f"{s.max_concurrency:,}", short[s.concurrency_limited_by],
                   "—" if s.prefill_ms is None else f"{s.prefill_ms:,.1f}", sat, _tps(s.peak_output_tokens_per_s))

    conc = sorted(set(concurrency or []))
    ct = Table(title="Output tokens/s bound vs concurrency (incl. prefill)",
               title_justify="left", show_edge=False)
    ct.add_column("ISL/OSL", no_wrap=True)
    for c in conc:
        ct.add_column(str(c), justify="right", no_wrap=True)
    for s in plan.scenarios:
        at = {p.batch: p.output_tokens_per_s for p in s.curve}
        ct.add_row(f"{s.isl}/{s.osl}", *[_tps(at.get(c)) if c <= s.max_concurrency else "cap" for c in conc])

    lines: list = [title, mt, Text(""), st]
    if plan.scenarios and plan.scenarios[0].curve and conc:
        lines += [Text(""), ct]
    v = plan.verdict
    lines.append(Text.from_markup("[bold green]fits[/]" if v.ok else "[bold red]does not fit[/]"))
    lines += [Text.assemble(("  error: ", "red"), e) for e in v.errors]
    lines += [Text.assemble(("  warning: ", "yellow"), x) for x in v.warnings]
    lines += [Text(f"  note: {n}", style="dim") for n in plan.notes]
    return Group(*lines)


def print_plan(plan: PlanResult, console: Console, concurrency: list[int] | None = None) -> None:
    """Print :func:`render` on ``console``."""
    console.print(render(plan, concurrency), highlight=False)
