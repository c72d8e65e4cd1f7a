"""``trtpipe plan measure-host``: measure this host's rates for the planner's CPU-engine prediction.

What it measures (torch, all the cores this process may use, best of several repeats — the machine may be
shared, and the best run is the closest to what the hardware does):

- ``read_bandwidth_gbs``: GB/s (10^9 B/s) at which the CPU engine's GEMMs (:class:`pipeline.cpu_runtime.linear.Linear`
  as the engine runs them: the native few-row kernel on oneDNN-packed weights where available) stream a weight set
  the size and shapes of SmolLM2's (30 layers × 7 Linear + lm_head, 538 MB fp32, far beyond the caches) for one
  token: the rate at which a decode step reads its weights on this machine (not a bare stream);
  ``stream_bandwidth_gbs``: ``tensor.sum()`` over 1 GiB, the bare streaming rate, for reference;
- ``fp32_gflops`` / ``bf16_gflops``: GFLOP/s of the same Linear layers for 64 tokens at once: the rate of
  prefill and batched decode at the CPU engine's shapes;
- ``engine_step_overhead_ms`` / ``engine_seq_overhead_us``: the CPU engine's own time per step and per
  sequence in a step: :class:`pipeline.cpu_runtime.CpuEngine` runs a model of SmolLM2's depth (30 layers)
  and vocabulary but width 64 (:func:`tiny_geometry`), whose bytes and FLOPs are negligible (what they cost at the
  measured rates is subtracted); the decode step time at 1, 2, 4, 8 and 16 concurrent requests (best of 3) is
  fitted as overhead + n × per-sequence (:func:`engine_overheads`);
- ``serving_cpu_per_token_us``: what the rest of a served deployment costs the engine on the same cores
  (:func:`serving_cpu_per_token`): the same tiny model goes through ``trtpipe build`` (full precision → CPU engine →
  Triton repository), is served by the real Triton on free ports and benched by ``trtpipe bench``'s load generator
  (:data:`SERVED_CONCURRENCY` clients, ISL/OSL as above); the CPU time of the server's process tree and of the
  bench client, less what the bare engine spends on the same tokens, per streamed token (about 40 s).

:func:`measure` returns a :class:`~pipeline.core.hardware.HostSpec`; the command writes it with
:func:`pipeline.core.hardware.write_host` to :func:`pipeline.core.hardware.host_file` (the user's cache, not the
package), where :func:`pipeline.core.hardware.cpu_host` finds it. Takes about a minute; rerun it after the CPU
engine changes. Run it on an otherwise idle machine (``flock /tmp/heavy.lock`` on a shared one).
"""

from __future__ import annotations

import datetime
import json
import os
import platform
import statistics
import tempfile
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from pipeline.core.geometry import ModelGeometry, known_geometry
from pipeline.core.hardware import HostSpec

#: concurrent requests at which the CPU engine's decode step is timed (the overhead line's points)
CONCURRENCIES = (1, 2, 4, 8, 16)
#: output / input tokens of each timing request
OSL = 48
ISL = 16
#: clients and measured requests of the served probe (:func:`serving_cpu_per_token`): the trtpipe bench load point
SERVED_CONCURRENCY = 16
SERVED_REQUESTS = 32
#: the served probe's recipe (less ``model``): the build and serving limits of recipes/smollm2_135m_cpu_*.yaml
PROBE_RECIPE = {
    "description": "trtpipe plan measure-host: served overhead probe",
    "target": {"gpu": "cpu"},
    "quantization": {"qformat": "full_prec"},
    "build": {"engine": "cpu", "max_batch_size": 32, "max_input_len": 512, "max_seq_len": 1024, "max_num_tokens": 1024,
              "tokens_per_block": 32, "kv_cache_config": {"max_tokens": 16384, "enable_block_reuse": False},
              "cpu": {"dtype": "float32"}},
    "serving": {"triton_max_batch_size": 32},
    "bench": {"model": "ensemble", "scenarios": [{"isl": ISL, "osl": OSL}], "concurrency": [SERVED_CONCURRENCY]},
}
#: the model whose shapes the rates are measured at (the shipped CPU recipes' model)
REFERENCE_MODEL = "embedded:smollm2-135m-instruct"
#: header of the written file
HEADER = ("# This host's measured rates for the planner's CPU-engine prediction (pipeline/core/hardware.py: HostSpec).\n"
          "# WRITTEN BY `trtpipe plan measure-host` — rerun it after the CPU engine changes; delete it to use the shipped "
          "reference host.\n")


