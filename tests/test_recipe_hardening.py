"""Hostile and absurd recipes: refused with bounded work (a budget of executed Python lines, not a clock), with one
line naming the file/field, exit 2, nothing written (`trtpipe recipe validate` writes nothing at all)."""

from __future__ import annotations

import contextlib
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

from pipeline.core.errors import RecipeError
from pipeline.recipe import load_recipe

REPO = Path(__file__).resolve().parents[1]
TRTPIPE = str(Path(sys.executable).parent / "trtpipe")
CPU = REPO / "recipes" / "smollm2_135m_cpu_fp8.yaml"
GPU = REPO / "recipes" / "llama31_8b_h200_fp8.yaml"

LAUGHS = "\n".join(
    ['a0: &a0 ["lol","lol","lol","lol","lol","lol","lol","lol","lol"]']
    + [f"a{i}: &a{i} [{','.join([f'*a{i - 1}'] * 9)}]" for i in range(1, 10)]
) + "\n"


#: Python lines a refusal may execute: loading the shipped CPU recipe runs ~125,000, refusing a hostile YAML ~2,000
#: to ~31,000 (40 levels of nesting); expanding a billion laughs would run billions
HOSTILE_LINES = 100_000
ABSURD_LINES = 1_000_000


class _BudgetSpent(BaseException):
    """Raised inside the traced code (a BaseException: no ``except Exception`` there swallows it)."""


@contextlib.contextmanager
def line_budget(limit: int) -> Iterator[None]:
    """Bounded work without a clock: count the Python lines the calls in the block execute (``sys.settrace``) and
    stop them past ``limit`` (the test fails there, instead of hanging on a pathological input)."""
    count = 0

    def local(frame, event, arg):  # noqa: ANN001, ANN202 - sys.settrace's protocol
        nonlocal count
        if event == "line":
            count += 1
            if count > limit:
                raise _BudgetSpent  # an error in a trace function also unsets it
        return local

    previous = sys.gettrace()
    sys.settrace(lambda frame, event, arg: local)
    try:
        yield
    except _BudgetSpent:
        raise AssertionError(f"more than {limit:,} Python lines executed: the work is not bounded") from None
    finally:
        sys.settrace(previous)


def _validate(tmp_path: Path, text: str) -> subprocess.CompletedProcess:
    path = tmp_path / "r.yaml"
    path.write_text(text)
    return subprocess.run([TRTPIPE, "recipe", "validate", str(path)], cwd=tmp_path, capture_output=True, text=True, timeout=60)


def test_billion_laughs_is_refused_at_once(tmp_path: Path):
    assert len(LAUGHS) < 1500
    res = _validate(tmp_path, LAUGHS)
    assert res.returncode == 2
    assert "r.yaml:1: YAML anchor '&a0' refused" in res.stderr and "Traceback" not in res.stderr
    assert len(res.stderr.strip().splitlines()) == 1
    assert sorted(p.name for p in tmp_path.iterdir()) == ["r.yaml"]  # nothing written
    with line_budget(HOSTILE_LINES), pytest.raises(RecipeError, match="anchor '&a0' refused"):  # the same load, counted
        load_recipe(tmp_path / "r.yaml")


@pytest.mark.parametrize("text,message", [
    ("model: &m {source: x}\ntarget: {gpu: cpu}\n", "anchor '&m' refused"),
    ("model:\n  source: x\nmodel:\n  source: y\n", ":3: duplicate key 'model' refused"),
    ("a:" + " [" * 40 + "]" * 40 + "\n", "nesting deeper than"),
    ("description: '" + "x" * 300_000 + "'\n", "larger than 256 KiB refused"),
])
def test_hostile_yaml_is_one_line(tmp_path: Path, text: str, message: str):
    path = tmp_path / "r.yaml"
    path.write_text(text)
    with line_budget(HOSTILE_LINES), pytest.raises(RecipeError, match=message.replace("[", r"\[").replace("(", r"\(")) as e:
        load_recipe(path)
    assert "\n" not in str(e.value)


def test_set_values_are_bounded_too():
    with pytest.raises(RecipeError, match="--set bench.concurrency: YAML anchor"):
        load_recipe(CPU, ["bench.concurrency=&x [1]"])


