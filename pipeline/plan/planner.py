"""``plan_recipe``, ``check_fits`` and ``predict``: memory, KV capacity, concurrency, throughput and latency of a
recipe on a GPU or on the host.

Steps (per GPU, or on the host for the cpu target):

1. the memory model (:mod:`pipeline.plan.capacity`): on a GPU, weights on the most loaded rank + activation and
   runtime reserve; free = device memory − both, what TensorRT-LLM applies ``free_gpu_memory_fraction`` to;
   KV tokens = blocks(free × fraction) × tokens_per_block, min with ``kv_cache_config.max_tokens``. On the cpu
   target, host memory (psutil) with the CPU engine's KV slots (:func:`pipeline.cpu_runtime.kv.kv_slots`);
2. the inputs of the achievable-throughput model (:mod:`pipeline.plan.model_inputs`): datasheet peaks and the
   calibrated efficiency on a GPU; on the cpu target the host's measured rates
   (:func:`pipeline.core.hardware.cpu_host`: this host's from ``trtpipe plan measure-host`` when present, else
   the shipped reference host's — the plan's notes say which), without a roofline bound;
3. the fit checks (:mod:`pipeline.plan.capacity`): qformat on the GPU, KV capacity, memory left unused;
4. per ISL/OSL (:mod:`pipeline.plan.scenarios`): concurrency, predictions, roofline.
"""

from __future__ import annotations

from collections.abc import Iterable
from pathlib import Path

from pipeline.core import hardware
from pipeline.core.errors import UserError
from pipeline.core.geometry import ModelGeometry, geometry_for_source
from pipeline.plan import capacity as cap
from pipeline.plan import memory as mem
from pipeline.plan import model_inputs as mi
from pipeline.plan.achievable import SLO_FIELDS, Prediction, predict_point
from pipeline.plan.perf import QFORMAT_COMPUTE, peak_flops
from pipeline.plan.result import FitVerdict, PlanResult
from pipeline.plan.scenarios import Target, plan_scenario
from pipeline.plan.speculative import spec_draft, speculative_plan
from pipeline.plan.vision_tokens import vision_tokens
from pipeline.recipe import Recipe, derived
from pipeline.recipe.serving_path import serving_path
from pipeline.recipe.vision import (
    image_tokens_per_request,
    vision_geometry,
    vision_notes,
)


def _geometry(recipe: Recipe, recipe_dir: Path | None = None) -> ModelGeometry:
    """The model's geometry (known-model table, else ``config.json`` of a local model.source, relative to
    ``recipe_dir``). Raises UserError when neither knows it."""
    geo = geometry_for_source(recipe.model.source, recipe_dir)
    if geo is None:
        raise UserError(
            f"model.source {recipe.model.source!r}: geometry unknown (not in pipeline/data/models.yaml and no local "
            "config.json): point model.source at a local checkpoint directory to plan it"
        )
    return geo


def _dtype_bytes(recipe: Recipe, geo: ModelGeometry, on_cpu: bool) -> int:
    """Bytes per element of the unquantized tensors: CPU engine → build.cpu.dtype; GPU → model.dtype,
    ``auto`` = the checkpoint's torch_dtype (float32 becomes float16 as quantize.py does; default bf16)."""
    if on_cpu:
        return mem.DTYPE_BYTES[recipe.build.cpu.dtype]
    return mem.DTYPE_BYTES.get(derived.model_dtype(recipe.model, recipe.target, geo.torch_dtype or "bfloat16"), 2)


def _resolve_gpu(recipe: Recipe, gpu: str | hardware.GpuSpec | None) -> hardware.GpuSpec | None:
    """The GPU to plan on (None: the host). Raises UserError for a name not in the catalog nor ``cpu``."""
    if isinstance(gpu, hardware.GpuSpec):
        return gpu
    if gpu is None:
        return recipe.gpu
    if gpu.strip().lower() == hardware.CPU_TARGET:
        return None
    spec = hardware.lookup(gpu)
    if spec is None:
        raise UserError(f"--gpu {gpu!r}: not in the GPU catalog ({', '.join(sorted(hardware.catalog()))}) nor 'cpu'")
    return spec


def _scenario_pairs(recipe: Recipe, scenarios: Iterable[tuple[int, int]] | None, max_seq_len: int,
                    image_tokens: int = 0) -> list[tuple[int, int]]:
    """The (ISL, OSL) pairs in tokens (default: ``recipe.bench.scenarios``), checked against the build limits with
    ``image_tokens`` (a request's image tokens, :func:`pipeline.recipe.vision.image_tokens_per_request`) added to the
    ISL. Raises UserError for a length under 1, an ISL over max_input_len, ISL + OSL over max_seq_len."""
    b = recipe.build
    pairs = [(s.isl, s.osl) for s in recipe.bench.scenarios] if scenarios is None else [tuple(p) for p in scenarios]
    img = f" + {image_tokens} image tokens" if image_tokens else ""
    for isl, osl in pairs:
        if isl < 1 or osl < 1:
            raise UserError(f"ISL {isl} / OSL {osl}: both must be at least 1 token")
        if isl + image_tokens > b.max_input_len:
            raise UserError(f"ISL {isl}{img} exceeds build.max_input_len {b.max_input_len}")
        if isl + image_tokens + osl > max_seq_len:
            raise UserError(f"ISL {isl}{img} + OSL {osl} = {isl + image_tokens + osl} tokens exceeds build.max_seq_len {max_seq_len}")
    return pairs


