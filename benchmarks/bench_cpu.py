#!/usr/bin/env python3
"""Raw CPU engine vs the Triton-served CPU deployment, at ISL/OSL 100/200, concurrency 1/4/16.

Prints in one run, per concurrency: the raw engine's output tokens/s, TTFT and ITL
(:class:`pipeline.cpu_runtime.engine.CpuEngine` in this process, closed loop, every request exactly
OSL tokens via ``min_tokens``), the same load through Triton (``trtpipe serve --detach`` then
``trtpipe bench`` on the build's ``ensemble``, one bench per concurrency; both sides measure ``--waves`` ×
concurrency requests), their ratio, and the roofline: output tokens/s if
every step only streamed the engine's weights and the batch's K/V (float32, or bfloat16 for
``build.cpu.dtype: bfloat16``) from memory at the machine's
measured read bandwidth (prefill not counted). Also: serve-ready time, the deployment's RSS
(server + every stub) at ready and at peak, the CPU seconds of the server and of each python stub over the
served bench, and the cores each process (server, stubs, the bench client) kept busy in the steady state of
the last concurrency: on a 2-core host what the others take, the engine's two OpenMP threads lose about twice.
With ``--direct``, the same load on the served ``tensorrt_llm`` model itself (token ids in and out), after the
ensemble on the same server: direct/raw is the engine's own Triton path, ensemble/direct what the ensemble
(preprocessing, postprocessing's detokenization, the ensemble's routing) costs.

    .venv/bin/python benchmarks/bench_cpu.py [BUILD_DIR] [--concurrency 1,4,16] [--waves 2] [--repeats 3] [--skip-triton] [--direct] [--side-load 0.2]

With ``--repeats N`` the raw engine and the served deployment alternate N times; the table gives the means,
then each round's Triton/raw (this host's speed drifts over minutes, so one raw/served pair is one sample).

BUILD_DIR defaults to artifacts/smollm2_135m_cpu_fp8 (``trtpipe build recipes/smollm2_135m_cpu_fp8.yaml``).
Run it on a quiet machine: both measurements use every core.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

import psutil

REPO = Path(__file__).resolve().parents[1]

ISL, OSL = 100, 200
END_ID = 2  # masked by min_tokens = OSL, as the bench client does


def read_bandwidth_gbs() -> float:
    """Memory read bandwidth (GB/s): best of 3 sums over a 256 MiB float32 tensor, all threads."""
    import torch

    a = torch.ones(64 * 2**20)
    best = 0.0
    for _ in range(3):
        t = time.perf_counter()
        a.sum()
        best = max(best, a.numel() * 4 / (time.perf_counter() - t) / 1e9)
    return best


def roofline(engine_dir: Path, conc: int, bw_gbs: float) -> float:
    """Output tok/s bound at ``conc`` sequences: one decode step reads the weights (the engine's safetensors bytes,
    in its build.cpu.dtype) + the K/V of ``conc`` sequences at mean context ISL + OSL/2 (the K+V bytes per token
    the engine stage recorded in engine_config.json: float32, or bfloat16 for a bfloat16 build)."""
    weights = sum(f.stat().st_size for f in engine_dir.glob("*.safetensors"))
    kv_tok = json.loads((engine_dir / "engine_config.json").read_text())["kv_cache"]["bytes_per_token"]
    step_bytes = weights + conc * (ISL + OSL / 2) * kv_tok
    return conc / (step_bytes / (bw_gbs * 1e9))


def raw_engine(engine_dir: Path, concurrency: list[int], waves: int) -> dict[int, dict]:
    """Closed-loop load on the engine in this process; {conc: {tok_s, ttft_ms, itl_ms}}."""
    from pipeline.cpu_runtime.engine import CpuEngine

    out = {}
    with CpuEngine(engine_dir) as eng:
        print(f"raw engine: {eng.runtime}, loaded in {eng.load_time_s:.1f} s", flush=True)
        prompt = [1000 + i for i in range(ISL)]

        def run(conc: int, total: int, osl: int) -> dict:
            lock, done = threading.Lock(), threading.Event()
            st = {"sub": 0, "fin": 0, "ttft": [], "itl": []}

            def submit() -> None:
                i = st["sub"]
                st["sub"] += 1
                t0, last = time.perf_counter(), [None]

                def cb(toks, fin):
                    now = time.perf_counter()
                    (st["ttft"] if last[0] is None else st["itl"]).append(now - (t0 if last[0] is None else last[0]))
                    last[0] = now
                    if fin:
                        with lock:
                            st["fin"] += 1
                            if st["sub"] < total:
                                submit()
                            if st["fin"] == total:
                                done.set()

                eng.add_request([prompt[0] + i % 97] + prompt[1:], max_new_tokens=osl, min_tokens=osl, end_id=END_ID, on_tokens=cb)

            t = time.perf_counter()
            with lock:
                for _ in range(conc):
                    submit()
            if not done.wait(1800):
                raise RuntimeError("raw engine run did not finish in 30 min")
            wall = time.perf_counter() - t
            return {"tok_s": total * osl / wall, "ttft_ms": 1e3 * statistics.mean(st["ttft"]),
                    "itl_ms": 1e3 * statistics.mean(st["itl"]) if st["itl"] else float("nan")}

        run(1, 1, 8)  # warm-up
        for c in concurrency:
            out[c] = run(c, c * waves, OSL)
            print(f"  raw c={c}: {out[c]['tok_s']:.1f} tok/s", flush=True)
    return out


#: A process that keeps ``duty`` of one core busy in bursts of ``duty × 2 ms`` every 2 ms (``--side-load``).
_SIDE_LOAD = """import sys, time
duty, period = float(sys.argv[1]), 0.002
while True:
    t = time.perf_counter()
    while time.perf_counter() - t < duty * period:
        pass
    time.sleep(period * (1 - duty))
