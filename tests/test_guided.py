"""Guided decoding (issue #36): the repository parameters and tokenizer-info file on every path, and for real on CPU —
50 JSON-schema requests through the served CPU deployment (the session's ``cpu_build``, one Triton start) all valid
against the schema; regex guides through the BLS and the token interface; a bad guide is an error response.
"""

from __future__ import annotations

import json
import queue
import re
from pathlib import Path

import jsonschema
import numpy as np
import pytest
from support import free_ports
from tritonclient.grpc.model_config_pb2 import DataType

from pipeline.core.layout import BuildLayout
from pipeline.recipe import load_recipe
from pipeline.triton import model_config
from pipeline.triton_repo import stage as triton_repo
from pipeline.trtllm import llmapi
from pipeline.trtllm.guided import TOKENIZER_INFO_KEYS, read_tokenizer_info
from pipeline.trtllm.triton_contract import repository_problems

REPO = Path(__file__).resolve().parents[1]
#: bounded lengths, so every output can close the object well inside max_tokens (SmolLM2 may ramble in strings)
SCHEMA = {
    "type": "object",
    "properties": {"name": {"type": "string", "maxLength": 12}, "age": {"type": "integer", "minimum": 0, "maximum": 120}},
    "required": ["name", "age"],
    "additionalProperties": False,
}
NAMES = ["Alice", "Bob", "Carla", "Dmitri", "Eve", "Farid", "Grace", "Hiro", "Ines", "Jonas"]


def _params(cfg) -> dict[str, str]:
    return {k: v.string_value for k, v in cfg.parameters.items()}


# ---------------------------------------------------------------------------------------------- contract (no server)
def test_engine_path_gets_both_parameters_only_when_on(tmp_path):
    """tensorrt recipe: off → both C++ keys present and empty; on → xgrammar + an absolute path into the repository,
    and the repository still meets the upstream contract."""
    recipe = load_recipe(REPO / "recipes" / "llama31_8b_h200_fp8.yaml")
    off = _params(triton_repo.model_configs(recipe, tmp_path, repo_dir=tmp_path / "repo")["tensorrt_llm"])
    assert off["guided_decoding_backend"] == "" and off["xgrammar_tokenizer_info_path"] == ""
    on_recipe = recipe.model_copy(update={"build": recipe.build.model_copy(update={"guided_decoding_backend": "xgrammar"})})
    configs = triton_repo.model_configs(on_recipe, tmp_path, repo_dir=tmp_path / "repo")
    on = _params(configs["tensorrt_llm"])
    assert on["guided_decoding_backend"] == "xgrammar"
    assert on["xgrammar_tokenizer_info_path"] == str((tmp_path / "repo" / "tensorrt_llm" / "xgrammar_tokenizer_info.json").resolve())
    assert repository_problems(configs, "cpp") == []
    for model in ("tensorrt_llm", "ensemble", "tensorrt_llm_bls"):
        declared = {i.name: (DataType.Name(i.data_type), list(i.dims), i.optional) for i in configs[model].input}
        for name in ("guided_decoding_guide_type", "guided_decoding_guide"):
            assert declared[name] == ("TYPE_STRING", [1], True), (model, name)
    ens = configs["ensemble"]
    maps = {k: v for s in ens.ensemble_scheduling.step if s.model_name == "tensorrt_llm" for k, v in s.input_map.items()}
    assert maps["guided_decoding_guide_type"] == "guided_decoding_guide_type" and maps["guided_decoding_guide"] == "guided_decoding_guide"


def test_llm_api_argument_follows_the_recipe(tmp_path):
    recipe = load_recipe(REPO / "recipes" / "llama31_8b_h200_fp8_pytorch.yaml")
    assert "guided_decoding_backend" not in llmapi.llm_api_kwargs(recipe, tmp_path)
    on = recipe.model_copy(update={"build": recipe.build.model_copy(update={"guided_decoding_backend": "xgrammar"})})
    kwargs = llmapi.llm_api_kwargs(on, tmp_path)
    assert kwargs["guided_decoding_backend"] == "xgrammar"
    assert llmapi.check_kwargs(kwargs, backend="pytorch") == []


def test_recipe_refuses_an_unknown_backend(tmp_path):
    bad = (REPO / "recipes" / "smollm2_135m_cpu_fp8.yaml").read_text().replace(
        "guided_decoding_backend: xgrammar", "guided_decoding_backend: outlines")
    path = tmp_path / "r.yaml"
    path.write_text(bad)
    from pipeline.core.errors import UserError

    with pytest.raises(UserError, match="build.guided_decoding_backend"):
        load_recipe(path)


