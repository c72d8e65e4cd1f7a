"""Run directory exports (bench.json, summary.csv, plots), `compare`, and the CLI without a server."""

from __future__ import annotations

import csv
import json
import subprocess
import sys
from pathlib import Path

import pytest

from pipeline.bench.compare import compare_runs
from pipeline.bench.exporters import write_run
from pipeline.bench.records import RequestRecord
from pipeline.bench.results import BenchResult, LoadPoint
from pipeline.bench.run import summarize_run
from pipeline.bench.summary_csv import read_summary
from pipeline.recipe.bench import BenchSpec

TRTPIPE = str(Path(sys.executable).parent / "trtpipe")
MS = 1_000_000


def fake_run(scale: float = 1.0) -> BenchResult:
    """A run of two concurrency points whose latencies are multiplied by ``scale``."""
    spec = BenchSpec(model="tensorrt_llm", scenarios=[{"isl": 10, "osl": 4}], concurrency=[1, 4])
    run = BenchResult(spec, started_at="now", t0_ns=0)
    for c in (1, 4):
        label = f"c{c}"
        for i in range(8):
            start = i * 100 * MS
            r = RequestRecord("10:4", label, i, i == 0, 10, 4, start_ns=start)
            r.response_ns = [start + int(scale * (50 + 10 * k) * c * MS) for k in range(4)]
            r.response_tokens = [1, 1, 1, 1]
            r.end_ns = r.response_ns[-1]
            run.records.append(r)
        run.load_points.append(LoadPoint("10:4", 10, 4, "concurrency", label, concurrency=c, client_cpu_fraction=0.1))
    summarize_run(run)
    return run


def test_run_directory_files_and_csv_columns(tmp_path):
    out = write_run(tmp_path / "run", fake_run())
    assert sorted(p.name for p in (out / "plots").iterdir()) == ["itl.png", "throughput.png", "throughput_latency.png", "ttft.png"]
    with open(out / "summary.csv") as f:
        header = next(csv.reader(f))
    assert len(header) == len(set(header))  # one column per name
    assert header[:12] == ["scenario", "isl", "osl", "mode", "concurrency", "request_rate", "requests", "completed",
                           "failed", "short", "duration_s", "client_cpu_fraction"]
    for col in ("time_to_first_token_ms_avg", "time_to_first_token_ms_p99", "inter_token_latency_ms_p50",
                "time_per_output_token_ms_avg", "request_latency_ms_p95", "output_token_throughput_tokens_per_s",
                "total_token_throughput_tokens_per_s", "request_throughput_requests_per_s",
                "output_token_throughput_per_user_tokens_per_s_avg", "request_goodput_requests_per_s"):
        assert col in header
    rows = read_summary(out)
    assert [r["concurrency"] for r in rows] == [1, 4] and rows[0]["requests"] == 7  # one warmup excluded
    assert rows[0]["time_to_first_token_ms_avg"] == pytest.approx(50.0)
    assert rows[1]["inter_token_latency_ms_avg"] == pytest.approx(40.0)
    doc = json.loads((out / "bench.json").read_text())
    assert doc["schema"] == "trtpipe.bench/1" and len(doc["requests"]) == 16
    assert doc["environment"]["versions"]["tritonclient"] and doc["status"]["complete"]
    assert doc["requests"][1]["response_ns"] == [(100 + 50) * MS, (100 + 60) * MS, (100 + 70) * MS, (100 + 80) * MS]


def test_compare_reports_direction_aware_deltas(tmp_path):
    a = write_run(tmp_path / "a", fake_run(1.0))
    b = write_run(tmp_path / "b", fake_run(0.5))  # twice as fast
    rows = {(r["load"], r["metric"]): r for r in compare_runs(a, b)}
    ttft = rows[(1, "TTFT avg")]
    assert ttft["change_pct"] == pytest.approx(-50.0) and ttft["verdict"] == "better"
    assert rows[(4, "Output tokens/s/user avg")]["verdict"] == "better"
    same = {r["verdict"] for r in compare_runs(a, a) if r["verdict"] != "n/a"}
    assert same == {"within noise"}


def _repeats(root: Path, scales: list[float]) -> Path:
    for i, s in enumerate(scales, 1):
        write_run(root / f"bench-{i}", fake_run(s))
    return root


