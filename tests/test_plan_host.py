"""``trtpipe plan measure-host`` and the host file the planner predicts the cpu target from: the user's measured
host (``$TRTPIPE_HOST_FILE`` / the trtpipe cache) when present, else the shipped reference host."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import yaml
from typer.testing import CliRunner

from pipeline.calibrate import host as host_mod
from pipeline.cli import app
from pipeline.core import hardware
from pipeline.core.errors import UserError
from pipeline.plan import plan_recipe
from pipeline.plan.step import Efficiency, StepMix, step_time
from pipeline.recipe import load_recipe

REPO = Path(__file__).resolve().parents[1]
CPU = REPO / "recipes" / "smollm2_135m_cpu_fp8.yaml"
runner = CliRunner()


def _fake_host() -> hardware.HostSpec:
    shipped = hardware.cpu_host()
    return shipped.model_copy(update={"name": "testhost: fake CPU, 3 cores", "read_bandwidth_gbs": 7.0, "fp32_gflops": 50.0,
                                      "origin": ""})


def test_without_a_measurement_the_shipped_reference_host_is_used():
    assert not hardware.host_file().exists()  # tests/conftest.py points TRTPIPE_HOST_FILE at a missing file
    host = hardware.cpu_host()
    assert host.name.startswith("vm:") and "shipped reference" in host.origin and "measure-host" in host.origin
    plan = plan_recipe(load_recipe(CPU), scenarios=[(100, 200)])
    assert any("shipped reference host" in n for n in plan.notes)


def test_measure_host_writes_the_user_file_and_the_planner_uses_it(tmp_path, monkeypatch):
    path = tmp_path / "cache" / "cpu_host.yaml"
    monkeypatch.setenv("TRTPIPE_HOST_FILE", str(path))
    monkeypatch.setattr(host_mod, "measure", lambda log=print, served=True: _fake_host())
    res = runner.invoke(app, ["plan", "measure-host", "--dry-run"])
    assert res.exit_code == 0, res.output
    assert yaml.safe_load(res.stdout)["name"] == "testhost: fake CPU, 3 cores" and not path.exists()
    res = runner.invoke(app, ["plan", "measure-host"])
    assert res.exit_code == 0, res.output
    assert str(path) in res.stdout and path.is_file()
    doc = yaml.safe_load(path.read_text())
    assert "origin" not in doc and doc["read_bandwidth_gbs"] == 7.0
    host = hardware.cpu_host()
    assert host.name == "testhost: fake CPU, 3 cores" and str(path) in host.origin
    plan = plan_recipe(load_recipe(CPU), scenarios=[(100, 200)])
    assert plan.step_cost.bandwidth == 7.0e9 and any("this host's measured rates" in n for n in plan.notes)
    res = runner.invoke(app, ["plan", str(CPU), "--json", "--isl", "100", "--osl", "200"])
    assert res.exit_code == 0, res.output
    assert json.loads(res.stdout)["step_cost"]["bandwidth"] == 7.0e9
    # --out writes elsewhere; the planner keeps reading TRTPIPE_HOST_FILE
    other = tmp_path / "other.yaml"
    assert runner.invoke(app, ["plan", "measure-host", "--out", str(other)]).exit_code == 0 and other.is_file()


def test_a_broken_user_host_file_is_a_user_error(tmp_path, monkeypatch):
    path = tmp_path / "cpu_host.yaml"
    path.write_text("name: only a name\n")
    monkeypatch.setenv("TRTPIPE_HOST_FILE", str(path))
    with pytest.raises(UserError, match="not a host measurement.*measure-host"):
        hardware.cpu_host()
    res = runner.invoke(app, ["plan", str(CPU)])
    assert res.exit_code == 2 and "not a host measurement" in res.stderr


def test_a_host_file_without_the_served_measurement_says_so(tmp_path, monkeypatch):
    """A file written before measure-host served its probe (or with --no-served): the bare engine's prediction, named
    in the plan's notes with the way out."""
    path = tmp_path / "cpu_host.yaml"
    hardware.write_host(_fake_host().model_copy(update={"serving_cpu_per_token_us": None}), path)
    monkeypatch.setenv("TRTPIPE_HOST_FILE", str(path))
    plan = plan_recipe(load_recipe(CPU), scenarios=[(100, 200)])
    assert any("without the served deployment's CPU per token" in n and "rerun `trtpipe plan measure-host`" in n
               for n in plan.notes), plan.notes
    hardware.write_host(_fake_host().model_copy(update={"serving_cpu_per_token_us": 5000.0}), path)
    assert not any("without the served" in n for n in plan_recipe(load_recipe(CPU), scenarios=[(100, 200)]).notes)
    path.write_text("- a list\n")
    with pytest.raises(UserError, match="not a host measurement"):
        hardware.cpu_host()


