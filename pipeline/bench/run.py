"""One benchmark run: preflight → prompts → scenarios × load points (warmup, measure) → export.

:func:`execute` runs one benchmark (the bench stage, :func:`pipeline.stages.bench.run`, calls it). It talks to the server only after preflight
(:func:`pipeline.bench.client.preflight`) succeeded, so an unreachable server is one
:class:`~pipeline.errors.UserError` (exit 2) before any load. Faults during the run:

* a request that fails or times out is recorded (``error``) and counted; the run goes on;
* the server going away (gRPC ``UNAVAILABLE``) stops the run; partial results are written and
  :class:`~pipeline.errors.StageError` (exit 1) is raised;
* Ctrl-C cancels the streams in flight, writes what was measured, then raises
  ``KeyboardInterrupt`` (exit 130).

On the LLM-API interface (``llmapi``, see :mod:`pipeline.bench.client`) OSL cannot be forced
(no ``min_tokens`` input): the run prints one warning line at its start, needs the model's
tokenizer to count the returned text, and reports requests that stop early as ``short``.

The client measures its own CPU time (``time.process_time`` over wall time, all threads incl.
gRPC's) per load point and warns when it exceeds :data:`CPU_WARN_FRACTION` of one core: the
client may then have limited the result.
"""

from __future__ import annotations

import asyncio
import dataclasses
import datetime as _dt
import signal
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from pipeline.bench import client as bclient
from pipeline.bench import metrics as bmetrics
from pipeline.bench.loadgen import Schedule, make_schedule, run_concurrency, run_request_rate
from pipeline.bench.prompts import Prompt, dataset_prompts, load_tokenizer, text_prompts, token_prompts
from pipeline.bench.records import RequestRecord, count_text_tokens
from pipeline.errors import StageError, UserError
from pipeline.layout import BuildLayout
from pipeline.recipe.bench import BenchSpec

#: client CPU (fraction of one core) above which the result may be client-bound
CPU_WARN_FRACTION = 0.7
#: distinct synthetic prompts per scenario; requests cycle through them
MAX_UNIQUE_PROMPTS = 512


def load_label(mode: Schedule, value: float) -> str:
    """``c8`` for concurrency 8, ``r2.5`` for 2.5 requests/s."""
    return f"c{int(value)}" if mode is Schedule.CONCURRENCY else f"r{value:g}"


@dataclasses.dataclass
class BenchResult:
    """One benchmark run, filled as it goes; exported even when the run stops early.

    ``spec`` is the bench section it ran; ``url``/``layout`` what it ran against; ``run_dir`` where
    :mod:`pipeline.bench.exporters` wrote it (bench.json = :meth:`to_manifest`).
    """

    spec: BenchSpec
    started_at: str
    t0_ns: int
    t0_epoch_ns: int = 0
    info: bclient.ModelInfo | None = None
    tokenizer_path: str | None = None
    records: list[RequestRecord] = dataclasses.field(default_factory=list)
    load_points: list[dict[str, Any]] = dataclasses.field(default_factory=list)
    interrupted: bool = False
    aborted: str | None = None
    warnings: list[str] = dataclasses.field(default_factory=list)
    notes: list[str] = dataclasses.field(default_factory=list)
    url: str = ""
    layout: BuildLayout | None = None
    run_dir: Path | None = None
    gpus: int | None = None
    metrics_url: str | None = None
    api: Any = None

    @property
    def osl_forced(self) -> bool:
        """Exact OSL was asked for: the model declares ``min_tokens`` (sent as OSL)."""
        return self.info is not None and "min_tokens" in self.info.inputs

    @property
    def scenarios(self) -> list[tuple[int, int]]:
        """``[(isl, osl)]`` of the spec, in tokens."""
        return [(s.isl, s.osl) for s in self.spec.scenarios]

    def to_manifest(self) -> dict[str, Any]:
        """The ``bench.json`` document of this run."""
        from pipeline.bench.exporters import run_document

        return run_document(self)

    @staticmethod
    def read(run_dir: Path) -> dict[str, Any]:
        """The ``bench.json`` document of a finished run directory (for comparisons and sweeps).

        Raises:
            UserError: ``run_dir`` holds no readable bench.json.
        """
        import json

        from pipeline.bench.exporters import BENCH_JSON

        try:
            return json.loads((Path(run_dir) / BENCH_JSON).read_text())
        except (OSError, ValueError):
            raise UserError(f"{run_dir}: not a bench run directory (no {BENCH_JSON}, or it is not readable JSON)") from None


