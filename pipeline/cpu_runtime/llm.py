"""An LLM-API-shaped facade over :class:`~pipeline.cpu_runtime.engine.CpuEngine`: what trtpipe's ``llmapi`` Triton
model (``pipeline/triton_repo/models/llmapi/model.py``) calls on CPU instead of ``tensorrt_llm``.

The names and semantics follow TensorRT-LLM's LLM API, as far as the calls that model makes go (upstream code read at
the commits named; these are undated copies of the index, the 1.2.1 sources themselves are not readable,
docs/upstream.md):

* ``LLM(model, tokenizer=None, **kwargs)``, ``generate_async(inputs, sampling_params, streaming)`` → a
  :class:`RequestOutput`, ``shutdown()`` (triton_backend/all_models/llmapi/tensorrt_llm/1/model.py@044a90d209e3:
  ``LLM(**self.llm_engine_args)`` 363, ``generate_async(prompt, SamplingParams(**sampling_params), streaming)`` in
  ``_execute_single_request``, ``llm.shutdown`` on finalize);
* :class:`RequestOutput`: an async iterator yielding itself after every new response (``async for request_output in
  response_iterator``), ``.finished``, ``.abort()``, ``.outputs[0]`` a :class:`CompletionOutput` whose ``text`` and
  ``token_ids`` are cumulative (``text_diff``/``token_ids_diff`` the new part), ``finish_reason`` one of ``stop``,
  ``length``, ``cancelled``, ``stop_reason`` the stop string that ended it (tensorrt_llm/executor/result.py@a678b91aafbe:
  ``CompletionOutput`` 92-153, ``_handle_sequence``'s finish reasons, ``abort``/``finished`` of ``GenerationResult``);
* :class:`SamplingParams`: the fields the model passes (tensorrt_llm/sampling_params.py@000a01de66f0:203-266):
  ``max_tokens`` (default 32), ``min_tokens`` (None → no lower bound), ``ignore_eos`` (default False: keep
  generating after the end token), ``end_id`` (default: the tokenizer's EOS), ``stop`` (strings; the returned text
  and tokens end before the stop string unless ``include_stop_str_in_output``), ``exclude_input_from_output``,
  ``return_perf_metrics``, ``detokenize``, ``skip_special_tokens``, ``add_special_tokens``, ``guided_decoding``
  (:class:`~pipeline.cpu_runtime.guided.GuidedDecodingParams`, honoured with ``LLM(guided_decoding_backend="xgrammar")``,
  llm_args.py@c292b9f997d6:1931), and the sampling knobs;
* LoRA: ``LLM(lora_config=…)`` and ``generate_async(…, lora_request=LoRARequest(lora_name, lora_int_id, lora_path))``
  (:class:`LoRARequest`; the adapter is loaded from its path the first time its id is seen, docs/lora.md);
* images (an image build): upstream's ``{"prompt": str, "multi_modal_data": {"image": [PIL.Image, ...]}}``, through the
  processor, the vision tower and M-RoPE (:mod:`pipeline.cpu_runtime.multimodal`); ``RequestOutput.image_tokens``.

Decoding is greedy, as in the CPU engine: ``temperature``/``top_k``/``top_p``/``seed``/penalties are accepted and
have no effect; ``n``/``best_of`` above 1 and beam search are refused (ValueError). The ``LLM()`` keyword arguments
are those of the engine stage's ``llm_api_config.yaml``: the engine limits must equal the CPU engine directory's
``engine_config.json`` (a differing value is a ValueError naming it); ``kv_cache_config.max_tokens`` /
``free_gpu_memory_fraction``, ``enable_chunked_prefill``, ``kv_cache_config.enable_block_reuse`` (prompt-prefix KV
reuse in ``tokens_per_block`` blocks, default 32: :mod:`pipeline.cpu_runtime.prefix`) and an ``NGram``
``speculative_config`` (:mod:`pipeline.cpu_runtime.speculative`; ValueError for another type) are passed to the
engine; GPU-only arguments are
accepted and listed in :attr:`LLM.ignored_args`.
"""