# ---------------------------------------------------------------------------------------------- the real CPU deployment
def test_cpu_build_writes_the_tokenizer_info_file(cpu_build, smollm2_tokenizer):
    """Upstream's file format, for this model's tokenizer: every token by id, its backend JSON, EOS as stop token."""
    repo = BuildLayout(cpu_build).triton_repo
    params = _params(model_config.load_model_config(repo / "tensorrt_llm"))
    assert params["guided_decoding_backend"] == "xgrammar"
    info = read_tokenizer_info(Path(params["xgrammar_tokenizer_info_path"]))
    assert set(TOKENIZER_INFO_KEYS) <= set(info)
    vocab = smollm2_tokenizer.get_vocab()
    assert len(info["encoded_vocab"]) == len(vocab)
    assert all(info["encoded_vocab"][i] == t for t, i in vocab.items())
    assert info["stop_token_ids"] == [smollm2_tokenizer.eos_token_id]
    assert json.loads(info["tokenizer_str"])["model"]["type"] == "BPE"


def _inputs(grpcclient, **named):
    out = []
    for name, (value, dtype) in named.items():
        t = grpcclient.InferInput(name, list(value.shape), dtype)
        t.set_data_from_numpy(value)
        out.append(t)
    return out


def _text(value: str) -> tuple[np.ndarray, str]:
    return np.array([[value.encode()]], dtype=object), "BYTES"


@pytest.mark.triton
def test_served_cpu_deployment_returns_schema_valid_json(tmp_path, cpu_build, smollm2_tokenizer):
    """50 concurrent json_schema requests through the ensemble: 0 invalid (json.loads + jsonschema); a regex guide
    through tensorrt_llm_bls and through the token interface matches; a malformed schema and an unknown guide type are
    error responses naming the input, and the server keeps serving."""
    import tritonclient.grpc as grpcclient

    from pipeline.serve import compat
    from pipeline.triton.server import TritonServer

    http, grpc, metrics = free_ports(3)
    repo = compat.ServeTarget.resolve(cpu_build).repo
    schema = json.dumps(SCHEMA)
    results: queue.Queue = queue.Queue()
    with TritonServer(repo, log_file=tmp_path / "triton.log", ready_timeout_s=240, http_port=http, grpc_port=grpc,
                      metrics_port=metrics) as server:
        client = grpcclient.InferenceServerClient(server.grpc_url)
        client.start_stream(callback=lambda result, error: results.put((result, error)))
        sent: dict[str, str] = {}

        def send(model: str, rid: str, **named) -> None:
            sent[rid] = model
            client.async_stream_infer(model, _inputs(grpcclient, **named), request_id=rid, enable_empty_final_response=True)

        for i in range(50):
            send("ensemble", f"json-{i}", text_input=_text(f"Describe {NAMES[i % len(NAMES)]} (case {i}) as JSON."),
                 max_tokens=(np.array([[64]], dtype=np.int32), "INT32"),
                 guided_decoding_guide_type=_text("json_schema"), guided_decoding_guide=_text(schema))
        regex = r"[0-9]{3}-[0-9]{4}"
        send("tensorrt_llm_bls", "bls-regex", text_input=_text("My phone number is"),
             max_tokens=(np.array([[16]], dtype=np.int32), "INT32"),
             guided_decoding_guide_type=_text("regex"), guided_decoding_guide=_text(regex))
        ids = np.array([smollm2_tokenizer.encode("The answer is")], dtype=np.int32)
        send("tensorrt_llm", "tok-regex", input_ids=(ids, "INT32"),
             input_lengths=(np.array([[ids.shape[1]]], dtype=np.int32), "INT32"),
             request_output_len=(np.array([[8]], dtype=np.int32), "INT32"),
             end_id=(np.array([[smollm2_tokenizer.eos_token_id]], dtype=np.int32), "INT32"),
             guided_decoding_guide_type=_text("regex"), guided_decoding_guide=_text("(yes|no)"))
        send("ensemble", "bad-schema", text_input=_text("x"), max_tokens=(np.array([[4]], dtype=np.int32), "INT32"),
             guided_decoding_guide_type=_text("json_schema"), guided_decoding_guide=_text('{"type": "object", "properties": '))
        send("ensemble", "bad-type", text_input=_text("x"), max_tokens=(np.array([[4]], dtype=np.int32), "INT32"),
             guided_decoding_guide_type=_text("xml"), guided_decoding_guide=_text("<a/>"))

        texts: dict[str, str] = {}
        tokens: dict[str, list[int]] = {}
        errors: dict[str, str] = {}
        done: set[str] = set()
        while len(done) < len(sent):
            result, error = results.get(timeout=600)
            if error is not None:
                rid = _error_request(error)
                errors[rid] = str(error)
                done.add(rid)
                continue
            resp = result.get_response()
            rid = resp.id
            if sent[rid] == "tensorrt_llm":
                out = result.as_numpy("output_ids")
                if out is not None:
                    tokens.setdefault(rid, []).extend(out.reshape(-1).tolist())
            else:
                out = result.as_numpy("text_output")
                if out is not None:
                    texts[rid] = texts.get(rid, "") + "".join(t.decode() for t in out.reshape(-1))
            if resp.parameters["triton_final_response"].bool_param:
                done.add(rid)
        client.stop_stream()
        assert client.is_server_live()
        client.close()

    invalid = []
    for i in range(50):
        out = texts.get(f"json-{i}", "")
        try:
            jsonschema.validate(json.loads(out), SCHEMA)
        except (json.JSONDecodeError, jsonschema.ValidationError) as e:
            invalid.append((i, out, str(e).splitlines()[0]))
    assert invalid == [], f"{len(invalid)} of 50 outputs invalid against the schema: {invalid[:5]}"
    assert re.fullmatch(regex, texts["bls-regex"].strip()), texts["bls-regex"]
    generated = smollm2_tokenizer.decode(tokens["tok-regex"], skip_special_tokens=True)
    assert generated in ("yes", "no"), generated
    assert "guided_decoding_guide" in errors.get("bad-schema", "") and "does not compile" in errors["bad-schema"]
    assert "guided_decoding_guide_type 'xml'" in errors.get("bad-type", "")


