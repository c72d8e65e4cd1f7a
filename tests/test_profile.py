"""``trtpipe profile``: the Nsight Systems SQLite analysis on a schema-built fixture (tests/nsys_fixture.py — NOT a
real trace), the GPU command line (--dry-run; nsys missing = one line), and the CPU engine's step timeline."""

from __future__ import annotations

import json
import shlex
from pathlib import Path

import pytest
from typer.testing import CliRunner

from pipeline.cli import app
from pipeline.profile.nsys_sqlite import analyse, category
from tests import nsys_fixture

REPO = Path(__file__).resolve().parents[1]
WIDE = {"COLUMNS": "400"}
# device 0: a cuBLAS GEMM overlapping an attention kernel on another stream, then norm, sampling, all-gather, an
# unknown kernel and a copy; device 1: one long GEMM (the busiest device)
KERNELS = [(0, 100, 0, 7, "nvjet_tst_128x64_64x8_2x1_v_bz_TNN"), (50, 150, 0, 8, "fmhaSm100fKernel_QkvE4m3OBfloat16"),
           (200, 230, 0, 7, "tensorrt_llm::kernels::RMSNormKernel<__nv_bfloat16>"),
           (300, 310, 0, 7, "tensorrt_llm::kernels::topKPerRowDecode<1024>"),
           (310, 360, 0, 9, "ncclDevKernel_AllGather_RING_LL"), (400, 420, 0, 7, "my_custom_kernel"),
           (0, 1000, 1, 7, "nvjet_tst_256x128")]
MEMCPY = [(420, 450, 0)]


@pytest.fixture
def trace(tmp_path):
    return nsys_fixture.build(tmp_path / "trace.sqlite", KERNELS, MEMCPY)


def test_analysis_of_the_fixture(trace):
    r = analyse(trace, device=0)
    # busy = [0,150] ∪ [200,230] ∪ [300,360] ∪ [400,450] = 150 + 30 + 60 + 50 ns of a 450 ns window
    assert r["window_s"] == pytest.approx(450e-9) and r["busy_s"] == pytest.approx(290e-9)
    assert r["active_pct"] == pytest.approx(100 * 290 / 450)
    assert r["count"] == 6 and r["mean_ms"] == pytest.approx(310 / 6 / 1e6)
    g = r["gaps"]
    assert g["count"] == 3 and g["total_s"] == pytest.approx(160e-9) and g["max_ms"] == pytest.approx(70e-6)
    assert g["idle_pct"] == pytest.approx(100 * 160 / 450)
    cats = {c["name"]: c["time_s"] * 1e9 for c in r["categories"]}
    assert cats == pytest.approx({"gemm": 100, "attention": 100, "elementwise": 30, "sampling": 10,
                                  "communication": 50, "other": 20})
    assert {t["name"] for t in r["top"][:2]} == {KERNELS[0][4], KERNELS[1][4]}  # the two 100 ns kernels
    assert analyse(trace)["input"].endswith("(device 1)")  # default: the busiest device


def test_gap_union_matches_the_reference_toy(tmp_path):
    # reference/observability-and-mig.md §3.1: (0,10) (5,12) (20,25) (22,23) (30,40) → gap 13, busy 27
    iv = [(0, 10), (5, 12), (20, 25), (22, 23), (30, 40)]
    r = analyse(nsys_fixture.build(tmp_path / "t.sqlite", [(a, b, 0, 7, "k") for a, b in iv], short_names=True))
    assert r["busy_s"] == pytest.approx(27e-9) and r["gaps"]["total_s"] == pytest.approx(13e-9)


def test_categories_by_tensorrt_llm_kernel_names():
    assert category("cutlass::device_kernel<cutlass::gemm::kernel::GemmUniversal<...>>") == "gemm"
    assert category("tensorrt_llm::kernels::applyBiasRopeUpdateKVCacheV2<...>") == "attention"
    assert category("allreduce_fusion_kernel_oneshot_lamport<...>") == "communication"
    assert category("at::native::distribution_elementwise_grid_stride_kernel<...>") == "sampling"
    assert category("silu_and_mul_kernel") == "elementwise"
    assert category("some_new_kernel") == "other"


def test_cli_writes_table_json_and_plot(trace, tmp_path):
    out = tmp_path / "p"
    res = CliRunner().invoke(app, ["profile", "--sqlite", str(trace), "--device", "0", "--out", str(out)], env=WIDE)
    assert res.exit_code == 0, res.output
    assert "active %" in res.output and "communication" in res.output and "ncclDevKernel_AllGather" in res.output
    doc = json.loads((out / "profile.json").read_text())
    assert doc["source"] == "nsys-sqlite" and doc["count"] == 6
    assert (out / "profile.png").stat().st_size > 0