from __future__ import annotations

import asyncio
import dataclasses
import datetime
import json
import threading
import time
from pathlib import Path
from typing import Any, Self

from pipeline.cpu_runtime.guided import GuidedDecodingParams, request_matcher
from pipeline.cpu_runtime.lora import LoRARequest, llm_lora, request_task_id
from pipeline.cpu_runtime.multimodal import encode_request, image_inputs
from pipeline.cpu_runtime.requests import Health

#: ``LLM()`` limits that must equal the CPU engine's engine_config.json (fixed when the engine directory was built)
_LIMITS = ("max_batch_size", "max_input_len", "max_seq_len", "max_num_tokens")
#: ``LLM()`` arguments the facade reads itself
_READ = {"model", "tokenizer", "kv_cache_config", "enable_chunked_prefill", "backend", "tensor_parallel_size",
         "pipeline_parallel_size", "max_beam_width", "guided_decoding_backend", "lora_config", "speculative_config", *_LIMITS}


@dataclasses.dataclass(kw_only=True)
class SamplingParams:
    """The ``tensorrt_llm.SamplingParams`` fields the ``llmapi`` model passes (lengths in tokens); see the module docstring."""

    end_id: int | None = None
    pad_id: int | None = None
    max_tokens: int = 32
    min_tokens: int | None = None
    ignore_eos: bool = False
    stop: str | list[str] | None = None
    stop_token_ids: list[int] | None = None
    include_stop_str_in_output: bool = False
    n: int = 1
    best_of: int | None = None
    use_beam_search: bool = False
    temperature: float | None = None
    top_k: int | None = None
    top_p: float | None = None
    seed: int | None = None
    frequency_penalty: float | None = None
    presence_penalty: float | None = None
    repetition_penalty: float | None = None
    exclude_input_from_output: bool = True
    return_perf_metrics: bool = False
    detokenize: bool = True
    skip_special_tokens: bool = True
    add_special_tokens: bool = True
    guided_decoding: GuidedDecodingParams | None = None

    def __post_init__(self) -> None:
        self.best_of = self.best_of or self.n
        if self.n != 1 or self.best_of != 1 or self.use_beam_search:
            raise ValueError("the CPU engine decodes greedily, one sequence: n, best_of must be 1 and use_beam_search false")

    def stop_strings(self) -> list[str]:
        """``stop`` as a list (``None`` → ``[]``)."""
        return [] if self.stop is None else [self.stop] if isinstance(self.stop, str) else [str(s) for s in self.stop]


@dataclasses.dataclass
class CompletionOutput:
    """One sequence of a request (cumulative ``text``/``token_ids``; ``*_diff``: what the last response added)."""

    index: int
    text: str = ""
    token_ids: list[int] = dataclasses.field(default_factory=list)
    cumulative_logprob: float | None = None
    finish_reason: str | None = None
    stop_reason: int | str | None = None
    request_perf_metrics: Any = None
    _last_text_len: int = 0
    _last_token_ids_len: int = 0

    @property
    def length(self) -> int:
        """Tokens generated so far."""
        return len(self.token_ids)

    @property
    def text_diff(self) -> str:
        return self.text[self._last_text_len:]

    @property
    def token_ids_diff(self) -> list[int]:
        return self.token_ids[self._last_token_ids_len:]


def _since_epoch(ns: int) -> datetime.timedelta:
    return datetime.timedelta(microseconds=ns / 1000)