def _error_request(error) -> str:
    """Which request an error answers: a streamed error carries no request id, so match it by its message."""
    msg = str(error)
    if "'xml'" in msg:
        return "bad-type"
    if "does not compile" in msg:
        return "bad-schema"
    raise AssertionError(f"unexpected error response: {msg}")


def test_trtllm_serve_stand_in_guides_by_response_format(cpu_build):
    """trtllm-serve's way: ``response_format`` on /v1/completions and /v1/chat/completions becomes the request's guide
    (openai_protocol ``_response_format_to_guided_decoding_params``, cited in pipeline/cpu_runtime/openai/): a json
    schema → schema-valid JSON, a regex → a full match, ``json`` without ``schema`` → 400 with upstream's message,
    ``text`` → unguided (the same tokens as no response_format at all)."""
    from fastapi.testclient import TestClient

    from pipeline.cpu_runtime.llm import LLM
    from pipeline.cpu_runtime.openai.routes import create_app

    engine = str(BuildLayout(cpu_build).engine)
    with LLM(engine, guided_decoding_backend="xgrammar") as llm, TestClient(create_app(llm, "m", engine)) as client:
        def text(route: str, **body) -> str:
            r = client.post(route, json={"model": "m", "max_tokens": 48, **body})
            assert r.status_code == 200, r.text
            choice = r.json()["choices"][0]
            return choice["text"] if route == "/v1/completions" else choice["message"]["content"]

        doc = json.loads(text("/v1/completions", prompt="Describe Alice (case 0) as JSON.",
                              response_format={"type": "json", "schema": SCHEMA}))
        jsonschema.validate(doc, SCHEMA)
        chat = json.loads(text("/v1/chat/completions", messages=[{"role": "user", "content": "Bob as JSON, please."}],
                               response_format={"type": "json", "schema": SCHEMA}))
        jsonschema.validate(chat, SCHEMA)
        regex = r"[0-9]{3}-[0-9]{4}"
        assert re.fullmatch(regex, text("/v1/completions", prompt="My phone number is", max_tokens=16,
                                        response_format={"type": "regex", "regex": regex}))
        plain = text("/v1/completions", prompt="The capital of France is", max_tokens=8)
        assert text("/v1/completions", prompt="The capital of France is", max_tokens=8,
                    response_format={"type": "text"}) == plain
        assert not re.fullmatch(regex, plain)
        bad = client.post("/v1/completions", json={"model": "m", "prompt": "x", "max_tokens": 4,
                                                   "response_format": {"type": "json"}})
        assert bad.status_code == 400 and "The 'schema' field is required" in bad.text, bad.text
