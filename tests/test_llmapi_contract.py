"""The LLM-API contract (pipeline/data/trtllm_1.2.1_llmapi_contract.yaml): the checker catches each kind of defect,
recipe validation refuses knobs the engine kind cannot read, the engine stage holds what it writes to the contract,
serving.frontend: trtllm-serve writes and prints its command line, and the release matrix's engine paths."""

from __future__ import annotations

import json
import re
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from pipeline.core import engine_paths
from pipeline.core.errors import RecipeError, StageError
from pipeline.core.layout import BuildLayout
from pipeline.engine import pytorch as pt
from pipeline.quantize.result import QuantizeResult
from pipeline.recipe import load_recipe
from pipeline.recipe.consumers import stage_of
from pipeline.trtllm import llmapi, trtllm_serve

REPO = Path(__file__).resolve().parents[1]
PT_RECIPE = REPO / "recipes" / "llama31_8b_h200_fp8_pytorch.yaml"
TRT_RECIPE = REPO / "recipes" / "llama31_8b_h200_fp8.yaml"
TYPES = {"bool", "int", "float", "str", "list_int", "list_str", "enum", "config", "speculative", "any", "flag"}


def run_cli(*args: str, cwd: Path) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "pipeline.cli", *args], cwd=cwd, capture_output=True, text=True, timeout=120)


def good_kwargs(tmp_path: Path) -> dict:
    return llmapi.llm_api_kwargs(load_recipe(PT_RECIPE), tmp_path / "hf_ckpt")


def test_every_contract_entry_has_a_type_and_a_source():
    c = llmapi.llmapi_contract()
    tables = [c["llm_args"], *c["configs"].values(), c["sampling_params"], c["trtllm_serve"]["flags"], c["openai_extensions"]]
    for table in tables:
        for name, spec in table.items():
            assert spec["type"] in TYPES and spec["src"], name
            assert spec["type"] != "enum" or spec["values"], name
            assert spec["type"] != "config" or spec["config"] in c["configs"], name
    assert set(c["sources"]) == {"L12", "MAIN", "SERVE", "PROTO", "SAMP", "OSRV", "MAP", "LORA", "REQ"}


SRC = re.compile(r"^(?P<key>[A-Z0-9]+):(?P<line>[1-9][0-9]*)(?: .*)?$")
SOURCE = re.compile(r"^TRTLLM:[A-Za-z0-9_./-]+\.py@[0-9a-f]{40}$")


def test_every_source_is_a_file_at_a_commit_and_every_src_a_line_of_one():
    c = llmapi.llmapi_contract()
    assert all(SOURCE.match(v) for v in c["sources"].values()), c["sources"]
    tables = [c["llm_args"], *c["configs"].values(), c["sampling_params"], c["trtllm_serve"]["flags"],
              c["trtllm_serve"]["routes"], c["openai_extensions"]]
    cites = [spec["src"] for table in tables for spec in table.values()]
    cites += list(c["rules"].values()) + list(c["main_differences"])
    for cite in cites:
        m = SRC.match(cite)
        assert m and m["key"] in c["sources"], cite


def test_generated_kwargs_pass_and_carry_the_published_cuda_graph_settings(tmp_path):
    kw = good_kwargs(tmp_path)
    assert llmapi.check_kwargs(kw) == []
    assert kw["cuda_graph_config"]["enable_padding"] is True
    # perf-overview's llm_options.yml (1 … 8192) ended at the recipe's max_batch_size 2048 (the ceiling of captured graphs)
    assert kw["cuda_graph_config"]["batch_sizes"] == [2**i for i in range(12)]
    assert kw["disable_overlap_scheduler"] is False and kw["attn_backend"] == "TRTLLM" and kw["stream_interval"] == 1


