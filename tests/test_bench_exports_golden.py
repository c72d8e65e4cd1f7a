"""The run directory's bytes, pinned: bench.json (less its machine-dependent ``environment``), summary.csv and the
AIPerf export files of a synthetic run — failures, short requests, a multi-token response, SLOs, GPUs, server
metrics, one and several load points — hash to what the code before issue #33 (6cf60e0) wrote. The metric registry,
the typed load points and the exporters may be rearranged; their output may not change. (A numpy upgrade that moves
the last digit of a float would change a hash too: check the diff, then re-record. Re-recorded for #39: the spec gained
`stall_timeout_s`; with that one line taken out, every file hashes as before. Re-recorded for #49: summary.csv gained the telemetry columns
(pipeline.bench.telemetry.CSV_COLUMNS, empty without telemetry); with them cut off, it hashes as before. Re-recorded
for #49 item 3: the spec gained `num_prefix_prompts`/`prefix_prompt_length` and each request record `cached_tokens`;
with those keys taken out, every file hashes as before.)"""

from __future__ import annotations

import hashlib
import json
from pathlib import Path

from pipeline.bench.exporters import write_run
from pipeline.bench.records import RequestRecord
from pipeline.bench.results import BenchResult, LoadPoint
from pipeline.bench.run import summarize_run
from pipeline.recipe.bench import BenchSpec

MS = 1_000_000
SCENARIOS = (("10:4", 10, 4), ("20:3", 20, 3))

MULTI = {
    "aiperf/10x4_c1/profile_export_aiperf.csv": "b76d9cbbc2b985c4",
    "aiperf/10x4_c1/profile_export_aiperf.json": "e08386bb2f4d11a4",  # + the prefix options (#49)
    "aiperf/10x4_c4/profile_export_aiperf.csv": "4d7c3bd80e872bae",
    "aiperf/10x4_c4/profile_export_aiperf.json": "d69868dbb30286b3",  # + the prefix options (#49)
    "aiperf/20x3_c1/profile_export_aiperf.csv": "127de62ba97b8faa",
    "aiperf/20x3_c1/profile_export_aiperf.json": "3dadb8a1f13722b0",  # + the prefix options (#49)
    "aiperf/20x3_c4/profile_export_aiperf.csv": "b6f35cfff222c338",
    "aiperf/20x3_c4/profile_export_aiperf.json": "0759886781cd8122",  # + the prefix options (#49)
    "bench.json": "17cd092a31e418a7",  # + config.stall_timeout_s (#39), the prefix options and cached_tokens (#49)
    "profile_export.jsonl": "ce88d164ba28b70a",
    "summary.csv": "274c00109b804da0",  # + the telemetry columns, empty here (#49)
}
SINGLE = {
    "aiperf/10x4_c4/profile_export_aiperf.csv": "2a3862423bfb141e",
    "aiperf/10x4_c4/profile_export_aiperf.json": "04f134ceeba02252",  # + the prefix options (#49)
    "bench.json": "a705584940e39f9a",  # + config.stall_timeout_s (#39), the prefix options and cached_tokens (#49)
    "profile_export.jsonl": "b4cbf0851d8a8c56",
    "profile_export_aiperf.csv": "2a3862423bfb141e",
    "profile_export_aiperf.json": "04f134ceeba02252",  # + the prefix options (#49)
    "summary.csv": "a7015fc3b9a9868a",  # + the telemetry columns, empty here (#49)
}


def _records() -> list[RequestRecord]:
    """9 requests per scenario × concurrency: #0 warmup, #3 one token short, #5 a two-token response, #6 timed out,
    #7 a disagreeing server count, #2 server timestamps and a re-tokenized count."""
    out = []
    for sc, isl, osl in SCENARIOS:
        for c in (1, 4):
            for i in range(9):
                start = i * 100 * MS + c * 7 * MS
                r = RequestRecord(sc, f"c{c}", i, i == 0, isl, osl, start_ns=start)
                n = osl if i != 3 else osl - 1
                r.response_ns = [start + int((50 + 10 * k + i) * c * MS) + 17 * k for k in range(n)]
                r.response_tokens = [1] * n
                if i == 5:
                    r.response_tokens[-1] = 2
                r.end_ns = r.response_ns[-1] + 3
                if i == 6:
                    r.error, r.response_ns, r.response_tokens = "timeout after 0.2 s", [], []
                if i == 7:
                    r.server_tokens = r.output_tokens + 1
                if i == 2:
                    r.server = {"arrival_time_ns": 5, "first_token_time_ns": 6, "last_token_time_ns": 7}
                    r.text_tokens = r.output_tokens
                out.append(r)
    return out


def _point(sc: str, isl: int, osl: int, c: int) -> LoadPoint:
    p = LoadPoint(sc, isl, osl, "concurrency", f"c{c}", concurrency=c, requests_sent=8, client_cpu_s=0.125 * c,
                  wall_s=1.5 * c, client_cpu_fraction=0.125 / 1.5)
    if c == 4 and sc == "10:4":
        p.server_metrics = {"counters": {"request_success": 8}, "queue_ms_per_request": 0.5, "url": "http://x/metrics"}
    return p


def _digests(root: Path) -> dict[str, str]:
    out = {}
    for p in sorted(root.rglob("*")):
        if p.is_file() and p.suffix != ".png":
            data = p.read_bytes()
            if p.name == "bench.json":
                doc = json.loads(data)
                doc.pop("environment")
                data = (json.dumps(doc, default=str, separators=(",", ":")) + "\n").encode()
            out[str(p.relative_to(root))] = hashlib.sha256(data).hexdigest()[:16]
    return out


def test_several_load_points(tmp_path):
    spec = BenchSpec(model="tensorrt_llm", scenarios=[{"isl": 10, "osl": 4}, {"isl": 20, "osl": 3}], concurrency=[1, 4],
                     goodput={"ttft": 300, "itl": 40})
    run = BenchResult(spec, started_at="2026-01-01T00:00:00+00:00", t0_ns=0, t0_epoch_ns=1_700_000_000_000_000_000,
                      url="localhost:8001", gpus=2, warnings=["w1"], notes=["n1"], tokenizer_path="/tok")
    run.records = _records()
    run.load_points = [_point(sc, isl, osl, c) for sc, isl, osl in SCENARIOS for c in (1, 4)]
    summarize_run(run)
    assert _digests(write_run(tmp_path / "run", run)) == MULTI


def test_one_interrupted_load_point(tmp_path):
    spec = BenchSpec(model="tensorrt_llm", scenarios=[{"isl": 10, "osl": 4}], concurrency=[4])
    run = BenchResult(spec, started_at="x", t0_ns=0, t0_epoch_ns=10**18, url="u", gpus=None, interrupted=True)
    run.records = [r for r in _records() if r.scenario == "10:4" and r.load == "c4"]
    run.load_points = [_point("10:4", 10, 4, 4)]
    summarize_run(run)
    assert _digests(write_run(tmp_path / "run", run)) == SINGLE