def plan_recipe(
    recipe: Recipe,
    gpu: str | hardware.GpuSpec | None = None,
    scenarios: Iterable[tuple[int, int]] | None = None,
    *,
    recipe_dir: Path | None = None,
    allow_kv_oversubscription: bool | None = None,
    concurrency: Iterable[int] | None = None,
    slo: dict[str, float] | None = None,
    acceptance: float | Path | None = None,
) -> PlanResult:
    """Plan ``recipe`` on ``gpu`` (default: the recipe's target; ``"cpu"``: the host) for ``scenarios`` ((ISL, OSL)
    pairs in tokens; default: ``recipe.bench.scenarios``).

    ``concurrency``: the closed-loop client counts predicted per scenario (default: ``recipe.bench.concurrency``);
    ``slo``: latency SLOs in ms (keys ``ttft``, ``itl``, ``tpot``, ``e2e``): each scenario then gets the largest
    concurrency predicted to meet them (``within_slo``).

    ``acceptance``: the speculative acceptance length (tokens per step incl. the bonus), or a bench run that measured
    it; default the decoding type's stated default (:mod:`pipeline.plan.speculative`); used only with a
    ``speculative_config``.

    ``allow_kv_oversubscription`` turns the KV-capacity errors into warnings; default: the recipe's
    ``build.allow_kv_oversubscription``.

    Raises:
        UserError: unknown GPU name, unknown model geometry, no max_seq_len, a scenario longer than
            max_seq_len, a concurrency under 1, an SLO key not in ttft/itl/tpot/e2e or a limit that is not positive.
    """
    conc = tuple(sorted(set(concurrency or ())))
    if conc and conc[0] < 1:
        raise UserError(f"concurrency {conc[0]}: must be at least 1")
    for key, limit in (slo or {}).items():
        if key not in SLO_FIELDS or not limit > 0:
            raise UserError(f"SLO {key}:{limit:g}: use ttft, itl, tpot or e2e with a limit in ms above 0, e.g. ttft:500,itl:50")
    spec = _resolve_gpu(recipe, gpu)
    on_cpu = spec is None
    geo = _geometry(recipe, recipe_dir)
    b, q, t = recipe.build, recipe.quantization, recipe.target
    allow = b.allow_kv_oversubscription if allow_kv_oversubscription is None else allow_kv_oversubscription
    max_seq_len = derived.max_seq_len(b, geo.max_position_embeddings)
    if not max_seq_len:
        raise UserError("build.max_seq_len is unset and the model has no max_position_embeddings: set build.max_seq_len")
    img = image_tokens_per_request(recipe.vision)  # Qwen2-VL-style image tokens join every prompt (vision_tokens.py)
    pairs = _scenario_pairs(recipe, scenarios, max_seq_len, img)
    dtype_b = _dtype_bytes(recipe, geo, on_cpu)
    tp, pp = (1, 1) if on_cpu else (t.tp_size, t.pp_size)
    out = cap.Findings()
    out.notes += vision_notes(recipe)  # the engine-path end-of-life (pipeline/recipe/vision.py)
    # the source's vision geometry, resolved once against the recipe's directory (core/recipe_paths.recipe_path)
    vgeo = vision_geometry(recipe.model.source, recipe_dir) if recipe.vision is not None else None
    vt = None if spec is None else vision_tokens(recipe, geo, vgeo)
    if vt is not None:
        tower = (f"vision tower + merger {vt.tower_params / 1e6:,.1f} M parameters = {vt.tower_bytes / 2**30:.2f} GiB in "
                 f"{recipe.vision.encoder_dtype} in every GPU's runtime reserve" if vt.tower_params else
                 "vision tower not counted (its vision_config is unknown)")
        out.notes.append(f"vision ({vt.family}): each {vt.image_width}×{vt.image_height} image = {vt.image_tokens_per_image} "
                         f"decoder tokens ({vt.rule}); {vt.images_per_request} per request adds {vt.image_tokens_per_request} "
                         f"to every ISL (KV cache, prefill, limits); {tower}")
    if spec is None:
        m = cap.cpu_memory(recipe, geo, max_seq_len, dtype_b, out)
    else:
        out.errors += [f"{f} {msg}" for f, msg in derived.format_problems(q, spec)]  # matters with --gpu
        m = cap.gpu_memory(recipe, spec, geo, max_seq_len, dtype_b, out, vision_geo=vgeo)
    cost = sched = eff = None
    if m.kv_tokens > 0 and (on_cpu or m.free_bytes > 0):
        cost, sched, eff, note = mi.model_inputs(recipe, geo, m.weights, m.kv_token_bytes, m.kv_tokens, dtype_b, spec,
                                                  vision_geo=vgeo)
        out.notes += [note] if note else []
    terms = mi.error_terms(recipe, spec)
    cap.kv_checks(b, m, on_cpu=on_cpu, allow_oversubscription=allow, out=out)
    if not on_cpu:
        cap.unused_memory_warning(m, out)
    compute = QFORMAT_COMPUTE[q.qformat]
    peak = None if spec is None else peak_flops(spec, compute, dtype_b)
    target = Target(recipe=recipe, geo=geo, memory=m, spec=spec, peak_flops=peak, tp=tp, pp=pp, cost=cost, scheduler=sched,
                    efficiency=eff, error_terms=terms, concurrency=conc, slo=dict(slo or {}))
    plans = [plan_scenario(target, isl + img, osl, out.warnings).model_copy(update={"isl": isl, "image_tokens": img})
             for isl, osl in pairs]
    draft = spec_draft(recipe, geo, dtype_b, tp_size=tp, pp_size=pp)
    spec_plan = None if draft is None or cost is None or eff is None else speculative_plan(
        draft, cost, eff, [p for s in plans for p in ([s.predicted] if s.predicted else []) + s.predicted_by_concurrency],
        geo.num_hidden_layers, acceptance=acceptance, on_gpu=spec is not None)
    return PlanResult(
        recipe=recipe.name or "", model_source=recipe.model.source, target=m.device,
        gpu_name="cpu (host memory)" if spec is None else spec.name,
        engine=serving_path(recipe, target="cpu" if on_cpu else "gpu").efficiency, qformat=q.qformat,
        kv_cache_dtype=q.kv_cache_dtype, tp_size=tp, pp_size=pp, compute_dtype=compute,
        peak_tflops=None if peak is None else peak / 1e12, bandwidth_tbs=None if spec is None else spec.memory_bandwidth_tbs,
        geometry=geo, memory=m, scenarios=plans,
        verdict=FitVerdict(ok=not out.errors, errors=out.errors, warnings=out.warnings), notes=out.notes,
        step_cost=cost, scheduler=sched, efficiency=eff, error_terms=terms, speculative=spec_plan,
        vision_tokens=vt,
    )