def added_special_tokens(tokenizer: Any) -> int:
    """Tokens the tokenizer adds to a text by default (e.g. Llama 3's BOS ``<|begin_of_text|>``: 1)."""
    return max(0, len(tokenizer.encode("a")) - len(tokenizer.encode("a", add_special_tokens=False)))


def make_prompts(spec: BenchSpec, info: bclient.ModelInfo, isl: int, n: int, tokenizer: Any) -> list[Prompt]:
    """``n`` (≤ :data:`MAX_UNIQUE_PROMPTS`) prompts of exactly ``isl`` tokens for the model's interface.

    LLM-API: the server tokenizes with the tokenizer's special tokens (``SamplingParams
    .add_special_tokens`` defaults to true), so the text has ``isl`` minus those tokens (the
    BOS of Llama 3) and the prompt is recorded as ``isl`` — what the model sees.

    Raises:
        UserError: a text model without a tokenizer, token-id dataset prompts without a tokenizer,
            or an ISL smaller than the special tokens the LLM-API server adds.
    """
    n = min(n, MAX_UNIQUE_PROMPTS)
    adds = info.interface in ("llmapi", "openai")  # the server tokenizes with special tokens (vLLM: add_special_tokens=True)
    extra = added_special_tokens(tokenizer) if adds and tokenizer is not None else 0
    if spec.dataset is not None:
        prompts = dataset_prompts(spec.dataset, tokenizer=tokenizer)
        if info.interface == "tokens" and prompts[0].ids is None:
            raise UserError(f"{spec.dataset}: text prompts for model {info.name!r} (token ids) need --tokenizer")
        if extra:
            prompts = [dataclasses.replace(p, num_tokens=p.num_tokens + extra) if p.num_tokens >= 0 else p for p in prompts]
        return prompts
    if info.takes_text:
        if tokenizer is None:
            raise UserError(
                f"model {info.name!r} takes text: exact-ISL prompts need its tokenizer — pass --tokenizer DIR "
                "(no tokenizer found in the last build)"
            )
        if isl - extra < 1:
            raise UserError(f"ISL {isl}: model {info.name!r} adds {extra} special token(s) to every prompt; use ISL > {extra}")
        prompts = text_prompts(n, isl - extra, seed=spec.seed + isl, tokenizer=tokenizer)
        return [dataclasses.replace(p, num_tokens=isl) for p in prompts] if extra else prompts
    return token_prompts(n, isl, seed=spec.seed + isl, tokenizer=tokenizer)


def _load_points(spec: BenchSpec) -> list[tuple[Schedule, float]]:
    return [(Schedule(mode), value) for mode, value in spec.load_points()]


async def _run_async(run: BenchResult, tokenizer: Any, on_progress: Callable[..., Any]) -> None:
    spec, info = run.spec, run.info
    assert info is not None
    loop = asyncio.get_running_loop()
    stop = asyncio.Event()
    points = _load_points(spec)
    max_streams = max(int(v) for m, v in points) if points[0][0] is Schedule.CONCURRENCY else 1024
    api = run.api
    client = api.client(info, timeout_s=spec.request_timeout_s, max_streams=max_streams)

    def on_sigint() -> None:
        if run.interrupted:  # second Ctrl-C: give up on a clean stop
            raise KeyboardInterrupt
        run.interrupted = True
        stop.set()
        client.stop()

    try:
        loop.add_signal_handler(signal.SIGINT, on_sigint)
    except (NotImplementedError, RuntimeError):  # not the main thread (tests): no handler
        pass
    try:
        for isl, osl in run.scenarios:
            scenario = f"{isl}:{osl}"
            most = max(spec.warmup_requests + spec.requests_for(v) for _, v in points)
            prompts = make_prompts(spec, info, isl, most, tokenizer)
            requests = [api.build(info, p, osl, perf_metrics=spec.server_timestamps) for p in prompts]
            for mode, value in points:
                if stop.is_set():
                    return
                await _load_point(run, client, stop, scenario, isl, osl, mode, value, prompts, requests, on_progress)
    finally:
        try:
            loop.remove_signal_handler(signal.SIGINT)
        except (NotImplementedError, RuntimeError):
            pass
        await client.close()


