"""What ``trtpipe recipe new`` prints and writes: the top-k table (rich), its JSON, and the commented recipe YAML.

The YAML is written by hand (a recipe is a fixed shape of mappings, scalars, lists of scalars and ISL/OSL pairs) so
that every choice carries a comment with the planner's numbers: the chosen value's predicted output tok/s per GPU,
and the best alternative of that one dimension (same everything else) with its figure and whether it ties.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any

from rich.table import Table

from pipeline.advise import space as sp
from pipeline.advise.search import Outcome, Search, path_last_release
from pipeline.plan.achievable import slo_value
from pipeline.recipe import qformats


def tps(o: Outcome) -> str:
    """``12,345 ±14%``: output tok/s per GPU and the planner's band."""
    return f"{o.per_gpu:,.0f} ±{o.band:.0%}"


def rank_label(o: Outcome) -> str:
    """``1`` or ``1=`` (tied with another of its group)."""
    return f"{o.rank}{'=' if o.tie else ''}"


def row(o: Outcome) -> dict[str, Any]:
    """One candidate as JSON: its settings, rank, the prediction at its SLO concurrency and the qformat's risk."""
    c, p = o.cand, o.pred
    assert p is not None
    risk, src = qformats.accuracy(c.qformat)
    return {"rank": o.rank, "tie": o.tie, "engine": c.engine, "qformat": c.qformat, "kv_cache_dtype": c.kv,
            "tp_size": c.tp, "pp_size": c.pp, "ep_size": c.ep, "replicas": o.replicas, "max_num_tokens": c.max_num_tokens,
            "cpu_threads": c.threads, "concurrency": o.concurrency, "limited_by": o.limited_by,
            "output_tokens_per_s_per_gpu": round(o.per_gpu, 1), "rel_error": round(o.band, 4),
            "output_tokens_per_s_per_gpu_low": round(o.per_gpu / (1 + o.band), 1),
            "output_tokens_per_s_per_gpu_high": round(o.per_gpu * (1 + o.band), 1),
            "instance_output_tokens_per_s": round(p.output_tokens_per_s, 1), "ttft_p99_ms": round(slo_value(p, "ttft"), 1),
            "itl_ms": round(p.itl_ms, 2), "per_user_tokens_per_s": round(p.per_user_tokens_per_s, 1),
            "accuracy_risk": risk, "accuracy_source": src}


def table(s: Search, top: int) -> Table:
    """The top-k candidates with their bands; '=' marks a tie within the planner's error band."""
    req = s.request
    slo = ", ".join(f"{k} ≤ {v:g} ms" for k, v in req.slo.items()) or "none (maximum load)"
    t = Table(title=(f"{req.source} on {req.num_gpus}× {req.target}, ISL {req.isl} / OSL {req.osl}, SLO {slo}: top "
                     f"{len(s.distinct(top))} of {len(s.ranked)} within the SLO ({len(s.outcomes)} judged; each layout at its best "
                     "token budget); '=' ties within the planner's error band"), title_justify="left", show_edge=False)
    for col in ("rank", "engine", "qformat", "KV", "layout", "repl.", "tokens", "conc.", "tok/s/GPU ±band", "TTFT p99",
                "ITL ms", "tok/s/user", "accuracy risk"):
        t.add_column(col, justify="left" if col in ("engine", "qformat", "KV", "layout", "accuracy risk") else "right",
                     no_wrap=True)
    for o in s.distinct(top):
        r = row(o)
        t.add_row(rank_label(o), r["engine"], r["qformat"], r["kv_cache_dtype"], o.cand.layout, str(o.replicas),
                  f"{r['max_num_tokens']:,}", f"{o.concurrency:,}", tps(o), f"{r['ttft_p99_ms']:,.0f}", f"{r['itl_ms']:.1f}",
                  f"{r['per_user_tokens_per_s']:,.0f}", r["accuracy_risk"])
    return t


def as_json(s: Search, top: int, written: Outcome, path: str | None) -> dict[str, Any]:
    """The ``--json`` document: the request, the written choice, the top-k rows, pruning counts, what was left out."""
    req = s.request
    return {"model": req.source, "gpu": req.target, "num_gpus": req.num_gpus, "isl": req.isl, "osl": req.osl,
            "slo": req.slo, "engines": list(req.engines), "written": path, "best": row(written),
            "candidates": [row(o) for o in s.distinct(top)], "judged": len(s.outcomes), "within_slo": len(s.ranked),
            "pruned": s.pruned_reasons(), "not_searched": s.not_searched}


#: dimension → (fields of Candidate that define it, recipe path it is written at)
DIMENSIONS: dict[str, tuple[tuple[str, ...], str]] = {
    "engine": (("engine",), "build.engine"),
    "qformat": (("qformat",), "quantization.qformat"),
    "kv": (("kv",), "quantization.kv_cache_dtype"),
    "layout": (("tp", "pp", "ep"), "target.tp_size"),
    "tokens": (("max_num_tokens",), "build.max_num_tokens"),
    "batch": (("max_batch_size",), "build.max_batch_size"),
}


def _key(c: sp.Candidate, skip: tuple[str, ...]) -> tuple:
    skip += () if c.path.on_cpu else ("max_batch_size",)  # the batch is a dimension on the CPU only
    return tuple(v for k, v in dataclasses.asdict(c).items() if k not in skip)


