"""Does each model of a running Triton answer? (issue #39: a process that runs is not a model that answers.)

:func:`probe` asks Triton's model-ready API for every model of the repository index, then sends one tiny real
inference (one output token, a deadline of ``timeout_s``) to every model with an LLM request interface: the token
interface (``input_ids``: ``tensorrt_llm``), the text interface (``text_input`` + ``max_tokens``: ``ensemble``,
``tensorrt_llm_bls``) and the LLM-API interface (``text_input`` + ``sampling_param_max_tokens``). The ensemble's
request also goes through ``preprocessing`` and ``postprocessing``, so every model of a TensorRT-LLM repository is
exercised. A python-backend model whose stub process died (OOM killer, a crash) stays READY in Triton's index while
its requests fail (``Stub process 'tensorrt_llm_0_0' is not healthy``) or never end: only the inference sees it.

Each problem is a :class:`ModelProblem`; ``definitive`` marks an answer that proves the model broken (an error
response, not READY), as opposed to no answer within the deadline (which an overloaded but healthy server can also
give): :mod:`pipeline.serve.watch` restarts at once on the first and only after repeated timeouts on the second.
"""

from __future__ import annotations

import dataclasses
import json
import urllib.error
import urllib.request
from typing import Any

from pipeline.triton.process import repository_index

#: seconds one probe inference may take (one token; under load it joins the running batch at the next step)
PROBE_TIMEOUT_S = 10.0


@dataclasses.dataclass(frozen=True)
class ModelProblem:
    """A model that does not answer: its name, what was seen, and whether that proves it broken."""

    model: str
    what: str
    definitive: bool

    def __str__(self) -> str:
        return f"{self.model} ({self.what})"


def _get_json(url: str, timeout: float) -> Any:
    with urllib.request.urlopen(url, timeout=timeout) as r:
        return json.loads(r.read())


def _model_ready(http_url: str, model: str, timeout: float) -> bool:
    try:
        with urllib.request.urlopen(f"http://{http_url}/v2/models/{model}/ready", timeout=timeout) as r:
            return r.status == 200
    except (urllib.error.URLError, OSError, ValueError):
        return False


def probe_request(model: str, inputs: dict[str, str], max_batch_size: int) -> Any | None:
    """A one-token streaming request for ``model`` from its declared inputs (``{name: datatype}``), or ``None``
    when it has no LLM request interface (``preprocessing``, ``postprocessing``: the ensemble's request covers them)."""
    import numpy as np
    from tritonclient.grpc import service_pb2

    if "input_ids" in inputs:
        wanted = [("input_ids", "INT32", np.array([1, 504, 3458], dtype=np.int32)), ("input_lengths", "INT32", 3),
                  ("request_output_len", "INT32", 1), ("streaming", "BOOL", True)]
    elif "text_input" in inputs:
        wanted = [("text_input", "BYTES", b"Hello"), ("max_tokens", "INT32", 1), ("stream", "BOOL", True),
                  ("streaming", "BOOL", True), ("sampling_param_max_tokens", "INT32", 1)]
    else:
        return None
    req = service_pb2.ModelInferRequest(model_name=model, id="trtpipe-health")
    req.parameters["triton_enable_empty_final_response"].bool_param = True
    dtypes = {"INT32": np.int32, "BOOL": np.bool_, "BYTES": np.object_}
    for name, dt, value in wanted:
        if name not in inputs:
            continue
        arr = value if isinstance(value, np.ndarray) else np.array([value], dtype=dtypes[dt])
        arr = arr.reshape(1, -1) if max_batch_size > 0 else arr
        t = req.inputs.add()
        t.name, t.datatype = name, dt
        t.shape.extend(arr.shape)
        raw = b"".join(len(b).to_bytes(4, "little") + b for b in arr.reshape(-1)) if dt == "BYTES" else arr.tobytes()
        req.raw_input_contents.append(raw)
    return req


def _infer(grpc_url: str, request: Any, timeout_s: float) -> ModelProblem | None:
    """Send ``request`` on a stream and read it to its end; a problem, or ``None`` when it answered."""
    import grpc
    from tritonclient.grpc import service_pb2_grpc

    model = request.model_name
    with grpc.insecure_channel(grpc_url) as channel:
        call = service_pb2_grpc.GRPCInferenceServiceStub(channel).ModelStreamInfer(iter((request,)), timeout=timeout_s)
        error, final = None, False
        try:
            for resp in call:  # read to the server's end of the stream (see pipeline.bench.client)
                if resp.error_message and error is None:
                    error = " ".join(resp.error_message.split())[:200]
                flag = resp.infer_response.parameters.get("triton_final_response")
                final = final or bool(flag is not None and flag.bool_param)
        except grpc.RpcError as e:
            if e.code() == grpc.StatusCode.DEADLINE_EXCEEDED:
                return ModelProblem(model, f"no answer to a one-token request within {timeout_s:g} s", False)
            return ModelProblem(model, f"{e.code().name}: {' '.join(str(e.details()).split())[:200]}", True)
    if error is not None:
        return ModelProblem(model, f"error: {error}", True)
    return None if final else ModelProblem(model, "stream ended without a final response", True)


def stub_processes(server_pid: int) -> dict[str, int]:
    """The python-backend stub processes of the Triton ``server_pid``: model instance name (``tensorrt_llm_0_0``) →
    pid, from the children's command lines (a stub is started as ``triton_python_backend_stub … INSTANCE KIND``).
    A stub that died (SIGKILL, the OOM killer) is missing, or has another pid once Triton started a new one. Empty when
    the server is gone or has no python models."""
    import re

    import psutil

    out: dict[str, int] = {}
    try:
        children = psutil.Process(server_pid).children(recursive=True)
    except psutil.Error:
        return out
    for child in children:
        try:
            cmd = child.cmdline()
        except psutil.Error:
            continue
        if any("triton_python_backend_stub" in c for c in cmd):
            name = next((c for c in reversed(cmd) if re.fullmatch(r"\w+_\d+_\d+", c)), None)
            if name:
                out[name] = child.pid
    return out


def probe(http_url: str, grpc_url: str, *, timeout_s: float = PROBE_TIMEOUT_S) -> list[ModelProblem]:
    """The models of the Triton at ``http_url``/``grpc_url`` that do not answer (``[]``: every model answers).

    A server that does not answer its repository index is one problem named ``server``."""
    index = repository_index(http_url)
    if not index:
        return [ModelProblem("server", f"no answer from http://{http_url}", True)]
    problems: list[ModelProblem] = []
    for entry in index:
        name = entry.get("name", "?")
        if not _model_ready(http_url, name, timeout=2.0):
            state = entry.get("state") or "UNKNOWN"
            problems.append(ModelProblem(name, f"not ready: {state}" + (f", {entry['reason']}" if entry.get("reason") else ""), True))
            continue
        try:
            meta = _get_json(f"http://{http_url}/v2/models/{name}", 2.0)
            config = _get_json(f"http://{http_url}/v2/models/{name}/config", 2.0)
        except (urllib.error.URLError, OSError, ValueError) as e:
            problems.append(ModelProblem(name, f"metadata unreadable: {e}", True))
            continue
        if not config.get("model_transaction_policy", {}).get("decoupled", False):
            continue
        request = probe_request(name, {t["name"]: t["datatype"] for t in meta.get("inputs", [])}, int(config.get("max_batch_size", 0)))
        if request is not None and (problem := _infer(grpc_url, request, timeout_s)) is not None:
            problems.append(problem)
    return problems