async def _load_point(run, client, stop, scenario, isl, osl, mode, value, prompts, requests, on_progress) -> None:  # noqa: ANN001
    spec = run.spec
    label = load_label(mode, value)
    n_measure = spec.requests_for(value)
    total = spec.warmup_requests + n_measure
    progress = on_progress(f"{scenario} {label}", total)

    def sender(warmup: bool) -> Callable[[int], Any]:
        async def send(i: int) -> None:
            k = i % len(requests)
            rec = RequestRecord(scenario, label, i, warmup, prompts[k].num_tokens, osl)
            run.records.append(rec)
            await client.stream(run.api.with_id(requests[k], f"{scenario}-{label}-{i}"), rec)
            if rec.error and rec.error.startswith("UNAVAILABLE") and not stop.is_set():
                run.aborted = f"server became unreachable during {scenario} {label}: {rec.error}"
                stop.set()
            progress(1)

        return send

    async def phase(warmup: bool, n: int, first: int) -> int:
        if mode is Schedule.CONCURRENCY:
            return await run_concurrency(
                sender(warmup), concurrency=int(value), num_requests=n, duration_s=None if warmup else spec.duration_s,
                stop=stop, first_index=first,
            )
        sched = make_schedule(mode, value, seed=spec.seed)
        return await run_request_rate(
            sender(warmup), sched, num_requests=n, duration_s=None if warmup else spec.duration_s, stop=stop, first_index=first
        )

    if spec.warmup_requests:
        await phase(True, spec.warmup_requests, 0)
    before = await _scrape(run)
    cpu0, wall0 = time.process_time(), time.perf_counter()
    sent = await phase(False, n_measure if spec.duration_s is None else 10**9, spec.warmup_requests)
    cpu, wall = time.process_time() - cpu0, time.perf_counter() - wall0
    after = await _scrape(run)
    frac = cpu / wall if wall > 0 else 0.0
    point = {
        "scenario": scenario, "isl": isl, "osl": osl, "mode": mode.value, "load": label,
        "concurrency": int(value) if mode is Schedule.CONCURRENCY else None,
        "request_rate": value if mode is not Schedule.CONCURRENCY else None,
        "requests_sent": sent, "client_cpu_s": cpu, "wall_s": wall, "client_cpu_fraction": frac,
    }
    if before is not None and after is not None:
        from pipeline.bench.server_metrics import delta

        point["server_metrics"] = delta(before, after, run.info.name) | {"url": run.metrics_url}
    if frac > CPU_WARN_FRACTION:
        run.warnings.append(
            f"{scenario} {label}: the bench client used {frac:.0%} of one core — it may have limited this result"
        )
    run.load_points.append(point)


async def _scrape(run: BenchResult) -> dict | None:
    """Triton's metrics now (off the event loop), or ``None`` without a metrics URL or on a failed scrape (noted)."""
    if run.metrics_url is None:
        return None
    from pipeline.bench.server_metrics import scrape

    try:
        return await asyncio.to_thread(scrape, run.metrics_url)
    except (OSError, ValueError) as e:
        run.warnings.append(f"server metrics scrape failed ({run.metrics_url}): {' '.join(str(e).split())[:200]}")
        return None


def summarize_run(run: BenchResult) -> None:
    """Fill each load point's ``summary`` from the records (after text token counting)."""
    for point in run.load_points:
        recs = [r for r in run.records if r.scenario == point["scenario"] and r.load == point["load"]]
        point["summary"] = bmetrics.summarize(recs, dict(run.spec.goodput), gpus=run.gpus)


