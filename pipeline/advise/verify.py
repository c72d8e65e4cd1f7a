"""``trtpipe recipe new --verify``: measure the top candidates with ``trtpipe tune`` and hold the ranking to it.

The tune file (:func:`tune_dict`) takes the written recipe as its base (candidate #1) and one knob whose values are the
other candidates, each as the changed recipe fields (``also``), in isolation mode: the base and each alternative are
built, served and benchmarked for real at the candidates' SLO concurrencies, with the SLO as the tune's objective
bounds (TTFT p99, ITL mean) and a small accuracy gate (``kld``, the shipped CPU sweep's rule). On the CPU target
:func:`run_tune` runs it (``trtpipe tune --no-mlflow`` in a subprocess) and :func:`compare` reads ``results.json``:
predicted vs measured output tok/s per GPU and the two rankings. On a GPU target only the tune file is written (it is
what would do the same in the container).
"""

from __future__ import annotations

import dataclasses
import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

from pipeline.advise.search import Outcome
from pipeline.recipe.consumers import flatten

#: SLO key → the bench.json metric the tune holds it to (the planner checks TTFT at p99 and the mean ITL)
SLO_METRICS = {"ttft": "time_to_first_token.p99", "itl": "inter_token_latency.avg", "tpot": "inter_token_latency.avg",
               "e2e": "request_latency.p99"}
#: the accuracy gate of the verify sweep: the shipped CPU sweep's rule at a smaller n (tunes/smollm2_cpu.yaml)
GATE = {"n": 4, "max_output_tokens": 16, "rule": "kld"}


def label(i: int, o: Outcome) -> str:
    """``#2 cpu int4_awq kv fp8 …``: the candidate's place in the predicted order and its name."""
    batch = min(max(o.concurrency or 1, 1), o.cand.max_batch_size)  # the written max_batch_size
    return f"#{i} {dataclasses.replace(o.cand, max_batch_size=batch).label}"


def changes(base: dict[str, Any], other: dict[str, Any]) -> dict[str, Any]:
    """Dotted field → value that turns recipe mapping ``base`` into ``other`` (name, description and bench aside): the
    fields ``other`` sets differently, and the fields only ``base`` sets, at ``other``'s resolved value (its default)."""
    from pipeline.recipe import Recipe

    a, b = flatten(base), flatten(other)
    resolved = flatten(Recipe.model_validate(other).model_dump(mode="json"))
    skip = ("name", "description", "bench")
    out = {k: v for k, v in b.items() if a.get(k) != v and not k.startswith(skip)}
    out.update({k: resolved[k] for k in a if k not in b and k in resolved and not k.startswith(skip)})
    return out


def tune_dict(recipe_file: Path, tune_file: Path, recipes: list[dict[str, Any]], tops: list[Outcome],
              slo: dict[str, float], isl: int, osl: int) -> dict[str, Any]:
    """The TUNE.yaml mapping: base = ``recipes[0]`` (written at ``recipe_file``), one knob holding the others: its
    field is the first one any alternative changes, each value sets it and carries the rest of that alternative's
    changes in ``also``."""
    diffs = [changes(recipes[0], r) for r in recipes[1:]]
    field = next((k for d in diffs for k in d), "build.max_batch_size")
    knob_values = [{"value": flatten(r).get(field), "also": {k: v for k, v in d.items() if k != field}, "label": label(i, o)}
                   for i, (r, d, o) in enumerate(zip(recipes[1:], diffs, tops[1:]), start=2)]
    conc = sorted({max(o.concurrency or 1, 1) for o in tops} | {1})
    rel = os.path.relpath(recipe_file.resolve(), tune_file.resolve().parent)
    return {"description": f"trtpipe recipe new --verify: the top {len(tops)} predicted candidates, measured",
            "recipe": rel, "knobs": [{"field": field, "values": knob_values}], "mode": "isolation",
            "bench": {"scenarios": [{"isl": isl, "osl": osl}], "concurrency": conc},
            "objective": {"metric": "output_token_throughput_per_gpu",
                          "slo": [{"metric": SLO_METRICS[k], "max": v} for k, v in slo.items()]},
            "gate": dict(GATE), "repeats": 1}


def run_tune(tune_file: Path, out: Path) -> int:
    """Run ``trtpipe tune TUNE --out OUT --no-mlflow`` (the real sweep) with this interpreter; its exit status."""
    cmd = [sys.executable, "-m", "pipeline.cli", "tune", str(tune_file), "--out", str(out), "--no-mlflow"]
    return subprocess.run(cmd, check=False, stdout=2).returncode  # to fd 2: stdout stays the command's (--json)


def compare(results_json: Path, tops: list[Outcome]) -> list[dict[str, Any]]:
    """Predicted vs measured per candidate (predicted order): output tok/s per GPU at the best load point within the
    SLO (None: none met it or the point did not run), and the measured rank (1 = best measured)."""
    doc = json.loads(results_json.read_text())
    by_label = {d.get("label"): d for d in doc.get("points", {}).values()}
    rows = []
    for i, o in enumerate(tops, start=1):
        d = by_label.get("base" if i == 1 else label(i, o)) or {}
        rows.append({"candidate": label(i, o), "predicted_rank": o.rank, "predicted": round(o.per_gpu, 2),
                     "band": round(o.band, 3), "status": d.get("status"), "measured": d.get("value"),
                     "measured_at": d.get("at"), "gate": (d.get("gate") or {}).get("verdict")})
    measured = sorted((r for r in rows if r["measured"] is not None), key=lambda r: -r["measured"])
    for n, r in enumerate(measured, start=1):
        r["measured_rank"] = n
    return rows


def held(rows: list[dict[str, Any]]) -> bool:
    """Whether the measured order keeps the predicted one: every pair the prediction ranks apart (different groups)
    is measured in the same order; tied pairs may come either way."""
    done = [r for r in rows if r.get("measured_rank")]
    return all(not (a["predicted_rank"] < b["predicted_rank"] and a["measured_rank"] > b["measured_rank"])
               for a in done for b in done)