def _best(fn, repeats: int) -> float:
    """Shortest wall time (s) of ``fn()`` over ``repeats`` runs after one warm-up."""
    fn()
    best = float("inf")
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - t0)
    return best


def stream_bandwidth_gbs(gib: float = 1.0, repeats: int = 7) -> float:
    """GB/s of summing a ``gib`` GiB fp32 tensor."""
    import torch

    x = torch.ones(int(gib * (1 << 30) / 4), dtype=torch.float32)
    t = _best(lambda: x.sum(), repeats)
    return x.numel() * 4 / t / 1e9


def reference_geometry() -> ModelGeometry:
    """The geometry whose Linear shapes the rates are measured at (:data:`REFERENCE_MODEL`, from the known-model table)."""
    geo = known_geometry(REFERENCE_MODEL)
    assert geo is not None, REFERENCE_MODEL
    return geo


def tiny_geometry() -> ModelGeometry:
    """The overhead probe's model: :func:`reference_geometry`'s depth and vocabulary, width 64 (1 head of 64, MLP
    128, tied lm_head), so that its bytes and FLOPs per step are negligible next to the engine's own time."""
    ref = reference_geometry()
    return ModelGeometry(architecture="LlamaForCausalLM", num_hidden_layers=ref.num_hidden_layers, hidden_size=64,
                         num_attention_heads=1, num_key_value_heads=1, head_dim=64, intermediate_size=128,
                         vocab_size=ref.vocab_size, tie_word_embeddings=True, max_position_embeddings=1024,
                         torch_dtype="float32", source="trtpipe plan measure-host: overhead probe")


def _model_weights(dtype_name: str) -> list:
    """Random weights with the reference model's Linear shapes (q, k, v, o, gate, up, down × layers + lm_head)."""
    import torch

    geo = reference_geometry()
    dt = getattr(torch, dtype_name)
    ws = [torch.randn(o, i, dtype=torch.float32).to(dt) for _ in range(geo.num_hidden_layers) for _, i, o in geo.layer_linear_shapes]
    return ws + [torch.randn(geo.vocab_size, geo.hidden_size).to(dt)]


def linear_rates(dtype_name: str, tokens: int, repeats: int = 5) -> tuple[float, float]:
    """(GB/s of weights read, GFLOP/s) of the engine's GEMMs over the SmolLM2-shaped weights for ``tokens`` tokens."""
    import torch

    from pipeline.cpu_runtime import native
    from pipeline.cpu_runtime.linear import Linear, mkldnn_linear_available

    ws = _model_weights(dtype_name)
    dt = getattr(torch, dtype_name)
    inputs = {w.shape[1]: torch.randn(tokens, w.shape[1]).to(dt) for w in ws}
    # the CPU engine's own GEMMs, as it serves: prepacked oneDNN weights, the native kernel up to its row limit
    layers = [Linear(w, None, packed=mkldnn_linear_available()) for w in ws]
    kernels = native.kernels()
    if kernels is not None:
        for lin in layers:
            lin.use_native(kernels)

    def run():
        for w, lin in zip(ws, layers):
            lin(inputs[w.shape[1]])

    t = _best(run, repeats)
    nbytes = sum(w.numel() * w.element_size() for w in ws)
    flops = 2 * tokens * sum(w.numel() for w in ws)
    return nbytes / t / 1e9, flops / t / 1e9


