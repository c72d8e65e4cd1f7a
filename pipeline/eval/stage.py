"""Eval stage: an accuracy gate on what is deployed — candidate vs baseline on one task.

::

    res = eval.run(recipe.eval, EvalTarget(layout=BuildLayout("artifacts/smollm2_135m_cpu_fp8")), None,
                   recipe=recipe, recipe_dir=Path("recipes"))
    res.verdict   # "PASS" | "FAIL" | "INCONCLUSIVE"

A target is a build (served here with :func:`pipeline.serve.stage.run` on free ports, one at a time,
stopped after its outputs are generated) or the gRPC URL of a running deployment. With no baseline,
the baseline is the same recipe at full precision (``quantization.qformat: full_prec``,
``kv_cache_dtype: none``) built by :func:`pipeline.assemble.stage.run` into ``<build>-baseline`` (stages
are cached by content keys: a rerun is free).

Generation uses the bench's Triton gRPC client (:mod:`pipeline.bench.client`) on the text interface:
greedy (the CPU engine and the ensemble default), the model's own EOS (no ``end_id`` override, no
``min_tokens``), ``max_tokens = max_output_tokens``. A build's outputs are cached in
``<build>/eval_outputs/<key>.jsonl``, ``key`` = hash of (its triton_repo cache key, the prompts, the
generation parameters), so a second eval against the same baseline does not regenerate.

The run directory (default ``artifacts/eval/<YYYYmmdd-HHMMSS>``) is written atomically: ``eval.json``
(verdict, scores, CIs, power analysis, hashes) and ``samples.jsonl`` (per prompt: both outputs, scores).
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import datetime as _dt
import json
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np

from pipeline.core import artifacts
from pipeline.core.errors import StageError, UserError
from pipeline.core.layout import BuildLayout
from pipeline.eval import scores as sc
from pipeline.eval import stats, tasks
from pipeline.recipe.bench import Flag
from pipeline.recipe.eval import EvalSpec

#: bump when the generation request or the cached-output format changes (2: outputs cached before 2026-11-27 held
#: every streamed text piece twice, a client bug; they are not reused)
GEN_VERSION = 2
EVAL_JSON, SAMPLES_JSONL = "eval.json", "samples.jsonl"
BASELINE_SUFFIX = "-baseline"
#: per-request deadline in seconds (the CPU engine makes ~10 tokens/s per request at concurrency 1)
REQUEST_TIMEOUT_S = 900.0


@dataclasses.dataclass(frozen=True)
class EvalTarget:
    """A deployment to evaluate: a build (served here unless ``url`` is given) and/or a running server.

    ``url`` is Triton's gRPC ``host:port`` (the candidate's ``--url``); ``model`` the text model to call (``ensemble``).
    """

    layout: BuildLayout | None = None
    url: str | None = dataclasses.field(default=None, metadata={"flag": Flag("--url", (
        "gRPC host:port of a running deployment of the candidate (not served here)."))})
    model: str = "ensemble"

    def __post_init__(self) -> None:
        if self.layout is None and self.url is None:
            raise ValueError("an EvalTarget needs a build or a URL")

    @property
    def label(self) -> str:
        """What to call it in tables: the build directory or the URL."""
        return str(self.layout.root) if self.layout is not None and self.url is None else str(self.url)

    def repo_key(self) -> str | None:
        """The build's triton_repo cache key; ``None`` for a URL (what it serves is not known for sure)
        or an unbuilt repository — such outputs are never cached."""
        from pipeline.triton_repo.result import RepoResult

        if self.layout is None or self.url is not None:
            return None
        res = RepoResult.load(self.layout.triton_repo)
        return res.cache_key if res is not None else None

    def weights_key(self) -> str | None:
        """Hash of the weights this build serves: the sha256 of every file its engine manifest records (serve
        refuses files that differ from it) and the quantize stage's key; ``None`` for a URL or an unbuilt engine."""
        if self.layout is None or self.url is not None:
            return None
        eng = artifacts.read_manifest(self.layout.engine) or {}
        quant = artifacts.read_manifest(self.layout.quantize) or {}
        return artifacts.stable_hash({"engine": eng.get("files"), "quantize": quant.get("cache_key")}) if eng else None