def check_fits(recipe: Recipe, *, recipe_dir: Path | None = None, allow_kv_oversubscription: bool | None = None) -> FitVerdict:
    """The fit verdict ``trtpipe build`` checks before any stage runs.

    ``ok`` is False with one message per problem (numbers included) when the weights and runtime reserve
    exceed device memory, when the KV cache cannot hold one build.max_seq_len sequence, when
    ``kv_cache_config.max_tokens`` asks for more tokens than fit, or when the GPU lacks the qformat's
    tensor cores. The KV-capacity ones become warnings with ``allow_kv_oversubscription``. ``warnings``
    name capacity left unused. A recipe whose geometry is unknown gets ``ok=True`` and a warning that it
    was not checked (the build itself reads the checkpoint).
    """
    try:
        return plan_recipe(recipe, recipe_dir=recipe_dir, allow_kv_oversubscription=allow_kv_oversubscription).verdict
    except UserError as e:
        return FitVerdict(ok=True, warnings=[f"fit not checked: {e}"])


def predict(recipe: Recipe, isl: int, osl: int, concurrency: int | None = None, *, gpu: str | hardware.GpuSpec | None = None,
            recipe_dir: Path | None = None) -> Prediction:
    """Predicted output tokens/s, TTFT and ITL (ms) of ``recipe`` at ISL/OSL (tokens) and ``concurrency`` clients
    (closed loop), or at maximum load when ``concurrency`` is None, with its expected relative error.

    ``gpu``: plan on this catalog GPU (name, alias or :class:`GpuSpec`; ``"cpu"`` for the host) instead of
    ``target.gpu``. The memory plan (weights, KV capacity) is :func:`plan_recipe`'s.

    Raises:
        UserError: unknown GPU, unknown geometry, ISL/OSL outside the recipe's limits, concurrency < 1, a
            recipe that does not fit the GPU (:func:`check_fits`'s errors), a prompt that no step can hold
            (ISL > max_num_tokens without chunked prefill), a KV cache that holds no sequence.
    """
    if concurrency is not None and concurrency < 1:
        raise UserError(f"concurrency {concurrency}: must be at least 1")
    plan = plan_recipe(recipe, gpu, [(isl, osl)], recipe_dir=recipe_dir)
    if not plan.verdict.ok or plan.step_cost is None or plan.scheduler is None or plan.efficiency is None:
        raise UserError(f"{recipe.name or 'recipe'} does not fit {plan.target}: " + "; ".join(plan.verdict.errors or ["no KV cache"]))
    try:
        return predict_point(plan.step_cost, plan.scheduler, plan.efficiency, isl, osl, concurrency,
                             extra_error=plan.error_terms)
    except ValueError as e:
        raise UserError(f"ISL {isl} / OSL {osl} on {plan.target}: {e}") from None
