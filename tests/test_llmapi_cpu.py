"""The LLM-API (``build.engine: pytorch``) path on CPU: trtpipe's ``llmapi`` Triton model over the CPU engine's LLM
facade (pipeline/cpu_runtime/llm.py), and the generated repository held to upstream's ``llmapi`` interface.

* contract (no server): the generated ``config.pbtxt`` declares every upstream llmapi input and output with upstream's
  type and dims plus exactly trtpipe's three optional inputs; ``model.yaml``'s ``triton_config`` carries upstream's keys;
  ``llm_runtime`` follows the target; the contract check catches a changed extension;
* the facade: exact ``max_tokens`` with ``min_tokens``/``ignore_eos``, stop strings, abort, streaming shape;
* a real Triton 2.51 serving the repository built from the real FP8 SmolLM2 engine: streaming (cumulative text),
  exact OSL, stop words, ``stop``-input cancellation, a client that goes away, perf outputs.
"""

from __future__ import annotations

import asyncio
import itertools
import json
import os
import queue
import time
from pathlib import Path

import numpy as np
import pytest
import yaml
from support import free_ports, quantized_stage

from pipeline.core.layout import BuildLayout
from pipeline.engine import stage as engine_stage
from pipeline.recipe import load_recipe
from pipeline.triton_repo import stage as triton_repo
from pipeline.trtllm import triton_contract

REPO = Path(__file__).resolve().parents[1]
FIXTURES = Path(os.environ.get("TRTPIPE_CACHE_DIR", REPO / ".trtpipe-cache")) / "cpu-engine-fixtures"
RECIPE = REPO / "recipes" / "smollm2_135m_cpu_llmapi.yaml"
GPU_RECIPE = REPO / "recipes" / "llama31_8b_h200_fp8_pytorch.yaml"
WAIT_S = 120
EXTENSIONS = {"sampling_param_min_tokens": ("TYPE_INT32", [1]), "sampling_param_ignore_eos": ("TYPE_BOOL", [1]),
              "sampling_param_skip_special_tokens": ("TYPE_BOOL", [1]), "return_num_output_tokens": ("TYPE_BOOL", [1])}
EXTRA_OUTPUTS = {"num_output_tokens": ("TYPE_INT32", [1])}


def _tensors(entries) -> dict[str, tuple[str, list[int]]]:
    from tritonclient.grpc import model_config_pb2 as pb

    return {t.name: (pb.DataType.Name(t.data_type), list(t.dims)) for t in entries}


# ---------------------------------------------------------------------- contract (no server)
@pytest.mark.parametrize("recipe_path, runtime", [(RECIPE, "trtpipe_cpu"), (GPU_RECIPE, "tensorrt_llm")])
def test_config_pbtxt_is_upstreams_interface_plus_four_optional_inputs_and_a_count(recipe_path, runtime, tmp_path):
    recipe = load_recipe(recipe_path)
    cfg = triton_repo.model_configs(recipe, tmp_path)["tensorrt_llm"]
    up = triton_contract.contract()["templates"]["llmapi_tensorrt_llm"]
    ours_in, ours_out = _tensors(cfg.input), _tensors(cfg.output)
    lora = triton_contract.llmapi_lora_inputs()  # upstream's newer copy adds them (pipeline/data/triton_backend_contract.yaml)
    assert sorted(lora) == ["lora_ckpt_source", "lora_id", "lora_name", "lora_path"] and {k: ours_in[k] for k in lora} == lora
    assert {x["name"]: (x["data_type"], x["dims"]) for x in up["inputs"]} == {
        k: v for k, v in ours_in.items() if k not in EXTENSIONS and k not in lora}
    assert {x["name"]: (x["data_type"], x["dims"]) for x in up["outputs"]} == {k: v for k, v in ours_out.items() if k not in EXTRA_OUTPUTS}
    assert {k: ours_in[k] for k in EXTENSIONS} == EXTENSIONS and {k: ours_out[k] for k in EXTRA_OUTPUTS} == EXTRA_OUTPUTS
    assert all(x.optional for x in cfg.input if x.name != "text_input")
    assert cfg.backend == "python" and cfg.max_batch_size == 0 and cfg.model_transaction_policy.decoupled
    assert {k: v.string_value for k, v in cfg.parameters.items()} == {"llm_runtime": runtime}
    assert triton_contract.repository_problems({"tensorrt_llm": cfg}, "llmapi") == []