def _perf_metrics(arrival_ns: int, first_ns: int, last_ns: int, spec_metrics: dict | None = None,
                  kv_metrics: dict | None = None) -> Any:
    """The shape of ``tllm.RequestPerfMetrics`` the model reads: times since the epoch; ``kv_cache_metrics`` from
    ``kv_metrics`` (block reuse on: reused / missed blocks, hit rate), ``speculative_decoding`` from ``spec_metrics``
    (n-gram speculation on); counters 0 otherwise."""
    ns = dataclasses.make_dataclass
    kv = ns("KvCacheMetrics", [("num_total_allocated_blocks", int, 0), ("num_new_allocated_blocks", int, 0),
                              ("num_reused_blocks", int, 0), ("num_missed_blocks", int, 0), ("kv_cache_hit_rate", float, 0.0)])
    timing = ns("TimingMetrics", ["arrival_time", "first_scheduled_time", "first_token_time", "last_token_time"])
    spec = ns("SpeculativeDecodingMetrics", [("acceptance_rate", float, 0.0), ("total_accepted_draft_tokens", int, 0),
                                             ("total_draft_tokens", int, 0)])
    perf = ns("RequestPerfMetrics", ["kv_cache_metrics", "timing_metrics", "speculative_decoding"])
    t = timing(*(_since_epoch(x) for x in (arrival_ns, arrival_ns, first_ns, last_ns)))
    reuse = {k: v for k, v in (kv_metrics or {}).items() if k != "cached_tokens"}
    return perf(kv(**reuse), t, spec(**(spec_metrics or {})))


