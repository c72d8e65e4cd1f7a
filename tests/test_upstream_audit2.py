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
