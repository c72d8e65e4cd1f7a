"""LoRA, for real on CPU: a small random adapter made with ``peft`` for SmolLM2-135M, built into a CPU engine
directory by the engine stage, applied per request by the CPU engine and served by a real Triton; greedy tokens equal
``peft``'s merged model's ``generate()`` token for token, and differ from the base model's."""

from __future__ import annotations

import json
import os
import subprocess
import threading
from pathlib import Path

import numpy as np
import pytest
import torch
from support import quantized_stage, smollm2_hf_dir

from pipeline.core.layout import BuildLayout
from pipeline.cpu_runtime.engine import CpuEngine
from pipeline.engine import cpu as cpu_stage
from pipeline.recipe import load_recipe

REPO = Path(__file__).resolve().parents[1]
RECIPE = REPO / "recipes" / "smollm2_135m_cpu_fp8.yaml"
CACHE = Path(os.environ.get("TRTPIPE_CACHE_DIR", REPO / ".trtpipe-cache"))
END_ID = 2  # SmolLM2 <|im_end|>
N_TOKENS = 16
PROMPTS = ["The capital of France is", "def fibonacci(n):\n    "]


def make_adapter(out: Path, *, r: int, seed: int, modules: list[str]) -> Path:
    """A random peft LoRA for SmolLM2-135M (``init_lora_weights=False``: B is not zero, so the adapter changes the
    output), saved as peft saves it."""
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    torch.manual_seed(seed)
    base = AutoModelForCausalLM.from_pretrained(smollm2_hf_dir(), dtype=torch.float32)
    model = get_peft_model(base, LoraConfig(r=r, lora_alpha=2 * r, target_modules=modules, init_lora_weights=False))
    model.save_pretrained(out)
    return out