def test_contract_catches_a_changed_extension_and_an_unknown_input(tmp_path):
    cfg = triton_repo.model_configs(load_recipe(RECIPE), tmp_path)["tensorrt_llm"]
    for x in cfg.input:
        if x.name == "sampling_param_min_tokens":
            x.optional = False
    extra = cfg.input.add()
    extra.name, extra.data_type, extra.optional = "sampling_param_bogus", 8, True
    extra.dims.append(1)
    problems = "; ".join(triton_contract.repository_problems({"tensorrt_llm": cfg}, "llmapi"))
    assert "'sampling_param_min_tokens' must be TYPE_INT32 dims [1] optional" in problems
    assert "'sampling_param_bogus' does not exist in upstream" in problems
    # the extensions are trtpipe's llmapi model's only: the C++ backend's tensorrt_llm does not get them
    assert triton_contract.LLMAPI_EXTRA_INPUTS["tensorrt_llm"].keys() == EXTENSIONS.keys()


def test_recipe_pytorch_runs_on_cpu_but_tensorrt_does_not():
    from pipeline.core.errors import RecipeError

    assert load_recipe(RECIPE).build.engine == "pytorch"
    with pytest.raises(RecipeError, match=r"build.engine: engine 'tensorrt' does not run on target 'cpu'"):
        load_recipe(RECIPE, ["build.engine=tensorrt"])


# ---------------------------------------------------------------------- the real CPU engine
@pytest.fixture(scope="module")
def stages():
    """(recipe, quantize result, engine result): the llmapi recipe's engine stage on the FP8 fixture checkpoint."""
    q = quantized_stage(FIXTURES, "fp8", kv_cache_dtype="fp8")
    recipe = load_recipe(RECIPE, ["build.max_batch_size=8"])
    return recipe, q, engine_stage.run(recipe, BuildLayout(FIXTURES / "build-fp8-llmapi"), quantized=q)


def test_engine_stage_writes_the_cpu_engine_and_its_llm_kwargs(stages):
    e = stages[2]
    assert e.engine_kind == "pytorch" and e.manifest["runtime"] == "trtpipe-torch"
    kwargs = yaml.safe_load((e.path / "llm_api_config.yaml").read_text())
    assert kwargs["model"] == kwargs["tokenizer"] == str(e.path.resolve())
    assert kwargs["max_batch_size"] == 8 and kwargs["backend"] == "pytorch"
    assert (e.path / "engine_config.json").is_file() and (e.path / "model.safetensors").is_file()


@pytest.fixture(scope="module")
def llm(stages):
    from pipeline.cpu_runtime.llm import LLM

    kwargs = yaml.safe_load((stages[2].path / "llm_api_config.yaml").read_text())
    with LLM(**kwargs) as llm:
        yield llm


def _collect(llm, prompt, streaming=True, abort_after=None, **params):
    from pipeline.cpu_runtime.llm import SamplingParams

    async def run():
        res = llm.generate_async(prompt, SamplingParams(**params), streaming=streaming)
        seen = []
        async for out in res:
            seen.append((list(out.outputs[0].token_ids), out.outputs[0].text, out.finished))
            if abort_after is not None and len(seen) == abort_after:
                res.abort()
        return res, seen

    return asyncio.run(asyncio.wait_for(run(), WAIT_S))


def test_facade_exact_tokens_with_min_tokens_and_ignore_eos(llm):
    res, seen = _collect(llm, "Say hi.", max_tokens=64, min_tokens=64, ignore_eos=True)
    final = res.outputs[0]
    assert len(final.token_ids) == 64 and final.finish_reason == "length" and res.finished
    assert len(seen) >= 2 and [s[2] for s in seen] == [False] * (len(seen) - 1) + [True]
    for (ids, _, _), (nxt, _, _) in itertools.pairwise(seen):  # cumulative: every response extends the previous one
        assert nxt[:len(ids)] == ids
    assert final.text == llm.tokenizer.decode(final.token_ids)


def test_facade_stop_string_and_abort(llm):
    res, _ = _collect(llm, "The capital of France is", max_tokens=60, stop=["."])
    out = res.outputs[0]
    assert out.finish_reason == "stop" and out.stop_reason == "." and "." not in out.text and out.text
    res, seen = _collect(llm, "Count: 1, 2, 3,", max_tokens=400, ignore_eos=True, abort_after=3)
    assert res.outputs[0].finish_reason == "cancelled" and res.aborted() and len(res.outputs[0].token_ids) < 400
    res, seen = _collect(llm, "Hello", streaming=False, max_tokens=5, min_tokens=5)
    assert len(seen) == 1 and len(res.outputs[0].token_ids) == 5