"""


def tree_cpu_s(pid: int) -> dict[str, float]:
    """CPU seconds (user + system) so far of the server process and each python-backend stub, by role
    (``tritonserver`` or the stub's model name, read from its model.py path)."""
    from pipeline.triton.process import tree_processes

    out: dict[str, float] = {}
    for proc in tree_processes(pid):
        try:
            cmd, t = proc.cmdline(), proc.cpu_times()
        except psutil.Error:
            continue
        role = next((Path(a).parent.parent.name for a in cmd if a.endswith("model.py")), proc.name())
        out[role] = out.get(role, 0.0) + t.user + t.system
    return out


def load_points(doc: dict) -> dict[int, dict]:
    """{conc: {tok_s, ttft_ms, itl_ms, exact_osl}} of a ``trtpipe bench`` run's ``bench.json``."""
    out = {}
    for p in doc["load_points"]:
        m = p["summary"]["metrics"]
        recs = [r for r in doc["requests"] if r["load"] == p["load"] and not r["warmup"]]
        out[int(p["concurrency"])] = {
            "tok_s": m["output_token_throughput"],
            "ttft_ms": m["time_to_first_token"]["avg"], "itl_ms": m["inter_token_latency"]["avg"],
            "exact_osl": all(r["output_tokens"] == OSL for r in recs),
        }
    return out


def served(build: Path, concurrency: list[int], waves: int, direct: bool = False) -> tuple[dict[int, dict], dict]:
    """``trtpipe serve --detach`` + ``trtpipe bench`` on the build's ``ensemble``; ({conc: metrics}, deployment facts).
    ``direct``: then the same load on the ``tensorrt_llm`` model of the same server (token ids in and out: no
    preprocessing, postprocessing or ensemble), its {conc: metrics} in ``facts["direct"]``."""
    from pipeline.core.layout import BuildLayout
    from pipeline.triton.process import pick_free_port as free_port
    from pipeline.triton.process import tree_rss
    from pipeline.triton_repo import client_tokenizer_dir

    trtpipe = str(Path(sys.executable).parent / "trtpipe")
    work = build.parent.parent  # holds artifacts/
    ports = [str(free_port()) for _ in range(3)]
    env = {**os.environ, "COLUMNS": "200"}
    t = time.perf_counter()
    up = subprocess.run([trtpipe, "serve", str(build), "--detach", "--http-port", ports[0], "--grpc-port", ports[1],
                         "--metrics-port", ports[2]], cwd=work, capture_output=True, text=True, env=env)
    if up.returncode != 0:
        raise RuntimeError(f"trtpipe serve failed: {up.stdout[-2000:]}{up.stderr[-2000:]}")
    facts = {"ready_s": time.perf_counter() - t}
    pid = json.loads((work / "artifacts" / "serve.json").read_text())["pid"]
    facts["rss_ready_mib"] = tree_rss(pid) / 2**20
    peak = [facts["rss_ready_mib"]]
    stop = threading.Event()
    client: list[Any] = []  # the running bench process and its start time (one per concurrency)
    cpu_log: list[tuple[float, dict[str, float]]] = []  # (time, CPU seconds so far by role) every 0.5 s

    def cpu_now() -> dict[str, float]:
        now = tree_cpu_s(pid)
        if client:
            try:
                t = psutil.Process(client[0].pid).cpu_times()
                now["bench client"] = t.user + t.system
            except psutil.Error:
                pass
        return now

    def sample() -> None:
        while not stop.wait(0.5):
            try:
                peak.append(tree_rss(pid) / 2**20)
                cpu_log.append((time.perf_counter(), cpu_now()))
            except Exception:
                pass

    def bench_cmd(out: str, c: int, *extra: str) -> list[str]:
        # waves × c measured requests, as the raw engine gets (trtpipe bench's own default is 2 × c)
        return [trtpipe, "bench", "--url", f"127.0.0.1:{ports[1]}", "--isl", str(ISL), "--osl", str(OSL),
                "--concurrency", str(c), "--num-requests", str(waves * c), "--out", out, *extra]

    def bench_all(tmp: str, *extra: str, on_start=None) -> dict[int, dict]:
        """One ``trtpipe bench`` per concurrency, in order; {conc: metrics}."""
        points: dict[int, dict] = {}
        for c in concurrency:
            proc = subprocess.Popen(bench_cmd(f"{tmp}/c{c}", c, *extra), cwd=work, stdout=subprocess.PIPE,
                                    stderr=subprocess.PIPE, text=True, env=env)
            if on_start is not None:
                on_start(proc)
            stdout, stderr = proc.communicate()
            if proc.returncode != 0:
                raise RuntimeError(f"trtpipe bench {' '.join(extra)} at c={c} failed: {stdout[-3000:]}{stderr[-2000:]}")
            points.update(load_points(json.loads(Path(f"{tmp}/c{c}/bench.json").read_text())))
        return points

    def track_client(proc: subprocess.Popen) -> None:
        client[:] = [proc, time.perf_counter()]  # one assignment: the sampler never sees a half-updated list

    threading.Thread(target=sample, daemon=True).start()
    try:
        with tempfile.TemporaryDirectory() as tmp:
            cpu0, t_bench = tree_cpu_s(pid), time.perf_counter()
            # the served build's tokenizer, not the last build's
            points = bench_all(tmp, "--tokenizer", str(client_tokenizer_dir(BuildLayout(build))), on_start=track_client)
            wall = time.perf_counter() - t_bench
            stop.set()
            cpu1 = tree_cpu_s(pid)
            facts["cpu_s"] = {k: v - cpu0.get(k, 0.0) for k, v in cpu1.items()}
            facts["bench_wall_s"] = wall
            # the last concurrency is the longest point and runs last, in its own bench process: its steady state is
            # the last two thirds of that process (its start-up is over), up to 1 s before the engine stopped working
            # (after it the client re-tokenizes and writes its exports)
            busy = [t1 for (t0, a), (t1, b) in zip(cpu_log, cpu_log[1:])
                    if (b.get("tensorrt_llm", 0.0) - a.get("tensorrt_llm", 0.0)) / (t1 - t0) >= 1.0]
            last_start = client[1]
            lo = last_start + (t_bench + wall - last_start) / 3
            hi = (max(busy) if busy else t_bench + wall) - 1.0
            window = [(t, c) for t, c in cpu_log if lo <= t <= hi]
            if len(window) >= 2:
                (ta, a), (tb, b) = window[0], window[-1]
                facts["steady_cores"] = {k: (v - a.get(k, 0.0)) / (tb - ta) for k, v in b.items()}
                facts["steady_s"] = tb - ta
        facts["rss_peak_mib"] = max(peak)
        if direct:
            with tempfile.TemporaryDirectory() as tmp:
                facts["direct"] = bench_all(tmp, "--model", "tensorrt_llm")
    finally:
        stop.set()
        subprocess.run([trtpipe, "serve", "--stop"], cwd=work, capture_output=True, env=env)
    return points, facts


def _mean_points(runs: list[dict[int, dict]]) -> dict[int, dict]:
    """Per concurrency, the mean of each figure over ``runs`` (``exact_osl``: true only if true in every run)."""
    if not runs:
        return {}
    out = {}
    for c in runs[0]:
        pts = [r[c] for r in runs]
        out[c] = {k: (all(p[k] for p in pts) if isinstance(pts[0][k], bool) else statistics.mean(p[k] for p in pts))
                  for k in pts[0]}
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("build", nargs="?", default=str(REPO / "artifacts" / "smollm2_135m_cpu_fp8"))
    ap.add_argument("--concurrency", default="1,4,16")
    ap.add_argument("--waves", type=int, default=2, help="requests per load point = waves × concurrency (default 2)")
    ap.add_argument("--skip-triton", action="store_true", help="raw engine and roofline only")
    ap.add_argument("--direct", action="store_true",
                    help="also bench the served tensorrt_llm model directly (token ids: no ensemble, pre- or "
                         "postprocessing), after the ensemble, on the same server: what the ensemble costs")
    ap.add_argument("--repeats", type=int, default=1, metavar="N",
                    help="alternate the raw engine and the served deployment N times (raw, served, raw, served, …): "
                         "the table shows means with their range and the ratio of the means, then each round's ratio "
                         "(this host's speed drifts over minutes; one pair is one sample)")
    ap.add_argument("--side-load", type=float, metavar="CORES",
                    help="also run the raw engine at the highest concurrency 3 times alone and 3 times beside a process "
                         "keeping CORES (e.g. 0.2) of one core busy in 2 ms bursts, interleaved: what the server, stubs "
                         "and client take from the served engine, without them")
    args = ap.parse_args(argv)
    build = Path(args.build).resolve()
    conc = [int(c) for c in args.concurrency.split(",")]
    engine_dir = build / "engine"
    # the raw engine first: once this process had allocated and freed a large tensor (the bandwidth probe), the
    # engine's steps in it ran ~1.8 × slower (measured: 377 → 212 tok/s at 16 after a freed 1 GiB tensor). Part of
    # that, at one sequence, was the probe's OpenMP pool on this thread, which CpuEngine now releases
    # (pipeline.cpu_runtime.engine.release_openmp_pool); at 16 that alone moved the step by less than this host's noise
    raws = [raw_engine(engine_dir, conc, args.waves)]
    side: dict[str, list[float]] = {"alone": [], "side load": []}
    if args.side_load:  # A B B A A B at the highest concurrency: this host's speed drifts over minutes
        for kind in ("alone", "side load", "side load", "alone", "alone", "side load"):
            burner = subprocess.Popen([sys.executable, "-c", _SIDE_LOAD, str(args.side_load)]) if kind != "alone" else None
            try:
                side[kind].append(raw_engine(engine_dir, conc[-1:], args.waves)[conc[-1]]["tok_s"])
            finally:
                if burner is not None:
                    burner.kill()
    srvs, facts = [], {}
    if not args.skip_triton:
        for i in range(max(1, args.repeats)):
            if i:
                raws.append(raw_engine(engine_dir, conc, args.waves))
            srv_i, facts = served(build, conc, args.waves, args.direct)
            srvs.append(srv_i)
    raw, srv = _mean_points(raws), _mean_points(srvs)
    bw = read_bandwidth_gbs()
    print(f"\nISL/OSL {ISL}/{OSL}, every request exactly {OSL} tokens; memory read bandwidth {bw:.0f} GB/s")
    print(f"{'conc':>4} | {'raw tok/s':>9} {'TTFT ms':>8} {'ITL ms':>7} | {'Triton tok/s':>12} {'TTFT ms':>8} {'ITL ms':>7} "
          f"{'exact':>5} | {'Triton/raw':>10} | {'roofline tok/s':>14}")
    for c in conc:
        r, s = raw[c], srv.get(c)
        line = f"{c:>4} | {r['tok_s']:>9.1f} {r['ttft_ms']:>8.0f} {r['itl_ms']:>7.1f} | "
        if s:
            line += f"{s['tok_s']:>12.1f} {s['ttft_ms']:>8.0f} {s['itl_ms']:>7.1f} {str(s['exact_osl']):>5} | {s['tok_s'] / r['tok_s']:>10.2f} | "
        else:
            line += f"{'-':>12} {'-':>8} {'-':>7} {'-':>5} | {'-':>10} | "
        print(line + f"{roofline(engine_dir, c, bw):>14.0f}")
    if len(srvs) > 1:
        print(f"means of {len(srvs)} rounds (raw, served, raw, served, …); per concurrency, tok/s range and each round's Triton/raw:")
        for c in conc:
            rr, ss = [x[c]["tok_s"] for x in raws], [x[c]["tok_s"] for x in srvs]
            print(f"{c:>4} | raw {min(rr):.1f}–{max(rr):.1f} | Triton {min(ss):.1f}–{max(ss):.1f} | Triton/raw per round "
                  + " ".join(f"{b / a:.2f}" for a, b in zip(rr, ss)))
    if facts.get("direct"):
        last = " (the last round)" if len(srvs) > 1 else ""
        print(f"the tensorrt_llm model served directly (no ensemble), same server, after the ensemble run{last}:")
        for c in conc:
            d = facts["direct"][c]
            print(f"{c:>4} | Triton direct {d['tok_s']:.1f} tok/s, TTFT {d['ttft_ms']:.0f} ms, ITL {d['itl_ms']:.1f} ms, "
                  f"exact {d['exact_osl']} | direct/raw {d['tok_s'] / raws[-1][c]['tok_s']:.2f}, "
                  f"ensemble/direct {srvs[-1][c]['tok_s'] / d['tok_s']:.2f}")
    if side["alone"]:
        a, b = statistics.mean(side["alone"]), statistics.mean(side["side load"])
        print(f"raw engine at c={conc[-1]}, 3 runs each, interleaved: alone {a:.1f} tok/s "
              f"({', '.join(f'{x:.0f}' for x in side['alone'])}), beside a {args.side_load:g}-core side load {b:.1f} tok/s "
              f"({', '.join(f'{x:.0f}' for x in side['side load'])}): {b / a:.2f} ×")
    if facts:
        if len(srvs) > 1:
            print("the last round's server:")
        print(f"serve ready in {facts['ready_s']:.1f} s; deployment RSS {facts['rss_ready_mib']:.0f} MiB at ready, "
              f"{facts['rss_peak_mib']:.0f} MiB peak under load")
        cores = len(os.sched_getaffinity(0))
        print(f"server-side CPU during the served bench ({facts['bench_wall_s']:.0f} s wall × {cores} cores = "
              f"{facts['bench_wall_s'] * cores:.0f} core-s): " + ", ".join(
                  f"{k} {v:.1f} s" for k, v in sorted(facts["cpu_s"].items(), key=lambda kv: -kv[1])))
        if "steady_cores" in facts:
            print(f"steady state at c={conc[-1]} ({facts['steady_s']:.0f} s), cores in use by process: " + ", ".join(
                f"{k} {v:.3f}" for k, v in sorted(facts["steady_cores"].items(), key=lambda kv: -kv[1]) if v >= 0.0005))
    return 0


if __name__ == "__main__":
    sys.exit(main())
