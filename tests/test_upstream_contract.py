"""Every GPU recipe's generated model repository against the upstream-derived contract
(pipeline/data/triton_backend_contract.yaml: the C++ tensorrtllm backend's parameter reads and the upstream
templates' tensors, each with its tensorrtllm_backend / TensorRT-LLM file@commit:line).

The contract is read from upstream code, not from our generator: these tests fail when a repository would
not load in the Triton container (a required parameter missing, a value the backend rejects) or would
silently lose data (a flag accepted whose output is not declared).
"""

from __future__ import annotations

import copy
from pathlib import Path

import pytest

from pipeline.assemble.stage import run as run_build
from pipeline.recipe import load_recipe
from pipeline.trtllm import triton_contract as upstream

REPO = Path(__file__).resolve().parents[1]
# vision recipes (issue #46) included: their repository is the multimodal one (triton_multimodal_contract.yaml)
GPU_RECIPES = [p for p in sorted((REPO / "recipes").glob("*.yaml")) if load_recipe(p).target.gpu != "cpu"]


def _repo(path: Path, tmp_path: Path):
    recipe = load_recipe(path)
    res = run_build(recipe, tmp_path / "b", recipe_dir=path.parent, dry_run=True, warn=lambda m: None)
    impl = "llmapi" if recipe.build.engine == "pytorch" else "cpp"
    return upstream.load_repository(res.layout.triton_repo), impl


@pytest.mark.parametrize("path", GPU_RECIPES, ids=[p.stem for p in GPU_RECIPES])
def test_every_gpu_recipe_repository_meets_the_upstream_contract(path: Path, tmp_path: Path):
    configs, impl = _repo(path, tmp_path)
    assert upstream.repository_problems(configs, impl) == []
    if impl == "cpp":
        params = {k: v.string_value for k, v in configs["tensorrt_llm"].parameters.items()}
        required = {p["name"] for p in upstream.contract()["cpp_backend_parameters"] if p.get("required")}
        # the four keys the backend reads without try/catch (audit defect 1)
        assert required == {"gpt_model_type", "tokenizer_dir", "xgrammar_tokenizer_info_path", "guided_decoding_backend"}
        assert required <= set(params)
        assert {"context_logits", "generation_logits"} <= {o.name for o in configs["ensemble"].output}  # defect 6
    else:
        assert {"acceptance_rate", "total_accepted_draft_tokens", "total_draft_tokens"} <= {
            o.name for o in configs["tensorrt_llm"].output}  # defect 5


def _cpp_configs(tmp_path: Path):
    return _repo(REPO / "recipes" / "llama31_8b_h200_fp8.yaml", tmp_path)[0]


def test_a_missing_required_parameter_is_caught(tmp_path: Path):
    configs = _cpp_configs(tmp_path)
    del configs["tensorrt_llm"].parameters["tokenizer_dir"]
    problems = upstream.repository_problems(configs, "cpp")
    assert len(problems) == 1 and "'tokenizer_dir' is missing" in problems[0] and "model_instance_state.cc@" in problems[0]


@pytest.mark.parametrize("key,value,message", [
    ("gpt_model_type", "INFLIGHT_FUSED_BATCHING", "is not one of"),
    ("batch_scheduler_policy", "MAX_UTILIZATION", "is not one of"),
    ("enable_kv_cache_reuse", "yes", "not a boolean"),
    ("kv_cache_free_gpu_mem_fraction", "ninety", "does not parse as float"),
    ("max_beam_width", "1.5", "does not parse as int"),
    ("kv_cache_free_gpu_mem_fractoin", "0.9", "not read by the tensorrtllm backend"),
])
def test_values_the_backend_rejects_or_ignores_are_caught(tmp_path: Path, key: str, value: str, message: str):
    configs = _cpp_configs(tmp_path)
    configs["tensorrt_llm"].parameters[key].string_value = value
    problems = upstream.repository_problems(configs, "cpp")
    assert any(message in p and key in p for p in problems), problems


