"""The ``kld`` gate's serving side: context logits from each deployment, scored one sequence at a time.

Where each serving path exposes the logits teacher forcing needs (the whole sequence is the request's prompt, so
its *context* logits hold the next-token distribution at every position):

* TensorRT-LLM C++ backend (``tensorrt_llm`` model): input ``return_context_logits`` (BOOL) → output
  ``context_logits`` ``[batch, input_len, vocab]`` in the model's ``logits_datatype`` (tensorrtllm_backend
  ``all_models/inflight_batcher_llm/tensorrt_llm/config.pbtxt``@c2e65b88d852:265/519, read by
  ``inflight_batcher_llm/src/utils.cc``@c2e65b88d852:620-626 into ``executor::OutputConfig``, written by
  ``model_instance_state.cc``@c2e65b88d852:1105-1117 as ``[1, input_len, vocab]``). The engine must be built with
  ``trtllm-build --gather_context_logits`` (BuildConfig ``gather_context_logits``; pipeline/data/
  trtllm_1.2.1_contract.yaml): ``trtpipe build`` adds it when the recipe's ``eval.rule`` is ``kld``
  (:func:`pipeline.recipe.eval.needs_context_logits`).
* LLM API (PyTorch backend): ``SamplingParams.return_context_logits`` / ``return_generation_logits`` /
  ``logprobs`` / ``prompt_logprobs`` (NVIDIA/TensorRT-LLM ``tensorrt_llm/sampling_params.py``@a98a9061d72f
  "Keep the below fields in sync with tllme.OutputConfig"); no build flag. The upstream Triton ``llmapi`` model
  returns none of them (its outputs: text, token counts, ``cumulative_logprob`` — ``all_models/llmapi/
  tensorrt_llm/1/model.py``@c2e65b88d852:400-434), so the gate refuses that interface.
* trtpipe's CPU engine: the same ``tensorrt_llm`` input and output (FP32; :mod:`pipeline.cpu_runtime.engine`
  ``on_context_logits``), no build flag.

Each sequence (prompt ids + the baseline's output ids, cut to the engine's ``max_input_len``) is sent with
``request_output_len = 1`` to the baseline and then to the candidate; the client computes the per-position
statistics (:func:`pipeline.eval.kld.position_stats`) and drops both arrays before the next sequence (for
SmolLM2 one response is ``input_len x 49,152 x 4`` bytes, ~80 MB at 400 tokens).
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import queue
from collections.abc import Callable, Sequence
from typing import Any

import numpy as np

from pipeline.core.errors import StageError, UserError
from pipeline.eval.kld import SeqStats, position_stats

TOKEN_MODEL = "tensorrt_llm"
RETURN_INPUT, LOGITS_OUTPUT = "return_context_logits", "context_logits"
#: per-request deadline in seconds (a 500-token prefill with full logits takes ~1 s on the 2-core CPU host)
TIMEOUT_S = 300.0


def check_model(url: str, model: str = TOKEN_MODEL) -> None:
    """Refuse a model that cannot return context logits (one line naming it and what it lacks).

    Raises:
        UserError: unreachable server, the LLM-API interface, or no ``return_context_logits`` / ``context_logits``.
    """
    from pipeline.bench.client import preflight

    info = asyncio.run(preflight(url, model))
    if info.interface == "llmapi":
        raise UserError(f"model {model!r} at {url} is the LLM-API model, which returns no logits (upstream "
                        "all_models/llmapi/tensorrt_llm/1/model.py): the kld rule needs the tensorrt_llm token model")
    if RETURN_INPUT not in info.inputs or LOGITS_OUTPUT not in info.outputs:
        raise UserError(f"model {model!r} at {url} declares no {RETURN_INPUT} input / {LOGITS_OUTPUT} output")


class LogitsClient:
    """One gRPC stream to a decoupled ``tensorrt_llm`` model asking for context logits, one request at a time."""

    def __init__(self, url: str, model: str = TOKEN_MODEL, timeout_s: float = TIMEOUT_S):
        import tritonclient.grpc as grpcclient  # sets 2 GiB message limits on its channel

        self._g, self.url, self.model, self.timeout_s = grpcclient, url, model, timeout_s
        self._client = grpcclient.InferenceServerClient(url)
        self._q: queue.Queue = queue.Queue()
        self._client.start_stream(callback=lambda result, error: self._q.put((result, error)))
        self._n = 0

    def context_logits(self, ids: Sequence[int]) -> np.ndarray:
        """float32 ``[len(ids), vocab]``: the logits at every position of ``ids`` (1 token is generated and dropped).

        Raises:
            StageError: the server answered with an error, without logits, or not within ``timeout_s``.
        """
        g = self._g
        arr = np.asarray([list(ids)], dtype=np.int32)
        inputs = []
        for name, dt, value in (("input_ids", "INT32", arr), ("input_lengths", "INT32", np.array([[arr.shape[1]]], np.int32)),
                                ("request_output_len", "INT32", np.array([[1]], np.int32)),
                                (RETURN_INPUT, "BOOL", np.array([[True]])), ("streaming", "BOOL", np.array([[False]]))):
            t = g.InferInput(name, list(value.shape), dt)
            t.set_data_from_numpy(value)
            inputs.append(t)
        self._n += 1
        self._client.async_stream_infer(self.model, inputs, outputs=[g.InferRequestedOutput(LOGITS_OUTPUT)],
                                        request_id=f"kld-{self._n}", enable_empty_final_response=True)
        out = None
        while True:
            try:
                result, error = self._q.get(timeout=self.timeout_s)
            except queue.Empty:
                raise StageError(f"{self.url}: no context logits within {self.timeout_s:.0f} s") from None
            if error is not None:
                raise StageError(f"{self.url}: context-logits request failed: {error}")
            got = result.as_numpy(LOGITS_OUTPUT)
            if got is not None:
                out = got
            if result.get_response().parameters["triton_final_response"].bool_param:
                break
        if out is None or out.ndim != 3 or out.shape[1] != len(ids):
            raise StageError(f"{self.url}: {LOGITS_OUTPUT} {None if out is None else out.shape} for {len(ids)} tokens")
        return out[0]

    def close(self) -> None:
        """Stop the stream and close the channel."""
        with contextlib.suppress(Exception):
            self._client.stop_stream()
        with contextlib.suppress(Exception):
            self._client.close()

    def __enter__(self) -> LogitsClient:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def served(target: Any, stack: contextlib.ExitStack, on_status: Callable[[str], None] = lambda s: None) -> Any:
    """``target`` (an :class:`pipeline.eval.stage.EvalTarget`) answering on a URL — a build is served on free ports
    until ``stack`` closes — with its token model checked for context logits (:func:`check_model`)."""
    if target.url is None:
        from pipeline.serve import stage as serve

        opts = serve.ServeOptions(http_port=None, grpc_port=None, metrics_port=None)
        handle = stack.enter_context(serve.run(target.layout, opts))
        on_status(f"serving {target.label} on {handle.grpc_url} ({handle.ready_s:.1f} s to ready)")
        target = dataclasses.replace(target, url=handle.grpc_url)
    check_model(target.url)
    return target


def teacher_sequences(prompts: Sequence[str], outputs: Sequence[str], tokenizer: Any,
                      max_len: int | None) -> list[tuple[list[int], int]]:
    """``(ids, start)`` per prompt: the prompt's ids (as the preprocessing model encodes it, special tokens on)
    followed by the baseline output's ids, cut to ``max_len`` tokens; positions ``start-1 .. len-2`` predict the
    output tokens ``ids[start:]`` (none when the output is empty or cut off)."""
    out = []
    for p, o in zip(prompts, outputs):
        pi = tokenizer(p, add_special_tokens=True)["input_ids"]
        ids = pi + tokenizer(o, add_special_tokens=False)["input_ids"]
        out.append((ids[:max_len] if max_len else ids, len(pi)))
    return out


def score(base_url: str, cand_url: str, seqs: Sequence[tuple[list[int], int]], *, model: str = TOKEN_MODEL,
          advance: Callable[[int], None] = lambda n: None) -> list[SeqStats]:
    """Per-sequence :class:`SeqStats` of the candidate at ``cand_url`` against the baseline at ``base_url``."""
    out = []
    with LogitsClient(base_url, model) as b, LogitsClient(cand_url, model) as c:
        for ids, start in seqs:
            if len(ids) <= start:
                out.append(SeqStats(0, 0.0, 0, 0.0, 0.0, []))
            else:
                lb = b.context_logits(ids)[start - 1:-1]
                lc = c.context_logits(ids)[start - 1:-1]
                out.append(position_stats(lb, lc, ids[start:]))
                del lb, lc
            advance(1)
    return out

