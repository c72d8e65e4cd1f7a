"""Speculative decoding in the planner (issue 48, item 2): the draft's memory, the verification cost per step, and the
predicted throughput / ITL from an acceptance length.

Facts used (docs/reference/speculative-and-config-search.md, each cited there):

- **Verification.** The target runs one forward over ``[last token, d1..dv]`` per request and emits ``accepted + 1``
  tokens: the acceptance length AL (mean tokens per step incl. the bonus) = (accepted + requests with drafts) /
  requests with drafts (§1.2, §1.3). Under CUDA graphs the drafter pads every request's drafts to ``max_draft_len``
  (``pad_draft_tokens_for_cuda_graph``, §1.1), so a GPU step verifies 1 + v tokens per sequence whatever was found;
  the CPU engine verifies 1 + the drafts it found (no padding). Attention reads each sequence's context KV once.
- **Speculation off** when the batch exceeds ``max_concurrency`` (§1.1 ``should_use_spec_decode``).
- **EAGLE-3 head memory** (§1.5): one decoder layer reading 3 × hidden concatenated target states through ``fc``
  (3h → h), attention on 2h inputs, MLP, a draft lm_head over ``draft_vocab_size``, norms; the target's embedding is
  shared (not stored). yuhuili/EAGLE3-LLaMA3.1-Instruct-8B: ≈ 424.7 M parameters, 850 MB in fp16. One-model EAGLE-3
  adds its layer(s) to the target's KV pool (``get_num_spec_layers``) and ``max_draft_len − 1`` extra KV tokens per
  sequence (``get_num_extra_kv_tokens``). The KV cache sizing adds the draft's KV bytes per token
  (``_util.py@d8ae02ca:106-109``, :mod:`pipeline.plan.kv_runtime`).
- **Draft/target**: the full draft checkpoint + the draft's own KV cache (§1.5).

The speed model (:func:`decode_speedup`): per decode step at batch B and mean context c̄, with
:func:`pipeline.plan.step.step_time` (the same calibrated step model as every prediction):
``t_plain = step(B seqs, B tokens, B logits, B·c̄ KV)``, ``t_spec = step(B seqs, B·(1+d) tokens, B·(1+d) logits,
B·c̄ KV) + t_draft`` with d the verified drafts per sequence (v on a GPU), ``t_draft`` = v draft forwards (EAGLE-3:
one head layer + draft lm_head at B tokens each; draft/target: the draft model; n-gram: 0 — CPU-side lookup).
Tokens per step go from 1 to AL, so ITL_spec = t_spec / AL and speed-up = AL · t_plain / t_spec.

On the CPU target two more facts of the served deployment enter (measured, docs/speculative.md "Predicted vs
measured"): (1) the CPU time the rest of the deployment spends per *streamed token* (Triton, the serving models'
response path, the bench client: the host's ``serving_cpu_per_token_us``, :func:`pipeline.calibrate.host.serving_cpu_per_token`)
runs on the engine's cores; :func:`pipeline.plan.model_inputs.cpu_efficiency` charges it once per sequence per step (one
token each), but a speculative step streams AL tokens per sequence, so t_spec adds B · (AL − 1) of it; (2) the CPU
engine pads nothing: a sequence verifies 1 + the drafts found at that step, so AL and d are means over *every*
generation step (the bench's ``accepted_tokens_per_step`` = Σ(OSL − 1) / Σ(OSL − 1 − accepted) and draft tokens /
those steps), not over the drafted steps only (TensorRT-LLM's ``acceptanceLength``, which overstates what a run with
undrafted steps gains).
"""

from __future__ import annotations

import json
from pathlib import Path

from pydantic import BaseModel

from pipeline.core import hardware
from pipeline.core.errors import UserError
from pipeline.core.geometry import ModelGeometry, _known, known_geometry
from pipeline.core.weights import DTYPE_BYTES, weight_bytes
from pipeline.plan.step import Efficiency, StepCost, StepMix, step_time
from pipeline.recipe.serving_path import unread_knobs

#: acceptance length assumed when neither the recipe's bench nor the CLI gives one (tokens per step incl. the bonus).
#: NGram 1.4: NVIDIA's first-turn chat figure for k=3-5, v=3-5 (1.37-1.40, blog 7 @d513eeaf, reference §1.4);
#: Eagle 2.0 and DraftTarget 1.5: judgment (no published AL for these heads in the references) — measure it.
DEFAULT_ACCEPTANCE: dict[str, float] = {"NGram": 1.4, "Eagle": 2.0, "DraftTarget": 1.5, "MTP": 1.5}


