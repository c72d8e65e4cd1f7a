"""The generated Triton model repository: configs from templates, per engine kind, and a real Triton run.

Config tests use the shipped recipes with stage results pointing at small stand-in directories
(tokenizer files; an engine dir with config.json; for pytorch an llm_api_config.yaml). The
``triton`` test builds the real CPU engine (quantize fixture → pipeline.engine.cpu) and streams
through ``ensemble``, ``tensorrt_llm_bls`` and ``tensorrt_llm`` on the nvidia-pytriton tritonserver.
"""

from __future__ import annotations

import os
import queue
import shutil
from pathlib import Path

import numpy as np
import pytest
import yaml

from pipeline.core.layout import BuildLayout
from pipeline.engine.result import EngineResult
from pipeline.quantize.result import QuantizeResult
from pipeline.recipe import load_recipe
from pipeline.triton import model_config
from pipeline.triton_repo import render
from pipeline.triton_repo import stage as triton_repo

REPO = Path(__file__).resolve().parents[1]
# Reference docs/reference/triton-model-repository.md §3.4 (name → (data type, dims)).
TRTLLM_INPUTS = {
    "input_ids": ("TYPE_INT32", [-1]), "input_lengths": ("TYPE_INT32", [1]), "request_output_len": ("TYPE_INT32", [1]),
    "end_id": ("TYPE_INT32", [1]), "pad_id": ("TYPE_INT32", [1]), "streaming": ("TYPE_BOOL", [1]),
    "beam_width": ("TYPE_INT32", [1]), "temperature": ("TYPE_FP32", [1]), "runtime_top_k": ("TYPE_INT32", [1]),
    "runtime_top_p": ("TYPE_FP32", [1]), "min_tokens": ("TYPE_INT32", [1]), "seed": ("TYPE_UINT64", [1]),
    "return_perf_metrics": ("TYPE_BOOL", [1]), "return_num_input_tokens": ("TYPE_BOOL", [1]),
    "return_num_output_tokens": ("TYPE_BOOL", [1]), "exclude_input_in_output": ("TYPE_BOOL", [1]),
    "stop": ("TYPE_BOOL", [1]), "stop_words_list": ("TYPE_INT32", [2, -1]), "bad_words_list": ("TYPE_INT32", [2, -1]),
    "embedding_bias": ("TYPE_FP32", [-1]), "num_return_sequences": ("TYPE_INT32", [1]),
}
TRTLLM_OUTPUTS = {
    "output_ids": ("TYPE_INT32", [-1, -1]), "sequence_length": ("TYPE_INT32", [-1]), "cum_log_probs": ("TYPE_FP32", [-1]),
    "arrival_time_ns": ("TYPE_INT64", [1]), "first_token_time_ns": ("TYPE_INT64", [1]),
    "last_token_time_ns": ("TYPE_INT64", [1]), "num_input_tokens": ("TYPE_INT32", [1]), "num_output_tokens": ("TYPE_INT32", [1]),
}
TEXT_INPUTS = {
    "text_input": ("TYPE_STRING", [1]), "max_tokens": ("TYPE_INT32", [1]), "stream": ("TYPE_BOOL", [1]),
    "min_tokens": ("TYPE_INT32", [1]), "end_id": ("TYPE_INT32", [1]), "pad_id": ("TYPE_INT32", [1]),
    "top_k": ("TYPE_INT32", [1]), "top_p": ("TYPE_FP32", [1]), "bad_words": ("TYPE_STRING", [-1]),
    "stop_words": ("TYPE_STRING", [-1]), "return_num_output_tokens": ("TYPE_BOOL", [1]), "seed": ("TYPE_UINT64", [1]),
}
TEXT_OUTPUTS = {"text_output": ("TYPE_STRING", [-1]), "num_output_tokens": ("TYPE_INT32", [1]),
                "num_input_tokens": ("TYPE_INT32", [1]), "first_token_time_ns": ("TYPE_INT64", [1])}


def tensors(entries):
    from tritonclient.grpc import model_config_pb2 as pb

    return {t.name: (pb.DataType.Name(t.data_type), list(t.dims)) for t in entries}


def params(cfg):
    return {k: v.string_value for k, v in cfg.parameters.items()}


