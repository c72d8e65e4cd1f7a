"""Judge the space of ``trtpipe recipe new`` with the planner: validate, fit, predict under the SLO, rank with ties.

Per candidate (:mod:`pipeline.advise.space`): the recipe validator accepts or refuses it (its one-line reason is kept
as the pruning reason), ``trtpipe plan`` checks the memory fit and finds the largest closed-loop concurrency whose
predicted TTFT p99 / ITL meet the SLO (:func:`pipeline.plan.planner.plan_recipe` with ``slo``). The figure ranked is
output tokens/s per GPU of the N GPUs asked for: an instance's prediction × its replicas ⌊N / (TP·PP)⌋ / N, which
charges the GPUs no whole replica can use (AIConfigurator's ``tokens/s/gpu_cluster``, sdk/picking.py@614b9c8c:193-290).

Ties: the planner's relative error band e (:func:`band`) makes B a tie of A (A ahead) when B ≥ A / (1 + max(e_A, e_B)).
Candidates are grouped from the top: a group is a leader and every later candidate within its band; inside a group the
order is the qformat's accuracy risk (least first), then a maintained serving path before one whose end the release
matrix records (:func:`path_last_release`: the TensorRT-engine path and its C++ ``tensorrtllm`` Triton backend end
with ``engine_paths.tensorrt_engine_last``, so a tie goes to the PyTorch LLM-API path), then fewer GPUs per instance,
then the point estimate (in 1 % steps), then the lower TTFT p99.

Errors (:class:`pipeline.core.errors.UserError`, one line, exit 2): nothing fits the N GPUs (names the smallest N
that fits, searching up to one 8-GPU node), no candidate meets the SLO even at one client (names the closest and by
how much), every candidate refused by the validator (its first reason).
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any

from pydantic import ValidationError

from pipeline.advise import space as sp
from pipeline.core import engine_paths
from pipeline.core.errors import UserError
from pipeline.plan.achievable import SLO_FIELDS, Prediction, slo_value
from pipeline.plan.planner import plan_recipe
from pipeline.recipe import Recipe, qformats
from pipeline.recipe.schema import RecipeCheckError

#: layouts per (path, qformat, KV dtype) refined over the other token budgets (space.TOKEN_BUDGETS) after the first pass
REFINE_TOP = 2


def band(p: Prediction) -> float:
    """The planner's relative error (1 σ) of a prediction's output tokens/s: the ONE place ``recipe new`` reads the
    band from, so it follows whatever the planner states (its calibration, held-out error and uncalibrated terms)."""
    return p.rel_error


@dataclasses.dataclass
class Outcome:
    """A judged candidate. ``pruned``: why it was dropped (validator or fit), else None. ``pred``: the prediction at
    ``concurrency`` (the largest within the SLO; at maximum load without one); ``at_one``: at one client;
    ``per_gpu``: output tok/s per GPU of the N asked for; ``replicas``: instances on the N GPUs."""

    cand: sp.Candidate
    recipe: Recipe | None = None
    pruned: str | None = None
    concurrency: int | None = None
    limited_by: str = ""
    pred: Prediction | None = None
    at_one: Prediction | None = None
    replicas: int = 1
    per_gpu: float = 0.0
    rank: int = 0
    tie: bool = False

    @property
    def band(self) -> float:
        """The prediction's relative error (0 without one)."""
        return band(self.pred) if self.pred else 0.0

    @property
    def meets_slo(self) -> bool:
        """True when some concurrency ≥ 1 is predicted to meet the SLO."""
        return self.pred is not None and self.concurrency is not None


def _check_error(e: ValidationError) -> str:
    """``field: what`` of the validator's first complaint."""
    err = e.errors()[0]
    exc = (err.get("ctx") or {}).get("error")
    if isinstance(exc, RecipeCheckError):
        return f"{exc.loc}: {exc.message}"
    return f"{'.'.join(str(p) for p in err['loc'])}: {err['msg']}"


