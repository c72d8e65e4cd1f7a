"""Device telemetry per load point (#49 item 1): the host view of a real process tree, NVML's absence as one note,
the per-device mean/peak block, and where it goes (CSV columns, AIPerf's GPU-telemetry names, tune's MLflow metrics)."""

from __future__ import annotations

import subprocess
import sys

import pytest

from pipeline.bench import aiperf_export, telemetry
from pipeline.tune.analysis import load_points

BUSY = "import time\nx = bytearray(64 << 20)\nt = time.process_time()\nwhile time.process_time() - t < 30: pass\n"


@pytest.fixture
def busy_tree():
    """A parent that sleeps with one child that spins on a core and holds 64 MiB: a server-like process tree."""
    code = f"import subprocess, sys, time\np = subprocess.Popen([sys.executable, '-c', {BUSY!r}])\ntime.sleep(60)\n"
    parent = subprocess.Popen([sys.executable, "-c", code])
    try:
        yield parent.pid
    finally:
        import psutil

        for c in psutil.Process(parent.pid).children(recursive=True):
            c.kill()
        parent.kill()
        parent.wait()


def test_process_tree_cpu_and_rss_are_measured(busy_tree):
    import psutil

    while not psutil.Process(busy_tree).children():  # the spinning child has started
        pass
    probe = telemetry.open_probe(busy_tree, interval_s=0.2)
    assert probe.source == "process" and probe.devices == [f"server process tree (pid {busy_tree})"]
    assert "NVML unavailable" in probe.note and f"pid {busy_tree}" in probe.note  # no NVML on this host: one line
    sampler = telemetry.Sampler(probe).start()
    while len(sampler.rows) < 5:
        sampler._stop.wait(0.1)
    block = sampler.stop()
    m = block["devices"][0]["metrics"]
    # the child's 64 MiB bytearray is in the tree's RSS; its spinning shows as CPU time (not zeros)
    assert m["rss"]["peak"] > 64 and m["rss"]["unit"] == "mib"
    assert m["cpu_util"]["peak"] > 5 and m["cpu_util"]["mean"] <= m["cpu_util"]["peak"]
    assert block["samples"] == len(sampler.rows) >= 6 and block["overall"]["rss"] == {"mean": m["rss"]["mean"], "peak": m["rss"]["peak"]}
    row = telemetry.csv_values(block)
    assert row["telemetry_source"] == "process" and row["rss_mib_peak"] == m["rss"]["peak"] and row["gpu_util_pct_mean"] is None
    assert aiperf_export.gpu_telemetry(block) == {}  # the process view has no place in AIPerf's GPU telemetry


def test_no_server_process_is_host_view():
    probe = telemetry.open_probe(None, "203.0.113.9:8001")  # a remote server: no pid on this host
    assert probe.source == "host" and "server process not found" in probe.note
    block = telemetry.Sampler(probe).start().stop()
    assert set(block["overall"]) == {"host_cpu_util"} and block["samples"] >= 1


class _TwoGpus:
    """Rows as :class:`telemetry._Nvml` reads them, for two GPUs (the second on MIG: no utilisation)."""

    def __init__(self):
        self.rows = iter([[{"gpu_util": 40.0, "fb_used": 1000.0, "power_usage": 300.0}, {"fb_used": 2000.0}],
                          [{"gpu_util": 80.0, "fb_used": 3000.0, "power_usage": 500.0}, {"fb_used": 2000.0}]])

    def sample(self):
        return next(self.rows)


def test_nvml_block_per_device_and_overall():
    probe = telemetry.Probe("nvml", ["NVIDIA H200 NVL", "NVIDIA H200 NVL"], _TwoGpus(), "device telemetry: NVML")
    rows = [probe.reader.sample(), probe.reader.sample()]
    block = telemetry.summarize(probe, rows, 1.0)
    d0, d1 = (d["metrics"] for d in block["devices"])
    assert d0["gpu_util"] == {"mean": 60.0, "peak": 80.0, "unit": "pct"} and "gpu_util" not in d1
    assert block["overall"]["fb_used"] == {"mean": (2000.0 + 2000.0) / 2, "peak": 3000.0}
    # AIPerf's names (aiperf/gpu_telemetry/constants.py): memory in GB (MiB × 1.048576e-3), power in W
    g = aiperf_export.gpu_telemetry(block)["gpu_telemetry"]
    assert g["gpu_power_usage"] == {"unit": "W", "avg": 400.0, "max": 500.0}
    assert g["gpu_memory_used"]["max"] == pytest.approx(3000 * 1.048576e-3)
    # tune: the point's MLflow metrics carry the telemetry beside the bench metrics
    doc = {"load_points": [{"scenario": "8:4", "load": "c1", "concurrency": 1, "telemetry": block,
                            "summary": {"metrics": {"output_token_throughput": 10.0}}}]}
    m = load_points(doc, gpus=2)[0]["metrics"]
    assert m["telemetry.gpu_util.peak"] == 80.0 and m["telemetry.power_usage.mean"] == 400.0