class DraftMemory(BaseModel):
    """The draft's memory per GPU (bytes) and what it adds to the KV pool."""

    decoding_type: str
    max_draft_len: int
    max_concurrency: int | None
    draft_source: str | None
    draft_params: int
    weight_bytes: int
    kv_token_bytes: int
    extra_kv_tokens_per_seq: int
    draft_flops_per_token: float
    draft_layers: int = 0
    note: str


def eagle3_params(g: ModelGeometry, draft_vocab: int) -> int:
    """Stored parameters of an EAGLE-3 head (reference §1.5): fc 3h·h; per layer q 2h·Hd, k and v 2h·Kd each, o Hd·h,
    MLP 3·h·I, norms 2h (input + hidden norms) + h; draft lm_head h·draft_vocab; final norm h. The embedding is the
    target's (not stored). Llama-3.1-8B head (yuhuili/EAGLE3-LLaMA3.1-Instruct-8B): 424,689,664 = 849.4 MB in fp16, the 850 MB file."""
    h, hd, kd = g.hidden_size, g.num_attention_heads * g.head_dim, g.num_key_value_heads * g.head_dim
    layer = 2 * h * hd + 2 * (2 * h * kd) + hd * h + 3 * h * g.intermediate_size + 3 * h
    return 3 * h * h + g.num_hidden_layers * layer + h * draft_vocab + h


def spec_draft(recipe, geo: ModelGeometry, dtype_bytes: int, *, tp_size: int = 1, pp_size: int = 1) -> DraftMemory | None:
    """The draft of ``build.pytorch.speculative_config`` on one GPU (None: no speculation, or not the PyTorch path).

    Eagle: :func:`eagle3_params` in the head's dtype (models.yaml ``torch_dtype``, else the model's), split by tp;
    its layers' KV per token in the target's KV dtype; ``max_draft_len − 1`` extra KV tokens per sequence.
    DraftTarget: the draft model's full-precision weights and its own KV per token (geometry from models.yaml; unknown
    → 0 with a note). NGram: nothing. MTP: the model's own layers, already in the weights.
    """
    b = recipe.build
    # the LLM-API knob section (build.pytorch) is read on the paths that do not ignore it (the serving-path table)
    spec = None if "build.pytorch" in unread_knobs(b.engine, recipe.target.gpu) else getattr(getattr(b, "pytorch", None), "speculative_config", None)
    if spec is None:
        return None
    kind = spec.decoding_type
    v = getattr(spec, "max_draft_len", getattr(spec, "num_nextn_predict_layers", 1))
    kv_b = 1 if recipe.quantization.kv_cache_dtype in ("fp8", "int8") else dtype_bytes
    src = getattr(spec, "speculative_model_dir", None)
    base = {"decoding_type": kind, "max_draft_len": v, "max_concurrency": spec.max_concurrency, "draft_source": src}
    if kind == "NGram":
        return DraftMemory(**base, draft_params=0, weight_bytes=0, kv_token_bytes=0, extra_kv_tokens_per_seq=0,
                           draft_flops_per_token=0.0, note="n-gram drafts come from a token pool (no weights, no KV)")
    if kind == "MTP":
        return DraftMemory(**base, draft_params=0, weight_bytes=0, kv_token_bytes=0, extra_kv_tokens_per_seq=0,
                           draft_flops_per_token=0.0, note="MTP layers are part of the model's checkpoint (not modelled)")
    dg = known_geometry(src) if src else None
    if dg is None:
        return DraftMemory(**base, draft_params=0, weight_bytes=0, kv_token_bytes=0, extra_kv_tokens_per_seq=0,
                           draft_flops_per_token=0.0, note=f"draft {src}: geometry unknown (not in models.yaml), not counted")
    kv_tok = dg.kv_bytes_per_token(kv_b, tp_size=tp_size, pp_size=1)
    if kind == "Eagle":
        raw = _known().get(src, {})
        draft_vocab = int(raw.get("draft_vocab_size", dg.vocab_size))
        params = eagle3_params(dg, draft_vocab)
        wb = params * DTYPE_BYTES.get(str(raw.get("torch_dtype", "float16")), dtype_bytes) // tp_size
        return DraftMemory(**base, draft_params=params, weight_bytes=wb, kv_token_bytes=kv_tok, extra_kv_tokens_per_seq=v - 1,
                           draft_flops_per_token=2 * params / tp_size, draft_layers=dg.num_hidden_layers,
                           note=f"EAGLE-3 head {src}: {params / 1e6:,.1f} M parameters in {raw.get('torch_dtype', 'float16')}, "
                                f"{dg.num_hidden_layers} KV layer(s) in the target's pool, {v - 1} extra KV tokens per sequence")
    w = weight_bytes(dg, "full_prec", dtype_bytes, tp_size=tp_size, pp_size=1, lm_head_copy=False)
    return DraftMemory(**base, draft_params=dg.num_parameters, weight_bytes=w.per_gpu_bytes, kv_token_bytes=kv_tok,
                       extra_kv_tokens_per_seq=0, draft_flops_per_token=2 * dg.num_parameters / tp_size,
                       draft_layers=dg.num_hidden_layers,
                       note=f"draft model {src}: {dg.num_parameters / 1e9:.2f} B parameters in the model dtype + its own KV cache")