def judge(c: sp.Candidate, req: sp.Request, *, num_gpus: int | None = None, fit_only: bool = False,
          concurrency: list[int] | None = None) -> Outcome:
    """Validate and plan candidate ``c`` (see the module doc); ``fit_only`` stops after the memory fit."""
    out = Outcome(c)
    try:
        out.recipe = Recipe.model_validate(sp.recipe_dict(c, req, name="recipe-new", concurrency=concurrency))
    except ValidationError as e:
        out.pruned = _check_error(e)
        return out
    try:
        plan = plan_recipe(out.recipe, scenarios=[(req.isl, req.osl)], concurrency=[1], slo=req.slo or None)
    except UserError as e:
        out.pruned = str(e)
        return out
    if not plan.verdict.ok:
        out.pruned = "does not fit: " + "; ".join(plan.verdict.errors)
        return out
    if fit_only:
        return out
    s = plan.scenarios[0]
    out.at_one = s.predicted_by_concurrency[0] if s.predicted_by_concurrency else None
    if req.slo and s.within_slo is not None:
        out.concurrency, out.limited_by = s.within_slo.concurrency, s.within_slo.limited_by
        out.pred = s.within_slo.prediction if s.within_slo.concurrency else None
    elif s.predicted is not None:
        out.pred, out.concurrency, out.limited_by = s.predicted, s.predicted.batch, s.predicted.limited_by
    if out.pred is None and out.at_one is None:
        out.pruned = "no prediction: " + "; ".join(plan.verdict.warnings or ["the KV cache holds no sequence"])
        return out
    n = req.num_gpus if num_gpus is None else num_gpus
    out.replicas = max(n // c.world, 1)
    if out.pred is not None:
        out.per_gpu = out.pred.output_tokens_per_s * out.replicas / n
    return out


def path_last_release(c: sp.Candidate) -> str | None:
    """The last TensorRT-LLM release that still has candidate ``c``'s serving path, as the release matrix records it
    (``engine_paths`` of pipeline/data/release_matrix.yaml, :mod:`pipeline.core.engine_paths`): the TensorRT-engine
    path (``build.engine: tensorrt``, served by the C++ ``tensorrtllm`` backend) ends with ``tensorrt_engine_last``;
    None for a path with no recorded end (the PyTorch LLM-API path, the CPU engine)."""
    return engine_paths.last_release(c.engine)


def _within_tie(o: Outcome) -> tuple:
    """Order inside a tie group: accuracy risk (least first), a maintained path before one that ends
    (:func:`path_last_release`), GPUs per instance, the point estimate in 1 % steps (finer differences are noise of the
    model), then the lower TTFT p99."""
    assert o.pred is not None
    return (qformats.risk_rank(o.cand.qformat), path_last_release(o.cand) is not None, o.cand.world, -round(math.log(o.per_gpu) / math.log(1.01)),
            slo_value(o.pred, "ttft"))


def rank(outcomes: list[Outcome]) -> list[Outcome]:
    """The outcomes that meet the SLO, ranked with ties (module doc); ``rank`` is the group number (1 = best),
    ``tie`` True when the group holds more than one."""
    ok = sorted((o for o in outcomes if o.meets_slo), key=lambda o: -o.per_gpu)
    ranked: list[Outcome] = []
    group = 0
    while ok:
        lead = ok[0]
        members = [o for o in ok if o.per_gpu >= lead.per_gpu / (1 + max(lead.band, o.band))]
        group += 1
        members.sort(key=_within_tie)
        for o in members:
            o.rank, o.tie = group, len(members) > 1
        ranked += members
        ok = [o for o in ok if o not in members]
    return ranked


def _closest(outcomes: list[Outcome], slo: dict[str, float]) -> str:
    """One sentence: the candidate whose one-client prediction misses the SLO by the least, and by how much."""
    def miss(o: Outcome) -> tuple[float, str]:
        worst = max(slo, key=lambda k: slo_value(o.at_one, k) / slo[k])
        return slo_value(o.at_one, worst) / slo[worst], worst

    scored = [(miss(o), o) for o in outcomes if o.at_one is not None]
    if not scored:
        return "no candidate has a prediction"
    (ratio, key), o = min(scored, key=lambda x: x[0][0])
    value = slo_value(o.at_one, key)
    return (f"the closest, {o.cand.label}, predicts {SLO_FIELDS[key]} {value:,.1f} ms at 1 client against {key} ≤ "
            f"{slo[key]:g} ms (+{ratio - 1:.0%})")


def smallest_fit(req: sp.Request) -> tuple[int, sp.Candidate] | None:
    """The smallest GPU count above ``req.num_gpus`` (up to one 8-GPU node) where some candidate fits, and it."""
    for n in range(req.num_gpus + 1, sp.MAX_INSTANCE_GPUS + 1):
        for c in sp.candidates(req, num_gpus=n):
            if c.world > req.num_gpus and judge(c, req, num_gpus=n, fit_only=True).pruned is None:
                return n, c
    return None


@dataclasses.dataclass
class Search:
    """The result: every judged outcome, the ranked ones (best first) and the qformats the rules left out."""

    request: sp.Request
    outcomes: list[Outcome]
    ranked: list[Outcome]
    not_searched: list[str]

    @property
    def best(self) -> Outcome:
        """The recipe to write: the first of the first group."""
        return self.ranked[0]

    def distinct(self, k: int) -> list[Outcome]:
        """The first ``k`` ranked outcomes that differ in more than the token budget (its variants are folded into
        the best-placed one)."""
        seen, out = set(), []
        for o in self.ranked:
            c = o.cand
            key = (c.engine, c.qformat, c.kv, c.tp, c.pp, c.ep, c.threads, c.max_batch_size if c.path.on_cpu else 0)
            if key not in seen:
                seen.add(key)
                out.append(o)
            if len(out) == k:
                break
        return out

    def pruned_reasons(self) -> dict[str, int]:
        """How many candidates each reason pruned (validator field or 'does not fit')."""
        out: dict[str, int] = {}
        for o in self.outcomes:
            if o.pruned:
                key = o.pruned.split(":")[0]
                out[key] = out.get(key, 0) + 1
        return out


def _to_refine(usable: list[Outcome]) -> list[Outcome]:
    """Per (path, qformat, KV dtype), the :data:`REFINE_TOP` best layouts of the first pass: the highest tok/s per GPU
    within the SLO, then (a layout missing it at this budget may meet it at a smaller one) the lowest one-client TTFT."""
    groups: dict[tuple[str, str, str], list[Outcome]] = {}
    for o in usable:
        groups.setdefault((o.cand.engine, o.cand.qformat, o.cand.kv), []).append(o)
    out = []
    for members in groups.values():
        members.sort(key=lambda o: (-o.per_gpu, slo_value(o.at_one, "ttft") if o.at_one else math.inf))
        out += members[:REFINE_TOP]
    return out


def search(req: sp.Request) -> Search:
    """Judge the space of ``req``, refine the best layouts over the other token budgets, rank.

    Raises:
        UserError: ISL + OSL over the model's context; nothing fits (smallest N named); every candidate refused by
            the validator; no candidate meets the SLO (closest named).
    """
    mpe = req.geo.max_position_embeddings
    if mpe and req.isl + req.osl > mpe:
        raise UserError(f"--isl {req.isl} + --osl {req.osl} = {req.isl + req.osl} tokens exceeds the model's "
                        f"max_position_embeddings {mpe}")
    outcomes = [judge(c, req) for c in sp.candidates(req)]
    usable = [o for o in outcomes if o.pruned is None]
    if not usable:
        fits = [o for o in outcomes if o.pruned and not o.pruned.startswith("does not fit")]
        if outcomes and len(fits) == len(outcomes):
            raise UserError(f"no searched configuration is a valid recipe: {outcomes[0].cand.label}: {outcomes[0].pruned}")
        where = f"{req.num_gpus}× {req.target}"
        found = None if req.on_cpu else smallest_fit(req)
        if found is None:
            raise UserError(f"{req.source} does not fit {where} with any searched qformat, nor one node of "
                            f"{sp.MAX_INSTANCE_GPUS}× {req.target}")
        n, c = found
        raise UserError(f"{req.source} does not fit {where} with any searched qformat: the smallest that fits is "
                        f"--num-gpus {n} ({c.label})")
    for o in _to_refine(usable):
        for budget in sp.TOKEN_BUDGETS[req.kind][1:]:
            outcomes.append(judge(dataclasses.replace(o.cand, max_num_tokens=budget), req))
    ranked = rank(outcomes)
    if not ranked:
        raise UserError(f"no configuration meets the SLO {', '.join(f'{k}:{v:g}' for k, v in req.slo.items())} "
                        f"on {req.num_gpus}× {req.target}: " + _closest([o for o in outcomes if o.pruned is None], req.slo))
    return Search(req, outcomes, ranked, sp.not_searched(req))


def finalize(o: Outcome, req: sp.Request, name: str) -> tuple[dict[str, Any], Outcome]:
    """The written form of ``o``: ``max_batch_size`` lowered to its concurrency within the SLO (the CUDA-graph sizes
    and the bench load points follow), judged again so the comments carry the numbers of what is written.
    Returns (recipe mapping, its outcome)."""
    c = max(o.concurrency or 1, 1)
    cand = dataclasses.replace(o.cand, max_batch_size=min(c, o.cand.max_batch_size))
    conc = sorted({1, max(c // 2, 1), c})
    final = judge(cand, req, concurrency=conc)
    if final.pruned is not None or not final.meets_slo:  # keep the searched cap when lowering it changed the answer
        cand, final = o.cand, o
    final.rank, final.tie, final.limited_by = o.rank, o.tie, o.limited_by
    final.cand = o.cand  # compared with the other candidates as searched (their batch caps)
    return sp.recipe_dict(cand, req, name=name, concurrency=conc), final
