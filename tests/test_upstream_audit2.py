"""The second upstream audit's fixes (issue #45 item 3; shared/reference/upstream-audit-2-2026-11-28.md rows 23, 27,
31): CUDA-graph sizes TensorRT-LLM would drop are refused by recipe validation, the trtllm-serve options YAML keeps
trtllm-serve's own ``dynamic_batch_config``, and ``trtpipe serve`` waits for readiness as long as the serving path
and the model's size need.
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from pipeline.core.errors import RecipeError
from pipeline.recipe import load_recipe

REPO = Path(__file__).resolve().parents[1]
TRTPIPE = str(Path(sys.executable).parent / "trtpipe")
PYTORCH = REPO / "recipes" / "llama31_8b_h200_fp8_pytorch.yaml"
EAGLE3 = REPO / "recipes" / "llama31_8b_h200_fp8_eagle3.yaml"


# ---------------------------------------------------------------- row 31: CUDA-graph sizes above the largest batch
@pytest.mark.parametrize(("recipe", "overrides", "field", "numbers"), [
    # the published 1 … 8192 list on a recipe whose max_batch_size is 2048 (the shipped recipe before the audit)
    (PYTORCH, ["build.pytorch.cuda_graph_config.batch_sizes=[1,2,4,8,16,32,64,128,256,512,1024,2048,4096,8192]"],
     "build.pytorch.cuda_graph_config.batch_sizes", ("4096, 8192", "build.max_batch_size 2048")),
    (PYTORCH, ["build.max_batch_size=256"], "build.pytorch.cuda_graph_config.batch_sizes",
     ("512, 1024, 2048", "build.max_batch_size 256")),
    # the token budget bounds a pure-decode batch too: max_num_tokens / (1 + draft tokens per step)
    (EAGLE3, ["build.max_num_tokens=1536"], "build.pytorch.cuda_graph_config.max_batch_size",
     ("512", "build.max_num_tokens 1536 / (1 + 3 draft tokens) = 384")),
])
def test_cuda_graph_sizes_above_the_largest_decode_batch_are_refused(recipe, overrides, field, numbers):
    with pytest.raises(RecipeError) as err:
        load_recipe(recipe, overrides)
    line = str(err.value)
    assert "\n" not in line and f" {field}: " in line, line
    for number in numbers:
        assert number in line, line


def test_the_refusal_is_one_line_exit_2_from_the_cli(tmp_path):
    res = subprocess.run([TRTPIPE, "recipe", "validate", str(PYTORCH), "--set", "build.max_batch_size=1024"],
                         cwd=tmp_path, capture_output=True, text=True, timeout=120, check=False)
    err = [ln for ln in res.stderr.splitlines() if ln.strip()]
    assert res.returncode == 2 and len(err) == 1, res.stdout + res.stderr
    assert "build.pytorch.cuda_graph_config.batch_sizes" in err[0] and "2048" in err[0] and "1024" in err[0]
    assert list(tmp_path.iterdir()) == []


def test_upstream_default_graph_sizes_and_sizes_at_the_ceiling_stay_valid():
    shipped = load_recipe(PYTORCH)  # ends its list at its max_batch_size
    assert max(shipped.build.pytorch.cuda_graph_config.batch_sizes) == shipped.build.max_batch_size
    # no sizes given: upstream's default (128) over a smaller max_batch_size is upstream's rule, not the recipe's
    small = load_recipe(PYTORCH, ["build.pytorch.cuda_graph_config.batch_sizes=null", "build.max_batch_size=64"])
    assert small.build.pytorch.cuda_graph_config.max_batch_size == 0


def _dry_run_build(recipe: Path, out: Path, *overrides: str) -> Path:
    sets = [a for o in overrides for a in ("--set", o)]
    res = subprocess.run([TRTPIPE, "build", str(recipe), "--dry-run", "--out", str(out), *sets], cwd=out.parent,
                         capture_output=True, text=True, timeout=300, check=False)
    assert res.returncode == 0, res.stdout[-2000:] + res.stderr[-2000:]
    return out


# ---------------------------------------------------------------- row 23: trtllm-serve's own dynamic_batch_config
#: trtllm-serve's default scheduler (get_llm_args, tensorrt_llm/commands/serve.py@c292b9f997d6:121-128)
UPSTREAM_DYNAMIC_BATCH = {"enable_batch_size_tuning": True, "enable_max_num_tokens_tuning": False,
                          "dynamic_batch_moving_average_window": 128}


@pytest.mark.parametrize("policy", ["GUARANTEED_NO_EVICT", "MAX_UTILIZATION"])
def test_the_trtllm_serve_options_keep_trtllm_serves_dynamic_batch_config(tmp_path, policy):
    import yaml

    from pipeline.trtllm.llmapi import check_kwargs

    out = _dry_run_build(PYTORCH, tmp_path / "b", "serving.frontend=trtllm-serve",
                         f"build.scheduler_config.capacity_scheduler_policy={policy}")
    options = yaml.safe_load((out / "engine" / "trtllm_serve_options.yaml").read_text())
    sched = options["scheduler_config"]
    assert sched["dynamic_batch_config"] == UPSTREAM_DYNAMIC_BATCH  # a YAML scheduler_config replaces serve's whole
    assert sched["capacity_scheduler_policy"] == policy            # the recipe's field still wins
    kwargs = yaml.safe_load((out / "engine" / "llm_api_config.yaml").read_text())
    assert check_kwargs({**kwargs, **options}) == []  # what trtllm-serve builds LLM() from holds the 1.2.1 contract


# ---------------------------------------------------------------- row 27: the readiness wait by path and size
#: upstream's own wait for trtllm-serve's /health (tests/unittest/llmapi/apps/openai_server.py@0c1ee82a446c:17)
UPSTREAM_SERVE_WAIT_S = 600


@pytest.mark.parametrize(("recipe", "overrides"), [
    (PYTORCH, ["serving.frontend=trtllm-serve"]),                      # trtllm-serve
    (PYTORCH, []),                                                       # Triton llmapi model
    (REPO / "recipes" / "llama33_70b_h100_fp8_tp2.yaml", []),            # TensorRT engine, TP2 under mpirun
])
def test_a_gpu_build_waits_at_least_as_long_as_upstreams_harness(tmp_path, recipe, overrides):
    from pipeline.serve.compat import ServeTarget
    from pipeline.serve.readiness import default_ready_timeout_s

    out = _dry_run_build(recipe, tmp_path / "b", *overrides)
    wait_s, why = default_ready_timeout_s(ServeTarget.resolve(out))
    assert wait_s >= UPSTREAM_SERVE_WAIT_S and why.startswith("GPU build"), (wait_s, why)


def test_serve_starts_trtllm_serve_with_the_rule_and_timeout_overrides_it(tmp_path):
    """`trtpipe serve` on a GPU trtllm-serve build, with a stand-in `trtllm-serve` on PATH that exits at once: the
    start line states the wait it would have given /health (the rule without --timeout, the flag's value with it)."""
    import os

    out = _dry_run_build(PYTORCH, tmp_path / "b", "serving.frontend=trtllm-serve")
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    fake = bin_dir / "trtllm-serve"
    fake.write_text("#!/bin/sh\nexit 7\n")
    fake.chmod(0o755)
    env = {**os.environ, "PATH": f"{bin_dir}{os.pathsep}{os.environ['PATH']}", "COLUMNS": "300"}
    for extra, wait in (([], f"ready wait ≤ {UPSTREAM_SERVE_WAIT_S} s"), (["--timeout", "42"], "ready wait ≤ 42 s")):
        res = subprocess.run([TRTPIPE, "serve", str(out), "--http-port", "0", *extra], cwd=tmp_path,
                             capture_output=True, text=True, timeout=120, env=env, check=False)
        assert res.returncode != 0 and wait in res.stdout, res.stdout + res.stderr
        assert "exited" in res.stderr and "\n" not in res.stderr.strip(), res.stderr


def test_a_cpu_build_waits_the_cpu_floor_plus_its_weights(cpu_build):
    from pipeline.serve.compat import ServeTarget
    from pipeline.serve.readiness import (
        CPU_FLOOR_S,
        SECONDS_PER_GIB,
        default_ready_timeout_s,
    )

    wait_s, why = default_ready_timeout_s(ServeTarget.resolve(cpu_build))
    weights = sum(p.stat().st_size for p in (cpu_build / "engine").glob("*.safetensors"))
    assert weights > 0 and why.startswith("CPU build")
    assert wait_s >= CPU_FLOOR_S + weights / 2**30 * SECONDS_PER_GIB - 1  # the weights the server reads add to the floor


# ---------------------------------------------------------------- rows 11, 19, 45: stale citations and docs sentences
def test_the_lora_request_table_is_the_1x_class():
    """Row 11: the cited ``LoRARequest`` is the 1.x class, which has ``lora_ckpt_source`` (default hf, the only source
    the llmapi model accepts); the 0.x copy cited before had no such field."""
    from pipeline.trtllm.llmapi import llmapi_contract

    table = llmapi_contract()["lora_request"]
    assert table["lora_ckpt_source"]["default"] == "hf" and set(table["lora_ckpt_source"]["values"]) == {"hf", "nemo"}


def test_engine_paths_doc_agrees_with_the_release_matrix_and_the_llmapi_template():
    """Rows 19 and 45: docs/engine-paths.md does not call the declared LoRA inputs 'not carried over', and dates the end
    of the TensorRT path as the release matrix does (after 1.3.0rc20, not '≥ 1.3')."""
    import re

    from pipeline.core.engine_paths import tensorrt_engine_last

    text = (REPO / "docs" / "engine-paths.md").read_text()
    future = next(ln for ln in text.splitlines() if ln.startswith("| Future |"))
    assert f"after {tensorrt_engine_last()}" in future.split("|")[3] and "≥ 1.3" not in future
    template = (REPO / "pipeline" / "triton_repo" / "templates" / "llmapi_tensorrt_llm.pbtxt.j2").read_text()
    lora_inputs = re.findall(r'name: "(lora_[a-z_]+)"', template)
    assert len(lora_inputs) == 4
    start = text.index("Not carried over from upstream")
    not_carried = text[start:text.index(". ", start)]
    assert "LoRA" not in not_carried and not any(name in not_carried for name in lora_inputs), not_carried