def draft_step_s(draft: DraftMemory, cost: StepCost, eff: Efficiency, batch: float, context: float, target_layers: int) -> float:
    """Seconds the drafter adds to one step at ``batch`` sequences: ``max_draft_len`` sequential draft forwards, each
    max(draft weights / (η_bw·BW), draft FLOPs · batch / (η_gemm·T)) + its KV reads (batch · context · draft KV bytes)
    + the per-step overhead × draft layers / target layers (kernel launches). 0 for n-gram."""
    if draft.weight_bytes == 0:
        return 0.0
    bw = eff.bw_frac * cost.bandwidth
    one = max(draft.weight_bytes / bw, draft.draft_flops_per_token * batch / (eff.gemm_frac * cost.gemm_flops))
    one += batch * context * draft.kv_token_bytes / bw
    one += eff.step_overhead_ms * 1e-3 * min(draft.draft_layers, target_layers) / target_layers
    return draft.max_draft_len * one


class SpecSpeedup(BaseModel):
    """Predicted effect of speculation on decode steps at one batch (ms; tokens/s; ratios)."""

    batch: int
    acceptance_length: float
    verified_drafts_per_seq: float
    plain_step_ms: float
    spec_step_ms: float
    draft_ms: float
    plain_itl_ms: float
    itl_ms: float
    speedup: float
    active: bool


def decode_speedup(cost: StepCost, eff: Efficiency, *, batch: int, context: float, acceptance_length: float,
                   verified_drafts_per_seq: float, draft_s: float = 0.0, max_concurrency: int | None = None,
                   token_overhead_s: float = 0.0) -> SpecSpeedup:
    """The speed-up of decode steps at ``batch`` sequences of mean ``context`` tokens (module docstring): AL · t_plain /
    t_spec. ``verified_drafts_per_seq``: draft tokens verified per sequence per step (max_draft_len on a GPU with CUDA
    graphs; the mean drafted on the CPU engine); ``draft_s``: :func:`draft_step_s`; ``token_overhead_s``: seconds per
    streamed token outside the engine on the same cores, which the step model's per-sequence overhead already charges for
    one token per sequence (the CPU target's served deployment, :func:`serving_token_s`; 0 on a GPU): the speculative
    step adds ``batch · (AL − 1)`` of it. Above ``max_concurrency`` speculation is off (speed-up 1).

    Raises:
        ValueError: an acceptance length below 1 or above 1 + the verified drafts, a batch below 1.
    """
    if batch < 1:
        raise ValueError(f"batch {batch}: must be at least 1")
    if not 1.0 <= acceptance_length <= 1.0 + verified_drafts_per_seq + 1e-9:
        raise ValueError(f"acceptance length {acceptance_length:g}: must be between 1 and 1 + {verified_drafts_per_seq:g} "
                         "drafts per step (it counts the target's own token)")
    plain = step_time(cost, eff, StepMix(n_seqs=batch, n_tokens=batch, n_logits=batch, kv_read_tokens=batch * context)).total_s
    active = max_concurrency is None or batch <= max_concurrency
    if not active:
        return SpecSpeedup(batch=batch, acceptance_length=1.0, verified_drafts_per_seq=0.0, plain_step_ms=plain * 1e3,
                           spec_step_ms=plain * 1e3, draft_ms=0.0, plain_itl_ms=plain * 1e3, itl_ms=plain * 1e3, speedup=1.0,
                           active=False)
    n = batch * (1 + verified_drafts_per_seq)
    spec = step_time(cost, eff, StepMix(n_seqs=batch, n_tokens=n, n_logits=n, kv_read_tokens=batch * context)).total_s + draft_s
    spec += batch * (acceptance_length - 1.0) * token_overhead_s
    return SpecSpeedup(batch=batch, acceptance_length=acceptance_length, verified_drafts_per_seq=verified_drafts_per_seq,
                       plain_step_ms=plain * 1e3, spec_step_ms=spec * 1e3, draft_ms=draft_s * 1e3, plain_itl_ms=plain * 1e3,
                       itl_ms=spec / acceptance_length * 1e3, speedup=acceptance_length * plain / spec, active=True)