@dataclasses.dataclass(frozen=True)
class EvalResult:
    """What an eval decided and where it wrote it.

    ``means`` holds per-side score means (``candidate``/``baseline``: ROUGE x100, ``gen_len`` chars) and
    ``agreement`` (exact-match rate %, mean ROUGE-L vs the baseline, median first divergent token).
    """

    run_dir: Path
    spec: EvalSpec
    task: str
    n: int
    rule: stats.RuleResult
    means: dict[str, dict[str, float | None]]
    hashes: dict[str, Any]
    cached: dict[str, bool]
    timings_s: dict[str, float]

    @property
    def verdict(self) -> str:
        """``PASS`` | ``FAIL`` | ``INCONCLUSIVE``."""
        return self.rule.verdict

    def to_manifest(self) -> dict[str, Any]:
        """The ``eval.json`` document."""
        return {
            "stage": "eval", "verdict": self.verdict, "task": self.task, "n": self.n, "spec": self.spec.model_dump(),
            "rule": self.rule.to_json(), "means": self.means, "hashes": self.hashes, "cached_outputs": self.cached,
            "timings_s": self.timings_s, "versions": artifacts.library_versions("rouge-score", "pysbd", "tritonclient"),
            "created_at": artifacts.utc_now(),
        }


# ---------------------------------------------------------------------- what to evaluate
def resolve_candidate(target: Path | None) -> tuple[BuildLayout, Any, Path]:
    """``(layout, recipe or None, recipe_dir)`` of ``[BUILD_DIR | RECIPE]`` (default: the last build).

    Raises:
        UserError: nothing built / not a build directory.
    """
    from pipeline.recipe import load_recipe

    if target is not None and target.suffix in (".yaml", ".yml"):
        if not target.is_file():
            raise UserError(f"{target}: no such recipe")
        recipe = load_recipe(target)
        layout = BuildLayout(artifacts.default_build_dir(recipe.name or target.stem))
        if not layout.has_repository():
            raise UserError(f"{target} is not built ({layout.root}): run `trtpipe build {target}` first")
        return layout, recipe, target.parent
    build = target if target is not None else artifacts.last_build()
    if build is None:
        raise UserError("no build found: give BUILD_DIR or RECIPE, or run `trtpipe build RECIPE` first")
    layout = BuildLayout(build)
    if not layout.has_repository():
        raise UserError(f"{build} is not a build directory with a model repository: run `trtpipe build RECIPE` first")
    recipe = load_recipe(layout.recipe_file) if layout.recipe_file.is_file() else None
    return layout, recipe, Path(".")


# ---------------------------------------------------------------------- baseline
def baseline_recipe(recipe: Any, recipe_dir: Path | None = None) -> Any:
    """``recipe`` at full precision: ``qformat: full_prec``, ``kv_cache_dtype: none``, ``build.cpu.dtype: float32``
    (the CPU engine's reference numerics; no effect on GPU engines), name + ``-baseline``; its local paths against
    ``recipe_dir``, the recipe file's directory (:mod:`pipeline.core.recipe_paths`)."""
    from pipeline.recipe import Recipe
    from pipeline.recipe.schema import RECIPE_DIR

    data = recipe.model_dump()
    data["quantization"].update(qformat="full_prec", kv_cache_dtype="none")
    if "cpu" in data["build"]:  # the engines whose build type has CPU-engine settings (build.engine cpu, pytorch)
        data["build"]["cpu"]["dtype"] = "float32"
    data["name"] = f"{recipe.name}{BASELINE_SUFFIX}" if recipe.name else None
    return Recipe.model_validate(data, context={RECIPE_DIR: recipe_dir} if recipe_dir is not None else None)