def test_not_a_cuda_trace_is_one_line(tmp_path):
    import sqlite3

    bad = tmp_path / "empty.sqlite"
    sqlite3.connect(bad).execute("CREATE TABLE StringIds (id INTEGER PRIMARY KEY, value TEXT NOT NULL)").connection.commit()
    res = CliRunner().invoke(app, ["profile", "--sqlite", str(bad), "--out", str(tmp_path / "o")], env=WIDE)
    assert res.exit_code == 2 and "CUPTI_ACTIVITY_KIND_KERNEL" in res.output
    assert len(res.output.strip().splitlines()) == 1 and not (tmp_path / "o").exists()


def _gpu_build(tmp_path: Path) -> Path:
    out = tmp_path / "build"
    res = CliRunner().invoke(app, ["build", str(REPO / "recipes/llama31_8b_h200_fp8.yaml"), "--dry-run", "--out", str(out)],
                             env=WIDE)
    assert res.exit_code == 0, res.output
    return out


def test_gpu_dry_run_prints_the_nsys_capture_range(tmp_path):
    build = _gpu_build(tmp_path)
    res = CliRunner().invoke(app, ["profile", str(build), "--dry-run", "--osl", "50", "--warmup", "2",
                                   "--out", str(tmp_path / "p")], env=WIDE)
    assert res.exit_code == 0, res.output
    lines = [ln for ln in res.output.splitlines() if ln and not ln.startswith("#")]
    env, _, rest = lines[0].partition(" ")
    argv = shlex.split(rest.split(" &")[0])
    assert env == "TLLM_PROFILE_START_STOP=102-202"  # after 2 warmups × 50 iterations; half of (16 / 4) × 50 measured
    assert argv[:2] == ["nsys", "profile"] and argv[argv.index("-c") + 1] == "cudaProfilerApi"
    assert "--capture-range-end=stop" in argv and argv[argv.index("--cuda-graph-trace") + 1] == "node"
    assert argv[argv.index("-e") + 1] == "TLLM_PROFILE_START_STOP=102-202" and any(a.endswith("tritonserver") for a in argv)
    assert "bench" in lines[1] and "--scenario 100:50" in lines[1]
    assert shlex.split(lines[2])[:4] == ["nsys", "export", "--type", "sqlite"]


def test_gpu_run_without_nsys_is_one_line(tmp_path, monkeypatch):
    build = _gpu_build(tmp_path)
    monkeypatch.setenv("PATH", "/nonexistent")
    res = CliRunner().invoke(app, ["profile", str(build), "--out", str(tmp_path / "p")], env=WIDE)
    assert res.exit_code == 2 and "nsys not on PATH" in res.output and len(res.output.strip().splitlines()) == 1


def test_step_timeline_kinds_gaps_and_gauges():
    from pipeline.cpu_runtime.timeline import STEP_GAUGES, StepTimeline
    from pipeline.profile.cpu import parse_deltas

    t = StepTimeline()
    t.record(0.0, 0.001, 0.009, 0.010, 32, 0, True)     # prefill only; a sequence stays in its slot
    t.record(0.0104, 0.011, 0.014, 0.015, 0, 1, True)  # decode; 0.4 ms gap with work
    t.record(0.0165, 0.017, 0.019, 0.020, 16, 1, False)  # prefill + decode; 1.5 ms gap with work; then empty
    t.record(1.020, 1.020, 1.025, 1.030, 0, 1, False)  # after 1 s without work: a wait, not a gap
    st = t.stats()
    assert st["steps"] == {"context": 1, "generation": 2, "mixed": 1}
    assert st["seconds"]["generation"] == pytest.approx(0.0046 + 0.010)
    assert st["gaps"]["gap"]["count"] == 2 and st["gaps"]["gap"]["seconds"] == pytest.approx(0.0019)
    assert st["gaps"]["wait"] == {"count": 1, "seconds": pytest.approx(1.0)}
    assert st["tokens"] == {"context": 48, "generation": 3}
    assert st["gapBucketsMs"]["0.1"] == 0 and st["gapBucketsMs"]["0.5"] == 1 and st["gapBucketsMs"]["2"] == 2
    # the served model's gauges read the same numbers, and the profile parses them back
    gauges = {f"{name}{{model=m,{label}={v}}}": read({"stepStats": st})
              for name, (label, values) in STEP_GAUGES.items() for v, read in values.items()}
    d = parse_deltas(gauges)
    assert d[("count", "mixed")] == 1 and d[("seconds", "wait")] == pytest.approx(1.0) and d[("gap_bucket", "+Inf")] == 2