def _tiny_engine(tmp: Path) -> Path:
    """A CPU engine directory holding a random model of :func:`tiny_geometry` (float32)."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    from pipeline.cpu_runtime.engine import RUNTIME

    g = tiny_geometry()
    cfg = LlamaConfig(hidden_size=g.hidden_size, intermediate_size=g.intermediate_size, num_hidden_layers=g.num_hidden_layers,
                      num_attention_heads=g.num_attention_heads, num_key_value_heads=g.num_key_value_heads, head_dim=g.head_dim,
                      vocab_size=g.vocab_size, tie_word_embeddings=True, max_position_embeddings=g.max_position_embeddings)
    torch.manual_seed(0)
    LlamaForCausalLM(cfg).to(torch.float32).save_pretrained(tmp)
    ec = {"kind": "cpu", "runtime": RUNTIME, "dtype": "float32", "max_batch_size": 32, "max_num_tokens": 1024,
          "max_seq_len": 1024, "max_input_len": 512, "enable_chunked_prefill": True,
          "kv_cache": {"max_tokens": 32 * 1024, "free_memory_fraction": 0.5}}
    (tmp / "engine_config.json").write_text(json.dumps(ec))
    return tmp


def _decode_step_s(engine, n: int) -> float:
    """Median gap (s) between consecutive tokens of ``n`` concurrent requests (ISL 16, OSL 48, decode only)."""
    gaps: list[float] = []
    done = threading.Event()
    left = [n]
    lock = threading.Lock()

    def make_cb():
        last = [None]

        def cb(tokens, finished):
            now = time.perf_counter()
            if last[0] is not None and tokens:
                gaps.append((now - last[0]) / len(tokens))
            last[0] = now
            if finished:
                with lock:
                    left[0] -= 1
                    if left[0] == 0:
                        done.set()
        return cb

    for i in range(n):
        engine.add_request([(7 * i + j) % 1000 + 10 for j in range(ISL)], max_new_tokens=OSL, min_tokens=OSL, end_id=None,
                           on_tokens=make_cb())
    if not done.wait(600):
        raise RuntimeError("CPU engine did not finish the measurement requests in 600 s")
    return statistics.median(gaps)


def engine_steps() -> tuple[dict[int, float], float]:
    """Decode step time (s) of the CPU engine by concurrency (:data:`CONCURRENCIES`), with the :func:`tiny_geometry`
    model, and the engine's CPU time (s) per generated token at :data:`SERVED_CONCURRENCY` requests (this process's
    CPU time over one such round / its tokens: what :func:`serving_cpu_per_token` subtracts).

    Run first, in a fresh process. Before ``CpuEngine`` released its creating thread's OpenMP workers
    (``pipeline.cpu_runtime.engine.release_openmp_pool``), the bandwidth probe's ``torch.sum`` on this thread made
    the engine's steps up to 13 × slower (libgomp then managed more threads than cores, and the engine's workers
    slept at every barrier); measured after the probe with the release, the steps at 1–4 requests are still
    1.2–1.5 × those of a fresh process (docs/plan.md, "CPU target").
    """
    from pipeline.cpu_runtime import CpuEngine

    with tempfile.TemporaryDirectory(prefix="trtpipe-measure-") as d:
        with CpuEngine(_tiny_engine(Path(d))) as engine:
            _decode_step_s(engine, 2)  # warm-up
            steps = {n: min(_decode_step_s(engine, n) for _ in range(3)) for n in CONCURRENCIES}
            cpu0 = time.process_time()
            _decode_step_s(engine, SERVED_CONCURRENCY)
            cpu_per_token = (time.process_time() - cpu0) / (SERVED_CONCURRENCY * OSL)
    return steps, cpu_per_token


def _probe_source(dest: Path) -> Path:
    """A model directory ``trtpipe build`` takes as ``model.source``: the :func:`tiny_geometry` model and the
    embedded SmolLM2's tokenizer files (same vocabulary)."""
    import shutil

    from pipeline.quantize.sources import embedded_smollm2_dir

    dest.mkdir(parents=True)
    _tiny_engine(dest)
    (dest / "engine_config.json").unlink()
    for f in embedded_smollm2_dir().iterdir():
        if f.is_file() and (f.name.startswith("tokenizer") or f.name in ("special_tokens_map.json", "generation_config.json")):
            shutil.copy(f, dest / f.name)
    return dest