def fake_stages(tmp: Path, kind: str):
    hf = tmp / "quantize" / "hf_ckpt"
    hf.mkdir(parents=True)
    for name in ("tokenizer.json", "tokenizer_config.json", "generation_config.json"):
        (hf / name).write_text("{}")
    if kind == "cpu":  # the CPU default turns guided decoding on: its tokenizer-info file needs a real tokenizer
        from pipeline.quantize.sources import embedded_smollm2_dir

        for name in ("tokenizer.json", "tokenizer_config.json"):
            shutil.copy2(embedded_smollm2_dir() / name, hf / name)
    eng = tmp / "engine"
    eng.mkdir()
    (eng / "config.json").write_text("{}")
    if kind == "pytorch":
        (eng / "llm_api_config.yaml").write_text(yaml.safe_dump({"model": str(hf), "backend": "pytorch",
                                                                  "kv_cache_config": {"free_gpu_memory_fraction": 0.9}}))
    return (QuantizeResult(hf.parent, {"stage": "quantize", "cache_key": "q", "status": "built"}),
            EngineResult(eng, {"stage": "engine", "cache_key": "e", "status": "built", "engine_kind": kind}))


RECIPES = {"tensorrt": "llama31_8b_h200_fp8", "cpu": "smollm2_135m_cpu_fp8", "pytorch": "llama31_8b_h200_fp8_pytorch"}


ALL_KINDS = pytest.mark.parametrize("built", sorted(RECIPES), indirect=True)
IFB_KINDS = pytest.mark.parametrize("built", ["cpu", "tensorrt"], indirect=True)  # the inflight_batcher_llm layout
LLMAPI_KIND = pytest.mark.parametrize("built", ["pytorch"], indirect=True)


@pytest.fixture
def built(request, tmp_path):
    kind = request.param
    recipe = load_recipe(REPO / "recipes" / f"{RECIPES[kind]}.yaml")
    q, e = fake_stages(tmp_path, kind)
    res = triton_repo.run(recipe, BuildLayout(tmp_path / "build"), quantized=q, engine=e)
    return kind, recipe, res, (q, e)


@ALL_KINDS
def test_every_config_parses_and_has_no_placeholder(built):
    kind, recipe, res, _ = built
    expected = ["tensorrt_llm"] if kind == "pytorch" else ["ensemble", "postprocessing", "preprocessing", "tensorrt_llm", "tensorrt_llm_bls"]
    assert res.manifest["models"] == expected and res.manifest["engine_kind"] == kind
    for name in expected:
        text = (res.path / name / "config.pbtxt").read_text()
        assert not any(m in text for m in ("${", "{{", "{%")), name
        cfg = model_config.load_model_config(res.path / name)
        assert cfg.name == name
        if name != "ensemble":
            assert cfg.model_transaction_policy.decoupled == (name in ("tensorrt_llm", "tensorrt_llm_bls"))


@LLMAPI_KIND
def test_llmapi_tensor_names_and_types_match_reference(built):
    kind, recipe, res, _ = built
    cfg = model_config.load_model_config(res.path / "tensorrt_llm")
    assert tensors(cfg.input)["text_input"] == ("TYPE_STRING", [-1])
    assert tensors(cfg.input)["sampling_param_max_tokens"] == ("TYPE_INT32", [1])
    assert "text_output" in tensors(cfg.output)


@IFB_KINDS
def test_tensor_names_and_types_match_reference(built):
    kind, recipe, res, _ = built
    trt = model_config.load_model_config(res.path / "tensorrt_llm")
    assert TRTLLM_INPUTS.items() <= tensors(trt.input).items()
    assert TRTLLM_OUTPUTS.items() <= tensors(trt.output).items()
    assert [i.name for i in trt.input if not i.optional] == ["input_lengths", "request_output_len"]
    for model in ("ensemble", "tensorrt_llm_bls"):
        cfg = model_config.load_model_config(res.path / model)
        assert TEXT_INPUTS.items() <= tensors(cfg.input).items(), model
        assert TEXT_OUTPUTS.items() <= tensors(cfg.output).items(), model
    ens = model_config.load_model_config(res.path / "ensemble")
    steps = {s.model_name: s for s in ens.ensemble_scheduling.step}
    assert {"QUERY": "text_input", "REQUEST_OUTPUT_LEN": "max_tokens", "END_ID": "end_id"}.items() <= dict(
        steps["preprocessing"].input_map).items()
    assert {
        "input_ids": "_INPUT_ID", "input_lengths": "_REQUEST_INPUT_LEN", "request_output_len": "_REQUEST_OUTPUT_LEN",
        "streaming": "stream", "min_tokens": "min_tokens", "end_id": "_PREPROCESSOR_END_ID", "runtime_top_k": "top_k",
    }.items() <= dict(steps["tensorrt_llm"].input_map).items()
    if kind == "cpu":  # build.cpu.detokenize: engine (default): the CPU model writes the ensemble's text
        assert recipe.build.cpu.detokenize == "engine"
        assert [s.model_name for s in ens.ensemble_scheduling.step] == ["preprocessing", "tensorrt_llm"]
        assert dict(steps["tensorrt_llm"].output_map)["text_output"] == "text_output"
        assert tensors(trt.output)["text_output"] == ("TYPE_STRING", [-1])
        assert {"tokenizer_dir": "../preprocessing/tokenizer", "skip_special_tokens": "true"}.items() <= params(trt).items()
        return
    assert "text_output" not in tensors(trt.output)  # not an output of the C++ tensorrtllm backend
    assert dict(steps["tensorrt_llm"].output_map)["output_ids"] == "_TOKENS_BATCH"
    assert dict(steps["postprocessing"].output_map) == {"OUTPUT": "text_output"}
    # every tensor postprocessing gets originates from tensorrt_llm (Triton rule for decoupled steps)
    assert set(dict(steps["postprocessing"].input_map).values()) == {"_TOKENS_BATCH", "_SEQUENCE_LENGTH"}