def execute(
    spec: BenchSpec,
    *,
    url: str,
    tokenizer: Path | None = None,
    out: Path | None = None,
    layout: BuildLayout | None = None,
    metrics_url: str | None = None,
    on_progress: Callable[[str, int], Callable[[int], None]] | None = None,
    on_status: Callable[[str], None] | None = None,
    api: str = "grpc",
    openai_endpoint: str = "completions",
    served_model: str | None = None,
) -> BenchResult:
    """Run the benchmark ``spec`` against the server at ``url`` and write its run directory.

    Args:
        spec: the bench section (scenarios, load points, counts, SLOs).
        url: gRPC ``host:port`` (a ``grpc://`` prefix is accepted); for ``api="triton-http"`` Triton's HTTP
            ``http://host:port``; for ``api="openai"`` the OpenAI base URL ``http://host:port/v1``.
        tokenizer: HF tokenizer directory (needed by text interfaces and to count LLM-API output).
        out: the run directory (default ``artifacts/bench/<YYYYmmdd-HHMMSS>``).
        layout: the build being served (provenance in bench.json).
        metrics_url: Triton's Prometheus endpoint; default ``http://<gRPC host>:8002/metrics`` when it answers
            (:mod:`pipeline.bench.server_metrics`). Each load point then gets ``server_metrics`` deltas.
        on_progress: ``(description, total) -> advance(n)`` for a progress display.
        on_status: receives one-line status messages.
        api: ``grpc`` | ``triton-http`` | ``openai`` (:mod:`pipeline.bench.apis`).
        openai_endpoint: ``completions`` (exact-ISL prompt text) or ``chat`` (the chat template adds tokens:
            each request's ISL is then the server's ``usage.prompt_tokens``).
        served_model: the OpenAI model name (default: the only one ``GET /v1/models`` lists); Triton APIs use
            ``spec.model``.

    Returns:
        The :class:`BenchResult` with ``run_dir`` set. Failures, a lost server and Ctrl-C are recorded in
        it (see :func:`check_outcome`).

    Raises:
        UserError: unreachable server / model problems (before any load), bad inputs.
    """
    from pipeline.bench import exporters

    status = on_status or (lambda s: None)
    progress = on_progress or (lambda d, t: (lambda n: None))
    from pipeline.bench.apis import Api

    proto = Api.make(api, url, openai_endpoint)
    url = proto.url
    info = proto.preflight(served_model if api == "openai" else spec.model)
    if api == "openai":
        spec = spec.model_copy(update={"model": info.name})
        status(f"{info.name} at {url}: OpenAI /{info.config['endpoint']}, streaming")
    else:
        status(f"{info.name} on {url}: {info.interface} interface, Triton {info.server.get('version', '?')} ({api})")
    if info.interface == "llmapi" and tokenizer is None:
        raise UserError(
            f"model {info.name!r} (LLM-API) returns text without token counts: counting output tokens needs its "
            "tokenizer — pass --tokenizer DIR (no tokenizer found in the last build)"
        )
    if info.interface in ("text", "openai", "openai-chat") and tokenizer is None and spec.dataset is None:
        raise UserError(
            f"model {info.name!r} takes text: exact-ISL prompts need its tokenizer — pass --tokenizer DIR "
            "(no tokenizer found in the last build)"
        )
    notes = []
    if info.interface == "llmapi":
        notes.append(bclient.LLMAPI_OSL_WARNING)
        status(f"warning: {bclient.LLMAPI_OSL_WARNING}")
    if api == "openai" and "min_tokens" not in info.inputs:
        why = "the server rejected min_tokens/ignore_eos: OSL is only max_tokens, requests may stop short at EOS"
        notes.append(why)
        status(f"warning: {why}")
    from pipeline.bench.server_metrics import probe

    given = metrics_url
    if proto.is_triton or given:  # Prometheus deltas only for Triton targets (or an explicit --metrics-url)
        metrics_url, why = probe(metrics_url, url)
    else:
        metrics_url, why = None, None
    if why and given:  # the default endpoint not answering is normal (another port, or no metrics): silent
        notes.append(why)
        status(f"note: {why}")
    tok = load_tokenizer(tokenizer) if tokenizer is not None else None
    now = _dt.datetime.now()
    run_dir = Path(out) if out is not None else Path("artifacts") / "bench" / now.strftime("%Y%m%d-%H%M%S")
    run = BenchResult(spec, started_at=now.astimezone().isoformat(timespec="seconds"), t0_ns=time.perf_counter_ns(),
                      info=info, t0_epoch_ns=time.time_ns(), tokenizer_path=None if tokenizer is None else str(tokenizer),
                      notes=notes, url=url, layout=layout, run_dir=run_dir, gpus=build_gpus(layout),
                      metrics_url=metrics_url, api=proto)
    try:
        asyncio.run(_run_async(run, tok, progress))
    except KeyboardInterrupt:
        run.interrupted = True
    finally:
        if tok is not None:
            count_text_tokens(run.records, lambda t: len(tok.encode(t, add_special_tokens=False)),
                              token_ends=_token_ends(tok))
        elif any(-1 in r.response_tokens for r in run.records):
            run.warnings.append("text responses without num_output_tokens and no tokenizer: output tokens not counted")
        summarize_run(run)
        short = sum(p["summary"]["counts"]["short"] for p in run.load_points)
        if short:
            run.warnings.append(f"{short} request(s) came back with fewer than OSL tokens (see `short` per load point)")
        mismatch = sum(p["summary"]["counts"]["osl_mismatch"] for p in run.load_points)
        if mismatch:
            run.warnings.append(f"{mismatch} request(s): output-token counts disagree between methods (see `osl_check`)")
        exporters.write_run(run_dir, run)
    return run