def serving_token_s(on_gpu: bool) -> float:
    """Seconds of CPU per streamed token that a served deployment spends outside the engine on the engine's own cores:
    the planner's host (:func:`pipeline.core.hardware.cpu_host`) ``serving_cpu_per_token_us`` on the CPU target, 0 on a
    GPU (the GPU step does not wait for the server's CPU) or when the host file has no served measurement."""
    if on_gpu:
        return 0.0
    return (hardware.cpu_host().serving_cpu_per_token_us or 0.0) * 1e-6


def parse_acceptance(text: str) -> float | Path:
    """``--acceptance``: a number (an acceptance length) or else the path of a bench run."""
    try:
        return float(text)
    except ValueError:
        return Path(text)


def point_speculation(pt: object) -> dict:
    """A bench load point's speculative figures, wherever the run put them: the point itself, its ``speculative``
    section, its ``summary`` / ``summary.metrics`` or their ``speculative`` sections (later ones win)."""
    if not isinstance(pt, dict):
        return {}
    summ = pt.get("summary") or {}
    metrics = summ.get("metrics") or {} if isinstance(summ, dict) else {}
    out: dict = {}
    for d in (pt, pt.get("speculative"), summ, summ.get("speculative") if isinstance(summ, dict) else None, metrics,
              metrics.get("speculative") if isinstance(metrics, dict) else None):
        out.update(d if isinstance(d, dict) else {})
    return out


def step_figures(pt: object) -> tuple[float, float | None] | None:
    """``(acceptance length, mean drafts per step or None)`` of one bench load point, or None when it has neither.

    ``trtpipe bench`` (:func:`pipeline.bench.metrics.speculative`): ``accepted_tokens_per_step`` is tokens per generation
    step over *every* step (Σ(OSL − 1) / Σ(OSL − 1 − accepted)), and drafts per step = ``draft_tokens`` / those steps
    (steps = Σ(OSL − 1) − accepted, Σ(OSL − 1) from ``requests`` × (mean output length − 1)). Preferred to an
    ``acceptance_length`` (the engine's ``acceptanceLength``, over drafted request-steps only: its drafts per step come
    from ``draft_tokens`` / ``spec_steps`` or ``requests_with_drafts``) where a point has both (module docstring).
    """
    s = point_speculation(pt)
    if s.get("accepted_tokens_per_step"):
        al = float(s["accepted_tokens_per_step"])
        osl = ((s.get("output_sequence_length") or {}) if isinstance(s.get("output_sequence_length"), dict) else {}).get("avg")
        drafts = None
        if s.get("draft_tokens") is not None and s.get("requests") and osl:
            steps = float(s["requests"]) * (float(osl) - 1) - float(s.get("accepted_draft_tokens") or 0)
            drafts = float(s["draft_tokens"]) / steps if steps > 0 else None
        return al, drafts
    if s.get("acceptance_length"):
        steps = s.get("requests_with_drafts") or s.get("spec_steps")
        drafts = float(s["draft_tokens"]) / float(steps) if s.get("draft_tokens") and steps else None
        return float(s["acceptance_length"]), drafts
    return None


def acceptance_from_bench(path: Path) -> tuple[float, float | None]:
    """``(acceptance length, mean drafts per step or None)`` measured by a ``trtpipe bench`` run (``bench.json`` or its
    directory): the mean over its load points (``load_points``, ``points``) of :func:`step_figures`.

    Raises:
        UserError: no such file, not JSON, or no load point with an acceptance length.
    """
    p = path / "bench.json" if path.is_dir() else path
    try:
        doc = json.loads(p.read_text())
    except (OSError, ValueError) as e:
        raise UserError(f"--acceptance {path}: cannot read a bench.json ({e.__class__.__name__})") from None
    points = (doc.get("load_points") or doc.get("points") or []) if isinstance(doc, dict) else doc
    figs = [f for pt in (points if isinstance(points, list) else []) if (f := step_figures(pt))]
    if not figs:
        raise UserError(f"--acceptance {path}: no load point reports an acceptance length (run the bench with "
                        "--server-timestamps on a recipe with speculative decoding)")
    drafts = [d for _, d in figs if d is not None]
    return sum(al for al, _ in figs) / len(figs), (sum(drafts) / len(drafts) if drafts else None)


