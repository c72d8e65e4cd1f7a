#!/usr/bin/env python3
"""The CPU engine's decode throughput on a quiet machine vs beside one ``nice``d CPU hog, in one run (#44 item 5).

One engine (:class:`pipeline.cpu_runtime.engine.CpuEngine`, loaded once, its default threads unless ``--threads``)
serves a closed loop of ``--concurrency`` requests (ISL 100, every request exactly ``--osl`` tokens via
``min_tokens``). The run alternates windows of ``--window`` seconds, quiet and busy, ``--rounds`` times (Q B B Q Q B
…: this host's speed drifts over minutes); a busy window has one neighbour process running ``while True: pass``
under ``nice -n 19``, started ``--hog-session new`` (default: in a session of its own, like a neighbour started from
another terminal or by a service; with the kernel's autogroup scheduling on, ``nice`` then only orders it against
its own session, so it gets a fair share of a core) or ``same`` (a child in this session: ``nice`` applies against
the engine). Each window's throughput is the output tokens delivered in it / its length; the result is the mean per
kind and busy/quiet, printed and written as JSON (``--out``) with the machine's facts (CPU model, the
vector/matrix flags the native kernels use, cores this process may use, kernel, autogroup, load average before).

    PYTHONPATH=$PWD .venv/bin/python benchmarks/bench_contention.py [BUILD_DIR] [--concurrency 1] [--rounds 2]
        [--window 6] [--threads N] [--hog-session new|same] [--out contention.json] [--before CHECKOUT]

BUILD_DIR defaults to artifacts/smollm2_135m_cpu_fp8 (``trtpipe build recipes/smollm2_135m_cpu_fp8.yaml``). Run it
with nothing else busy: the hog must be the only neighbour. To compare engine versions with the same method, run this
file with ``PYTHONPATH`` pointing at the other checkout, or pass ``--before CHECKOUT``: that checkout's engine is measured
first, then this one's, each in a process of its own, and both results go to ``--out``.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import subprocess
import sys
import threading
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
ISL = 100
END_ID = 2  # masked by min_tokens = OSL
#: CPU flags that decide which native kernels run (pipeline/cpu_runtime/native.py).
KERNEL_FLAGS = ("avx2", "fma", "avx512f", "avx512bw", "avx512_bf16", "avx512_vnni", "amx_bf16", "amx_tile")


def machine_facts() -> dict:
    """CPU model, the kernel-relevant flags present, usable/online cores, kernel, autogroup, 1-min load average."""
    model, flags = platform.processor() or "?", set()
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name") and model in ("?", "x86_64", ""):
                model = line.split(":", 1)[1].strip()
            elif line.startswith("flags"):
                flags = set(line.split(":", 1)[1].split())
    except OSError:
        pass
    try:
        autogroup = Path("/proc/sys/kernel/sched_autogroup_enabled").read_text().strip() == "1"
    except OSError:
        autogroup = None
    return {"cpu_model": model, "cpu_flags": [f for f in KERNEL_FLAGS if f in flags], "cores_usable": len(os.sched_getaffinity(0)),
            "cores_online": os.cpu_count(), "kernel": platform.release(), "sched_autogroup": autogroup,
            "loadavg_1m_before": os.getloadavg()[0]}


def busy_cores_s() -> float:
    """CPU seconds all cores have spent busy since boot (``/proc/stat``: everything but idle and iowait)."""
    import psutil

    t = psutil.cpu_times()
    return sum(t) - t.idle - getattr(t, "iowait", 0.0) - getattr(t, "guest", 0.0) - getattr(t, "guest_nice", 0.0)


def cpu_s(proc) -> float:
    """User + system CPU seconds of a ``psutil.Process`` (0 once it is gone)."""
    try:
        t = proc.cpu_times()
        return t.user + t.system
    except Exception:  # noqa: BLE001 - a process that ended took nothing more
        return 0.0


def start_hog(session: str) -> subprocess.Popen:
    """One ``nice -n 19`` Python busy loop; ``session='new'`` puts it in a session (and autogroup) of its own."""
    return subprocess.Popen(["nice", "-n", "19", sys.executable, "-c", "while True: pass"],
                            start_new_session=session == "new")


class ClosedLoop:
    """``conc`` requests kept in flight on ``eng`` (each finished one is replaced); counts delivered output tokens."""

    def __init__(self, eng, conc: int, osl: int):
        self.eng, self.osl, self.tokens, self.stop = eng, osl, 0, False
        self.lock, self.idle = threading.Lock(), threading.Condition()
        self.live, self.n = 0, 0
        with self.lock:
            for _ in range(conc):
                self._submit()

    def _submit(self) -> None:
        self.n += 1
        self.live += 1
        prompt = [1000 + self.n % 97] + [1000 + i for i in range(1, ISL)]

        def cb(toks, fin) -> None:
            with self.lock:
                self.tokens += len(toks)
                if fin:
                    self.live -= 1
                    if not self.stop:
                        self._submit()
            if fin:
                with self.idle:
                    self.idle.notify_all()

        self.eng.add_request(prompt, max_new_tokens=self.osl, min_tokens=self.osl, end_id=END_ID, on_tokens=cb)

    def count(self) -> int:
        with self.lock:
            return self.tokens

    def drain(self, timeout: float) -> None:
        """Stop resubmitting and wait (≤ ``timeout`` s) for the requests in flight to finish."""
        with self.lock:
            self.stop = True
        deadline = time.monotonic() + timeout
        with self.idle:
            while self.live and time.monotonic() < deadline:
                self.idle.wait(0.5)


def measure(build: Path, *, conc: int, osl: int, rounds: int, window: float, threads: int | None,
            hog_session: str) -> dict:
    """Alternate quiet and busy windows on one engine; return per-window tok/s, means and their ratio."""
    from pipeline.cpu_runtime.engine import CpuEngine

    engine_dir = build / "engine" if (build / "engine").is_dir() else build
    windows: dict[str, list[float]] = {"quiet": [], "busy": []}
    order = [k for r in range(rounds) for k in (("quiet", "busy") if r % 2 == 0 else ("busy", "quiet"))]
    import psutil

    me = psutil.Process()
    others: dict[str, list[float]] = {"quiet": [], "busy": []}
    hog_cores: list[float] = []
    threads_seen: dict[str, list[int]] = {"quiet": [], "busy": []}
    with CpuEngine(engine_dir, num_threads=threads) as eng:
        loop = ClosedLoop(eng, conc, osl)
        time.sleep(min(window, 3.0))  # warm-up: the first prefills and steps
        for kind in order:
            hog = start_hog(hog_session) if kind == "busy" else None
            hp = psutil.Process(hog.pid) if hog is not None else None
            try:
                time.sleep(0.5)  # let the scheduler settle with (or without) the neighbour
                n0, t0, b0, m0, h0 = loop.count(), time.perf_counter(), busy_cores_s(), cpu_s(me), cpu_s(hp) if hp else 0.0
                time.sleep(window)
                dt = time.perf_counter() - t0
                tok_s = (loop.count() - n0) / dt
                h = (cpu_s(hp) - h0) / dt if hp else 0.0
                mine = (cpu_s(me) - m0) / dt
                others[kind].append((busy_cores_s() - b0) / dt - mine - h)
                if hp:
                    hog_cores.append(h)
            finally:
                if hog is not None:
                    hog.kill()
                    hog.wait()
            windows[kind].append(tok_s)
            now = eng.runtime.get("threads_now", eng.threads)
            threads_seen[kind].append(now)
            print(f"  {kind:5s} {tok_s:7.1f} tok/s, {now} threads at the end, engine process {mine:.2f} cores, hog {h:.2f}, "
                  f"anything else {others[kind][-1]:.2f}", flush=True)
        loop.drain(0.0)  # what is still in flight ends with the engine
        stats = eng.iteration_stats() if hasattr(eng, "iteration_stats") else {}
        threads_used = eng.threads
    quiet, busy = statistics.mean(windows["quiet"]), statistics.mean(windows["busy"])
    return {"threads": threads_used, "windows_tok_s": windows, "quiet_tok_s": quiet, "busy_tok_s": busy,
            "busy_over_quiet": busy / quiet if quiet else float("nan"), "hog_cores": hog_cores,
            "threads_at_window_end": threads_seen,
            "other_processes_cores": others,
            "engine_stats": stats if isinstance(stats, dict) else {}}


def compare(args: argparse.Namespace, build: Path) -> int:
    """Run this benchmark on ``args.before``'s engine, then on this checkout's (each in a process of its own with
    ``PYTHONPATH`` at that checkout); print both ratios, write both results (``--out``)."""
    import tempfile

    runs = {}
    with tempfile.TemporaryDirectory() as tmp:
        for label, root in (("before", args.before.resolve()), ("after", REPO)):
            if not (root / "pipeline" / "cpu_runtime" / "engine.py").is_file():
                print(f"error: --before {root}: not a trtpipe checkout (no pipeline/cpu_runtime/engine.py)", file=sys.stderr)
                return 2
            out = Path(tmp) / f"{label}.json"
            cmd = [sys.executable, __file__, str(build), "--concurrency", str(args.concurrency), "--osl", str(args.osl),
                   "--rounds", str(args.rounds), "--window", str(args.window), "--hog-session", args.hog_session,
                   "--out", str(out), *(["--threads", str(args.threads)] if args.threads else [])]
            print(f"{label}: {root}", flush=True)
            subprocess.run(cmd, check=True, env={**os.environ, "PYTHONPATH": str(root)})
            runs[label] = json.loads(out.read_text())
    for label, r in runs.items():
        print(f"{label:6s}: quiet {r['quiet_tok_s']:.1f} tok/s, busy neighbour {r['busy_tok_s']:.1f} tok/s, "
              f"{r['busy_over_quiet']:.2f} ×")
    print(f"quiet after / before: {runs['after']['quiet_tok_s'] / runs['before']['quiet_tok_s']:.2f}")
    if args.out:
        args.out.write_text(json.dumps(runs, indent=2) + "\n")
    return 0


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("build", nargs="?", default=str(REPO / "artifacts" / "smollm2_135m_cpu_fp8"))
    ap.add_argument("--concurrency", type=int, default=1)
    ap.add_argument("--osl", type=int, default=200, help="output tokens per request (default 200)")
    ap.add_argument("--rounds", type=int, default=2, help="quiet+busy window pairs, alternated (default 2)")
    ap.add_argument("--window", type=float, default=6.0, help="seconds per window (default 6)")
    ap.add_argument("--threads", type=int, default=None, help="engine threads (default: the engine's own rule)")
    ap.add_argument("--hog-session", choices=("new", "same"), default="new")
    ap.add_argument("--out", type=Path, help="write the result as JSON here")
    ap.add_argument("--before", type=Path, metavar="CHECKOUT",
                    help="also measure the engine of another checkout (e.g. `git worktree add /tmp/before fc84aa0`), "
                         "first, same method: both results and both ratios in one run")
    args = ap.parse_args(argv)
    build = Path(args.build).resolve()
    if not (build / "engine" / "engine_config.json").is_file() and not (build / "engine_config.json").is_file():
        print(f"error: {build}: no CPU engine (build it: trtpipe build recipes/smollm2_135m_cpu_fp8.yaml)", file=sys.stderr)
        return 2
    if args.before:
        return compare(args, build)
    facts = machine_facts()
    print(f"{facts['cpu_model']}, {facts['cores_usable']} cores usable, flags {' '.join(facts['cpu_flags'])}, "
          f"kernel {facts['kernel']}, autogroup {facts['sched_autogroup']}, load {facts['loadavg_1m_before']:.2f}")
    import pipeline.cpu_runtime as cr

    res = measure(build, conc=args.concurrency, osl=args.osl, rounds=args.rounds, window=args.window,
                  threads=args.threads, hog_session=args.hog_session)
    doc = {"date": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()), "machine": facts, "build": str(build),
           "engine_module": str(Path(cr.__file__).parent), "concurrency": args.concurrency, "isl": ISL, "osl": args.osl,
           "window_s": args.window, "rounds": args.rounds, "hog": f"nice -n 19 python busy loop, {args.hog_session} session",
           "env": {k: v for k, v in os.environ.items() if k.startswith(("OMP_", "GOMP_", "KMP_", "TRTPIPE_"))}, **res}
    print(f"threads {res['threads']}, c={args.concurrency}: quiet {res['quiet_tok_s']:.1f} tok/s, busy neighbour "
          f"{res['busy_tok_s']:.1f} tok/s: {res['busy_over_quiet']:.2f} ×")
    print(json.dumps({k: doc[k] for k in ("quiet_tok_s", "busy_tok_s", "busy_over_quiet", "threads")}))
    if args.out:
        args.out.write_text(json.dumps(doc, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