class RequestOutput:
    """One request's result, updated from the engine's delivery thread; iterate it with ``async for`` (one item per
    engine step when streaming, else one at the end: the item is the object itself) or wait with :meth:`result`."""

    def __init__(self, llm: LLM, request_id: int, prompt: str | None, prompt_token_ids: list[int],
                 params: SamplingParams, streaming: bool):
        self._llm, self.request_id, self.prompt, self.prompt_token_ids = llm, request_id, prompt, prompt_token_ids
        self.sampling_params, self._streaming = params, streaming
        self.outputs = [CompletionOutput(0)]
        self._lock = threading.Lock()
        self._new: list[int] = []  # from the engine, not yet folded into outputs[0]
        self._generated = 0  # tokens the engine returned
        self._ended: str | None = None  # the engine's finish reason: length | stop | end | cancelled | error
        self._error: str | None = None
        self._done = False  # outputs[0] holds the final state
        self._yielded_final = False
        self._aborted = False
        self._engine_id: str | None = None
        self._arrival_ns = time.time_ns()
        self._first_ns = 0
        self.image_tokens = 0  # tokens the request's images became (multi_modal_data; 0 for text)
        try:
            self._loop: asyncio.AbstractEventLoop | None = asyncio.get_running_loop()
        except RuntimeError:
            self._loop = None
        self._wake = asyncio.Event() if self._loop is not None else None
        self._finished_evt = threading.Event()

    # ---------------------------------------------------------------- engine side (delivery thread)
    def _on_tokens(self, new: list[int], finished: bool, reason: str | None = None) -> None:
        with self._lock:
            if self._ended is not None:
                return
            if new and not self._first_ns:
                self._first_ns = time.time_ns()
            self._new.extend(new)
            self._generated += len(new)
            if finished:  # the end token or a stop word before max_tokens: "stop" (stop words are told apart in _fold)
                self._ended = reason or ("length" if self._generated >= self.sampling_params.max_tokens else "stop")
        self._notify(finished)

    def _on_error(self, message: str) -> None:
        with self._lock:
            if self._ended is not None:
                return
            self._error, self._ended = message, "error"
        self._notify(True)

    def _notify(self, finished: bool) -> None:
        if finished:
            self._finished_evt.set()
        if self._loop is not None:
            try:
                self._loop.call_soon_threadsafe(self._wake.set)
            except RuntimeError:  # the loop is closed: nobody is waiting any more
                pass

    # ---------------------------------------------------------------- consumer side
    @property
    def finished(self) -> bool:
        """Whether the last :meth:`__anext__`/:meth:`result` saw the request end."""
        return self._done

    def aborted(self) -> bool:
        return self._aborted

    @property
    def cached_tokens(self) -> int:
        """Prompt tokens whose K/V came from reused blocks (``kv_cache_config.enable_block_reuse``; 0 when off)."""
        m = self._llm._engine.prefix.request_metrics(self._engine_id) if self._engine_id else None
        return m["cached_tokens"] if m else 0

    def abort(self) -> None:
        """Stop the request (``tensorrt_llm`` ``GenerationResult.abort``): the engine frees its slot at its next step
        and the result ends with ``finish_reason = "cancelled"``."""
        self._aborted = True
        if self._engine_id is not None:
            self._llm._engine.cancel(self._engine_id)
        self._on_tokens([], True, "cancelled")

    def _ready(self) -> bool:
        with self._lock:
            return self._ended is not None or (self._streaming and bool(self._new))

    def __aiter__(self) -> RequestOutput:
        return self

    async def __anext__(self) -> RequestOutput:
        if self._yielded_final:
            raise StopAsyncIteration
        if self._wake is None:
            raise RuntimeError("generate_async was not called inside a running event loop")
        while not self._ready():
            self._wake.clear()
            if self._ready():
                break
            await self._wake.wait()
        return self._fold()

    def result(self, timeout: float | None = None) -> RequestOutput:
        """Wait (seconds; ``None``: no limit) until the request ends; returns the final state."""
        if not self._finished_evt.wait(timeout):
            raise TimeoutError(f"request {self.request_id} did not finish within {timeout} s")
        return self._fold()

    def _fold(self) -> RequestOutput:
        """Move the engine's new tokens into ``outputs[0]``, decode, apply stop strings; mark the end."""
        out, p = self.outputs[0], self.sampling_params
        with self._lock:
            new, self._new = self._new, []
            ended, error = self._ended, self._error
        if error is not None:
            self._yielded_final = self._done = True
            raise RuntimeError(error)
        out._last_token_ids_len, out._last_text_len = len(out.token_ids), len(out.text)
        if not out.token_ids and not p.exclude_input_from_output:
            out.token_ids.extend(self.prompt_token_ids)
        out.token_ids.extend(new)
        if ended is not None:
            out.finish_reason = ended
            if ended in ("stop", "length") and self._trim_stop_tokens(out):
                out.finish_reason = ended = "stop"
        if p.detokenize and self._llm.tokenizer is not None:
            out.text = self._llm.tokenizer.decode(out.token_ids, skip_special_tokens=p.skip_special_tokens)
            if self._apply_stop_strings(out):
                ended = "stop"
        if ended is not None:
            self._done = self._yielded_final = True
            if p.return_perf_metrics:
                sp, eid = self._llm._engine.speculation, self._engine_id
                out.request_perf_metrics = _perf_metrics(self._arrival_ns, self._first_ns or time.time_ns(), time.time_ns(),
                                                         sp.request_metrics(eid) if sp and eid else None,
                                                         self._llm._engine.prefix.request_metrics(eid) if eid else None)
        return self

    def _trim_stop_tokens(self, out: CompletionOutput) -> bool:
        """Whether a stop word's tokens end the sequence; if so say which, and drop them unless
        include_stop_str_in_output (result.py@a678b91aafbe ``_handle_sequence``, FinishReason.STOP_WORDS)."""
        p = self.sampling_params
        for reason, ids in zip(p.stop_strings(), self._llm.stop_word_ids(p)):
            if ids and out.token_ids[-len(ids):] == ids:
                out.stop_reason = reason
                if not p.include_stop_str_in_output:
                    del out.token_ids[-len(ids):]
                return True
        return False

    def _apply_stop_strings(self, out: CompletionOutput) -> bool:
        """A stop string inside the text (it may tokenize differently in context) ends the request there."""
        p = self.sampling_params
        for s in p.stop_strings():
            pos = out.text.find(s) if s else -1
            if pos < 0:
                continue
            out.text = out.text[:pos + (len(s) if p.include_stop_str_in_output else 0)]
            out.finish_reason, out.stop_reason = "stop", s
            if not self._done and self._engine_id is not None:
                self._aborted = True
                self._llm._engine.cancel(self._engine_id)
            with self._lock:
                self._ended = self._ended or "stop"
            return True
        return False