def serving_cpu_per_token(engine_cpu_per_token_s: float, log: Callable[[str], None] = lambda line: None) -> tuple[float, str]:
    """CPU time (s) a served CPU deployment spends per streamed token outside the engine's own work, and how it was
    measured (one line, with the figures).

    The probe model (:func:`_probe_source`) is built by the build stage (:func:`pipeline.assemble.stage.run`, what
    ``trtpipe build`` runs; :data:`PROBE_RECIPE`: the shipped CPU recipes' engine and serving limits, full
    precision; the user's last build stays the one recorded, :func:`pipeline.core.artifacts.last_build_kept`), served by
    the real Triton on free ports, and benched in this process by ``trtpipe bench``'s load generator:
    :data:`SERVED_CONCURRENCY` clients, ISL :data:`ISL` / OSL :data:`OSL`, :data:`SERVED_REQUESTS` requests + 2 warm-up.
    Per streamed response (token): (CPU time of the server's process tree + this process's) / responses −
    ``engine_cpu_per_token_s`` (the bare engine's CPU time per token at the same concurrency, :func:`engine_steps`).
    Everything is in a temporary directory, removed afterwards; the server is stopped.

    Raises:
        StageError / UserError: the build, the server or the bench failed (the message says which).
    """
    import psutil
    import yaml

    from pipeline.bench.run import execute
    from pipeline.bench.target import BenchTarget
    from pipeline.recipe import load_recipe
    from pipeline.recipe.bench import BenchSpec
    from pipeline.serve import stage as serve_stage

    with tempfile.TemporaryDirectory(prefix="trtpipe-measure-served-") as d:
        work = Path(d)
        doc = {**PROBE_RECIPE, "model": {"source": str(_probe_source(work / "model")), "dtype": "float32"}}
        (work / "probe.yaml").write_text(yaml.safe_dump(doc))
        layout = _build_probe(load_recipe(work / "probe.yaml"), work, log)
        opts = serve_stage.ServeOptions(http_port=None, grpc_port=None, metrics_port=None, log_file=work / "triton.log")
        with serve_stage.run(work / "build", opts, root=work / "artifacts") as handle:
            server = psutil.Process(handle.server.pid)

            def tree_cpu_s() -> float:
                total = 0.0
                for p in [server, *server.children(recursive=True)]:
                    try:
                        t = p.cpu_times()
                        total += t.user + t.system
                    except psutil.Error:
                        pass
                return total

            spec = BenchSpec(model="ensemble", scenarios=[{"isl": ISL, "osl": OSL}], concurrency=[SERVED_CONCURRENCY],
                             requests_per_load=SERVED_REQUESTS // SERVED_CONCURRENCY, min_requests=SERVED_REQUESTS,
                             warmup_requests=2)
            target = BenchTarget(url=handle.grpc_url, layout=layout, out=work / "bench")
            server0, client0 = tree_cpu_s(), time.process_time()
            run = execute(spec, target)
            server_s, client_s = tree_cpu_s() - server0, time.process_time() - client0
    failed = [r.error for r in run.records if r.error]
    if failed or not run.records:
        raise RuntimeError(f"the served probe's bench failed: {failed[0] if failed else 'no requests'}")
    responses = sum(len(r.response_ns) for r in run.records)
    per_token = max((server_s + client_s) / responses - engine_cpu_per_token_s, 0.0)
    how = (f"trtpipe build/serve/bench of the width-64 probe model, {SERVED_CONCURRENCY} clients, ISL {ISL} / OSL {OSL}, "
           f"{len(run.records)} requests: server tree {server_s:.2f} s + client {client_s:.2f} s CPU over {responses} "
           f"streamed tokens, minus the bare engine's {engine_cpu_per_token_s * 1e6:.0f} µs per token")
    log(f"served deployment: {per_token * 1e6:.0f} µs CPU per streamed token besides the engine ({how})")
    return per_token, how


def _build_probe(recipe: Any, work: Path, log: Callable[[str], None]) -> Any:
    """Build the probe ``recipe`` into ``work/build`` with the build stage (:func:`pipeline.assemble.stage.run`: the
    planner's fit check, then quantize → engine → triton_repo, as ``trtpipe build``) and return its
    :class:`~pipeline.core.layout.BuildLayout`; the user's last-build marker (``artifacts/.last_build``) is kept as it
    was, and an ``artifacts/`` folder the marker's bookkeeping created in the working directory is removed. The
    build's fit check plans the probe on the shipped reference host, not on the host file being measured again (a
    broken one would otherwise stop the measurement that replaces it)."""
    from pipeline.assemble import stage as build_stage
    from pipeline.core import artifacts, hardware

    root_existed = artifacts.DEFAULT_ARTIFACTS_ROOT.exists()
    before = os.environ.get(hardware.HOST_FILE_ENV)
    os.environ[hardware.HOST_FILE_ENV] = str(work / "no-host-file.yaml")  # absent: the shipped reference host
    try:
        with artifacts.last_build_kept():  # the probe is not "the last build" of `trtpipe serve` / `bench`
            return build_stage.run(recipe, work / "build", recipe_dir=work, warn=log).layout
    finally:
        if before is None:
            os.environ.pop(hardware.HOST_FILE_ENV, None)
        else:
            os.environ[hardware.HOST_FILE_ENV] = before
        if not root_existed and artifacts.DEFAULT_ARTIFACTS_ROOT.is_dir() and not any(artifacts.DEFAULT_ARTIFACTS_ROOT.iterdir()):
            artifacts.DEFAULT_ARTIFACTS_ROOT.rmdir()