@IFB_KINDS
def test_parameters_come_from_the_recipe(built):
    kind, recipe, res, (q, e) = built
    p = params(model_config.load_model_config(res.path / "tensorrt_llm"))
    kv = recipe.build.kv_cache_config
    assert p["gpt_model_path"] == str(e.path.resolve())
    assert p["exclude_input_in_output"] == "true"
    if kind == "tensorrt":  # the C++ backend's runtime knobs
        assert p["gpt_model_type"] == "inflight_fused_batching"
        assert p["kv_cache_free_gpu_mem_fraction"] == str(kv.free_gpu_memory_fraction)
        assert p["enable_kv_cache_reuse"] == str(kv.enable_block_reuse).lower()
        assert p["batch_scheduler_policy"] == "guaranteed_no_evict"
        assert p["enable_chunked_context"] == str(recipe.build.enable_chunked_prefill).lower()
        assert ("max_tokens_in_paged_kv_cache" in p) == (kv.max_tokens is not None)
    else:  # the CPU model's config carries exactly the parameters its model.py reads
        import re

        reads = set(re.findall(r'get_param\(\s*raw,\s*"(\w+)"', (REPO / "pipeline" / "triton_repo" / "models" / "tensorrt_llm_cpu" / "model.py").read_text()))
        assert set(p) <= reads and reads - set(p) <= {"cpu_num_threads"}, (set(p), reads)
    trt = model_config.load_model_config(res.path / "tensorrt_llm")
    assert trt.backend == ("tensorrtllm" if kind == "tensorrt" else "python")
    assert trt.max_batch_size == recipe.triton_max_batch_size
    assert ("executor_worker_path" in p) == (kind == "tensorrt")
    assert (res.path / "tensorrt_llm" / "1" / "model.py").exists() == (kind == "cpu")
    pre = model_config.load_model_config(res.path / "preprocessing")
    assert params(pre) == {"tokenizer_dir": "../preprocessing/tokenizer", "add_special_tokens": "true"}
    assert (res.path / "preprocessing" / "tokenizer" / "tokenizer.json").is_file()
    assert pre.instance_group[0].count == recipe.serving.preprocessing_instance_count
    assert model_config.load_model_config(res.path / "postprocessing").instance_group[0].count == 1
    bls = params(model_config.load_model_config(res.path / "tensorrt_llm_bls"))
    assert bls["accumulate_tokens"] == "true" and bls["tensorrt_llm_model_name"] == "tensorrt_llm"
    for model in ("preprocessing", "postprocessing", "tensorrt_llm_bls"):
        assert {"model.py", "_common.py", "detokenize.py", "tokenizer.py"} <= {p.name for p in (res.path / model / "1").iterdir()}


def test_translation_single_function(tmp_path):
    recipe = load_recipe(REPO / "recipes" / "llama31_8b_h200_fp8.yaml", [
        "build.kv_cache_config.max_tokens=4096", "build.kv_cache_config.free_gpu_memory_fraction=0.5",
        "build.scheduler_config.capacity_scheduler_policy=MAX_UTILIZATION", "build.kv_cache_config.enable_block_reuse=false"])
    p = triton_repo.tensorrt_llm_parameters(recipe, tmp_path)
    assert (p["max_tokens_in_paged_kv_cache"], p["kv_cache_free_gpu_mem_fraction"], p["batch_scheduler_policy"],
            p["enable_kv_cache_reuse"]) == ("4096", "0.5", "max_utilization", "false")
    src = (REPO / "pipeline" / "triton_repo" / "stage.py").read_text()
    assert src.count('"kv_cache_free_gpu_mem_fraction"') == 1 and src.count('"max_tokens_in_paged_kv_cache"') == 1