@pytest.fixture(scope="module")
def adapters(tmp_path_factory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("lora")
    return {
        "attn": make_adapter(root / "attn", r=8, seed=1, modules=["q_proj", "v_proj"]),
        "all": make_adapter(root / "all", r=4, seed=2, modules=["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj",
                                                                 "up_proj", "down_proj"]),
    }


def lora_overrides(adapters: dict[str, Path], max_rank: int = 16) -> list[str]:
    spec = {"max_lora_rank": max_rank, "adapters": [{"name": "attn", "path": str(adapters["attn"]), "task_id": 7},
                                                    {"name": "all", "path": str(adapters["all"])}]}
    return [f"build.lora={json.dumps(spec)}", "build.max_batch_size=8", "build.cpu.num_threads=1"]


@pytest.fixture(scope="module")
def lora_build(adapters, tmp_path_factory):
    """The CPU engine stage (and its quantize fixture) for the shipped CPU recipe plus the two adapters."""
    recipe = load_recipe(RECIPE, lora_overrides(adapters))
    q = quantized_stage(CACHE / "cpu-engine-fixtures", "fp8", kv_cache_dtype="fp8")
    layout = BuildLayout(tmp_path_factory.mktemp("lora-build"))
    return recipe, q, cpu_stage.run(recipe, layout, quantized=q)


def _generate(engine: CpuEngine, ids: list[int], **kw) -> tuple[threading.Event, list[int], list[str]]:
    done, toks, err = threading.Event(), [], []
    engine.add_request(ids, max_new_tokens=N_TOKENS, min_tokens=N_TOKENS, on_tokens=lambda t, f: (toks.extend(t), f and done.set()),
                       on_error=lambda m: (err.append(m), done.set()), **kw)
    return done, toks, err


def _reference(engine_dir: Path, adapter: Path | None, tok) -> list[list[int]]:
    """Greedy tokens of the engine directory's own weights (plain HF) with ``adapter`` merged by peft."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(engine_dir, dtype=torch.float32)
    if adapter is not None:
        from peft import PeftModel

        model = PeftModel.from_pretrained(model, adapter).merge_and_unload()
    out = []
    for p in PROMPTS:
        enc = tok(p, return_tensors="pt")
        with torch.no_grad():
            ref = model.eval().generate(**enc, max_new_tokens=N_TOKENS, do_sample=False, eos_token_id=None, pad_token_id=END_ID)
        out.append(ref[0, enc.input_ids.shape[1]:].tolist())
    return out


def test_engine_directory_holds_the_adapters_and_their_hashes(lora_build, adapters):
    recipe, _, res = lora_build
    cfg = json.loads((res.path / "engine_config.json").read_text())
    lora = cfg["lora"]
    assert [(a["name"], a["task_id"], a["rank"]) for a in lora["adapters"]] == [("attn", 7, 8), ("all", 2, 4)]
    assert lora["max_lora_rank"] == 16 and lora["target_modules"][:3] == ["q_proj", "k_proj", "v_proj"]
    for name in ("attn", "all"):
        for f in ("adapter_config.json", "adapter_model.safetensors"):
            copied = res.path / "lora" / name / f
            assert copied.read_bytes() == (adapters[name] / f).read_bytes()
            assert res.manifest["files"][f"lora/{name}/{f}"]  # hashed like every engine file: serve checks them


@pytest.fixture(scope="module")
def refs(lora_build, adapters):
    """peft's greedy tokens per task id (None: the base model) for each prompt, and the tokenizer."""
    from transformers import AutoTokenizer

    _, _, res = lora_build
    tok = AutoTokenizer.from_pretrained(res.path)
    return {None: _reference(res.path, None, tok), 7: _reference(res.path, adapters["attn"], tok),
            2: _reference(res.path, adapters["all"], tok)}, tok


def test_lora_requests_match_peft_merged_model_token_for_token(lora_build, refs):
    """One engine, one batch: the base model, adapter 7 and adapter 2 requests run side by side (per-sequence deltas
    in the same steps); each equals its own reference."""
    _, _, res = lora_build
    refs, tok = refs
    with CpuEngine(res.path, num_threads=1) as eng:
        runs = {(task, i): _generate(eng, tok(p).input_ids, lora_task_id=task) for task in refs for i, p in enumerate(PROMPTS)}
        for (task, i), (done, toks, err) in runs.items():
            assert done.wait(300) and not err, err
            assert toks == refs[task][i], (task, PROMPTS[i], tok.decode(toks), tok.decode(refs[task][i]))
        with pytest.raises(ValueError, match="LoRA task 99 not found"):
            eng.add_request([1, 2, 3], max_new_tokens=2, on_tokens=lambda t, f: None, lora_task_id=99)
    for i in range(len(PROMPTS)):  # the adapters change the output
        assert refs[7][i] != refs[None][i] and refs[2][i] != refs[None][i], i


def test_llm_api_facade_takes_a_lora_request(lora_build, refs, adapters):
    """The LLM-API way on CPU: ``LLM(lora_config=…)`` and ``generate_async(…, lora_request=LoRARequest(name, id, path))``,
    the adapter loaded from its path on first use; a rank above ``max_lora_rank`` is refused."""
    import asyncio

    from pipeline.cpu_runtime.llm import LLM, LoRARequest, SamplingParams

    _, _, res = lora_build
    refs, tok = refs
    params = SamplingParams(max_tokens=N_TOKENS, ignore_eos=True)

    async def run(llm, req):
        out = llm.generate_async(PROMPTS[0], params, lora_request=req)
        async for _ in out:
            pass
        return out.outputs[0].token_ids

    with LLM(str(res.path), lora_config={"lora_dir": [], "max_lora_rank": 4}) as llm:
        loop = asyncio.new_event_loop()
        try:
            assert loop.run_until_complete(run(llm, LoRARequest("all", 2, str(adapters["all"])))) == refs[2][0]
            with pytest.raises(ValueError, match="rank r=8 exceeds max_lora_rank 4"):
                loop.run_until_complete(run(llm, LoRARequest("attn", 7, str(adapters["attn"]))))
        finally:
            loop.close()
        # trtllm-serve's way (its CPU stand-in): the request body's lora_request object
        from fastapi.testclient import TestClient

        from pipeline.cpu_runtime.openai.routes import create_app

        body = {"model": "m", "prompt": PROMPTS[0], "max_tokens": N_TOKENS, "ignore_eos": True,
                "lora_request": {"lora_name": "all", "lora_int_id": 2, "lora_path": str(adapters["all"])}}
        with TestClient(create_app(llm, "m", str(res.path))) as client:
            r = client.post("/v1/completions", json=body)
            assert r.status_code == 200, r.text
            assert r.json()["choices"][0]["text"] == tok.decode(refs[2][0], skip_special_tokens=True)
            bad = client.post("/v1/completions", json={**body, "lora_request": {"lora_name": "x", "lora_int_id": 3,
                                                                                 "lora_path": str(res.path / "nowhere")}})
            assert bad.status_code == 400 and "does not exist" in bad.text
    with pytest.raises(ValueError, match="does not exist"):
        LoRARequest("x", 1, str(res.path / "nowhere"))


def test_rank_above_max_lora_rank_is_one_line_exit_2_and_writes_nothing(adapters, tmp_path):
    from tests.conftest import TRTPIPE

    recipe = tmp_path / "r.yaml"
    recipe.write_text(RECIPE.read_text())
    before = sorted(tmp_path.rglob("*"))
    res = subprocess.run([TRTPIPE, "build", str(recipe), *sum((["--set", o] for o in lora_overrides(adapters, max_rank=4)), [])],
                         cwd=tmp_path, capture_output=True, text=True, timeout=300)
    assert res.returncode == 2, res.stdout + res.stderr
    lines = [ln for ln in res.stderr.splitlines() if ln.strip()]
    assert len(lines) == 1 and "build.lora.adapters.0" in lines[0] and "max_lora_rank 4" in lines[0], res.stderr
    assert "r=8" in lines[0]
    assert sorted(tmp_path.rglob("*")) == before


@pytest.mark.slow
@pytest.mark.triton
@pytest.mark.timeout(900)
def test_real_triton_serves_the_adapter_by_lora_task_id(lora_build, tmp_path):
    """The CPU tensorrt_llm model on a real Triton: ``lora_task_id`` selects the build's adapter, through the model
    and through the ensemble; tokens equal the engine's (which equal peft's, above); an unknown id is an error."""
    from test_triton_repo import _in, _stream
    from transformers import AutoTokenizer

    from pipeline.triton.server import TritonServer
    from pipeline.triton_repo import stage as triton_repo

    recipe, q, res = lora_build
    repo = triton_repo.run(recipe, BuildLayout(tmp_path), quantized=q, engine=res).path
    tok = AutoTokenizer.from_pretrained(res.path)
    ids = tok(PROMPTS[0]).input_ids
    with CpuEngine(res.path, num_threads=1) as eng:
        expect = {}
        for task in (None, 7):
            done, toks, err = _generate(eng, ids, lora_task_id=task)
            assert done.wait(300) and not err
            expect[task] = toks

    def infer(url: str, model: str, task: int | None) -> list[int]:
        if model == "ensemble":
            inputs = [_in("text_input", np.array([[PROMPTS[0].encode()]], dtype=object), "BYTES"),
                      _in("max_tokens", np.array([[N_TOKENS]], dtype=np.int32), "INT32")]
        else:
            arr = np.array([ids], dtype=np.int32)
            inputs = [_in("input_ids", arr, "INT32"), _in("input_lengths", np.array([[arr.shape[1]]], dtype=np.int32), "INT32"),
                      _in("request_output_len", np.array([[N_TOKENS]], dtype=np.int32), "INT32")]
        inputs += [_in("min_tokens", np.array([[N_TOKENS]], dtype=np.int32), "INT32"), _in("stream", np.array([[True]]), "BOOL")]
        if model != "ensemble":
            inputs[-1] = _in("streaming", np.array([[True]]), "BOOL")
        if task is not None:
            inputs.append(_in("lora_task_id", np.array([[task]], dtype=np.uint64), "UINT64"))
        out = "text_output" if model == "ensemble" else "output_ids"
        got = _stream(url, model, inputs, [out], f"{model}-{task}")
        if model == "ensemble":
            return "".join(g[out].reshape(-1)[0].decode() for g in got)
        return [int(t) for g in got for t in g[out].reshape(-1)]

    with TritonServer(repo, log_file=tmp_path / "triton.log", ready_timeout_s=300, http_port=None, grpc_port=None,
                      metrics_port=None) as srv:
        for task in (None, 7):
            assert infer(srv.grpc_url, "tensorrt_llm", task)[-N_TOKENS:] == expect[task], task
            assert infer(srv.grpc_url, "ensemble", task) == tok.decode(expect[task], skip_special_tokens=True), task
        assert "LoRA task 5 not found" in _stream_error(srv.grpc_url, [
            _in("input_ids", np.array([ids], dtype=np.int32), "INT32"),
            _in("input_lengths", np.array([[len(ids)]], dtype=np.int32), "INT32"),
            _in("request_output_len", np.array([[2]], dtype=np.int32), "INT32"),
            _in("lora_task_id", np.array([[5]], dtype=np.uint64), "UINT64")])


def _stream_error(url: str, inputs) -> str:
    """The error message of the first response to a streamed ``tensorrt_llm`` request ('' when none)."""
    import queue

    import tritonclient.grpc as grpcclient

    q: queue.Queue = queue.Queue()
    client = grpcclient.InferenceServerClient(url)
    client.start_stream(callback=lambda result, error: q.put(error))
    try:
        client.async_stream_infer("tensorrt_llm", inputs, request_id="bad-lora")
        error = q.get(timeout=120)
        return error.message() if error is not None else ""
    finally:
        client.stop_stream()
        client.close()


@pytest.mark.slow
@pytest.mark.triton
@pytest.mark.timeout(900)
def test_real_triton_llmapi_model_takes_lora_id_name_path(adapters, refs, tmp_path):
    """The LLM-API Triton model (``build.engine: pytorch`` on the cpu target): ``llm_api_config.yaml`` carries
    ``lora_config`` (the engine directory's adapter copies), and a request's ``lora_id`` / ``lora_name`` /
    ``lora_path`` inputs apply the adapter: the text equals peft's merged model's greedy tokens, decoded."""
    import tritonclient.grpc as grpcclient
    import yaml
    from test_llmapi_cpu import _stream, _text

    from pipeline.engine import stage as engine_stage
    from pipeline.triton.server import TritonServer
    from pipeline.triton_repo import stage as triton_repo

    refs, tok = refs
    recipe = load_recipe(REPO / "recipes" / "smollm2_135m_cpu_llmapi.yaml", lora_overrides(adapters))
    q = quantized_stage(CACHE / "cpu-engine-fixtures", "fp8", kv_cache_dtype="fp8")
    e = engine_stage.run(recipe, BuildLayout(tmp_path / "build"), quantized=q)
    lora = yaml.safe_load((e.path / "llm_api_config.yaml").read_text())["lora_config"]
    assert lora["lora_dir"] == [str(e.path.resolve() / "lora" / n) for n in ("attn", "all")]
    assert lora["max_lora_rank"] == 16 and lora["lora_target_modules"][:3] == ["attn_q", "attn_k", "attn_v"]
    repo = triton_repo.run(recipe, BuildLayout(tmp_path / "repo"), quantized=q, engine=e).path

    def inputs(**lora_inputs):
        values = [("text_input", np.array([PROMPTS[0].encode()], dtype=object), "BYTES"),
                  ("streaming", np.array([True]), "BOOL"),
                  ("sampling_param_max_tokens", np.array([N_TOKENS], dtype=np.int32), "INT32"),
                  ("sampling_param_ignore_eos", np.array([True]), "BOOL")]
        for name, value in lora_inputs.items():
            values.append((name, np.array([value], dtype=np.uint64), "UINT64") if name == "lora_id"
                          else (name, np.array([value.encode()], dtype=object), "BYTES"))
        out = []
        for name, arr, dt in values:
            t = grpcclient.InferInput(name, list(arr.shape), dt)
            t.set_data_from_numpy(arr)
            out.append(t)
        return out

    with TritonServer(repo, log_file=tmp_path / "triton.log", ready_timeout_s=300, http_port=None, grpc_port=None,
                      metrics_port=None) as srv:
        for task, name in ((None, None), (7, "attn")):
            extra = {} if task is None else {"lora_id": task, "lora_name": name, "lora_path": str(e.path / "lora" / name)}
            got, final, err = _stream(srv, inputs(**extra))
            assert err is None, (task, err.message() if hasattr(err, "message") else err)
            # exclude_input_from_output false (upstream's default): the cumulative text starts with the prompt
            assert _text(got[-1]) == PROMPTS[0] + tok.decode(refs[task][0], skip_special_tokens=True), task
        _, _, err = _stream(srv, inputs(lora_id=7, lora_name="attn"))
        assert "must all be provided together" in str(err)


def test_gpu_paths_get_upstreams_lora_knobs_by_contract(adapters, tmp_path, monkeypatch):
    """No GPU here: the TensorRT recipe's trtllm-build command takes the LoRA flags the fake trtllm-build (whose parser
    is the 1.2.1 flag table) accepts, its tensorrt_llm model the lora_cache_* parameters the C++ backend reads and
    the lora_* request tensors upstream declares; the PyTorch recipe's LLM() kwargs a lora_config the LLM-API contract
    accepts, in TensorRT-LLM's module names."""
    import sys

    from test_engine_tensorrt import FAKES, _path_with, quantized

    from pipeline.engine import tensorrt as trt
    from pipeline.triton_repo import stage as triton_repo
    from pipeline.trtllm import contract, llmapi, triton_contract

    cache = '{"cache_gpu_memory_fraction": 0.1, "cache_host_memory_bytes": 2000000000}'
    spec = json.loads(lora_overrides(adapters)[0].split("=", 1)[1]) | json.loads(cache)
    recipe = load_recipe(REPO / "recipes" / "llama31_8b_h200_fp8.yaml", [f"build.lora={json.dumps(spec)}"])
    plan = trt.plan(recipe, quantized(tmp_path, recipe, with_checkpoint=True))
    argv = plan["argv"]
    assert set(a for a in argv if a.startswith("--")) <= contract.build_flag_names()
    at = argv.index("--lora_dir")
    assert argv[at + 1:at + 3] == [str(adapters["attn"]), str(adapters["all"])]
    assert argv[argv.index("--max_lora_rank") + 1] == "16" and argv[argv.index("--lora_plugin") + 1] == "auto"
    mods = argv[argv.index("--lora_target_modules") + 1:argv.index("--lora_target_modules") + 8]
    assert mods == ["attn_q", "attn_k", "attn_v", "attn_dense", "mlp_h_to_4h", "mlp_gate", "mlp_4h_to_h"]
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    (bin_dir / "trtllm-build").symlink_to(FAKES / "fake_trtllm_build")
    monkeypatch.setenv("PATH", _path_with(bin_dir))
    res = subprocess.run([sys.executable, str(FAKES / "fake_trtllm_build"), *argv[1:]], cwd=tmp_path / "quantize",
                         capture_output=True, text=True, timeout=120)
    assert res.returncode == 0, res.stderr[-2000:]
    cfgs = triton_repo.model_configs(recipe, tmp_path / "engine")
    params = {k: v.string_value for k, v in cfgs["tensorrt_llm"].parameters.items()}
    assert params["lora_cache_gpu_memory_fraction"] == "0.1" and params["lora_cache_host_memory_bytes"] == "2000000000"
    assert "lora_cache_optimal_adapter_size" not in params  # unset: the backend's default
    assert triton_contract.repository_problems(cfgs, "cpp") == []  # lora_* tensors and parameters as upstream's
    assert {"lora_task_id", "lora_weights", "lora_config"} <= {i.name for i in cfgs["ensemble"].input}

    pt = load_recipe(REPO / "recipes" / "llama31_8b_h200_fp8_pytorch.yaml", [f"build.lora={json.dumps(spec)}"])
    kwargs = llmapi.llm_api_kwargs(pt, tmp_path)
    assert kwargs["lora_config"] == {"lora_dir": [str(adapters["attn"]), str(adapters["all"])], "lora_ckpt_source": "hf",
                                     "max_lora_rank": 16, "lora_target_modules": mods, "max_loras": None, "max_cpu_loras": None}
    assert llmapi.check_kwargs(kwargs) == []
    assert llmapi.check_kwargs({**kwargs, "lora_config": {**kwargs["lora_config"], "lora_rank": 8}})  # not a LoraConfig field