HUGE = 10**15
ABSURD = [
    "build.max_batch_size", "build.max_num_tokens", "build.max_input_len", "build.max_seq_len", "build.max_beam_width",
    "build.tokens_per_block", "build.workers", "build.opt_num_tokens", "build.kv_cache_config.max_tokens",
    "build.kv_cache_config.max_attention_window", "build.cpu.num_threads", "serving.preprocessing_instance_count",
    "serving.postprocessing_instance_count", "serving.bls_instance_count", "serving.triton_max_batch_size",
    "serving.max_queue_size", "serving.cancellation_check_period_ms", "serving.stats_check_period_ms",
    "quantization.calibration.size", "quantization.calibration.max_seq_length", "quantization.calibration.batch_size",
    "quantization.calibration.eval_samples", "quantization.calibration.seed", "quantization.awq_block_size",
    "bench.num_requests", "bench.min_requests", "bench.warmup_requests", "bench.requests_per_load",
    "bench.request_timeout_s", "bench.duration_s", "bench.seed", "target.tp_size", "target.pp_size", "target.num_gpus",
]


@pytest.mark.parametrize("field", ABSURD)
def test_absurd_numbers_name_the_field(field: str):
    with line_budget(ABSURD_LINES), pytest.raises(RecipeError) as e:
        load_recipe(CPU, [f"{field}={HUGE}"])
    assert f" {field}: " in str(e.value) or f" {field}." in str(e.value), str(e.value)


@pytest.mark.parametrize("override,field,message", [
    ("quantization.calibration.seed=-1", "quantization.calibration.seed", "greater than or equal to 0"),
    ("bench.seed=4294967296", "bench.seed", "less than or equal to 4294967295"),
    ("build.tokens_per_block=48", "build.tokens_per_block", "not a power of two"),
    ("bench.concurrency=[1, 0]", "bench.concurrency.1", "greater than or equal to 1"),
    ("bench.request_rate=[.nan]", "bench.request_rate.0", "finite"),
    ("bench.goodput={ttft: -5}", "bench.goodput.ttft", "greater than 0"),
    ("quantization.calibration.batch_size=65", "quantization.calibration.batch_size", "exceeds calibration.size 64"),
    ("quantization.calibration.max_seq_length=100000", "quantization.calibration.max_seq_length",
     "exceeds the model's max_position_embeddings 8192"),
])
def test_bounds_that_depend_on_other_fields_or_the_model(override: str, field: str, message: str):
    with pytest.raises(RecipeError, match=message) as e:
        load_recipe(CPU, [override])
    assert f" {field}: " in str(e.value)


def test_workers_beyond_the_ranks_are_refused():
    with pytest.raises(RecipeError, match="build.workers: 4 build processes for 1 rank"):
        load_recipe(GPU, ["build.workers=4"])
    load_recipe(GPU, ["build.workers=2", "target.tp_size=2", "target.num_gpus=2"])


def test_validate_reports_a_gpu_recipe_that_cannot_fit(tmp_path: Path):
    res = subprocess.run([TRTPIPE, "recipe", "validate", str(GPU), "--set", "target.gpu=l4", "--set",
                          "quantization.qformat=full_prec", "--set", "quantization.kv_cache_dtype=none", "--set",
                          "model.dtype=float32"], cwd=tmp_path, capture_output=True, text=True, timeout=60)
    assert res.returncode == 2 and "does not fit l4" in res.stderr and "GiB" in res.stderr
    assert "Traceback" not in res.stderr and list(tmp_path.iterdir()) == []


@pytest.mark.parametrize("override,field", [
    ("build.kv_cache_config.enable_block_reuse=true", "build.kv_cache_config.enable_block_reuse"),
    ("build.kv_cache_config.host_cache_size=1024", "build.kv_cache_config.host_cache_size"),
    ("build.kv_cache_config.max_attention_window=256", "build.kv_cache_config.max_attention_window"),
    ("build.scheduler_config.capacity_scheduler_policy=MAX_UTILIZATION", "build.scheduler_config.capacity_scheduler_policy"),
    ("build.max_beam_width=4", "build.max_beam_width"),
    ("build.kv_cache_type=continuous", "build.kv_cache_type"),
])
def test_the_cpu_engine_rejects_kv_knobs_it_cannot_honour(override: str, field: str):
    with pytest.raises(RecipeError, match="CPU engine") as e:
        load_recipe(CPU, [override])
    assert f" {field}: " in str(e.value)
