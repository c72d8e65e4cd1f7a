"""One benchmark run: preflight → prompts → scenarios × load points (warmup, measure) → recount → export.

:func:`execute` runs one benchmark (the bench stage, :func:`pipeline.bench.stage.run`, calls it) in three steps:
:func:`pipeline.bench.preflight.preflight` (the server and model, before any load: an unreachable server is one
:class:`~pipeline.core.errors.UserError`, exit 2, and nothing is written), :func:`measure` (the load) and
:func:`finish` (count text tokens, summarize, write the run directory). Faults during the run:

* a request that fails or times out is recorded (``error``) and counted; the run goes on;
* the server going away (gRPC ``UNAVAILABLE``), a stream that stops answering (no response for
  ``stall_timeout_s``, ``--stall-timeout``: a model whose engine process died) or a model whose python-backend
  process died (:func:`~pipeline.bench.records.server_lost`) stops the run, cancelling the
  streams in flight; partial results are written and
  :func:`~pipeline.bench.results.check_outcome` raises :class:`~pipeline.core.errors.StageError` (exit 1);
* Ctrl-C or SIGTERM (``kill``, ``timeout``) cancels the streams in flight, writes what was measured (bench.json
  ``status.complete`` false, ``interrupted`` true, a warning naming the signal), then ``check_outcome`` raises
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
import datetime as _dt
import signal
import time
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, Any

from pipeline.bench import metrics as bmetrics
from pipeline.bench.loadgen import (
    Schedule,
    make_schedule,
    run_concurrency,
    run_request_rate,
)
from pipeline.bench.prompts import Prompt, load_tokenizer, make_prompts
from pipeline.bench.records import RequestRecord, count_text_tokens, server_lost
from pipeline.bench.results import BenchResult, LoadPoint
from pipeline.recipe.bench import BenchSpec

if TYPE_CHECKING:
    from pipeline.bench.target import BenchTarget

#: client CPU (fraction of one core) above which the result may be client-bound
CPU_WARN_FRACTION = 0.7
#: signals that stop a run cleanly (streams cancelled, partial results written): Ctrl-C, and ``kill`` / ``timeout``
STOP_SIGNALS = (signal.SIGINT, signal.SIGTERM)

Progress = Callable[[str, int], Callable[[int], None]]


def load_label(mode: Schedule, value: float) -> str:
    """``c8`` for concurrency 8, ``r2.5`` for 2.5 requests/s."""
    return f"c{int(value)}" if mode is Schedule.CONCURRENCY else f"r{value:g}"


def _load_points(spec: BenchSpec) -> list[tuple[Schedule, float]]:
    return [(Schedule(mode), value) for mode, value in spec.load_points()]


async def _run_async(run: BenchResult, tokenizer: Any, on_progress: Progress) -> None:
    spec, info, api = run.spec, run.info, run.api
    loop = asyncio.get_running_loop()
    stop = asyncio.Event()
    points = _load_points(spec)
    max_streams = max(int(v) for m, v in points) if points[0][0] is Schedule.CONCURRENCY else 1024
    client = api.client(info, timeout_s=spec.request_timeout_s, max_streams=max_streams, stall_s=spec.stall_timeout_s)

    def on_signal(sig: signal.Signals) -> None:
        if run.interrupted:  # second Ctrl-C / SIGTERM: give up on a clean stop
            raise KeyboardInterrupt
        run.interrupted = True
        run.warnings.append(f"interrupted ({sig.name}): partial results — the load points and requests finished "
                            "before it (the one in progress up to the stop)")
        stop.set()
        client.stop()

    for sig in STOP_SIGNALS:
        try:
            loop.add_signal_handler(sig, on_signal, sig)
        except (NotImplementedError, RuntimeError, ValueError):  # not the main thread (tests): no handler
            pass
    try:
        for isl, osl in run.scenarios:
            most = max(spec.warmup_requests + spec.requests_for(v) for _, v in points)
            prompts = make_prompts(spec, info, isl, most, tokenizer, images=run.image_plan)
            requests = [api.build(info, p, osl, perf_metrics=spec.server_timestamps) for p in prompts]
            for mode, value in points:
                if stop.is_set():
                    return
                point = LoadPoint(f"{isl}:{osl}", isl, osl, mode.value, load_label(mode, value),
                                  concurrency=int(value) if mode is Schedule.CONCURRENCY else None,
                                  request_rate=value if mode is not Schedule.CONCURRENCY else None)
                await _load_point(run, client, stop, point, value, prompts, requests, on_progress)
    finally:
        for sig in STOP_SIGNALS:
            try:
                loop.remove_signal_handler(sig)
            except (NotImplementedError, RuntimeError, ValueError):
                pass
        await client.close()


async def _load_point(run: BenchResult, client: Any, stop: asyncio.Event, point: LoadPoint, value: float,
                      prompts: list[Prompt], requests: list[Any], on_progress: Progress) -> None:
    """Warm up, then measure one load point (client CPU and wall time, Triton's metrics before and after)."""
    spec, scenario, label = run.spec, point.scenario, point.load
    mode = Schedule(point.mode)
    n_measure = spec.requests_for(value)
    progress = on_progress(f"{scenario} {label}", spec.warmup_requests + n_measure)

    def sender(warmup: bool) -> Callable[[int], Any]:
        async def send(i: int) -> None:
            k = i % len(requests)
            rec = RequestRecord(scenario, label, i, warmup, prompts[k].num_tokens, point.osl,
                                images=len(prompts[k].images), image_tokens=prompts[k].image_tokens)
            run.records.append(rec)
            await client.stream(run.api.with_id(requests[k], f"{scenario}-{label}-{i}"), rec)
            if (lost := server_lost(rec.error)) and not stop.is_set():
                run.aborted = f"server {lost} during {scenario} {label}: {rec.error}"
                stop.set()
                client.stop()  # the other streams in flight end now (cancelled), not one by one
            progress(1)

        return send

    async def phase(warmup: bool, n: int, first: int) -> int:
        duration = None if warmup else spec.duration_s
        if mode is Schedule.CONCURRENCY:
            return await run_concurrency(sender(warmup), concurrency=int(value), num_requests=n, duration_s=duration,
                                         stop=stop, first_index=first)
        sched = make_schedule(mode, value, seed=spec.seed)
        return await run_request_rate(sender(warmup), sched, num_requests=n, duration_s=duration, stop=stop,
                                      first_index=first)

    if spec.warmup_requests:
        await phase(True, spec.warmup_requests, 0)
    before = await _scrape(run)
    cpu0, wall0 = time.process_time(), time.perf_counter()
    point.requests_sent = await phase(False, n_measure if spec.duration_s is None else 10**9, spec.warmup_requests)
    point.client_cpu_s, point.wall_s = time.process_time() - cpu0, time.perf_counter() - wall0
    point.client_cpu_fraction = point.client_cpu_s / point.wall_s if point.wall_s > 0 else 0.0
    after = await _scrape(run)
    if before is not None and after is not None:
        from pipeline.bench.server_metrics import delta

        point.server_metrics = delta(before, after, run.info.name) | {"url": run.metrics_url}
    if point.client_cpu_fraction > CPU_WARN_FRACTION:
        run.warnings.append(f"{scenario} {label}: the bench client used {point.client_cpu_fraction:.0%} of one core — "
                            "it may have limited this result")
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
        point.summary = bmetrics.summarize(point.records(run.records), dict(run.spec.goodput), gpus=run.gpus)


def measure(run: BenchResult, tokenizer: Any, on_progress: Progress) -> None:
    """Run every scenario × load point of ``run.spec`` into ``run`` (records and load points); Ctrl-C stops it
    cleanly (``run.interrupted``), a lost server too (``run.aborted``)."""
    try:
        asyncio.run(_run_async(run, tokenizer, on_progress))
    except KeyboardInterrupt:
        run.interrupted = True


def finish(run: BenchResult, tokenizer: Any) -> None:
    """After the load: count text tokens (``tokenizer``, if any), summarize each load point, warn about short
    requests and disagreeing token counts, and write the run directory (:func:`pipeline.bench.exporters.write_run`)."""
    from pipeline.bench import exporters

    if tokenizer is not None:
        count_text_tokens(run.records, lambda t: len(tokenizer.encode(t, add_special_tokens=False)),
                          token_ends=_token_ends(tokenizer))
    elif any(-1 in r.response_tokens for r in run.records):
        run.warnings.append("text responses without num_output_tokens and no tokenizer: output tokens not counted")
    summarize_run(run)
    if short := run.total("short"):
        run.warnings.append(f"{short} request(s) came back with fewer than OSL tokens (see `short` per load point)")
    if mismatch := run.total("osl_mismatch"):
        run.warnings.append(f"{mismatch} request(s): output-token counts disagree between methods (see `osl_check`)")
    assert run.run_dir is not None
    exporters.write_run(run.run_dir, run)


def execute(spec: BenchSpec, target: BenchTarget, *, on_progress: Progress | None = None,
            on_status: Callable[[str], None] | None = None) -> BenchResult:
    """Run the benchmark ``spec`` against ``target`` and write its run directory.

    Args:
        spec: the bench section (scenarios, load points, counts, SLOs).
        target: the server (``url``, ``api``, ``openai_endpoint``, ``served_model``), the build (provenance and GPUs),
            the tokenizer, the run directory (default ``artifacts/bench/<YYYYmmdd-HHMMSS>``) and ``metrics_url``
            (default ``http://<host>:8002/metrics`` when it answers; each load point then gets ``server_metrics``).
        on_progress: ``(description, total) -> advance(n)`` for a progress display.
        on_status: receives one-line status messages.

    Returns:
        The :class:`~pipeline.bench.results.BenchResult` with ``run_dir`` set. Failures, a lost server and Ctrl-C are
        recorded in it (see :func:`~pipeline.bench.results.check_outcome`).

    Raises:
        UserError: unreachable server / model problems (before any load), bad inputs, a missing tokenizer.
    """
    from pipeline.bench.preflight import preflight
    from pipeline.bench.target import build_gpus

    tokenizer = target.tokenizer_dir()
    pre = preflight(spec, url=target.url, api=target.api, openai_endpoint=target.openai_endpoint,
                    served_model=target.served_model, tokenizer=tokenizer, metrics_url=target.metrics_url,
                    layout=target.layout, status=on_status or (lambda s: None))
    tok = load_tokenizer(tokenizer) if tokenizer is not None else None
    now = _dt.datetime.now()
    run = BenchResult(pre.spec, started_at=now.astimezone().isoformat(timespec="seconds"), t0_ns=time.perf_counter_ns(),
                      info=pre.info, t0_epoch_ns=time.time_ns(), tokenizer_path=None if tokenizer is None else str(tokenizer),
                      notes=pre.notes, url=pre.api.url, layout=target.layout,
                      run_dir=Path(target.out) if target.out is not None else Path("artifacts") / "bench" / now.strftime("%Y%m%d-%H%M%S"),
                      gpus=build_gpus(target.layout), metrics_url=pre.metrics_url, api=pre.api, image_plan=pre.images)
    try:
        measure(run, tok, on_progress or (lambda d, t: (lambda n: None)))
    finally:
        finish(run, tok)
    return run


def _token_ends(tokenizer: Any) -> Callable[[str], list[int]] | None:
    """End character offset of every token of a text (fast tokenizers' offset mapping), else ``None``."""
    if not getattr(tokenizer, "is_fast", False):
        return None

    def ends(text: str) -> list[int]:
        enc = tokenizer(text, add_special_tokens=False, return_offsets_mapping=True)
        return [e for _, e in enc["offset_mapping"]]

    return ends