@pytest.mark.parametrize(("mutate", "expect"), [
    (lambda kw: kw.update(kv_cache_free_gpu_mem_fraction=0.9), "kv_cache_free_gpu_mem_fraction: LLM() has no such field"),
    (lambda kw: kw["kv_cache_config"].update(fraction=1), "kv_cache_config.fraction: kv_cache_config has no such field"),
    (lambda kw: kw["cuda_graph_config"].update(padding=True), "cuda_graph_config.padding: cuda_graph_config has no such field"),
    (lambda kw: kw.update(max_batch_size="2048"), "max_batch_size is '2048': must be int"),
    (lambda kw: kw.update(enable_chunked_prefill=1), "enable_chunked_prefill is 1: must be bool"),
    (lambda kw: kw["cuda_graph_config"].update(batch_sizes=[1, "8"]), "cuda_graph_config.batch_sizes is [1, '8']: must be list_int"),
    (lambda kw: kw.update(stream_interval=0), "stream_interval is 0: must be >= 1"),
    (lambda kw: kw["kv_cache_config"].update(free_gpu_memory_fraction=1.5), "free_gpu_memory_fraction is 1.5: must be <= 1"),
    (lambda kw: kw["scheduler_config"].update(capacity_scheduler_policy="FAST"), "capacity_scheduler_policy is 'FAST': must be one of"),
    (lambda kw: kw.update(sampler_type="Greedy"), "sampler_type is 'Greedy': must be one of"),
    (lambda kw: kw.update(build_config={"max_batch_size": 8}), "build_config: a tensorrt-backend-only argument"),
    (lambda kw: kw.update(extended_runtime_perf_knob_config={}), "extended_runtime_perf_knob_config: a tensorrt-backend-only"),
    (lambda kw: kw.update(fast_build=True), "fast_build: a tensorrt-backend-only"),
    (lambda kw: kw.pop("model"), "model: required LLM() argument missing"),
    (lambda kw: kw["cuda_graph_config"].update(max_batch_size=64), "batch_sizes with max_batch_size 64 must be the generated"),
    (lambda kw: kw.update(enable_iter_req_stats=True), "enable_iter_req_stats without enable_iter_perf_stats"),
])
def test_checker_catches_each_kind_of_defect(tmp_path, mutate, expect):
    kw = good_kwargs(tmp_path)
    mutate(kw)
    problems = llmapi.check_kwargs(kw)
    assert len(problems) == 1 and expect in problems[0], problems


def test_cuda_graph_sizes_follow_the_1_2_generator_and_both_given_must_match_it(tmp_path):
    # llm_args.py@c292b9f997d6:135-164, worked by hand: padding → 1, 2, 4, 8…128 by 8, then 256…4096, then the max
    assert llmapi.cuda_graph_batch_sizes(8192, True) == [1, 2, 4, *range(8, 129, 8), 256, 512, 1024, 2048, 4096, 8192]
    assert llmapi.cuda_graph_batch_sizes(100, False) == [*range(1, 32), 32, 64, 100]
    assert llmapi.cuda_graph_batch_sizes(1, True) == [1]
    kw = good_kwargs(tmp_path)
    kw["cuda_graph_config"] = {"enable_padding": False, "max_batch_size": 100, "batch_sizes": [100, *range(1, 32), 32, 64]}
    assert llmapi.check_kwargs(kw) == []  # upstream sorts batch_sizes before comparing (:3057)


def test_pytorch_only_arguments_are_refused_for_the_tensorrt_backend(tmp_path):
    kw = good_kwargs(tmp_path)
    problems = llmapi.check_kwargs({k: v for k, v in kw.items() if k != "backend"}, "tensorrt")
    assert any(p.startswith("cuda_graph_config: a pytorch-backend-only argument") for p in problems)


def _refusal(overrides: list[str], recipe: Path = PT_RECIPE) -> str:
    with pytest.raises(RecipeError) as e:
        load_recipe(recipe, overrides)
    return str(e.value)