def build_baseline(recipe: Any, candidate: BuildLayout, *, recipe_dir: Path,
                   on_status: Callable[[str], None] = lambda s: None) -> BuildLayout:
    """Build (or reuse) the full-precision baseline of ``recipe`` into ``<candidate>-baseline``."""
    from pipeline.assemble import stage as build

    out = candidate.root.parent / f"{candidate.root.name}{BASELINE_SUFFIX}"
    on_status(f"baseline: {out} (full_prec, kv none; reused when unchanged)")
    with artifacts.last_build_kept():  # the user's last build stays the one they built, not our baseline
        return build.run(baseline_recipe(recipe, recipe_dir), out, recipe_dir=recipe_dir, warn=on_status).layout


def build_recipe_baseline(recipe_file: Path, on_status: Callable[[str], None] = lambda s: None) -> BuildLayout:
    """``--baseline-recipe``: build (or reuse) ``recipe_file`` into its ``artifacts/<name>``. The recorded last
    build, when there is one, stays the user's (``trtpipe serve`` / ``bench`` default to it)."""
    from pipeline.assemble import stage as build
    from pipeline.recipe import load_recipe

    recipe = load_recipe(recipe_file)
    on_status(f"baseline: building {recipe_file} (reused when unchanged)")
    last = artifacts.last_build()
    res = build.run(recipe, artifacts.default_build_dir(recipe.name or recipe_file.stem), recipe_dir=recipe_file.parent,
                    warn=on_status)
    if last is not None:
        artifacts.record_last_build(last)
    return res.layout


def with_overrides(spec: EvalSpec, overrides: dict[str, Any], flags: dict[str, str] | None = None) -> EvalSpec:
    """``spec`` with ``overrides`` (``None`` values skipped), re-validated as a whole.

    Raises:
        UserError: a value :class:`EvalSpec` rejects (one line naming the flag or field).
    """
    from pipeline.recipe.load import override_section

    return override_section(spec, overrides, section="eval", flags=flags)


# ---------------------------------------------------------------------- generation
def gen_params(spec: EvalSpec, model: str) -> dict[str, Any]:
    """The generation parameters that change outputs (part of the cache key)."""
    return {"version": GEN_VERSION, "model": model, "max_tokens": spec.max_output_tokens, "decoding": "greedy",
            "end_id": "model default (EOS)", "min_tokens": None, "instruction": tasks.INSTRUCTION,
            "max_input_tokens": spec.max_input_tokens}


async def _generate_async(url: str, model: str, prompts: list[str], spec: EvalSpec,
                          advance: Callable[[int], None]) -> list[str]:
    from pipeline.bench import client as bclient
    from pipeline.bench.prompts import Prompt
    from pipeline.bench.records import RequestRecord

    info = await bclient.preflight(url, model)
    if info.interface != "text":
        raise UserError(f"model {model!r} at {url} has the {info.interface} interface; trtpipe eval uses the text "
                        "interface (ensemble or tensorrt_llm_bls)")
    client = bclient.StreamClient(url, info, timeout_s=REQUEST_TIMEOUT_S, max_streams=spec.concurrency)
    sem = asyncio.Semaphore(spec.concurrency)
    records = [RequestRecord("eval", f"c{spec.concurrency}", i, False, 0, spec.max_output_tokens) for i in range(len(prompts))]

    async def one(i: int) -> None:
        async with sem:
            req = bclient.build_request(info, Prompt(0, text=prompts[i]), spec.max_output_tokens,
                                        request_id=f"eval-{i}-{id(records)}", ignore_eos=False, exact_osl=False)
            await client.stream(req, records[i])
            advance(1)

    try:
        await asyncio.gather(*(one(i) for i in range(len(prompts))))
    finally:
        await client.close()
    failed = [(r.index, r.error) for r in records if r.error]
    if failed:
        raise StageError(f"{len(failed)} of {len(records)} eval requests to {url} failed (first: #{failed[0][0]}: "
                         f"{failed[0][1]})")
    return [b"".join(r.response_text or []).decode("utf-8", errors="replace") for r in records]


