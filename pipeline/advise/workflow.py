"""``trtpipe recipe new`` end to end: search, write the best as a validated recipe (atomically), and ``--verify``.

Nothing is half-written: the recipe text goes to a temporary file beside ``--out``, is loaded back through the recipe
loader (every validator rule) and the planner's fit check, and only then renamed into place. The ``--verify`` tune file
is written the same way.
"""

from __future__ import annotations

import dataclasses
import os
import re
import sys
import tempfile
from pathlib import Path
from typing import Any

import yaml

from pipeline.advise import render
from pipeline.advise import space as sp
from pipeline.advise import verify as vf
from pipeline.advise.search import Outcome, Search, finalize, search
from pipeline.core.errors import StageError

#: candidates ``--verify`` measures
VERIFY_TOP = 3


@dataclasses.dataclass
class Result:
    """What a run produced: the search, the written outcome and file, the lines to print, and the verify figures."""

    search: Search
    written: Outcome
    path: Path
    lines: list[str]
    verify: dict[str, Any] | None = None


def default_out(source: str, target: str) -> Path:
    """``recipe-new-<model>-<gpu>.yaml`` in the working directory (the model's last path part, lower-case)."""
    slug = re.sub(r"[^a-z0-9]+", "-", Path(source.split(":")[-1]).name.lower()).strip("-") or "model"
    return Path(f"recipe-new-{slug}-{target}.yaml")


def _write_checked(path: Path, text: str, check) -> None:
    """Write ``text`` to ``path`` through a temporary file in its directory, renamed only after ``check(tmp)``."""
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".yaml", dir=path.parent)
    try:
        with os.fdopen(fd, "w") as f:
            f.write(text)
        check(Path(tmp))
        os.replace(tmp, path)
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)


def _check_recipe(tmp: Path) -> None:
    """The written recipe must load (every validator rule) and fit its GPU (the planner's verdict)."""
    from pipeline.plan import check_fits
    from pipeline.recipe import load_recipe

    verdict = check_fits(load_recipe(tmp), recipe_dir=tmp.parent)
    if not verdict.ok:
        raise StageError(f"the written recipe does not fit: {'; '.join(verdict.errors)}")


def _sample(ranked: list[Outcome], k: int) -> list[Outcome]:
    """The ``k`` candidates to measure, in predicted order: the best, then each next one that differs from every one
    taken in qformat and in max_batch_size (so the measurement sees the dimensions, not near-copies), filled up in
    ranked order when too few do."""
    out = ranked[:1]
    for o in ranked[1:]:
        if len(out) < k and all(o.cand.qformat != t.cand.qformat and o.cand.max_batch_size != t.cand.max_batch_size
                                for t in out):
            out.append(o)
    out += [o for o in ranked if o not in out][:k - len(out)]
    return sorted(out, key=ranked.index)


def run(req: sp.Request, out: Path, *, command: str, verify: bool = False) -> Result:
    """Search ``req``, write the best recipe to ``out`` (commented, validated, fit-checked) and, with ``verify``, the
    tune file of the top :data:`VERIFY_TOP` (run on the cpu target). Raises UserError as :func:`search` does."""
    s = search(req)
    data, final = finalize(s.best, req, out.stem)
    text = render.yaml_text(data, render.why(s, final), render.header(s, final, command))
    _write_checked(out, text, _check_recipe)
    c = dataclasses.replace(final.cand, max_batch_size=data["build"]["max_batch_size"])  # as written
    lines = [(f"wrote {out}: {c.label}, max_batch_size {data['build']['max_batch_size']} — rank "
              f"{render.rank_label(final)}, {render.tps(final)} output tok/s per GPU ({final.replicas} replica(s) on "
              f"{req.num_gpus}× {req.target})"),
             (f"not searched ({len(s.not_searched)} format/path pairs the support matrices leave out on {req.target}; "
              "rules: docs/recipe-new.md)")]
    res = Result(s, final, out, lines)
    if verify:
        res.verify = _verify(res, req, data, out)
    return res


def _verify(res: Result, req: sp.Request, base: dict[str, Any], out: Path) -> dict[str, Any]:
    """Write the tune file of the top candidates; on the cpu target run it and compare the rankings."""
    tops = _sample(res.search.distinct(len(res.search.ranked)), VERIFY_TOP)
    recipes = [base] + [finalize(o, req, out.stem)[0] for o in tops[1:]]
    tops = [res.written] + [o for o in tops if o is not res.search.best][:len(tops) - 1]
    tune_file = out.with_name(f"{out.stem}.verify.yaml")
    doc = vf.tune_dict(out, tune_file, recipes, tops, req.slo, req.isl, req.osl)
    text = ("# trtpipe tune file written by trtpipe recipe new --verify: the top candidates as predicted, to measure\n"
            + yaml.safe_dump(doc, sort_keys=False, allow_unicode=True, width=120))

    def check(tmp: Path) -> None:
        from pipeline.tune.spec import load_tune

        load_tune(tmp)

    _write_checked(tune_file, text, check)
    info: dict[str, Any] = {"tune_file": str(tune_file), "candidates": [vf.label(i, o) for i, o in enumerate(tops, 1)]}
    if not req.on_cpu:
        res.lines.append(f"wrote {tune_file}: run `trtpipe tune {tune_file}` in the GPU container to measure the top "
                         f"{len(tops)} (docs/recipe-new.md)")
        return info
    run_dir = out.with_name(f"{out.stem}.verify")
    res.lines.append(f"verify: trtpipe tune {tune_file} --out {run_dir} (builds, serves and benches {len(tops)} points)")
    rc = vf.run_tune(tune_file, run_dir)
    results = run_dir / "results.json"
    if not results.is_file():
        raise StageError(f"trtpipe tune {tune_file} exited {rc} without {results}")
    rows = vf.compare(results, tops)
    info.update(run_dir=str(run_dir), tune_exit=rc, rows=rows, ranking_held=vf.held(rows))
    for r in rows:
        m = "—" if r["measured"] is None else f"{r['measured']:,.1f} (measured rank {r.get('measured_rank', '—')})"
        res.lines.append(f"  {r['candidate']}: predicted {r['predicted']:,.1f} ±{r['band']:.0%} (rank {r['predicted_rank']}), "
                         f"measured {m}, {r['status']}")
    res.lines.append("ranking held" if info["ranking_held"] else "ranking did NOT hold: the measured order differs where "
                     "the prediction ranks apart")
    print(f"verify: results in {run_dir}", file=sys.stderr)
    return info