@LLMAPI_KIND
def test_llmapi_layout(built):
    kind, recipe, res, _ = built
    v = res.path / "tensorrt_llm" / "1"
    cfg = yaml.safe_load((v / "model.yaml").read_text())
    assert cfg["backend"] == "pytorch" and cfg["triton_config"] == {
        "max_batch_size": 0, "decoupled": True, "cancellation_check_period_ms": 100}
    # trtpipe's own llmapi model.py (not a link to the container's): upstream's interface + min_tokens/ignore_eos
    assert not (v / "model.py").is_symlink()
    assert (v / "model.py").read_bytes() == (REPO / "pipeline/triton_repo/models/llmapi/model.py").read_bytes()
    assert params(model_config.load_model_config(res.path / "tensorrt_llm")) == {"llm_runtime": "tensorrt_llm"}
    assert model_config.load_model_config(res.path / "tensorrt_llm").max_batch_size == 0


@ALL_KINDS
def test_cache_reuse_and_invalidation(built, tmp_path):
    kind, recipe, res, (q, e) = built
    again = triton_repo.run(recipe, BuildLayout(res.path.parent), quantized=q, engine=e)
    assert again.cached and again.manifest["cache_key"] == res.manifest["cache_key"]
    other = load_recipe(REPO / "recipes" / f"{RECIPES[kind]}.yaml", ["serving.max_queue_delay_microseconds=7"])
    assert not triton_repo.run(other, BuildLayout(res.path.parent), quantized=q, engine=e).cached


def test_unknown_field_fails_at_generation_time(monkeypatch):
    import jinja2

    from pipeline.core.errors import StageError

    with pytest.raises(StageError, match="undefined"):
        render.render_model_config("postprocessing", max_batch_size=1, parameters={})
    # a value cannot inject fields: it is escaped into the string
    cfg = render.render_model_config("postprocessing", max_batch_size=1, instance_count=1,
                                          parameters={'k" } bogus_field: { x': "1"})
    assert 'k" } bogus_field: { x' in cfg.parameters
    templates = {"bad.pbtxt.j2": 'name: "x"\nbogus_field: 1\n', "enum.pbtxt.j2": 'input [ { name: "a" data_type: TYPE_INT33 } ]',
                 "left.pbtxt.j2": 'name: "${engine_dir}"'}
    env = jinja2.Environment(loader=jinja2.DictLoader(templates), undefined=jinja2.StrictUndefined)
    monkeypatch.setattr(render, "_jinja_env", lambda: env)
    for name in ("bad", "enum"):
        with pytest.raises(StageError, match="not a valid ModelConfig"):
            render.render_model_config(name)
    with pytest.raises(StageError, match="placeholder"):
        render.render_model_config("left")


# ------------------------------------------------------------------------------- real Triton


def _stream(url, model, inputs, outputs, request_id):
    import tritonclient.grpc as grpcclient

    q: queue.Queue = queue.Queue()
    client = grpcclient.InferenceServerClient(url)
    client.start_stream(callback=lambda result, error: q.put((result, error)))
    try:
        client.async_stream_infer(model, inputs, outputs=[grpcclient.InferRequestedOutput(o) for o in outputs],
                                  request_id=request_id, enable_empty_final_response=True)
        got = []
        while True:
            result, error = q.get(timeout=120)
            assert error is None, error
            resp = result.get_response()
            if resp.outputs:
                got.append({o: result.as_numpy(o) for o in outputs if result.as_numpy(o) is not None})
            if resp.parameters["triton_final_response"].bool_param:
                return got
    finally:
        client.stop_stream()
        client.close()


def _in(name, arr, dtype):
    import tritonclient.grpc as grpcclient

    t = grpcclient.InferInput(name, list(arr.shape), dtype)
    t.set_data_from_numpy(arr)
    return t


def _real_cpu_repo(tmp_path: Path, *overrides: str) -> Path:
    """The CPU default recipe's model repository (one torch thread, plus ``overrides``) on the real quantized
    SmolLM2 and CPU engine, written to ``tmp_path``."""
    from support import quantized_stage

    from pipeline.engine import cpu as engine_cpu

    cache = Path(os.environ["TRTPIPE_CACHE_DIR"])
    recipe = load_recipe(REPO / "recipes" / "smollm2_135m_cpu_fp8.yaml", ["build.cpu.num_threads=1", *overrides])
    q = quantized_stage(cache)
    e = engine_cpu.run(recipe, BuildLayout(cache / "triton-test-build"), quantized=q)
    return triton_repo.run(recipe, BuildLayout(tmp_path), quantized=q, engine=e).path


