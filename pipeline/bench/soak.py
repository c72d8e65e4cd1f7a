"""``trtpipe bench --soak MINUTES``: N streams back to back for M minutes against a deployment, then a verdict.

    trtpipe bench --soak 10 --url 127.0.0.1:8001 --model ensemble --concurrency 32 --isl 100 --osl 64 --server-pid PID
    trtpipe bench --soak 10 --serve tests/data/timed_llm_repo --model tensorrt_llm --concurrency 256 --isl 16 --osl 20

The scenario (one ISL:OSL) and the streams (one ``--concurrency`` value) come from the bench spec, so every bench
option applies (``--api``, ``--timeout``, ``--tokenizer``, …). Each stream sends requests back to back with the bench's
own client (exact ISL, OSL forced where the interface allows) until the soak's time is up — at least one request each
— and keeps only counters, no per-request history. Every ``--soak-sample`` seconds a thread records the server's RSS
(its process tree: tritonserver + python stubs; ``--server-pid``, or the server ``--serve`` started) and this
process's RSS. Verdict: PASS when no request failed, every request returned exactly OSL tokens, and the RSS growth
after the warm-up (``--soak-warmup`` minutes) stays below ``--max-rss-growth`` for both; ``soak.json`` in the run
directory holds the report (:meth:`SoakReport.to_json`).
"""

from __future__ import annotations

import asyncio
import dataclasses
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from pipeline.bench.target import BenchTarget
from pipeline.core.errors import UserError
from pipeline.recipe.bench import BenchSpec, Flag

SOAK_JSON = "soak.json"


def _flag(name: str, help: str, kind: Any, shows_default: bool = False, min: float | None = None) -> dict[str, Flag]:
    return {"flag": Flag(name, help, kind, min=min, shows_default=shows_default)}


@dataclasses.dataclass(frozen=True)
class SoakSpec:
    """How long to soak and what to check; a field with a flag is a ``trtpipe bench`` option (help panel "Soak")."""

    minutes: float | None = dataclasses.field(default=None, metadata=_flag("--soak", (
        "Soak instead of a benchmark: the scenario at one --concurrency (streams), back to back for this many minutes; "
        "exit 1 on a failed request, a wrong OSL or RSS growth (report: soak.json in the run directory)."), float, min=0.01))
    warmup_minutes: float = dataclasses.field(default=1.0, metadata=_flag(
        "--soak-warmup", "Minutes at the start of a soak left out of the RSS-growth check.", float, True, 0.0))
    sample_s: float = dataclasses.field(default=5.0, metadata=_flag(
        "--soak-sample", "Seconds between RSS samples of the server and the client during a soak.", float, True, 0.1))
    max_growth: float = dataclasses.field(default=0.05, metadata=_flag(
        "--max-rss-growth", "Largest RSS growth after the soak's warm-up (fraction: 0.05 = 5 %).", float, True, 0.0))
    server_pid: int | None = dataclasses.field(default=None, metadata=_flag(
        "--server-pid", "PID of the server whose RSS (process tree) a soak samples (default: the one --serve starts).", int))
    serve: Path | None = dataclasses.field(default=None, metadata=_flag(
        "--serve", "Serve this build directory or model repository for the soak (free ports), then stop it.", Path))


@dataclasses.dataclass
class SoakCounts:
    """Counters of a soak: requests sent, ``completed`` (no error), ``failed``, ``short``/``long`` (fewer/more tokens
    than OSL), ``output_tokens``; ``errors`` by first 120 characters; ``aborted`` when the server went away."""

    requests: int = 0
    completed: int = 0
    failed: int = 0
    short: int = 0
    long: int = 0
    output_tokens: int = 0
    errors: dict[str, int] = dataclasses.field(default_factory=dict)
    aborted: str | None = None


class Sampler(threading.Thread):
    """Samples ``(elapsed s, server RSS bytes, client RSS bytes)`` every ``period`` s until ``done`` is set, and once
    more at the end (the server's is 0 without a PID)."""

    def __init__(self, server_pid: int | None, period: float) -> None:
        super().__init__(daemon=True)
        import psutil

        self.server_pid, self.period, self.me = server_pid, period, psutil.Process()
        self.samples: list[tuple[float, int, int]] = []
        self.done = threading.Event()
        self.t0 = time.monotonic()

    def sample(self) -> None:
        """Record one sample now."""
        from pipeline.triton.process import tree_rss

        server = tree_rss(self.server_pid) if self.server_pid else 0
        self.samples.append((time.monotonic() - self.t0, server, self.me.memory_info().rss))

    def run(self) -> None:
        while not self.done.is_set():
            self.sample()
            self.done.wait(self.period)
        self.sample()


