#!/usr/bin/env python3
"""Cross-check ``trtpipe bench`` against GenAI-Perf's measurement engine on the same deployment and load.

    benchmarks/peer_check.py                       # build (reused) + serve the CPU default, ISL/OSL 100/200, c = 1,4,16
    benchmarks/peer_check.py --url localhost:8001 --isl 100 --osl 200 --concurrency 1,4,16 --waves 2 --repeats 4

For each concurrency both tools send the SAME prompts (exact-ISL texts from :func:`pipeline.bench.prompts.text_prompts`)
to the ``ensemble`` over Triton gRPC with the same exact-OSL inputs (``max_tokens = min_tokens = OSL``,
``end_id = -1``): first ``c`` warmup requests (discarded), then ``c × waves`` measured ones.

* trtpipe: ``trtpipe bench`` (``bench.json``; TTFT avg, ITL avg = (E2E − TTFT)/(OSL − 1) per request, output tok/s).
* GenAI-Perf: ``perf_analyzer`` 2.51.0 from ``tritonclient==2.51.0``'s wheel (the engine ``genai-perf profile``
  drives; /work/shared/reference/cpu-stack.md §2), installed idempotently into its own venv (``.venv-peer``; its
  protobuf/grpc pins differ from the project's). Its per-request export (``--profile-export-file``) is turned into
  GenAI-Perf's LLM metrics with GenAI-Perf 0.0.16's formulas (``genai_perf/profile_data_parser/
  llm_profile_data_parser.py``): responses without text are dropped; TTFT = first response − request start;
  ITL = (request latency − TTFT) / (output tokens − 1); output tok/s = Σ output tokens / (last response − first
  request start); output tokens by re-tokenizing each request's text (how GenAI-Perf counts).

Each tool runs ``--repeats`` times per concurrency in A B B A … order (a machine whose speed drifts over minutes
hits both alike; on this shared 2-core host two runs of the same tool differ by up to ~7 %). Prints, per concurrency,
both tools' means of TTFT avg, ITL avg and output tok/s, the difference (GenAI-Perf − trtpipe) in % and each tool's
run-to-run range, and writes ``peer_check.json`` (every run) into ``--out``. Needs Debian's ``libb64-0d`` (``apt-get install libb64-0d``) and a
``libcudart.so.12`` (the copy in ``nvidia_pytriton.libs`` is linked into ``<out>/libs``).
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import sysconfig
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
PEER_VENV = REPO / ".venv-peer"
CPU_RECIPE = REPO / "recipes" / "smollm2_135m_cpu_fp8.yaml"
TRTPIPE = [sys.executable, "-m", "pipeline.cli"]


def peer_venv() -> Path:
    """``perf_analyzer`` of ``tritonclient==2.51.0`` in :data:`PEER_VENV` (installed once)."""
    pa = PEER_VENV / "bin" / "perf_analyzer"
    if not pa.is_file():
        subprocess.run([sys.executable, "-m", "venv", "--clear", str(PEER_VENV)], check=True)
        subprocess.run([str(PEER_VENV / "bin" / "pip"), "install", "-q", "--disable-pip-version-check",
                        "tritonclient[all]==2.51.0"], check=True)
    if not Path("/usr/lib/x86_64-linux-gnu/libb64.so.0d").exists():
        sys.exit("perf_analyzer needs libb64: apt-get install libb64-0d")
    return pa


def cudart_dir(out: Path) -> Path:
    """A directory holding ``libcudart.so.12`` (a link to nvidia_pytriton's bundled copy)."""
    libs = Path(sysconfig.get_paths()["purelib"]) / "nvidia_pytriton.libs"
    src = next(iter(sorted(libs.glob("libcudart*.so.12*"))), None)
    if src is None:
        sys.exit(f"no libcudart.so.12 in {libs} (install trtpipe[cpu])")
    d = out / "libs"
    d.mkdir(parents=True, exist_ok=True)
    link = d / "libcudart.so.12"
    if not link.exists():
        link.symlink_to(src)
    return d


def input_data(prompts: list[str], osl: int, path: Path) -> Path:
    """perf_analyzer ``--input-data`` JSON: one entry per prompt, the ensemble inputs trtpipe sends (perf_analyzer
    cannot set a per-request id; trtpipe sends one, which the ensemble's postprocessing keys its streamed text on)."""
    data = [{"text_input": [p], "max_tokens": [osl], "min_tokens": [osl], "end_id": [-1], "stream": [True],
             "exclude_input_in_output": [True], "return_num_output_tokens": [True]} for p in prompts]
    path.write_text(json.dumps({"data": data}))
    return path


def run_perf_analyzer(pa: Path, libs: Path, url: str, data: Path, c: int, n: int, export: Path, *, need_export: bool = True) -> None:
    """One perf_analyzer run at concurrency ``c`` for ``n`` requests, per-request timestamps into ``export``
    (a warmup run, ``need_export=False``, is not re-run for an empty export)."""
    env = {**os.environ, "LD_LIBRARY_PATH": str(libs)}
    cmd = [str(pa), "-m", "ensemble", "-u", url, "-i", "grpc", "--streaming", "--input-data", str(data),
           "--shape", "text_input:1", "--concurrency-range", str(c), "--request-count", str(n),
           "--measurement-mode", "count_windows", "--measurement-request-count", str(n), "--stability-percentage", "999",
           "--max-trials", "1", "--profile-export-file", str(export)]
    for attempt in range(3):  # perf_analyzer 2.51 now and then exits 0 leaving an empty export: run it again
        export.unlink(missing_ok=True)
        p = subprocess.run(cmd, env=env, capture_output=True, text=True, check=False)
        export.with_suffix(".log").write_text(p.stdout + p.stderr)
        if p.returncode != 0:
            sys.exit(f"perf_analyzer failed (rc {p.returncode}): {p.stdout[-1500:]}{p.stderr[-1500:]}")
        if not need_export:
            return
        try:
            json.loads(export.read_text())["experiments"][0]["requests"]
            return
        except (OSError, ValueError, KeyError, IndexError):
            print(f"perf_analyzer c={c}: empty/invalid export (attempt {attempt + 1}), see {export.with_suffix('.log')}", flush=True)
    sys.exit(f"perf_analyzer c={c}: no valid export after 3 runs; see {export.with_suffix('.log')}")


def genai_perf_metrics(export: Path, tokenizer) -> dict:
    """GenAI-Perf 0.0.16's LLM metrics from a perf_analyzer profile export (see the module docstring)."""
    doc = json.loads(export.read_text())
    reqs = doc["experiments"][0]["requests"]
    ttft, itl, total, starts, ends, osl = [], [], 0, [], [], []
    for r in reqs:
        texts = [o.get("text_output", "") for o in r["response_outputs"]]
        times = [t for t, s in zip(r["response_timestamps"], texts) if s]
        text = "".join(texts)
        n = len(tokenizer.encode(text, add_special_tokens=False))
        start = r["timestamp"]
        first, last = times[0], times[-1]
        ttft.append((first - start) / 1e6)
        if n > 1:
            itl.append(((last - start) - (first - start)) / 1e6 / (n - 1))
        total += n
        osl.append(n)
        starts.append(start)
        ends.append(last)
    dur = (max(ends) - min(starts)) / 1e9
    return {"requests": len(reqs), "ttft_ms": sum(ttft) / len(ttft), "itl_ms": sum(itl) / len(itl),
            "output_tok_s": total / dur, "osl_min": min(osl), "osl_max": max(osl)}


def trtpipe_metrics(run_dir: Path) -> dict:
    """TTFT avg, ITL avg and output tok/s of a one-load-point ``trtpipe bench`` run."""
    p = json.loads((run_dir / "bench.json").read_text())["load_points"][0]["summary"]
    m = p["metrics"]
    return {"requests": p["counts"]["completed"], "ttft_ms": m["time_to_first_token"]["avg"],
            "itl_ms": m["inter_token_latency"]["avg"], "output_tok_s": m["output_token_throughput"],
            "osl_min": m["output_sequence_length"]["min"], "osl_max": m["output_sequence_length"]["max"]}


def mean_metrics(runs: list[dict]) -> dict:
    """The mean of every numeric metric over repeated runs (min/max for the OSL bounds)."""
    out = {k: sum(r[k] for r in runs) / len(runs) for k in runs[0] if k not in ("osl_min", "osl_max")}
    return out | {"osl_min": min(r["osl_min"] for r in runs), "osl_max": max(r["osl_max"] for r in runs), "runs": len(runs)}


def serve_default(out: Path):
    """Build (reused from the cache) and serve the CPU default; returns the serve handle (a context manager)."""
    build = out / "build"
    p = subprocess.run([*TRTPIPE, "build", str(CPU_RECIPE), "--out", str(build)], cwd=REPO, capture_output=True, text=True, check=False)
    if p.returncode != 0:
        sys.exit(f"trtpipe build failed: {p.stderr[-2000:]}")
    from pipeline.core.layout import BuildLayout
    from pipeline.serve import stage as serve

    return serve.run(BuildLayout(build), serve.ServeOptions(http_port=None, grpc_port=None, metrics_port=None, ready_timeout_s=300))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--url", help="Triton gRPC host:port of a running deployment (default: build + serve the CPU default)")
    ap.add_argument("--tokenizer", type=Path, help="tokenizer dir (default: the SmolLM2 checkpoint)")
    ap.add_argument("--isl", type=int, default=100)
    ap.add_argument("--osl", type=int, default=200)
    ap.add_argument("--concurrency", default="1,4,16")
    ap.add_argument("--waves", type=int, default=2, help="measured requests = waves × concurrency (at least 4)")
    ap.add_argument("--repeats", type=int, default=2, help="runs per tool and concurrency, in A B B A order; means are compared")
    ap.add_argument("--out", type=Path, default=REPO / "artifacts" / "peer_check")
    a = ap.parse_args()
    out = a.out.resolve()
    out.mkdir(parents=True, exist_ok=True)
    pa, libs = peer_venv(), cudart_dir(out)
    from transformers import AutoTokenizer

    from pipeline.bench.prompts import text_prompts
    from pipeline.quantize.sources import embedded_smollm2_dir

    tok_dir = a.tokenizer or embedded_smollm2_dir()
    tok = AutoTokenizer.from_pretrained(tok_dir)
    conc = [int(c) for c in a.concurrency.split(",")]

    def measure(url: str) -> list[dict]:
        rows = []
        for c in conc:
            n = max(4, a.waves * c)
            prompts = [p.text for p in text_prompts(n, a.isl, seed=1000 + c, tokenizer=tok)]
            # trtpipe bench: the same texts as a dataset, c warmup requests, n measured
            ds = out / f"prompts_c{c}.jsonl"
            ds.write_text("".join(json.dumps({"text": t}) + "\n" for t in prompts))
            data = input_data(prompts, a.osl, out / f"pa_inputs_c{c}.json")
            runs: dict[str, list[dict]] = {"trtpipe": [], "genai_perf": []}
            for rep in range(a.repeats):  # A B B A …: a drift of the machine over the runs hits both tools alike
                for tool in (("trtpipe", "genai_perf") if rep % 2 == 0 else ("genai_perf", "trtpipe")):
                    t0 = time.time()
                    if tool == "trtpipe":
                        run_dir = out / f"trtpipe_c{c}_r{rep}"
                        shutil.rmtree(run_dir, ignore_errors=True)
                        p = subprocess.run([*TRTPIPE, "bench", "--url", url, "--model", "ensemble", "--tokenizer", str(tok_dir),
                                            "--dataset", str(ds), "--scenario", f"{a.isl}:{a.osl}", "--concurrency", str(c),
                                            "--num-requests", str(n), "--warmup", str(c), "--out", str(run_dir)],
                                           cwd=REPO, capture_output=True, text=True, check=False)
                        if p.returncode != 0:
                            sys.exit(f"trtpipe bench c={c} failed: {p.stderr[-2000:]}")
                        m = trtpipe_metrics(run_dir)
                    else:  # perf_analyzer: a warmup run (c requests, discarded), then n measured
                        run_perf_analyzer(pa, libs, url, data, c, c, out / f"pa_warmup_c{c}.json", need_export=False)
                        run_perf_analyzer(pa, libs, url, data, c, n, out / f"pa_c{c}_r{rep}.json")
                        m = genai_perf_metrics(out / f"pa_c{c}_r{rep}.json", tok)
                    runs[tool].append(m | {"wall_s": time.time() - t0})
            ours, peer = mean_metrics(runs["trtpipe"]), mean_metrics(runs["genai_perf"])
            rows.append({"concurrency": c, "requests": n, "trtpipe": ours, "genai_perf": peer, "runs": runs})
            print(f"c={c}: trtpipe {ours}\n     genai-perf {peer}", flush=True)
        return rows

    if a.url:
        rows = measure(a.url)
    else:
        with serve_default(out) as handle:
            rows = measure(handle.grpc_url)
    doc = {"isl": a.isl, "osl": a.osl, "waves": a.waves, "repeats": a.repeats, "machine": f"{os.cpu_count()} CPUs", "rows": rows}
    (out / "peer_check.json").write_text(json.dumps(doc, indent=2))
    print(f"\nISL/OSL {a.isl}/{a.osl}, ensemble over gRPC, means of {a.repeats} runs per tool (A B B A); "
          "diff = (GenAI-Perf − trtpipe) / trtpipe")
    print(f"{'c':>3} {'metric':<14} {'trtpipe':>10} {'GenAI-Perf':>11} {'diff':>8} {'trtpipe runs':>14} {'GenAI-Perf runs':>16}")
    for r in rows:
        for key, name in (("output_tok_s", "output tok/s"), ("ttft_ms", "TTFT avg ms"), ("itl_ms", "ITL avg ms")):
            x, y = r["trtpipe"][key], r["genai_perf"][key]
            spread = {t: f"{min(v[key] for v in r['runs'][t]):.1f}–{max(v[key] for v in r['runs'][t]):.1f}" for t in r["runs"]}
            print(f"{r['concurrency']:>3} {name:<14} {x:>10.2f} {y:>11.2f} {100 * (y - x) / x:>+7.1f}% "
                  f"{spread['trtpipe']:>14} {spread['genai_perf']:>16}")
    print(f"results: {out / 'peer_check.json'}")


if __name__ == "__main__":
    main()