@pytest.mark.parametrize(("recipe", "overrides", "field"), [
    (PT_RECIPE, ["build.plugins.multiple_profiles=true"], "build.plugins"),
    (PT_RECIPE, ["build.kv_cache_type=continuous"], "build.kv_cache_type"),
    (PT_RECIPE, ["build.workers=2", "target.num_gpus=2", "target.tp_size=2"], "build.workers"),
    (PT_RECIPE, ["build.opt_num_tokens=512"], "build.opt_num_tokens"),
    (TRT_RECIPE, ["build.pytorch.disable_overlap_scheduler=true"], "build.pytorch"),
    (TRT_RECIPE, ["serving.frontend=trtllm-serve"], "serving.frontend"),
    (TRT_RECIPE, ["target.tensorrt_llm=1.3.0"], "target.tensorrt_llm"),
    (PT_RECIPE, ["build.pytorch.cuda_graph_config.max_batch_size=64"], "build.pytorch.cuda_graph_config"),
    (PT_RECIPE, ["build.pytorch.sampler_type=Greedy"], "build.pytorch.sampler_type"),
    (PT_RECIPE, ["build.pytorch.cuda_graph_gap=1"], "build.pytorch.cuda_graph_gap"),
])
def test_recipe_validation_names_the_field(recipe, overrides, field):
    assert field in _refusal(overrides, recipe)


def test_knob_refusal_is_one_line_exit_2_and_writes_nothing(tmp_path):
    out = tmp_path / "b"
    res = run_cli("build", str(PT_RECIPE), "--dry-run", "--out", str(out), "--set", "build.plugins.gemm_plugin=auto", cwd=tmp_path)
    assert res.returncode == 2 and not out.exists()
    lines = [line for line in res.stderr.splitlines() if line.strip()]
    assert len(lines) == 1 and "build.plugins" in lines[0] and "PyTorch LLM-API backend has no such setting" in lines[0]
    res = run_cli("build", str(TRT_RECIPE), "--dry-run", "--out", str(out), "--set", "target.tensorrt_llm=1.3.0rc21", cwd=tmp_path)
    assert res.returncode == 2 and not out.exists()
    assert "TensorRT-LLM 1.3.0rc21 has no TensorRT-engine path" in res.stderr and "build.engine: pytorch" in res.stderr


def test_cpu_target_uses_trtllm_serve_with_the_pytorch_engine_only():
    cpu = REPO / "recipes" / "smollm2_135m_cpu_llmapi.yaml"
    if not cpu.is_file():
        pytest.skip("the CPU llmapi recipe is not in this checkout")
    assert load_recipe(cpu, ["serving.frontend=trtllm-serve"]).serving.frontend == "trtllm-serve"  # the CPU stand-in
    assert "build.engine 'cpu'" in _refusal(["serving.frontend=trtllm-serve", "build.engine=cpu"], cpu)


def test_engine_paths_follow_the_release_matrix():
    assert engine_paths.tensorrt_engine_last() == "1.3.0rc20"
    assert engine_paths.has_tensorrt_engine_path("1.2.1") and engine_paths.has_tensorrt_engine_path("1.3.0rc20")
    assert not engine_paths.has_tensorrt_engine_path("1.3.0rc21") and not engine_paths.has_tensorrt_engine_path("1.3.0")
    assert engine_paths.engine_path_problem("pytorch", "1.4.0") is None
    assert load_recipe(PT_RECIPE, ["target.tensorrt_llm=1.4.0"]).target.tensorrt_llm == "1.4.0"
    with pytest.raises(ValueError, match="not a TensorRT-LLM version"):
        engine_paths.version_key("latest")


def test_new_fields_are_classified_for_the_cache_keys():
    assert stage_of("build.pytorch.cuda_graph_config.enable_padding") == "runtime"
    assert stage_of("serving.frontend") == "runtime" and stage_of("target.tensorrt_llm") == "plan"


def _quantized(tmp_path: Path) -> QuantizeResult:
    (tmp_path / "quantize" / "hf_ckpt").mkdir(parents=True)
    return QuantizeResult(tmp_path / "quantize", {"cache_key": "q", "stage": "quantize", "status": "built"})


def test_engine_stage_refuses_a_contract_violation_and_writes_nothing(tmp_path, monkeypatch):
    recipe = load_recipe(PT_RECIPE)
    real = pt.llm_api_kwargs
    monkeypatch.setattr(pt, "llm_api_kwargs", lambda r, d, **kw: {**real(r, d, **kw), "cuda_graph_batch_sizes": [1, 2]})
    with pytest.raises(StageError, match="breaks the TensorRT-LLM 1.2.1 LLM-API contract: cuda_graph_batch_sizes"):
        pt.run(recipe, BuildLayout(tmp_path), quantized=_quantized(tmp_path), dry_run=True)
    assert not (tmp_path / "engine").exists()