def test_host_file_defaults_to_the_trtpipe_cache(tmp_path, monkeypatch):
    monkeypatch.delenv("TRTPIPE_HOST_FILE")
    monkeypatch.setenv("TRTPIPE_CACHE_DIR", str(tmp_path))
    assert hardware.host_file() == tmp_path / "cpu_host.yaml"


def test_plan_recipe_and_measure_host_share_the_plan_command():
    """``trtpipe plan measure-host`` is a sub-command; ``trtpipe plan RECIPE`` and ``plan --help`` are unchanged."""
    res = runner.invoke(app, ["plan", "measure-host", "--help"])
    assert res.exit_code == 0 and "Usage: trtpipe plan measure-host" in res.stdout
    res = runner.invoke(app, ["plan", "--help"])
    assert res.exit_code == 0 and "Usage: trtpipe plan [OPTIONS] [RECIPE]" in res.stdout and "--against" in res.stdout
    res = runner.invoke(app, ["plan"])
    assert res.exit_code == 2 and "missing RECIPE" in res.stderr


def test_engine_overheads_recover_a_known_line():
    """Step times = the probe model's modelled cost + 0.4 ms + n × 150 µs → the fit returns 0.4 ms and 150 µs."""
    geo = host_mod.tiny_geometry()
    bw, flops = 20e9, 100e9
    cost = _probe_cost(geo, bw, flops)
    zero = Efficiency(bw_frac=1, gemm_frac=1, attn_frac=1, seq_overhead_us=0, step_overhead_ms=0, rel_error=0)
    ctx = host_mod.ISL + host_mod.OSL / 2
    measured = {n: step_time(cost, zero, StepMix(n_seqs=n, n_tokens=n, n_logits=n, kv_read_tokens=n * ctx)).total_s
                + 0.4e-3 + n * 150e-6 for n in host_mod.CONCURRENCIES}
    step_ms, seq_us = host_mod.engine_overheads(measured, geo, bw, flops)
    assert step_ms == pytest.approx(0.4, rel=1e-6) and seq_us == pytest.approx(150.0, rel=1e-6)
    # never negative: a step time below the model's clips at 0
    assert host_mod.engine_overheads({n: 0.0 for n in host_mod.CONCURRENCIES}, geo, bw, flops) == (0.0, 0.0)


def _probe_cost(geo, bw, flops):
    """The probe model's StepCost in float32, written out from the geometry (KV bytes: the one rule)."""
    from pipeline.plan.step import StepCost, activation_traffic_bytes

    h, L, V = geo.hidden_size, geo.num_hidden_layers, geo.vocab_size
    lin = L * (4 * h * h + 3 * h * geo.intermediate_size)
    assert geo.kv_bytes_per_token(4) == 2 * L * 1 * 64 * 4
    return StepCost(weight_bytes=(lin + V * h) * 4, kv_token_bytes=geo.kv_bytes_per_token(4), linear_flops_per_token=2 * lin,
                    head_flops_per_token=2 * V * h, attn_flops_coeff=2 * L * h,
                    act_bytes_per_token=activation_traffic_bytes(h, 1, 1, h, geo.intermediate_size, L, 4),
                    logit_bytes_per_token=2 * V * 4, bandwidth=bw, gemm_flops=flops, attn_flops=flops)


@pytest.mark.slow
@pytest.mark.serial  # measures the host (and counts its tritonservers): alone on it
def test_measure_host_for_real(tmp_path, monkeypatch):
    """The real measurement (about two minutes on 2 cores): every rate positive, the overheads non-negative, the served
    probe (a real build, Triton and bench) costs CPU per token and leaves no server behind."""
    import psutil

    monkeypatch.setenv("TRTPIPE_HOST_FILE", str(tmp_path / "cpu_host.yaml"))
    before = {p.pid for p in psutil.process_iter(["name"]) if p.info["name"] == "tritonserver"}
    res = runner.invoke(app, ["plan", "measure-host"])
    assert res.exit_code == 0, res.output
    host = hardware.cpu_host()
    assert host.read_bandwidth_gbs > 0 and host.fp32_gflops > 0 and host.engine_step_overhead_ms >= 0
    assert host.engine_seq_overhead_us >= 0 and "measure-host" in host.measured
    assert host.serving_cpu_per_token_us is not None and host.serving_cpu_per_token_us > 0
    assert "streamed tokens" in host.sources["serving_cpu_per_token_us"]
    after = {p.pid for p in psutil.process_iter(["name"]) if p.info["name"] == "tritonserver"}
    assert after <= before