def _load_tokenizer(path: Path) -> Any:
    """The tokenizer of ``path/tokenizer.json`` with its default end id (the one wrapper and end-id rule,
    :mod:`pipeline.core.tokenizer`); ``None`` when the directory has none (then ``detokenize`` yields no text)."""
    from pipeline.core.tokenizer import tokenizer_json_or_none

    return tokenizer_json_or_none(str(path))


class LLM:
    """``tensorrt_llm.LLM`` on the CPU engine. ``model``: a CPU engine directory (``build.engine: pytorch`` with
    ``target.gpu: cpu``: pipeline/engine/cpu.py); ``tokenizer``: a directory with ``tokenizer.json`` (default:
    ``model``). Other keyword arguments: see the module docstring.

    Raises:
        ValueError: an engine limit differs from engine_config.json, tensor/pipeline parallelism or beam width
            above 1, a backend other than ``pytorch``, a
            ``guided_decoding_backend`` other than ``xgrammar``.
        FileNotFoundError: ``model`` is not a CPU engine directory.
    """

    def __init__(self, model: str, tokenizer: str | None = None, **kwargs: Any):
        from pipeline.cpu_runtime.engine import ENGINE_CONFIG, CpuEngine

        self.model_dir = Path(model)
        cfg_path = self.model_dir / ENGINE_CONFIG
        if not cfg_path.is_file():
            raise FileNotFoundError(f"{cfg_path}: model is not a CPU engine directory (no {ENGINE_CONFIG})")
        cfg = json.loads(cfg_path.read_text())
        self._check(kwargs, cfg)
        kv = kwargs.get("kv_cache_config") or {}
        honoured_kv = {"max_tokens", "free_gpu_memory_fraction", "enable_block_reuse", "tokens_per_block"}
        self.ignored_args = sorted(set(kwargs) - _READ) + [f"kv_cache_config.{k}" for k in kv if k not in honoured_kv]
        self.tokenizer = _load_tokenizer(Path(tokenizer) if tokenizer else self.model_dir)
        self._engine = CpuEngine(
            self.model_dir, kv_max_tokens=kv.get("max_tokens"), kv_free_memory_fraction=kv.get("free_gpu_memory_fraction"),
            enable_chunked_prefill=kwargs.get("enable_chunked_prefill"), speculative_config=kwargs.get("speculative_config"),
            block_reuse=int(kv.get("tokens_per_block") or 32) if kv.get("enable_block_reuse") else None)
        self.guides = None
        if kwargs.get("guided_decoding_backend") is not None:  # the tokenizer's info, as upstream's LLM builds it
            from pipeline.cpu_runtime.guided import Guides
            from pipeline.trtllm.guided import tokenizer_info

            self.guides = Guides(tokenizer_info(Path(tokenizer) if tokenizer else self.model_dir), self._engine.vocab_size)
        self._ids = iter(range(1, 1 << 62))
        self._stop_cache: dict[tuple[str, ...], list[list[int]]] = {}
        self._lora_on = llm_lora(self._engine, kwargs.get("lora_config"))  # adapters come per request (LoRARequest)
        self._images = image_inputs(self.model_dir, cfg)  # an image build: processor + vision tower (multimodal.py)
        self.max_images = (cfg.get("vision") or {}).get("max_images_per_request")

    @staticmethod
    def _check(kwargs: dict[str, Any], cfg: dict[str, Any]) -> None:
        for name in _LIMITS:
            if kwargs.get(name) is not None and int(kwargs[name]) != int(cfg[name]):
                raise ValueError(f"{name}={kwargs[name]} differs from the CPU engine's {cfg[name]} (engine_config.json): rebuild the engine stage")
        for name in ("tensor_parallel_size", "pipeline_parallel_size", "max_beam_width"):
            if kwargs.get(name) not in (None, 1):
                raise ValueError(f"{name}={kwargs[name]}: the CPU engine runs one rank and decodes greedily (1)")
        if kwargs.get("backend") not in (None, "pytorch"):
            raise ValueError(f"backend={kwargs['backend']!r}: the CPU facade stands in for the pytorch backend only")
        if kwargs.get("guided_decoding_backend") not in (None, "xgrammar"):
            raise ValueError(f"guided_decoding_backend={kwargs['guided_decoding_backend']!r}: the CPU engine guides with xgrammar")

    @property
    def engine(self) -> Any:
        """The :class:`~pipeline.cpu_runtime.engine.CpuEngine` underneath (runtime facts, stats)."""
        return self._engine

    def stop_word_ids(self, params: SamplingParams) -> list[list[int]]:
        """Token ids of ``params.stop`` (encoded without special tokens, as ``SamplingParams._setup`` does)."""
        words = tuple(params.stop_strings())
        if words not in self._stop_cache:
            self._stop_cache[words] = [self.tokenizer.encode(w, add_special_tokens=False) if self.tokenizer else [] for w in words]
        return self._stop_cache[words]

    def generate_async(self, inputs: str | list[int] | dict, sampling_params: SamplingParams | None = None, *_: Any,
                       streaming: bool = False, lora_request: LoRARequest | None = None, **__: Any) -> RequestOutput:
        """Queue one request; returns its :class:`RequestOutput` at once (call it inside the event loop that iterates
        it). ``inputs``: a prompt string (encoded with ``add_special_tokens``), token ids, or a prompt dict with
        ``multi_modal_data`` (module docstring). ``lora_request``: the adapter (:func:`pipeline.cpu_runtime.lora.request_task_id`).

        Raises ValueError for a request the engine refuses (empty or too long prompt, prompt + max_tokens beyond
        max_seq_len, …; see :meth:`CpuEngine.add_request`), a string prompt without a tokenizer, images the build
        cannot take (:func:`~pipeline.cpu_runtime.multimodal.encode_request`), or an adapter that cannot be served."""
        p = sampling_params or SamplingParams()
        prompt, ids, mm, image_tokens = encode_request(inputs, self.tokenizer, self._images, add_special_tokens=p.add_special_tokens,
                                                       max_images=self.max_images, model_dir=self.model_dir)
        end_id = p.end_id if p.end_id is not None else (self.tokenizer.eos_token_id if self.tokenizer else None)
        matcher = request_matcher(self.guides, p.guided_decoding)
        out = RequestOutput(self, next(self._ids), prompt, ids, p, streaming)
        out.image_tokens = image_tokens
        words = [w for w in self.stop_word_ids(p) if w] + [[t] for t in (p.stop_token_ids or [])]
        out._engine_id = self._engine.add_request(
            ids, max_new_tokens=int(p.max_tokens), min_tokens=max(0, int(p.min_tokens or 0)),
            end_id=None if p.ignore_eos or end_id is None else int(end_id), stop_words=words, multimodal=mm,
            on_tokens=out._on_tokens, on_error=out._on_error, matcher=matcher,
            lora_task_id=request_task_id(self._engine, lora_request, self._lora_on))
        return out

    def health(self) -> Health:
        """Whether the model answers: ``Health(True, "")``, or ``Health(False, reason)`` once the engine is shut down or
        its scheduler failed (trtllm-serve's ``/health`` asks upstream's LLM ``_check_health`` the same question:
        tensorrt_llm/serve/openai_server.py@00057725d9a6:333-339)."""
        return self._engine.health()

    def shutdown(self) -> None:
        """Stop the engine (requests in flight end with an error)."""
        self._engine.shutdown()

    def __enter__(self) -> Self:
        return self

    def __exit__(self, *exc: object) -> None:
        self.shutdown()