@pytest.mark.triton
@pytest.mark.timeout(900)
@pytest.mark.parametrize("detokenize", ["engine", "postprocessing"])
def test_real_triton_streams_through_all_three_models(tmp_path, detokenize):
    """The ensemble's streamed text equals the BLS's whether the CPU engine model decodes it (two-step
    ensemble) or postprocessing does (the GPU layout's three steps)."""
    from transformers import AutoTokenizer

    from pipeline.triton.server import TritonServer

    repo = _real_cpu_repo(tmp_path, f"build.cpu.detokenize={detokenize}")
    steps = [st.model_name for st in model_config.load_model_config(repo / "ensemble" / "config.pbtxt").ensemble_scheduling.step]
    assert steps == (["preprocessing", "tensorrt_llm"] if detokenize == "engine"
                     else ["preprocessing", "tensorrt_llm", "postprocessing"])
    tok = AutoTokenizer.from_pretrained(repo / "preprocessing" / "tokenizer")
    prompt = "<|im_start|>user\nWhat is the capital of France?<|im_end|>\n<|im_start|>assistant\n"
    with TritonServer(repo, log_file=tmp_path / "triton.log", ready_timeout_s=300, http_port=None, grpc_port=None,
                      metrics_port=None) as srv:
        text_inputs = [
            _in("text_input", np.array([[prompt.encode()]], dtype=object), "BYTES"),
            _in("max_tokens", np.array([[24]], dtype=np.int32), "INT32"),
            _in("stream", np.array([[True]]), "BOOL"),
            _in("return_num_output_tokens", np.array([[True]]), "BOOL"),
        ]
        texts = {}
        for model in ("ensemble", "tensorrt_llm_bls"):
            got = _stream(srv.grpc_url, model, text_inputs, ["text_output", "num_output_tokens"], f"{model}-1")
            pieces = [g["text_output"].reshape(-1)[0].decode() for g in got]
            assert len(pieces) > 3, pieces  # streamed, one response per step
            texts[model] = "".join(pieces)
            print(model, repr(texts[model]), pieces[:8])
        assert "Paris" in texts["ensemble"]
        assert texts["ensemble"] == texts["tensorrt_llm_bls"]

        ids = np.array([tok.encode(prompt)], dtype=np.int32)
        got = _stream(srv.grpc_url, "tensorrt_llm", [
            _in("input_ids", ids, "INT32"), _in("input_lengths", np.array([[ids.shape[1]]], dtype=np.int32), "INT32"),
            _in("request_output_len", np.array([[12]], dtype=np.int32), "INT32"), _in("streaming", np.array([[True]]), "BOOL"),
            _in("min_tokens", np.array([[12]], dtype=np.int32), "INT32"), _in("end_id", np.array([[-1]], dtype=np.int32), "INT32"),
        ], ["output_ids", "sequence_length"], "ids-1")
        out = [int(t) for g in got for t in g["output_ids"].reshape(-1)]
        assert len(got) == 12 and len(out) == 12  # min_tokens = request_output_len, end_id -1: exact length
        print("tensorrt_llm", out, repr(tok.decode(out)))
        assert tok.decode(out, skip_special_tokens=True).startswith(texts["ensemble"][:10])


@pytest.mark.triton
@pytest.mark.timeout(300)
def test_cpu_model_with_text_output_but_no_tokenizer_refuses_to_load(tmp_path):
    """A hand-edited CPU repository that declares text_output without tokenizer_dir fails the model load with
    a message naming the parameter, instead of streams that silently lack their text."""
    from pipeline.core.errors import StageError
    from pipeline.triton.server import TritonServer

    repo = _real_cpu_repo(tmp_path)
    cfg = model_config.load_model_config(repo / "tensorrt_llm")
    assert "text_output" in tensors(cfg.output)
    del cfg.parameters["tokenizer_dir"]
    model_config.write_model_config(repo / "tensorrt_llm" / "config.pbtxt", cfg)
    with pytest.raises(StageError) as exc:
        with TritonServer(repo, log_file=tmp_path / "triton.log", ready_timeout_s=120, http_port=None, grpc_port=None,
                          metrics_port=None):
            pass
    assert "output text_output needs the parameter tokenizer_dir" in str(exc.value)