def why(s: Search, best: Outcome) -> dict[str, str]:
    """Recipe path → comment: the chosen value's figure and the best alternative of that dimension alone."""
    out: dict[str, str] = {}
    for dim, (fields, path) in DIMENSIONS.items():
        on_cpu = best.cand.path.on_cpu
        if dim == "batch" and not on_cpu:
            continue
        if dim == "qformat" and on_cpu:
            fields = ("qformat", "kv")  # paired on the CPU engine
        same = _key(best.cand, fields)
        alts = [o for o in s.ranked if _key(o.cand, fields) == same and _key(o.cand, ()) != _key(best.cand, ())]
        mine = best.cand.layout if dim == "layout" else ", ".join(str(getattr(best.cand, f)) for f in fields)
        text = f"{mine}: {tps(best)} tok/s/GPU"
        if alts:
            a = max(alts, key=lambda o: o.per_gpu)
            other = a.cand.layout if dim == "layout" else ", ".join(str(getattr(a.cand, f)) for f in fields)
            rel = "tie" if a.rank == best.rank else f"rank {a.rank}"
            text += f"; next {other}: {tps(a)} ({rel})"
        else:
            text += "; no other value of it meets the SLO with the rest unchanged"
        out[path] = text
    risk, _ = qformats.accuracy(best.cand.qformat)
    out["quantization.qformat"] += f"; accuracy risk {risk} (docs/recipe-new.md)"
    p = best.pred
    assert p is not None
    out["build.max_batch_size"] = (out.get("build.max_batch_size", "") + "; " if best.cand.path.on_cpu else "") + (
                                   f"the largest concurrency predicted within the SLO ({best.limited_by} stops it): "
                                   f"TTFT p99 {slo_value(p, 'ttft'):,.0f} ms, ITL {p.itl_ms:.1f} ms")
    if not best.cand.path.on_cpu:
        out["target.num_gpus"] = (f"one instance = TP × PP; {best.replicas} replica(s) of it on the {s.request.num_gpus} "
                                  "GPU(s) asked for")
    else:
        out["build.cpu"] = "threads: every core of this host; the planner's host rates are measured with all of them"
    return out


def _scalar(v: Any) -> str:
    if isinstance(v, bool):
        return "true" if v else "false"
    if v is None:
        return "null"
    if isinstance(v, str):
        return v if v and all(ch.isalnum() or ch in "-_./:" for ch in v) and not v[0].isdigit() else repr(v).replace("'", '"')
    if isinstance(v, list):
        return "[" + ", ".join(_scalar(x) for x in v) + "]"
    if isinstance(v, dict):
        return "{" + ", ".join(f"{k}: {_scalar(x)}" for k, x in v.items()) + "}"
    return str(v)


def yaml_text(data: dict[str, Any], comments: dict[str, str], header: list[str]) -> str:
    """``data`` (a recipe mapping) as YAML with ``# comment`` after the lines whose dotted path has one, under the
    ``header`` comment lines."""
    lines = [f"# {h}" if h else "#" for h in header]

    def emit(d: dict[str, Any], prefix: str, indent: int) -> None:
        for k, v in d.items():
            path = f"{prefix}{k}"
            note = f"  # {comments[path]}" if path in comments else ""
            pad = "  " * indent
            if isinstance(v, dict):
                lines.append(f"{pad}{k}:{note}")
                emit(v, path + ".", indent + 1)
            elif isinstance(v, list) and v and isinstance(v[0], dict):
                lines.append(f"{pad}{k}:{note}")
                lines.extend(f"{pad}  - {_scalar(x)}" for x in v)
            else:
                lines.append(f"{pad}{k}: {_scalar(v)}{note}")

    emit(data, "", 0)
    return "\n".join(lines) + "\n"


def _ends(s: Search, best: Outcome) -> str:
    """``; the TensorRT-engine path ends after X (release matrix)`` when the best's tie group holds a path that ends."""
    last = {path_last_release(o.cand) for o in s.ranked if o.rank == best.rank} - {None}
    return f"; the TensorRT-engine path ends after TensorRT-LLM {next(iter(last))} (release matrix)" if last else ""


def header(s: Search, best: Outcome, command: str, note: Callable[[Outcome], str] = rank_label) -> list[str]:
    """The recipe's top comment: the command, the prediction of what is written, the top of the table."""
    p = best.pred
    assert p is not None
    ties = [o for o in s.distinct(len(s.ranked)) if o.rank == best.rank and _key(o.cand, ()) != _key(best.cand, ())]
    lines = [f"Written by: {command}",
             (f"Predicted by trtpipe plan: {best.per_gpu:,.0f} output tok/s per GPU ±{best.band:.0%} "
             f"({p.output_tokens_per_s:,.0f} per instance × {best.replicas}) at {best.concurrency} concurrent clients "
             f"per instance, TTFT p99 {slo_value(p, 'ttft'):,.0f} ms, ITL {p.itl_ms:.1f} ms, "
             f"{p.per_user_tokens_per_s:,.0f} tok/s per user."),
             f"Rank {note(best)} of {len(s.ranked)} candidates within the SLO ({len(s.outcomes)} judged)"
             + (f"; {len(ties)} other layout(s) tie within the band (the lowest accuracy risk, then a maintained path, then the fewest "
                "GPUs, is written" + _ends(s, best) + "):" if ties else ".")]
    lines += [f"  {rank_label(o)} {o.cand.label}: {tps(o)} tok/s/GPU" for o in ties[:4]]
    lines += ["Check it: trtpipe recipe validate FILE; trtpipe plan FILE; trtpipe build FILE --dry-run."]
    return lines