def growth(samples: list[tuple[float, int, int]], after_s: float, column: int) -> float | None:
    """Relative RSS growth (fraction) of ``column`` (1 server, 2 client) from the first sample at or after ``after_s``
    seconds to the mean of the last 10 % of those samples; ``None`` with fewer than 3 such samples."""
    post = [s[column] for s in samples if s[0] >= after_s and s[column] > 0]
    if len(post) < 3:
        return None
    tail = post[-max(1, len(post) // 10):]
    return (sum(tail) / len(tail)) / post[0] - 1.0


@dataclasses.dataclass
class SoakReport:
    """A finished soak: what ran (``url``, ``model``, ``streams``, ``minutes``, ``isl``/``osl`` tokens), how long
    (``wall_s``), its :class:`SoakCounts`, the RSS ``samples`` and growth fractions, and the ``verdict``."""

    url: str
    model: str
    streams: int
    minutes: float
    isl: int
    osl: int
    wall_s: float
    counts: SoakCounts
    samples: list[tuple[float, int, int]]
    server_rss_growth: float | None
    client_rss_growth: float | None
    verdict: str
    path: Path | None = None  # where soak.json was written

    @property
    def passed(self) -> bool:
        """The verdict is PASS."""
        return self.verdict == "PASS"

    def to_json(self) -> dict[str, Any]:
        """The ``soak.json`` document (tokens/s over the wall time; RSS in bytes)."""
        c = dataclasses.asdict(self.counts)
        errors, aborted = c.pop("errors"), c.pop("aborted")
        return {"url": self.url, "model": self.model, "streams": self.streams, "minutes": self.minutes, "isl": self.isl,
                "osl": self.osl, "wall_s": round(self.wall_s, 1), **c, "errors": errors, "aborted": aborted,
                "output_tokens_per_s": self.counts.output_tokens / self.wall_s if self.wall_s else 0.0,
                "server_rss_growth": self.server_rss_growth, "client_rss_growth": self.client_rss_growth,
                "rss_samples": [{"t_s": round(t, 1), "server_bytes": s, "client_bytes": cl} for t, s, cl in self.samples],
                "verdict": self.verdict}

    def line(self) -> str:
        """The one-line summary printed at the end."""
        def pct(g: float | None) -> str:
            return "n/a" if g is None else f"{g:+.1%}"

        c = self.counts
        return (f"soak {self.streams} streams × {self.minutes:g} min on {self.model} ({self.url}): {c.requests} requests, "
                f"{c.completed} completed, {c.failed} failed, {c.short} short, {c.long} long; "
                f"{c.output_tokens / self.wall_s if self.wall_s else 0.0:.1f} output tok/s; RSS growth after warm-up: "
                f"server {pct(self.server_rss_growth)}, client {pct(self.client_rss_growth)} → {self.verdict}"
                + (f" ({c.aborted})" if c.aborted else ""))


async def _streams(pre: Any, requests: list[Any], prompts: list[Any], streams: int, seconds: float, osl: int,
                   count: Callable[[Any], None], timeout_s: float) -> SoakCounts:
    """``streams`` workers sending back to back until ``seconds`` are up (each at least one request)."""
    from pipeline.bench.records import RequestRecord, server_lost

    api, info, scenario = pre.api, pre.info, f"{pre.spec.scenarios[0].isl}:{osl}"
    client = api.client(info, timeout_s=timeout_s, max_streams=streams)
    counts = SoakCounts()
    t0 = time.monotonic()

    async def worker(i: int) -> None:
        while counts.aborted is None:
            k = i % len(requests)
            rec = RequestRecord(scenario, f"c{streams}", i, False, prompts[k].num_tokens, osl)
            await client.stream(api.with_id(requests[k], f"soak-{i}"), rec)
            counts.requests += 1
            if rec.error:
                counts.failed += 1
                counts.errors[rec.error[:120]] = counts.errors.get(rec.error[:120], 0) + 1
                if (lost := server_lost(rec.error)) and counts.aborted is None:  # the deployment went away: stop
                    counts.aborted = f"server {lost} after {time.monotonic() - t0:.0f} s: {rec.error[:200]}"
            else:
                count(rec)
                got = rec.output_tokens
                counts.completed += 1
                counts.output_tokens += got
                counts.short += got < osl
                counts.long += got > osl
            i += streams
            if time.monotonic() - t0 >= seconds:
                return

    try:
        await asyncio.gather(*(worker(w) for w in range(streams)))
    finally:
        await client.close()
    return counts


def _one(spec: BenchSpec) -> tuple[int, int, int]:
    """``(isl, osl, streams)`` of a soak: the spec must hold one scenario and one concurrency."""
    if len(spec.scenarios) != 1 or spec.request_rate or len(spec.concurrency) != 1:
        raise UserError("--soak runs one scenario at one concurrency: give one --scenario (or --isl/--osl) and one "
                        "--concurrency value (the streams)")
    return spec.scenarios[0].isl, spec.scenarios[0].osl, spec.concurrency[0]


def soak(spec: BenchSpec, soak_spec: SoakSpec, target: BenchTarget, *,
         on_status: Callable[[str], None] = lambda s: None) -> SoakReport:
    """Soak the deployment at ``target`` (or the one ``soak_spec.serve`` starts) and write ``soak.json``.

    Returns:
        The :class:`SoakReport` (``passed`` tells the verdict; the caller turns FAIL into exit 1).

    Raises:
        UserError: not one scenario and one concurrency, an unreachable server or model (before any load).
    """
    import contextlib
    import json

    from pipeline.core.artifacts import write_atomic

    isl, osl, streams = _one(spec)
    with contextlib.ExitStack() as stack:
        pid = soak_spec.server_pid
        if soak_spec.serve is not None:
            target, pid = _serve(stack, soak_spec.serve, target, pid)
        report = _soak(spec, soak_spec, target, pid, isl, osl, streams, on_status)
    out = Path(target.out) if target.out is not None else Path("artifacts") / "bench" / time.strftime("%Y%m%d-%H%M%S-soak")
    out.mkdir(parents=True, exist_ok=True)
    report.path = out / SOAK_JSON
    write_atomic(report.path, json.dumps(report.to_json(), indent=2) + "\n")
    return report


def _serve(stack: Any, where: Path, target: BenchTarget, pid: int | None) -> tuple[BenchTarget, int | None]:
    """Start a server on ``where`` (a build directory or a model repository) for the soak; the target points at it."""
    from pipeline.core.layout import BuildLayout
    from pipeline.serve import stage as serve

    layout = BuildLayout(where)
    handle = stack.enter_context(serve.run(layout if layout.is_build() else where, serve.ServeOptions(
        http_port=None, grpc_port=None, metrics_port=None, ready_timeout_s=300)))
    target = dataclasses.replace(target, url=handle.grpc_url, api="grpc", layout=handle.layout or target.layout)
    return target, pid or handle.server.pid


def _soak(spec: BenchSpec, soak_spec: SoakSpec, target: BenchTarget, pid: int | None, isl: int, osl: int, streams: int,
          on_status: Callable[[str], None]) -> SoakReport:
    from pipeline.bench.preflight import preflight
    from pipeline.bench.prompts import load_tokenizer, make_prompts
    from pipeline.bench.records import count_text_tokens

    tokenizer = target.tokenizer_dir()
    pre = preflight(spec, url=target.url, api=target.api, openai_endpoint=target.openai_endpoint,
                    served_model=target.served_model, tokenizer=tokenizer, status=on_status, metrics=False)
    tok = load_tokenizer(tokenizer) if tokenizer is not None else None
    prompts = make_prompts(pre.spec, pre.info, isl, min(512, streams * 2), tok, images=pre.images)
    requests = [pre.api.build(pre.info, p, osl) for p in prompts]

    def count(rec: Any) -> None:
        if tok is not None:
            count_text_tokens([rec], lambda t: len(tok.encode(t, add_special_tokens=False)))

    assert soak_spec.minutes is not None
    sampler = Sampler(pid, soak_spec.sample_s)
    sampler.start()
    t0 = time.monotonic()
    try:
        counts = asyncio.run(_streams(pre, requests, prompts, streams, soak_spec.minutes * 60, osl, count,
                                      spec.request_timeout_s))
    finally:
        wall = time.monotonic() - t0
        sampler.done.set()
        sampler.join()
    warm = soak_spec.warmup_minutes * 60
    server_g, client_g = growth(sampler.samples, warm, 1), growth(sampler.samples, warm, 2)
    ok = (counts.aborted is None and counts.failed == 0 and counts.short == 0 and counts.long == 0 and counts.completed > 0
          and all(g is None or g < soak_spec.max_growth for g in (server_g, client_g)))
    return SoakReport(pre.api.url, pre.info.name, streams, soak_spec.minutes, isl, osl, wall, counts, sampler.samples,
                      server_g, client_g, "PASS" if ok else "FAIL")
