"""``build`` is one type per ``build.engine`` (issue #45 item 1, as upstream splits ``TrtLlmArgs``/``TorchLlmArgs``):
a knob section of another engine is refused by type, one line naming the field, exit 2 from the CLI."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from pipeline.core.errors import RecipeError
from pipeline.recipe import CpuBuild, PytorchBuild, TensorrtBuild, load_recipe

REPO = Path(__file__).resolve().parents[1]
TRT = REPO / "recipes" / "llama31_8b_h200_fp8.yaml"
PYT = REPO / "recipes" / "llama31_8b_h200_fp8_pytorch.yaml"
CPU = REPO / "recipes" / "smollm2_135m_cpu_fp8.yaml"


@pytest.mark.parametrize("recipe_file, knob", [
    (TRT, "build.pytorch.disable_overlap_scheduler=true"),
    (TRT, "build.cpu.dtype=bfloat16"),
    (PYT, "build.plugins.gemm_plugin=auto"),
    (PYT, "build.workers=1"),
    (CPU, "build.pytorch.stream_interval=2"),
], ids=["pytorch-on-tensorrt", "cpu-on-tensorrt", "plugins-on-pytorch", "workers-on-pytorch", "pytorch-on-cpu"])
def test_cli_refuses_a_knob_of_another_engine_by_type(recipe_file, knob, tmp_path):
    field = knob.split("=")[0].split(".")[:2]
    res = subprocess.run([sys.executable, "-m", "pipeline.cli", "recipe", "validate", str(recipe_file), "--set", knob],
                         check=False, capture_output=True, text=True, cwd=tmp_path, timeout=120)
    out = (res.stdout + res.stderr).strip()
    assert res.returncode == 2 and "Traceback" not in out and len(out.splitlines()) == 1, out
    assert f" {'.'.join(field)}: " in out and "Class" not in out and "Build." not in out, out


def test_the_build_type_follows_the_engine():
    assert type(load_recipe(TRT).build) is TensorrtBuild
    assert type(load_recipe(PYT).build) is PytorchBuild
    assert type(load_recipe(CPU).build) is CpuBuild
    assert type(load_recipe(CPU, ["build.engine=pytorch", "bench.model=tensorrt_llm"]).build) is PytorchBuild


def test_an_engine_switch_of_the_tensorrt_recipe_is_refused_naming_the_field():
    with pytest.raises(RecipeError) as e:  # its bench.model first, as before the types
        load_recipe(TRT, ["build.engine=pytorch"])
    assert " bench.model: " in str(e.value)
    with pytest.raises(RecipeError) as e:  # then its trtllm-build knobs, by type
        load_recipe(TRT, ["build.engine=pytorch", "bench.model=tensorrt_llm"])
    assert " build.kv_cache_type: " in str(e.value) and "PyTorch LLM-API backend has no such setting" in str(e.value)
    with pytest.raises(RecipeError) as e:
        load_recipe(PYT, ["build.engine=tensorrt"])
    assert " build.pytorch: " in str(e.value)