def test_trtllm_serve_build_writes_options_and_a_contract_command(tmp_path):
    recipe = load_recipe(PT_RECIPE, ["serving.frontend=trtllm-serve"])
    res = pt.run(recipe, BuildLayout(tmp_path), quantized=_quantized(tmp_path), dry_run=True)
    spec = json.loads((res.path / pt.SERVE_COMMAND).read_text())
    argv = spec["argv"]
    assert argv[:2] == ["trtllm-serve", str((tmp_path / "quantize" / "hf_ckpt").resolve())]
    assert trtllm_serve.argv_problems(argv) == []
    assert argv[argv.index("--extra_llm_api_options") + 1] == spec["options"] == str((res.path / pt.SERVE_OPTIONS).resolve())
    options = yaml.safe_load((res.path / pt.SERVE_OPTIONS).read_text())
    kwargs = yaml.safe_load((res.path / pt.CONFIG_YAML).read_text())
    assert options == trtllm_serve.extra_options(kwargs) and "model" not in options
    assert options["cuda_graph_config"]["enable_padding"] is True and llmapi.check_kwargs({"model": "m", **options}) == []
    assert res.manifest["frontend"] == "trtllm-serve" and res.manifest["trtllm_serve"] == argv
    assert trtllm_serve.argv_problems(["trtllm-serve", "m", "--backend", "tensorrt_llm", "--kv_cache_fraction", "1"]) == [
        "--backend tensorrt_llm: not one of ['pytorch', 'tensorrt', '_autodeploy']", "trtllm-serve has no option --kv_cache_fraction", ]


def test_serve_print_command_for_both_frontends_and_missing_trtllm_serve(tmp_path):
    out = tmp_path / "b"
    res = run_cli("build", str(PT_RECIPE), "--dry-run", "--out", str(out), "--set", "serving.frontend=trtllm-serve", cwd=tmp_path)
    assert res.returncode == 0, res.stderr
    res = run_cli("serve", str(out), "--print-command", "--http-port", "9100", cwd=tmp_path)
    assert res.returncode == 0, res.stderr
    line = res.stdout.strip()
    assert line.startswith("trtllm-serve ") and "--port 9100" in line
    assert f"--extra_llm_api_options {(out / 'engine' / pt.SERVE_OPTIONS).resolve()}" in line
    res = run_cli("serve", str(out), cwd=tmp_path, )
    assert res.returncode == 3 and "trtllm-serve is not installed here" in res.stderr
    out2 = tmp_path / "t"
    assert run_cli("build", str(PT_RECIPE), "--dry-run", "--out", str(out2), cwd=tmp_path).returncode == 0
    res = run_cli("serve", str(out2), "--print-command", cwd=tmp_path)
    assert res.returncode == 0 and "tritonserver" in res.stdout and f"--model-repository={(out2 / 'triton_repo').resolve()}" in res.stdout


def test_bench_sends_the_openai_extensions_trtllm_serve_accepts():
    from pipeline.bench.http_client import OPENAI_EXTRA_FIELDS

    accepted = llmapi.llmapi_contract()["openai_extensions"]
    assert {"min_tokens", "ignore_eos"} <= set(accepted) & set(OPENAI_EXTRA_FIELDS)


def test_deploy_refuses_trtllm_serve_for_dynamo_on_one_line(tmp_path):
    """trtllm-serve renders for Helm and KServe (tests/test_deploy_trtllm_serve.py); Dynamo has its own frontend."""
    res = run_cli("deploy", "k8s", str(PT_RECIPE), "--format", "dynamo", "--out", str(tmp_path / "k8s"),
                  "--set", "serving.frontend=trtllm-serve", cwd=tmp_path)
    assert res.returncode == 2 and len(res.stderr.strip().splitlines()) == 1 and "dynamo" in res.stderr.lower()
    assert not (tmp_path / "k8s").exists()