def test_tensor_mismatches_and_undeclared_outputs_are_caught(tmp_path: Path):
    from tritonclient.grpc import model_config_pb2

    configs = _cpp_configs(tmp_path)
    bad = copy.deepcopy(configs)
    next(i for i in bad["tensorrt_llm"].input if i.name == "input_lengths").data_type = model_config_pb2.TYPE_INT64
    next(o for o in bad["ensemble"].output if o.name == "cum_log_probs").dims[:] = [1]
    ens_out = bad["ensemble"].output
    del ens_out[[o.name for o in ens_out].index("context_logits")]
    trt_out = bad["tensorrt_llm"].output
    del trt_out[[o.name for o in trt_out].index("first_token_time_ns")]
    problems = upstream.repository_problems(bad, "cpp")
    assert any("'input_lengths' is TYPE_INT64, upstream declares TYPE_INT32" in p for p in problems)
    assert any("'cum_log_probs' has dims [1], upstream [-1]" in p for p in problems)
    assert any("ensemble: output 'context_logits' is not declared" in p for p in problems)  # return_context_logits accepted
    assert any("tensorrt_llm: output 'first_token_time_ns' is not declared" in p for p in problems)  # perf metrics
    assert len(problems) == 4, problems


def test_llmapi_outputs_are_checked_against_upstream_model_py(tmp_path: Path):
    configs, impl = _repo(REPO / "recipes" / "llama31_8b_h200_fp8_pytorch.yaml", tmp_path)
    out = configs["tensorrt_llm"].output
    del out[[o.name for o in out].index("total_draft_tokens")]
    assert upstream.repository_problems(configs, impl) == [
        "tensorrt_llm: output 'total_draft_tokens' is not declared, but upstream's backend/model writes it"]


def test_the_contract_cites_upstream_code_for_every_parameter():
    c = upstream.contract()
    commits = {s["id"]: s for s in c["sources"]}
    assert "backend_c2e65b8" in commits and commits["backend_c2e65b8"]["commit"].startswith("c2e65b88d852")
    for p in c["cpp_backend_parameters"]:
        assert "@" in p["source"] and ".cc" in p["source"], p["name"]
    for name, t in c["templates"].items():
        assert "@" in t["source"], name
        assert all("line" in x for x in t["inputs"] + t["outputs"]), name


def test_only_the_release_matrix_spells_container_tags_and_tensorrt_versions():
    """Code, recipes, scripts and the Dockerfile get versions from pipeline/data/release_matrix.yaml."""
    import re
    import subprocess

    files = subprocess.run(["git", "ls-files", "pipeline", "recipes", "scripts", "Dockerfile", "triton_repo"],
                           cwd=REPO, capture_output=True, text=True, check=True).stdout.split()
    spelled = re.compile(r"tritonserver:\d\d\.\d\d|\b10\.1[0-9]\.\d+\.\d+\b")
    allowed = {"pipeline/data/release_matrix.yaml", "pipeline/data/triton_backend_contract.yaml"}
    offenders = [f for f in files if f not in allowed and (REPO / f).is_file()
                 and spelled.search((REPO / f).read_text(errors="replace"))]
    assert offenders == []
    from pipeline.trtllm.release import default_release
    assert default_release().image.endswith(":26.04-trtllm-python-py3") and default_release().tensorrt_llm == "1.2.1"


def test_the_cpu_models_text_output_is_the_only_extension_allowed(tmp_path: Path):
    """trtpipe's CPU tensorrt_llm model may add text_output (STRING [-1], build.cpu.detokenize: engine) and
    nothing else; the C++ backend's contract never allows it."""
    from tritonclient.grpc import model_config_pb2

    configs, _ = _repo(REPO / "recipes" / "smollm2_135m_cpu_fp8.yaml", tmp_path)
    assert "text_output" in {o.name for o in configs["tensorrt_llm"].output}
    assert upstream.repository_problems(configs, "cpu") == []
    trt = configs["tensorrt_llm"]
    assert any("'text_output' does not exist in upstream tensorrt_llm" in p
               for p in upstream.tensor_problems("tensorrt_llm", "tensorrt_llm", trt))
    bad = copy.deepcopy(configs)
    next(o for o in bad["tensorrt_llm"].output if o.name == "text_output").data_type = model_config_pb2.TYPE_INT32
    extra = bad["tensorrt_llm"].output.add()
    extra.name, extra.data_type, extra.dims[:] = "text_len", model_config_pb2.TYPE_INT32, [1]
    problems = upstream.repository_problems(bad, "cpu")
    assert len(problems) == 2, problems
    assert problems[0] == "tensorrt_llm: output 'text_output' must be TYPE_STRING dims [-1] (trtpipe's CPU model)"
    assert problems[1].startswith("tensorrt_llm: output 'text_len' does not exist in upstream tensorrt_llm ")
