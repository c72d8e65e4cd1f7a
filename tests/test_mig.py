"""MIG slices (#49 item 4): the catalog's profiles, ``target.mig`` on a GPU, the planner sizing against the slice,
``deploy k8s`` requesting ``nvidia.com/mig-<profile>``, and a profile the GPU does not have as one line."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from pipeline.core import hardware
from pipeline.plan.planner import plan_recipe
from pipeline.recipe.load import load_recipe

REPO = Path(__file__).resolve().parents[1]
MIG = REPO / "recipes" / "llama31_8b_h200nvl_mig3g_fp8.yaml"
FULL = REPO / "recipes" / "llama31_8b_h200_fp8.yaml"


def test_catalog_profiles_follow_the_user_guide_slices():
    for key in ("a100_40gb", "a100_80gb", "h100_sxm", "h100_pcie", "h200"):
        gpu = hardware.catalog()[key]
        assert len(gpu.mig) == 7
        for name, p in gpu.mig.items():
            g, gb = name.split("+")[0].split(".")
            assert int(g.rstrip("g")) == p.compute_slices  # "3g.71gb": 3 compute slices of 7
            # each profile's memory is its memory slices' share of the GPU (nominal sizes, within 5 %)
            assert p.memory_mib == pytest.approx(gpu.memory_mib * p.memory_share, rel=0.05), (key, name)
            assert int(gb.removesuffix("gb")) == pytest.approx(gpu.memory_gb * p.memory_share, rel=0.1), (key, name)
    assert hardware.lookup("h200_nvl").mig["3g.71gb"].count == 2 and not hardware.catalog()["l40s"].mig


def test_slice_scales_memory_bandwidth_and_compute():
    h200 = hardware.lookup("h200_nvl")
    s = hardware.mig_slice(h200, "3g.71gb")
    assert s.memory_mib == 72704 and s.memory_bandwidth_tbs == h200.memory_bandwidth_tbs * 4 / 8
    assert s.fp8_tflops == pytest.approx(h200.fp8_tflops * 3 / 7) and s.interconnect_gbs is None
    assert hardware.mig_slice(h200, "7g.141gb").memory_mib == h200.memory_mib  # never more than nvidia-smi's total
    assert hardware.mig_resource("3g.71gb") == "nvidia.com/mig-3g.71gb"
    assert hardware.mig_resource("1g.18gb+me") == "nvidia.com/mig-1g.18gb.me"


def test_planner_sizes_against_the_slice():
    mig, full = load_recipe(MIG), load_recipe(FULL)
    pm, pf = plan_recipe(mig, scenarios=[(2048, 2048)]), plan_recipe(full, scenarios=[(2048, 2048)])
    assert mig.gpu.mig_profile == "3g.71gb" and pm.memory.total_bytes == 72704 * hardware.MIB
    assert pm.memory.weights == pf.memory.weights  # same model, a smaller device: less KV
    assert pm.memory.kv_tokens < pf.memory.kv_tokens / 1.8


def _cli(*args: str, cwd: Path) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "pipeline.cli", *args], capture_output=True, text=True, cwd=cwd,
                          env={**os.environ, "PYTHONPATH": str(REPO)}, timeout=120, check=False)


def test_bad_profile_is_one_line(tmp_path):
    bad = tmp_path / "bad.yaml"
    bad.write_text(MIG.read_text().replace("mig: 3g.71gb", "mig: 3g.40gb"))
    p = _cli("recipe", "validate", str(bad), cwd=tmp_path)
    assert p.returncode == 2 and len(p.stderr.strip().splitlines()) == 1
    assert "target.mig: '3g.40gb' is not a MIG profile of h200_nvl" in p.stderr and "3g.71gb" in p.stderr


def test_deploy_requests_the_mig_resource(tmp_path):
    pytest.importorskip("kubernetes_validate")
    p = _cli("deploy", "k8s", str(MIG), "--out", str(tmp_path / "out"), cwd=tmp_path)
    assert p.returncode == 0, p.stderr
    dep = (tmp_path / "out" / "rendered" / "deployment.yaml").read_text()
    assert 'nvidia.com/mig-3g.71gb: "1"' in dep and "nvidia.com/gpu:" not in dep
    # the NVL card's nodes, not the SXM product's (GFD: the NVML name with spaces as dashes)
    assert "nvidia.com/gpu.product: NVIDIA-H200-NVL" in dep, dep


def test_product_name_follows_the_alias():
    assert hardware.product_name("h200_nvl") == "NVIDIA H200 NVL"
    assert hardware.product_name("H200-NVL") == "NVIDIA H200 NVL"
    assert hardware.product_name("h200") == hardware.product_name("h200_sxm") == "NVIDIA H200"