def engine_overheads(measured: dict[int, float], geo: ModelGeometry, bw: float, flops: float) -> tuple[float, float]:
    """(step overhead ms, per-sequence overhead µs) of the CPU engine: the measured step times (s, by request
    count) minus what the probe model ``geo``'s bytes and FLOPs cost in float32 at ``bw`` B/s and ``flops`` FLOP/s
    (the achievable-throughput model's :func:`~pipeline.plan.achievable.step_time` with efficiencies 1, context
    ISL + OSL/2), fitted as a line in the request count (least squares; slope and intercept clipped at 0)."""
    from pipeline.plan.step import (
        Efficiency,
        StepCost,
        StepMix,
        activation_traffic_bytes,
        step_time,
    )

    h, inter, layers, vocab = geo.hidden_size, geo.intermediate_size, geo.num_hidden_layers, geo.vocab_size
    lin = layers * geo.layer_linear_params
    cost = StepCost(weight_bytes=(lin + vocab * h) * 4, kv_token_bytes=geo.kv_bytes_per_token(4), linear_flops_per_token=2 * lin,
                    head_flops_per_token=2 * vocab * h,
                    attn_flops_coeff=2 * layers * geo.num_attention_heads * geo.head_dim,
                    act_bytes_per_token=activation_traffic_bytes(h, geo.num_attention_heads, geo.num_key_value_heads, geo.head_dim,
                                                                 inter, layers, 4),
                    logit_bytes_per_token=2 * vocab * 4, bandwidth=bw, gemm_flops=flops, attn_flops=flops)
    zero = Efficiency(bw_frac=1, gemm_frac=1, attn_frac=1, seq_overhead_us=0, step_overhead_ms=0, rel_error=0)
    ctx = ISL + OSL / 2
    resid = {n: t - step_time(cost, zero, StepMix(n_seqs=n, n_tokens=n, n_logits=n, kv_read_tokens=n * ctx)).total_s
             for n, t in measured.items()}
    ns = list(resid)
    mean_n, mean_t = statistics.fmean(ns), statistics.fmean(resid.values())
    slope = sum((n - mean_n) * (resid[n] - mean_t) for n in ns) / sum((n - mean_n) ** 2 for n in ns)
    slope = max(slope, 0.0)
    intercept = max(mean_t - slope * mean_n, 0.0)
    return intercept * 1e3, slope * 1e6


def _cpu_model() -> str:
    """The CPU's model name (/proc/cpuinfo, else platform.processor())."""
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or "unknown"