def test_compare_without_repeats_calls_a_small_change_within_noise(tmp_path):
    """#44: a 5 % change between two single runs was "better"; their noise is unknown, so it is within the band."""
    from pipeline.bench.compare import DEFAULT_BAND_PCT

    a, b = write_run(tmp_path / "a", fake_run(1.0)), write_run(tmp_path / "b", fake_run(0.95))
    ttft = {(r["load"], r["metric"]): r for r in compare_runs(a, b)}[(1, "TTFT avg")]
    assert ttft["change_pct"] == pytest.approx(-5.0) and abs(ttft["change_pct"]) < DEFAULT_BAND_PCT
    assert ttft["verdict"] == "within noise" and "no repeats" in ttft["noise"]


def test_compare_with_repeats_judges_against_their_measured_noise(tmp_path):
    """Three repeats a side: a 5 % shift larger than the repeats' spread is "better"; a 0.5 % one inside it is not."""
    a = _repeats(tmp_path / "a", [1.0, 1.01, 0.99])
    faster = _repeats(tmp_path / "faster", [0.95, 0.955, 0.945])
    alike = _repeats(tmp_path / "alike", [0.995, 1.005, 1.0])
    ttft = {(r["load"], r["metric"]): r for r in compare_runs(a, faster)}[(1, "TTFT avg")]
    assert ttft["change_pct"] == pytest.approx(-5.0) and ttft["verdict"] == "better"
    assert "95% CI" in ttft["noise"] and "3+3 repeats" in ttft["noise"]
    ttft = {(r["load"], r["metric"]): r for r in compare_runs(a, alike)}[(1, "TTFT avg")]
    assert ttft["verdict"] == "within noise" and "95% CI" in ttft["noise"]


def test_cli_compare_prints_the_table(tmp_path):
    a = write_run(tmp_path / "a", fake_run(1.0))
    b = write_run(tmp_path / "b", fake_run(2.0))
    p = subprocess.run([TRTPIPE, "bench", "compare", str(a), str(b)], capture_output=True, text=True, timeout=60,
                       env={"COLUMNS": "200", "PATH": str(Path(sys.executable).parent)})
    assert p.returncode == 0, p.stderr
    assert "TTFT avg" in p.stdout and "worse" in p.stdout and "+100.0" in p.stdout


def test_cli_unreachable_server_is_one_line_and_exit_2(tmp_path):
    from support import free_port

    url = f"127.0.0.1:{free_port()}"
    p = subprocess.run([TRTPIPE, "bench", "--url", url, "--model", "tensorrt_llm", "--isl", "10", "--osl", "10",
                        "--out", str(tmp_path / "run")], capture_output=True, text=True, timeout=60, cwd=tmp_path)
    assert p.returncode == 2
    lines = [ln for ln in p.stderr.splitlines() if ln.strip()]
    assert len(lines) == 1 and "not reachable" in lines[0] and url in lines[0], p.stderr
    assert not (tmp_path / "run").exists()  # nothing measured, nothing written


@pytest.mark.parametrize("args, message", [
    (["--isl", "10"], "--isl and --osl go together"),
    (["--scenario", "10x20"], "expected ISL:OSL"),
    (["--concurrency", "1,0"], "values must be >= 1"),
    (["--goodput", "latency:3"], "unknown SLO"),
    (["--concurrency", "1", "--request-rate", "2"], "exclude each other"),
])
def test_cli_flag_mistakes_exit_2(args, message, tmp_path):
    p = subprocess.run([TRTPIPE, "bench", "--url", "127.0.0.1:1", *args], capture_output=True, text=True, timeout=60,
                       cwd=tmp_path)
    assert p.returncode == 2 and message in p.stderr, p.stderr


def test_find_tokenizer_reads_the_llmapi_model_yaml(tmp_path):
    import yaml

    from pipeline.core.layout import BuildLayout
    from pipeline.triton_repo import client_tokenizer_dir

    def find_tokenizer(build):
        return client_tokenizer_dir(BuildLayout(build))

    build, tok = tmp_path / "build", tmp_path / "ckpt"
    tok.mkdir()
    (tok / "tokenizer.json").write_text("{}")
    version = build / "triton_repo" / "tensorrt_llm" / "1"
    version.mkdir(parents=True)
    (version / "model.yaml").write_text(yaml.safe_dump({"model": "/nonexistent", "tokenizer": str(tok), "backend": "pytorch"}))
    assert find_tokenizer(build) == tok
    (build / "quantize" / "hf_ckpt").mkdir(parents=True)
    (version / "model.yaml").write_text(yaml.safe_dump({"model": "/nonexistent"}))
    assert find_tokenizer(build) is None
    (build / "quantize" / "hf_ckpt" / "tokenizer_config.json").write_text("{}")
    assert find_tokenizer(build) == build / "quantize" / "hf_ckpt"