def generate(target: EvalTarget, prompts: list[str], spec: EvalSpec, *, key: str | None,
             on_progress: Callable[[str, int], Callable[[int], None]] | None = None,
             on_status: Callable[[str], None] = lambda s: None) -> tuple[list[str], bool]:
    """Outputs of ``target`` for ``prompts``: from its cache when ``key`` has one, else generated (serving
    a build on free ports when no URL is given, then stopping it). Returns ``(outputs, from_cache)``.

    Raises:
        UserError / StageError / IncompatibleArtifactError: from serving or the client; any failed request.
    """
    cache = target.layout.eval_outputs(key) if target.layout is not None and key is not None else None
    advance = on_progress(f"generate {target.label}", len(prompts)) if on_progress else (lambda n: None)
    if cache is not None and cache.is_file():
        rows = [json.loads(line) for line in cache.read_text().splitlines() if line.strip()]
        if len(rows) == len(prompts):
            on_status(f"{target.label}: {len(rows)} outputs reused from {cache}")
            advance(len(rows))
            return [r["output"] for r in rows], True
    if target.url is not None:
        outputs = asyncio.run(_generate_async(target.url, target.model, prompts, spec, advance))
    else:
        from pipeline.serve import stage as serve

        opts = serve.ServeOptions(http_port=None, grpc_port=None, metrics_port=None)
        with serve.run(target.layout, opts) as handle:
            on_status(f"serving {target.label} on {handle.grpc_url} ({handle.ready_s:.1f} s to ready)")
            outputs = asyncio.run(_generate_async(handle.grpc_url, target.model, prompts, spec, advance))
    if cache is not None:
        artifacts.write_atomic(cache, "".join(json.dumps({"i": i, "output": o}) + "\n" for i, o in enumerate(outputs)))
    return outputs, False


# ---------------------------------------------------------------------- the stage
def _tokenizer(*targets: EvalTarget | None) -> Any:
    from pipeline.bench.prompts import load_tokenizer
    from pipeline.triton_repo import client_tokenizer_dir

    for t in targets:
        d = client_tokenizer_dir(t.layout) if t is not None and t.layout is not None else None
        if d is not None:
            return load_tokenizer(d), d
    raise UserError("no tokenizer: give a build directory for the candidate or the baseline (a bare --url has none)")


def _column(rows: list[dict[str, Any]], side: str, metric: str) -> list[float]:
    return [float(r["scores"][side][metric]) for r in rows]


def decide(spec: EvalSpec, rows: list[dict[str, Any]], labelled: bool, reference: dict[str, float] | None) -> stats.RuleResult:
    """Apply ``spec.rule`` to the per-sample score rows (see :mod:`pipeline.eval.stats`).

    A label-free task has no accuracy to gate: its verdict is INCONCLUSIVE with the agreement reported.
    Fewer than 2 samples is INCONCLUSIVE under every rule.
    """
    if not labelled:
        return stats.RuleResult(spec.rule, stats.INCONCLUSIVE, [], [], [
            "label-free task: agreement with the baseline is reported, no accuracy threshold applies"])
    if len(rows) < 2:
        return stats.RuleResult(spec.rule, stats.INCONCLUSIVE, [], [], [f"n={len(rows)}: at least 2 samples are needed"])
    keys = (*stats.ROUGE_KEYS, stats.GEN_LEN)
    cand = {m: _column(rows, "candidate", m) for m in keys}
    base = {m: _column(rows, "baseline", m) for m in keys}
    common = dict(alpha=spec.alpha, beta=spec.beta)
    if spec.rule == "paired":
        return stats.paired(cand, base, ratio=spec.ratio, resamples=spec.resamples, seed=spec.seed, **common)
    if spec.rule in ("mlperf", "mlperf_high"):
        return stats.mlperf(cand, reference, None if reference is not None else base, high=spec.rule == "mlperf_high",
                            resamples=spec.resamples, seed=spec.seed, **common)
    ref = reference["rouge1"] if reference is not None else float(np.mean(base["rouge1"]))
    return stats.trtllm(cand["rouge1"], ref, sigma=spec.sigma, **common)