def host_spec(*, cores: int, steps_s: dict[int, float], bw_gbs: float, stream_gbs: float, f32_gflops: float,
              bf16_gflops: float | None, step_ms: float, seq_us: float, serving_us: float | None = None,
              serving_how: str = "") -> HostSpec:
    """The :class:`HostSpec` of this host from its measurements (rates in GB/s and GFLOP/s, step times in s by
    request count, overheads in ms and µs; ``bf16_gflops`` None where the CPU has no bfloat16 GEMM), named after
    the machine and CPU, with how each figure was measured."""
    import psutil
    import torch
    import transformers

    flags = Path("/proc/cpuinfo").read_text() if Path("/proc/cpuinfo").exists() else ""
    isa = "AVX-512" if " avx512f" in flags else ("AVX2" if " avx2" in flags else "")
    steps_ms = ", ".join(f"{t * 1e3:.2f}" for t in steps_s.values())
    return HostSpec(
        name=f"{platform.node()}: {_cpu_model()}, {cores} cores{' ' + isa if isa else ''}", cpu_model=_cpu_model(), cores=cores,
        memory_gib=round(psutil.virtual_memory().total / (1 << 30), 2),
        measured=f"{datetime.date.today().isoformat()}, torch {torch.__version__}, transformers {transformers.__version__}, "
                 f"{cores} threads, trtpipe plan measure-host",
        read_bandwidth_gbs=round(bw_gbs, 2), stream_bandwidth_gbs=round(stream_gbs, 2), fp32_gflops=round(f32_gflops, 1),
        bf16_gflops=None if bf16_gflops is None else round(bf16_gflops, 1), engine_step_overhead_ms=round(step_ms, 3), engine_seq_overhead_us=round(seq_us, 1),
        serving_cpu_per_token_us=None if serving_us is None else round(serving_us, 1),
        sources={
            "read_bandwidth_gbs": "best of 5: the CPU engine's Linear (native kernel on oneDNN-packed weights) of 1 token through "
                                  "SmolLM2-shaped fp32 weights (30 × 7 Linear + lm_head, 538 MB), weight bytes / time",
            "stream_bandwidth_gbs": "best of 7 torch.sum over a 1 GiB fp32 tensor (reference, not used)",
            "fp32_gflops": "best of 5: the same Linear layers for 64 tokens through the same weights, 2 × tokens × params / time",
            "bf16_gflops": "as fp32_gflops with bfloat16 weights and inputs" if bf16_gflops is not None else
                           "not measured: no oneDNN bfloat16 GEMM on this CPU (fp32_gflops is used)",
            "engine_step_overhead_ms": "CpuEngine decode step with a 30-layer width-64 SmolLM2-vocabulary model at "
                                       f"{', '.join(map(str, CONCURRENCIES))} requests, minus its modelled bytes/FLOPs: intercept "
                                       f"of a line in the request count (measured {steps_ms} ms)",
            "engine_seq_overhead_us": "slope of that line",
            "serving_cpu_per_token_us": serving_how or "not measured (measure-host --no-served)",
        },
    )


def measure(log: Callable[[str], None] = lambda line: None, *, served: bool = True) -> HostSpec:
    """Measure this host (about two minutes, all the cores this process may use); ``log`` gets one progress line per
    phase. The engine's steps are timed first, in this fresh process (see :func:`engine_steps`); ``served`` False
    skips the served probe (:func:`serving_cpu_per_token`; no Triton needed, the prediction is then the bare engine's).

    Raises:
        RuntimeError: the CPU engine did not finish the timing requests in 600 s.
    """
    import torch

    cores = len(os.sched_getaffinity(0))
    torch.set_num_threads(cores)
    steps, engine_cpu = engine_steps()
    bw, _ = linear_rates("float32", 1)
    _, f32 = linear_rates("float32", 64)
    try:
        _, bf16 = linear_rates("bfloat16", 64)
    except RuntimeError as e:  # oneDNN's bfloat16 GEMM needs AVX-512 BW/VL/DQ or AVX-NE-CONVERT
        log(f"no bfloat16 GEMM on this CPU ({str(e).splitlines()[0]}): the planner uses the fp32 rate")
        bf16 = None
    stream = stream_bandwidth_gbs()
    log(f"weight-read bandwidth {bw:.1f} GB/s (bare stream {stream:.1f}), GEMM fp32 {f32:.0f} GFLOP/s, "
        f"bf16 {'—' if bf16 is None else f'{bf16:.0f}'} GFLOP/s ({cores} threads)")
    step_ms, seq_us = engine_overheads(steps, tiny_geometry(), bw * 1e9, f32 * 1e9)
    log("CPU engine decode step (width-64 model): " + ", ".join(f"{n} seq {t * 1e3:.2f} ms" for n, t in steps.items()))
    log(f"→ step overhead {step_ms:.2f} ms + {seq_us:.0f} µs per sequence")
    serving_s, serving_how = serving_cpu_per_token(engine_cpu, log) if served else (None, "")
    return host_spec(cores=cores, steps_s=steps, bw_gbs=bw, stream_gbs=stream, f32_gflops=f32, bf16_gflops=bf16,
                     step_ms=step_ms, seq_us=seq_us, serving_us=None if serving_s is None else serving_s * 1e6,
                     serving_how=serving_how)