def build_gpus(layout: BuildLayout | None) -> int | None:
    """GPUs one model instance of the build uses: ``target.tp_size × target.pp_size`` of its recipe.yaml;
    ``None`` without a build or a readable recipe (tok/s per GPU is then not reported)."""
    if layout is None or not layout.recipe_file.is_file():
        return None
    from pipeline.errors import TrtpipeError
    from pipeline.recipe.load import load_recipe

    try:
        target = load_recipe(layout.recipe_file).target
    except TrtpipeError:
        return None
    return target.tp_size * target.pp_size


def _token_ends(tokenizer: Any) -> Callable[[str], list[int]] | None:
    """End character offset of every token of a text (fast tokenizers' offset mapping), else ``None``."""
    if not getattr(tokenizer, "is_fast", False):
        return None

    def ends(text: str) -> list[int]:
        enc = tokenizer(text, add_special_tokens=False, return_offsets_mapping=True)
        return [e for _, e in enc["offset_mapping"]]

    return ends


def check_outcome(run: BenchResult, out: Path | None = None) -> None:
    """Raise for a run that did not complete cleanly (call after showing the results).

    Raises:
        KeyboardInterrupt: the run was stopped with Ctrl-C (exit 130).
        StageError: the server went away, or measured requests failed (exit 1).
    """
    out = out or run.run_dir
    if run.interrupted:
        raise KeyboardInterrupt
    if run.aborted:
        raise StageError(f"{run.aborted}; partial results in {out}")
    failed = sum(p["summary"]["counts"]["failed"] for p in run.load_points)
    if failed:
        raise StageError(f"{failed} request(s) failed (first: {_first_error(run)}); results in {out}")
    if run.osl_forced and not run.spec.allow_short:
        short = [r for r in run.records if not r.warmup and r.short]
        if short:
            raise StageError(f"{short_summary(short)}; results in {out} (--allow-short accepts this)")


def short_summary(short: list[RequestRecord], shown: int = 5) -> str:
    """One line naming short requests (``scenario load #index got/requested``) and by how much."""
    worst = max(r.requested_tokens - r.output_tokens for r in short)
    named = ", ".join(f"{r.scenario} {r.load} #{r.index}: {r.output_tokens}/{r.requested_tokens} (−{r.requested_tokens - r.output_tokens})"
                      for r in short[:shown])
    more = f", … {len(short) - shown} more" if len(short) > shown else ""
    return (f"{len(short)} request(s) stopped short of the forced OSL (min_tokens), up to {worst} token(s) short: "
            f"{named}{more}")


def _first_error(run: BenchResult) -> str:
    return next((r.error for r in run.records if r.error and not r.warmup), "?") or "?"