class SpecPoint(BaseModel):
    """One ISL/OSL at one concurrency: without and with speculation (tokens/s of all clients; ms)."""

    isl: int
    osl: int
    concurrency: int | None
    plain_tokens_per_s: float
    tokens_per_s: float
    plain_itl_ms: float
    itl_ms: float
    speedup: float
    active: bool


class SpecPlan(BaseModel):
    """What speculation adds to a plan: the draft's memory, the acceptance length used and where it came from, and the
    predicted speed-up per ISL/OSL and concurrency."""

    draft: DraftMemory
    acceptance_length: float
    acceptance_source: str
    verified_drafts_per_seq: float
    points: list[SpecPoint]


def resolve_acceptance(draft: DraftMemory, acceptance: float | Path | None) -> tuple[float, float | None, str]:
    """``(acceptance length, measured drafts per step or None, source)`` from ``acceptance``: a number (tokens per step
    incl. the bonus), a bench run (:func:`acceptance_from_bench`) or None (:data:`DEFAULT_ACCEPTANCE` of the type).

    Raises:
        UserError: a length below 1 or above 1 + max_draft_len; an unreadable bench run.
    """
    if isinstance(acceptance, Path):
        al, drafts = acceptance_from_bench(acceptance)
        src = f"measured by {acceptance}"
    elif acceptance is not None:
        al, drafts, src = float(acceptance), None, "given (--acceptance)"
    else:
        al, drafts = DEFAULT_ACCEPTANCE[draft.decoding_type], None
        src = f"default for {draft.decoding_type} (assumed; measure it: trtpipe bench, then --acceptance RUN_DIR)"
    if not 1.0 <= al <= 1.0 + draft.max_draft_len:
        raise UserError(f"acceptance length {al:g}: must be between 1 and 1 + max_draft_len = {1 + draft.max_draft_len} "
                        "(tokens per step, the target's own token included)")
    return al, drafts, src


def speculative_plan(draft: DraftMemory, cost: StepCost, eff: Efficiency, predictions: list, target_layers: int, *,
                     acceptance: float | Path | None, on_gpu: bool, drafts_per_step: float | None = None) -> SpecPlan:
    """The speed-up of every prediction in ``predictions`` (:class:`~pipeline.plan.achievable.Prediction`: its batch,
    TTFT, ITL, E2E and tokens/s without speculation): decode steps scaled by :func:`decode_speedup` at the prediction's
    batch and mean context ISL + OSL/2; ITL_spec = ITL / speed-up; tokens/s scaled by E2E / E2E_spec with E2E_spec =
    TTFT + (OSL − 1) · ITL_spec. Verified drafts per sequence: max_draft_len on a GPU (CUDA-graph padding), the
    measured drafts per step on the CPU engine (``drafts_per_step``, else the bench run's, else max_draft_len: an upper
    bound on the cost); on the CPU target the served deployment's CPU per streamed token (:func:`serving_token_s`)."""
    al, drafts, src = resolve_acceptance(draft, acceptance)
    drafts = drafts_per_step if drafts_per_step is not None else drafts
    verified = float(draft.max_draft_len) if on_gpu or drafts is None else drafts
    tok_s = serving_token_s(on_gpu)
    points = []
    for p in predictions:
        ctx = p.isl + p.osl / 2
        s = decode_speedup(cost, eff, batch=p.batch, context=ctx, acceptance_length=min(al, 1 + verified),
                           verified_drafts_per_seq=verified, draft_s=draft_step_s(draft, cost, eff, p.batch, ctx, target_layers),
                           max_concurrency=draft.max_concurrency, token_overhead_s=tok_s)
        itl = p.itl_ms / s.speedup
        e2e = p.ttft_ms + (p.osl - 1) * itl
        points.append(SpecPoint(isl=p.isl, osl=p.osl, concurrency=p.concurrency, plain_tokens_per_s=p.output_tokens_per_s,
                                tokens_per_s=p.output_tokens_per_s * p.e2e_ms / e2e, plain_itl_ms=p.itl_ms, itl_ms=itl,
                                speedup=p.e2e_ms / e2e, active=s.active))
    return SpecPlan(draft=draft, acceptance_length=al, acceptance_source=src, verified_drafts_per_seq=verified, points=points)