def test_facade_refuses_what_the_cpu_engine_cannot_do(stages):
    from pipeline.cpu_runtime.llm import LLM, SamplingParams

    kwargs = yaml.safe_load((stages[2].path / "llm_api_config.yaml").read_text())
    with pytest.raises(ValueError, match="max_seq_len=999 differs"):
        LLM(**{**kwargs, "max_seq_len": 999})
    with pytest.raises(ValueError, match="tensor_parallel_size=2"):
        LLM(**{**kwargs, "tensor_parallel_size": 2})
    with pytest.raises(ValueError, match="n, best_of must be 1"):
        SamplingParams(best_of=2)


# ---------------------------------------------------------------------- a real Triton
@pytest.fixture(scope="module")
def server(stages, tmp_path_factory):
    from pipeline.triton.server import TritonServer

    recipe, q, e = stages
    root = tmp_path_factory.mktemp("llmapi")
    res = triton_repo.run(recipe, BuildLayout(root), quantized=q, engine=e)
    assert yaml.safe_load((res.path / "tensorrt_llm/1/model.yaml").read_text())["triton_config"] == {
        "max_batch_size": 0, "decoupled": True, "cancellation_check_period_ms": recipe.serving.cancellation_check_period_ms}
    http, grpc, metrics = free_ports(3)
    with TritonServer(res.path, log_file=root / "triton.log", ready_timeout_s=240, http_port=http, grpc_port=grpc,
                      metrics_port=metrics) as srv:
        yield srv


def _inputs(prompt: str, **values):
    import tritonclient.grpc as grpcclient

    kinds = {bool: ("BOOL", np.bool_), int: ("INT32", np.int32)}
    out = []
    for name, value in {"text_input": prompt, "streaming": True, **values}.items():
        if isinstance(value, (list, str)):
            arr, dt = np.array([v.encode() for v in ([value] if isinstance(value, str) else value)], dtype=object), "BYTES"
        else:
            dt, np_type = kinds[type(value)]
            arr = np.array([value], dtype=np_type)
        t = grpcclient.InferInput(name, list(arr.shape), dt)
        t.set_data_from_numpy(arr)
        out.append(t)
    return out


def _stream(server, inputs, request_id="", outputs=None, cancel_after=None):
    """(responses, final, error) of one streamed request; ``cancel_after``: close the stream (the client goes away)."""
    import tritonclient.grpc as grpcclient

    client = grpcclient.InferenceServerClient(server.grpc_url)
    q: queue.Queue = queue.Queue()
    client.start_stream(callback=lambda result, error: q.put((result, error)))
    got = []
    try:
        req_out = [grpcclient.InferRequestedOutput(n) for n in outputs] if outputs else None
        client.async_stream_infer("tensorrt_llm", inputs, request_id=request_id, outputs=req_out,
                                  enable_empty_final_response=True)
        while True:
            result, error = q.get(timeout=WAIT_S)
            if error is not None:
                return got, None, error
            final = result.get_response().parameters["triton_final_response"].bool_param
            if result.get_response().outputs:
                got.append(result)
            if final:
                return got, result, None
            if cancel_after is not None and len(got) >= cancel_after:
                client.stop_stream(cancel_requests=True)
                return got, None, "cancelled by the test"
    finally:
        client.stop_stream()
        client.close()


def _text(result) -> str:
    return result.as_numpy("text_output").reshape(-1)[0].decode()


@pytest.mark.triton
def test_triton_streams_cumulative_text_with_exact_osl(server, stages):
    from pipeline.cpu_runtime.llm import _load_tokenizer

    tok = _load_tokenizer(stages[2].path)
    got, _, err = _stream(server, _inputs("Say hi.", sampling_param_max_tokens=48, sampling_param_min_tokens=48,
                                          sampling_param_ignore_eos=True, return_finish_reason=True,
                                          sampling_param_skip_special_tokens=False, return_num_output_tokens=True,
                                          sampling_param_exclude_input_from_output=True))
    assert err is None and len(got) >= 2
    texts = [_text(r) for r in got]
    assert all(b.startswith(a) for a, b in itertools.pairwise(texts)), "text_output must be cumulative"
    assert got[-1].as_numpy("finish_reason").reshape(-1)[0].decode() == "length"
    # special tokens kept in the text (past the EOS): re-tokenizing it gives back the 48 generated tokens
    assert len(tok.encode(texts[-1], add_special_tokens=False)) == 48
    counts = [int(r.as_numpy("num_output_tokens").reshape(-1)[0]) for r in got]  # tokens each response adds
    assert sum(counts) == 48 and all(c >= 1 for c in counts)