def run(
    spec: EvalSpec,
    candidate: EvalTarget,
    baseline: EvalTarget | None = None,
    *,
    recipe: Any = None,
    recipe_dir: Path = Path("."),
    reference: str | None = None,
    out: Path | None = None,
    on_progress: Callable[[str, int], Callable[[int], None]] | None = None,
    on_status: Callable[[str], None] = lambda s: None,
) -> EvalResult:
    """Generate, score and judge ``candidate`` against ``baseline`` on ``spec.task``; write the run dir.

    Args:
        spec: the ``eval`` section (task, n, rule, thresholds, lengths, concurrency).
        candidate: the deployment under test.
        baseline: the deployment to compare with; ``None`` builds the full-precision baseline of
            ``recipe`` next to the candidate's build.
        recipe: the candidate's recipe (needed for the default baseline and the ``agreement`` task).
        recipe_dir: directory of the recipe (relative paths).
        reference: a published reference for the ``mlperf``/``trtllm`` rules (a key of
            :data:`pipeline.eval.stats.PUBLISHED`, e.g. ``llama3.1-8b``) instead of the baseline's scores.
        out: the run directory (default ``artifacts/eval/<YYYYmmdd-HHMMSS>``).
        on_progress / on_status: display hooks (``(description, total) -> advance(n)``; one-line messages).

    Raises:
        UserError: no baseline can be derived, no tokenizer, unknown task/reference, unreachable server.
        StageError: a request failed or a server did not start.
    """
    timings: dict[str, float] = {}
    import time

    t0 = time.monotonic()
    ref_numbers = None
    if reference is not None:
        if reference not in stats.PUBLISHED:
            raise UserError(f"--reference {reference!r}: known references are {', '.join(stats.PUBLISHED)}")
        ref_numbers = stats.PUBLISHED[reference]
    if baseline is None:
        if recipe is None or candidate.layout is None:
            raise UserError("no baseline: give --baseline BUILD_DIR, --baseline-recipe RECIPE or --url with a build "
                            "(the default baseline is the candidate's recipe at full precision)")
        baseline = EvalTarget(layout=build_baseline(recipe, candidate.layout, recipe_dir=recipe_dir, on_status=on_status))
        timings["baseline_build"] = round(time.monotonic() - t0, 3)
    tok, tok_dir = _tokenizer(candidate, baseline)
    task = tasks.load(spec, calibration=recipe.quantization.calibration if recipe is not None else None,
                      tokenizer=tok, base_dir=recipe_dir)
    max_prompt = recipe.build.max_input_len if recipe is not None else None
    prompts = [tasks.prompt_text(s.article, tok, spec.max_input_tokens, max_prompt) for s in task.samples]
    prompts_hash = artifacts.stable_hash(prompts)
    outputs, cached, keys, seq_stats = {}, {}, {}, None
    with contextlib.ExitStack() as servers:
        served = {"candidate": candidate, "baseline": baseline}
        if spec.rule == "kld":  # both deployments answer at once: each sequence is scored by both, then dropped
            t1 = time.monotonic()
            from pipeline.eval.logits import served as _served

            served = {side: _served(t, servers, on_status) for side, t in served.items()}
            timings["serve"] = round(time.monotonic() - t1, 3)
        for side, target in (("candidate", candidate), ("baseline", baseline)):
            t1 = time.monotonic()
            repo_key = target.repo_key()
            keys[side] = None if repo_key is None else artifacts.stable_hash(
                {"repo": repo_key, "weights": target.weights_key(), "prompts": prompts_hash,
                 "params": gen_params(spec, target.model)})
            outputs[side], cached[side] = generate(served[side], prompts, spec, key=keys[side], on_progress=on_progress,
                                                   on_status=on_status)
            timings[f"generate_{side}"] = round(time.monotonic() - t1, 3)
        if spec.rule == "kld":
            from pipeline.eval import logits

            t1 = time.monotonic()
            seqs = logits.teacher_sequences(prompts, outputs["baseline"], tok, max_prompt)
            advance = on_progress("score: context logits of both", len(seqs)) if on_progress else (lambda n: None)
            seq_stats = logits.score(served["baseline"].url, served["candidate"].url, seqs, advance=advance)
            timings["score"] = round(time.monotonic() - t1, 3)
    rows = []
    for i, s in enumerate(task.samples):
        scores = sc.sample_scores(outputs["candidate"][i], outputs["baseline"][i], s.reference, tok)
        rows.append({"id": s.id, "reference": s.reference, "candidate": outputs["candidate"][i],
                     "baseline": outputs["baseline"][i], "scores": scores})
        if seq_stats is not None:
            rows[-1]["kld"] = seq_stats[i].to_json()
    means = summarize(rows)
    if seq_stats is not None:
        from pipeline.eval import kld

        rule, means["kld"] = kld.judge(spec, seq_stats, rows, recipe)
    else:
        rule = decide(spec, rows, task.labelled, ref_numbers)
    hashes = {
        "data": task.data_hash, "prompts": prompts_hash, "tokenizer": str(tok_dir),
        "candidate": {"target": candidate.label, "triton_repo_key": candidate.repo_key(),
                      "weights_key": candidate.weights_key(), "outputs_key": keys["candidate"]},
        "baseline": {"target": baseline.label, "triton_repo_key": baseline.repo_key(),
                     "weights_key": baseline.weights_key(), "outputs_key": keys["baseline"]},
        "reference": reference,
    }
    timings["total"] = round(time.monotonic() - t0, 3)
    run_dir = Path(out) if out is not None else (
        artifacts.DEFAULT_ARTIFACTS_ROOT / "eval" / _dt.datetime.now().strftime("%Y%m%d-%H%M%S"))
    result = EvalResult(run_dir, spec, task.name, len(rows), rule, means, hashes, cached, timings)
    with artifacts.atomic_dir(run_dir) as tmp:
        (tmp / EVAL_JSON).write_text(json.dumps(result.to_manifest(), indent=2) + "\n")
        (tmp / SAMPLES_JSONL).write_text("".join(json.dumps(r) + "\n" for r in rows))
    return result


def summarize(rows: list[dict[str, Any]]) -> dict[str, dict[str, float | None]]:
    """Means per side (ROUGE x100 and ``gen_len`` chars, where present) and the agreement summary."""
    out: dict[str, dict[str, float | None]] = {}
    for side in ("candidate", "baseline"):
        keys = [k for k in (*stats.ROUGE_KEYS, stats.GEN_LEN) if rows and k in rows[0]["scores"][side]]
        out[side] = {k: float(np.mean(_column(rows, side, k))) for k in keys}
    agree = [r["scores"]["agreement"] for r in rows]
    div = [a["first_divergent_token"] for a in agree if a["first_divergent_token"] is not None]
    out["agreement"] = {
        "exact_match_pct": 100.0 * float(np.mean([a["exact"] for a in agree])) if agree else None,
        "rougeL_vs_baseline": float(np.mean([a["rougeL"] for a in agree])) if agree else None,
        "median_first_divergent_token": float(np.median(div)) if div else None,
    }
    return out