@pytest.mark.triton
def test_bench_gets_exactly_osl_tokens_counted_by_the_server(server, stages, tmp_path):
    """``trtpipe bench``'s own run on the CPU llmapi deployment: exact OSL from min_tokens/ignore_eos, every response's
    tokens from num_output_tokens, and the re-tokenized final text agreeing with the server's count (osl_check)."""
    from pipeline.bench import stage as bench
    from pipeline.bench.results import check_outcome
    from pipeline.bench.stage import BenchTarget
    from pipeline.recipe.bench import BenchSpec

    spec = BenchSpec(model="tensorrt_llm", scenarios=[{"isl": 24, "osl": 20}], concurrency=[3], num_requests=6,
                     warmup_requests=1)
    run = bench.run(spec, BenchTarget(url=server.grpc_url, tokenizer=stages[2].path, out=tmp_path / "run"))
    check_outcome(run, run.run_dir)  # raises on failed or short requests: min_tokens is sent, so OSL is forced
    assert run.info.interface == "llmapi" and run.osl_forced and not run.warnings
    measured = [r for r in run.records if not r.warmup]
    assert len(measured) == 6 and all(r.output_tokens == 20 and r.text_tokens == 20 for r in measured)
    assert all(len(r.response_tokens) >= 2 for r in measured)  # streamed: tokens counted per response
    doc = json.loads((run.run_dir / "bench.json").read_text())
    assert {r["output_tokens"] for r in doc["requests"]} == {20} and [n for n in doc["status"]["notes"] if not n.startswith("device telemetry:")] == []


@pytest.mark.triton
def test_triton_stop_words_and_perf_outputs(server):
    got, _, err = _stream(server, _inputs("The capital of France is", sampling_param_max_tokens=60,
                                          sampling_param_stop=["."], return_finish_reason=True,
                                          return_stop_reason=True, sampling_param_return_perf_metrics=True,
                                          sampling_param_exclude_input_from_output=True))
    assert err is None
    last = got[-1]
    assert "." not in _text(last) and _text(last)
    assert last.as_numpy("finish_reason").reshape(-1)[0].decode() == "stop"
    assert last.as_numpy("stop_reason").reshape(-1)[0].decode() == "."
    arrival, first, end = (int(last.as_numpy(n).reshape(-1)[0]) for n in ("arrival_time_ns", "first_token_time_ns", "last_token_time_ns"))
    assert 0 < arrival <= first <= end and last.as_numpy("kv_cache_hit_rate").dtype == np.float32


@pytest.mark.triton
def test_triton_stop_input_and_client_cancellation(server):
    import threading

    long = {"sampling_param_max_tokens": 500, "sampling_param_min_tokens": 500, "sampling_param_ignore_eos": True,
            "return_finish_reason": True}
    box: dict = {}
    worker = threading.Thread(target=lambda: box.update(r=_stream(server, _inputs("Count: 1, 2, 3,", **long), request_id="victim")))
    worker.start()
    time.sleep(2)  # the victim is decoding
    _, _, err = _stream(server, _inputs("x", stop=True), request_id="victim")
    assert "cancelled" in str(err).lower()
    worker.join(WAIT_S)
    got, _, err = box["r"]
    assert err is None and got[-1].as_numpy("finish_reason").reshape(-1)[0].decode() == "cancelled"
    # a client that goes away: the model aborts the request and keeps serving
    got, _, err = _stream(server, _inputs("Count: 1, 2, 3,", **long), cancel_after=2)
    assert err == "cancelled by the test"
    got, _, err = _stream(server, _inputs("Hi", sampling_param_max_tokens=4, sampling_param_min_tokens=4,
                                          sampling_param_ignore_eos=True, return_finish_reason=True))
    assert err is None and got[-1].as_numpy("finish_reason").reshape(-1)[0].decode() == "length"
    assert "Traceback" not in Path(server.log_file).read_text(errors="replace")


@pytest.mark.triton
def test_triton_refuses_images_to_a_text_build(server):
    """A text build declares no ``image_url`` (issue #47 item 4): Triton answers one line, 400, and serves on."""
    import requests

    url = f"http://{server.http_url}/v2/models/tensorrt_llm/generate"
    body = {"text_input": "Say hi.", "sampling_param_max_tokens": 2, "image_url": ["data:image/png;base64,AAAA"]}
    r = requests.post(url, json=body, timeout=WAIT_S)
    assert r.status_code == 400 and "image_url" in r.json()["error"] and "\n" not in r.json()["error"]
    assert requests.post(url, json={"text_input": "Say hi.", "sampling_param_max_tokens": 2}, timeout=WAIT_S).status_code == 200
