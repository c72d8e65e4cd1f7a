"""trtpipe's CPU ``tensorrt_llm`` model: the TensorRT-LLM tensorrt_llm interface on the CPU engine.

Same inputs/outputs as the C++ ``tensorrtllm`` backend (config generated from the same template):
input_ids, input_lengths, request_output_len, end_id, pad_id, streaming, min_tokens, stop,
stop_words_list, exclude_input_in_output, lora_task_id (the build's adapters), return_num_input_tokens / return_num_output_tokens /
return_perf_metrics, … → output_ids [beam=1, n], sequence_length [1], num_input_tokens,
num_output_tokens (tokens generated in THIS response), arrival/first_scheduled/first_token/
last_token_time_ns, and with ``return_context_logits`` the ``context_logits`` output (FP32 [1, input_len,
vocab]: the shape the C++ backend writes, model_instance_state.cc@c2e65b88d852:1105-1117, in the first response
after the prompt is prefilled). Decoding is greedy (sampling inputs are accepted and ignored); beam_width and
num_return_sequences must be 1; bad_words_list, embedding_bias, lora_weights and lora_config are rejected.

Decoupled: ``execute`` only submits requests to :class:`pipeline.cpu_runtime.engine.CpuEngine`; the
engine's delivery thread calls back with new tokens and this model sends one response per engine
step when streaming (the last one carries TRITONSERVER_RESPONSE_COMPLETE_FINAL), or one response with
every token otherwise. end_id absent or -1 never stops on EOS; stop words end the request with the
word included. A request with ``stop=true`` cancels the running request with the same request id. A
watcher thread cancels requests whose client went away (``request.is_cancelled()``) every
``cancellation_check_period_ms``: the engine frees its KV slot (or drops it from the queue) at its next step.
Every error becomes a ``TritonError`` response with the final flag: a client is never left waiting.

Queue limit, as the C++ backend: ``dynamic_batching.default_queue_policy.max_queue_size`` of this model's config
(model_instance_state.cc@c2e65b88d852:659-680 hands it to the executor) bounds the requests waiting for a KV slot;
one more gets at once an UNAVAILABLE error ``Maximum queue size of N has been reached, please try again later: …``
(TensorRT-LLM executorImpl.cpp ``enqueueRequests``' text). 0 (the default): unbounded, as upstream.

Statistics, as the C++ backend's custom metrics reporter (custom_metrics_reporter.cc@0d5352f5fc5f): every
``stats_check_period_ms`` the engine's :meth:`~pipeline.cpu_runtime.engine.CpuEngine.iteration_stats` become the
gauges ``nv_trt_llm_request_metrics{request_type=active|max|waiting}`` and
``nv_trt_llm_kv_cache_block_metrics{kv_cache_block_type=max|free|used|tokens_per|fraction}`` on Triton's metrics
endpoint (a block is one KV slot of max_seq_len tokens).

Text (``build.cpu.detokenize: engine``, the parameter ``tokenizer_dir``): the model also outputs
``text_output`` (BYTES [1, 1]), decoded per request by an incremental detokenizer (detokenize.py: spaces
and multi-byte characters intact; what an incomplete UTF-8 sequence held back is flushed into the final
response), and the ensemble maps it directly instead of calling postprocessing for every streamed step.

Guided decoding: the optional inputs ``guided_decoding_guide_type`` (json, json_schema, regex, ebnf_grammar) and
``guided_decoding_guide`` (schema / regex / EBNF text) of the upstream interface are compiled with xgrammar
(pipeline/cpu_runtime/guided.py) and the engine masks each step's logits with the grammar. An unknown type, a guide
that does not compile, or a guide sent to a model without guided decoding is an error response (the C++ backend
silently ignores an unknown type, utils.cc@c2e65b88d852:835-838).

Only the outputs the request asked for are built (``request.requested_output_names()``, python_backend
src/pb_stub.cc@a2564ea:1844), and the tensors of a response stay referenced until ``send`` returns. The python backend prunes unrequested outputs after
releasing the GIL (python_backend src/response_sender.cc@a2564ea:124-129, ``ResponseSender::Send``): a
pruned tensor whose last owner was the response frees its numpy array there, without the GIL. Sending
output_ids + sequence_length + text_output to an ensemble that asked for text_output only killed the stub
in the first of three runs at c = 16 with ``sys.setswitchinterval(2e-4)`` (2026-11-26); building only the
requested outputs, it served 4 × 32 requests under the same setting.

Parameters (strict: every one listed here is read, and any other key fails the load, so the
generated config.pbtxt carries only what this model honours): gpt_model_path (engine dir),
max_beam_width (must be 1), exclude_input_in_output, cancellation_check_period_ms, stats_check_period_ms, cpu_num_threads
(optional), tokenizer_dir (optional; required when the config declares text_output) and
skip_special_tokens, guided_decoding_backend + xgrammar_tokenizer_info_path (optional, as the C++ backend reads
them: guided decoding is on only when both are set, model_instance_state.cc@c2e65b88d852:424-449). The KV cache, scheduler and chunked-prefill settings are the engine directory's
``engine_config.json`` (pipeline/engine/cpu.py), sized at load by pipeline.cpu_runtime.kv.kv_slots.
Multimodal: encoder_input_features / encoder_output_lengths / cross_attention_mask / skip_cross_attn_blocks (from
multimodal_encoders) go to ``CpuEngine.add_request`` (_vision.encoder_kwargs); a text repository sends none of them.
"""

from __future__ import annotations

import dataclasses
import json
import threading
import time

import numpy as np
import triton_python_backend_utils as pb_utils
from _common import (
    ParameterError,
    apply_pythonpath,
    array,
    get_param,
    load_tokenizer,
    parse_bool,
    parse_int,
    parse_word_list,
    raw_parameters,
    resolve_dir,
    scalar,
    text,
)
from _vision import ENCODER_INPUTS, encoder_kwargs
from detokenize import IncrementalDetokenizer

FINAL = pb_utils.TRITONSERVER_RESPONSE_COMPLETE_FINAL
#: Every parameter this model reads (anything else in config.pbtxt is refused).
PARAMETERS = (
    "gpt_model_path", "max_beam_width", "exclude_input_in_output", "cancellation_check_period_ms", "cpu_num_threads",
    "tokenizer_dir", "skip_special_tokens", "stats_check_period_ms", "guided_decoding_backend",
    "xgrammar_tokenizer_info_path",
)
#: guided_decoding_backend values this model honours (the C++ backend's, model_instance_state.cc@c2e65b88d852:439-449)
GUIDED_BACKENDS = ("xgrammar",)
#: gauge → label → its value in :meth:`CpuEngine.iteration_stats` (custom_metrics_reporter.cc@0d5352f5fc5f's labels)
GAUGES = {
    "nv_trt_llm_request_metrics": ("request_type", {
        "active": lambda st: st["numActiveRequests"], "max": lambda st: st["maxNumActiveRequests"],
        "waiting": lambda st: st["numQueuedRequests"]}),
    "nv_trt_llm_kv_cache_block_metrics": ("kv_cache_block_type", {
        "max": lambda st: st["kvCacheStats"]["maxNumBlocks"], "free": lambda st: st["kvCacheStats"]["freeNumBlocks"],
        "used": lambda st: st["kvCacheStats"]["usedNumBlocks"], "tokens_per": lambda st: st["kvCacheStats"]["tokensPerBlock"],
        "fraction": lambda st: st["kvCacheStats"]["usedNumBlocks"] / max(st["kvCacheStats"]["maxNumBlocks"], 1)}),
}


@dataclasses.dataclass(frozen=True)
class Params:
    """Parsed model parameters."""

    engine_dir: str
    exclude_input_in_output: bool
    cancellation_check_period_ms: int
    stats_check_period_ms: int
    num_threads: int | None
    tokenizer_dir: str | None  # set: the model writes ``text_output`` (relative to the model dir, like every tokenizer_dir)
    skip_special_tokens: bool
    #: the xgrammar tokenizer-info file when guided decoding is on (both guided parameters set), else None
    tokenizer_info_path: str | None = None

    @classmethod
    def parse(cls, raw: dict[str, str]) -> "Params":
        """Raises :class:`ParameterError` for an unknown key, a malformed value or a setting the engine cannot honour."""
        unknown = sorted(set(raw) - set(PARAMETERS))
        if unknown:
            raise ParameterError(f"parameter {unknown[0]} is not read by the CPU tensorrt_llm model (it reads: {', '.join(PARAMETERS)})")
        beam = get_param(raw, "max_beam_width", lambda n, v: parse_int(n, v, minimum=1), 1)
        if beam != 1:
            raise ParameterError(f"parameter max_beam_width={beam}: the CPU engine decodes greedily (1 beam)")
        backend = get_param(raw, "guided_decoding_backend", lambda n, v: v, None)
        info = get_param(raw, "xgrammar_tokenizer_info_path", lambda n, v: v, None)
        if backend is not None and backend not in GUIDED_BACKENDS:
            raise ParameterError(f"parameter guided_decoding_backend={backend!r}: expected one of {', '.join(GUIDED_BACKENDS)}")
        return cls(
            engine_dir=get_param(raw, "gpt_model_path", lambda n, v: v),
            exclude_input_in_output=get_param(raw, "exclude_input_in_output", parse_bool, False),
            cancellation_check_period_ms=get_param(raw, "cancellation_check_period_ms", lambda n, v: parse_int(n, v, minimum=1), 100),
            stats_check_period_ms=get_param(raw, "stats_check_period_ms", lambda n, v: parse_int(n, v, minimum=1), 100),
            num_threads=get_param(raw, "cpu_num_threads", lambda n, v: parse_int(n, v, minimum=1), None),
            tokenizer_dir=get_param(raw, "tokenizer_dir", lambda n, v: v, None),
            skip_special_tokens=get_param(raw, "skip_special_tokens", parse_bool, True),
            tokenizer_info_path=info if backend is not None else None,
        )


@dataclasses.dataclass
class Job:
    """One in-flight request."""

    request: object
    sender: object
    triton_id: str
    input_ids: list[int]
    streaming: bool
    exclude_input: bool
    want_in: bool
    want_out: bool
    want_perf: bool
    arrival_ns: int
    #: the output names the request asked for (only these are built: see the module docstring)
    wanted: frozenset[str] = frozenset()
    #: incremental detokenizer of ``text_output`` (created on the first response that asks for text)
    detok: object = None
    engine_id: str | None = None
    generated: list[int] = dataclasses.field(default_factory=list)
    #: held while the final response is sent and while the watcher asks ``is_cancelled()``: once the final
    #: response is out, Triton releases the request's response factory, and asking it then crashed the
    #: server (SIGSEGV in TRITONBACKEND_ResponseFactoryIsCancelled, Triton 2.51, seen in a 32-stream soak)
    final_lock: threading.Lock = dataclasses.field(default_factory=threading.Lock)
    #: return_context_logits: the engine's per-chunk float32 logits [n, vocab] until they are sent
    ctx_logits: list | None = None
    first_token_ns: int = 0
    sent_any: bool = False
    done: bool = False


class TritonPythonModel:
    """Decoupled CPU-engine model."""

    def initialize(self, args):
        config = json.loads(args["model_config"])
        self.params = Params.parse(raw_parameters(config))
        if not pb_utils.using_decoupled_model_transaction_policy(config):
            raise ParameterError("the CPU tensorrt_llm model needs model_transaction_policy { decoupled: true }")
        if any(o["name"] == "text_output" for o in config.get("output", [])) and self.params.tokenizer_dir is None:
            raise ParameterError("output text_output needs the parameter tokenizer_dir (the tokenizer that decodes it)")
        apply_pythonpath()
        from pipeline.cpu_runtime.engine import CpuEngine
        from pipeline.cpu_runtime.requests import QueueFullError

        self.queue_full, _ = QueueFullError, GAUGES.update(CpuEngine.step_gauges)  # + trtpipe's step-timeline gauges

        p = self.params
        self.tokenizer = None
        if p.tokenizer_dir is not None:
            self.tokenizer = load_tokenizer(resolve_dir(args["model_repository"], p.tokenizer_dir))
        queue = int(((config.get("dynamic_batching") or {}).get("default_queue_policy") or {}).get("max_queue_size") or 0)
        self.engine = CpuEngine(p.engine_dir, num_threads=p.num_threads, max_queue_size=queue)
        self.guides = None
        if p.tokenizer_info_path is not None:
            from pipeline.cpu_runtime.guided import Guides
            from pipeline.trtllm.guided import read_tokenizer_info

            self.guides = Guides(read_tokenizer_info(p.tokenizer_info_path), self.engine.vocab_size)
        rt = self.engine.runtime
        pb_utils.Logger.log_info(
            f"tensorrt_llm (CPU): {rt['runtime']} {rt['gemm']} GEMMs, {rt['kernels']} kernels, {rt['dtype']}, "
            f"{rt['threads']} threads, KV "
            f"{rt['kv_slots']} slots × {rt['kv_slot_len']} tokens, max_queue_size {queue or 'unbounded'}, "
            f"guided decoding {'xgrammar' if self.guides else 'off'}, "
            f"loaded in {self.engine.load_time_s:.1f} s"
        )
        self.lock = threading.Lock()
        self.jobs: dict[int, Job] = {}  # keyed by id(job)
        self.closing = threading.Event()
        self.watcher = threading.Thread(target=self._watch_cancellations, name="cancel-watch", daemon=True)
        self.watcher.start()
        self.families, self.gauges = self._create_gauges({"model": args["model_name"], "version": args["model_version"]})
        self.reporter = threading.Thread(target=self._report_stats, name="stats", daemon=True)
        self.reporter.start()

    @staticmethod
    def _create_gauges(labels: dict[str, str]):
        """``(families, {(gauge, label value): Metric})`` of :data:`GAUGES`; none when Triton's metrics are off."""
        families, gauges = [], {}
        try:
            for name, (key, values) in GAUGES.items():
                fam = pb_utils.MetricFamily(name=name, description=f"{name} (trtpipe CPU engine)",
                                            kind=pb_utils.MetricFamily.GAUGE)
                families.append(fam)
                for value in values:
                    gauges[(name, value)] = fam.Metric(labels={**labels, key: value})
        except Exception as e:  # metrics disabled (--allow-metrics=false): serve without them
            pb_utils.Logger.log_warn(f"tensorrt_llm (CPU): no statistics metrics: {e}")
            return [], {}
        return families, gauges

    def _report_stats(self) -> None:
        """Every ``stats_check_period_ms``: the gauges whose value changed (each set is a message to Triton)."""
        period = self.params.stats_check_period_ms / 1000.0
        last: dict = {}
        while self.gauges and not self.closing.wait(period):
            st = self.engine.iteration_stats()
            try:
                for (name, value), metric in self.gauges.items():
                    v = float(GAUGES[name][1][value](st))
                    if last.get((name, value)) != v:
                        metric.set(v)
                        last[(name, value)] = v
            except Exception as e:
                pb_utils.Logger.log_warn(f"tensorrt_llm (CPU): statistics not reported: {e}")

    # ------------------------------------------------------------------ responses
    def _finish(self, job: Job, tensors=None, error: str | None = None, code=None) -> None:
        """Send the last response (or just the final flag) exactly once (``code``: the error's TritonError code)."""
        with job.final_lock:
            with self.lock:
                if job.done:
                    return
                job.done = True
                self.jobs.pop(id(job), None)
            self._send_final(job, tensors, error, code)

    @staticmethod
    def _send_final(job: Job, tensors, error: str | None, code=None) -> None:
        try:
            if error is not None:
                err = pb_utils.TritonError(error) if code is None else pb_utils.TritonError(error, code)
                job.sender.send(pb_utils.InferenceResponse(output_tensors=[], error=err), flags=FINAL)
            elif tensors is not None:
                job.sender.send(pb_utils.InferenceResponse(output_tensors=tensors), flags=FINAL)
            else:
                job.sender.send(flags=FINAL)
        except Exception as e:  # client gone: nothing else to do
            pb_utils.Logger.log_warn(f"tensorrt_llm: could not send final response: {e}")

    def _tensors(self, job: Job, new: list[int], final: bool = False):
        """The requested outputs of one response carrying ``new`` tokens (the caller keeps the list
        referenced until ``send`` returns: see the module docstring)."""
        ids = new
        if not job.exclude_input and not job.sent_any:
            ids = job.input_ids + new
        want = job.wanted
        out = []
        if "output_ids" in want:
            out.append(pb_utils.Tensor("output_ids", np.array([[ids]], dtype=np.int32)))
        if "sequence_length" in want:
            out.append(pb_utils.Tensor("sequence_length", np.array([[len(ids)]], dtype=np.int32)))
        if "text_output" in want:  # declared only with tokenizer_dir (checked at load)
            if job.detok is None:
                job.detok = IncrementalDetokenizer(self.tokenizer, skip_special_tokens=self.params.skip_special_tokens)
            text = job.detok.add(ids) + (job.detok.flush() if final else "")
            out.append(pb_utils.Tensor("text_output", np.array([[text.encode("utf-8")]], dtype=object)))
        if job.ctx_logits and sum(len(c) for c in job.ctx_logits) == len(job.input_ids):
            import torch

            out.append(pb_utils.Tensor("context_logits", torch.cat(job.ctx_logits).unsqueeze(0).numpy()))
            job.ctx_logits = None
        if job.want_out and "num_output_tokens" in want:
            out.append(pb_utils.Tensor("num_output_tokens", np.array([[len(new)]], dtype=np.int32)))
        if job.want_in and "num_input_tokens" in want:
            out.append(pb_utils.Tensor("num_input_tokens", np.array([[len(job.input_ids)]], dtype=np.int32)))
        if job.want_perf:
            now = time.time_ns()
            for name, value in (("arrival_time_ns", job.arrival_ns), ("first_scheduled_time_ns", job.arrival_ns),
                                ("first_token_time_ns", job.first_token_ns or now), ("last_token_time_ns", now)):
                if name in want:
                    out.append(pb_utils.Tensor(name, np.array([[value]], dtype=np.int64)))
        job.sent_any = True
        return out

    def _on_tokens(self, job: Job, new: list[int], finished: bool) -> None:
        """Engine callback (its delivery thread): stream or accumulate, then finish."""
        if job.done:
            return
        if new and not job.first_token_ns and job.want_perf:
            job.first_token_ns = time.time_ns()
        if job.streaming:
            if finished:
                held = job.detok is not None and job.detok.pending
                self._finish(job, self._tensors(job, new, final=True) if new or held else None)
            elif new:
                tensors = self._tensors(job, new)
                try:
                    job.sender.send(pb_utils.InferenceResponse(output_tensors=tensors))
                except Exception as e:
                    self._cancel(job, f"send failed: {e}")
        else:
            job.generated.extend(new)
            if finished:
                self._finish(job, self._tensors(job, job.generated, final=True))

    def _cancel(self, job: Job, why: str | None = None) -> None:
        if job.engine_id is not None:
            self.engine.cancel(job.engine_id)
        self._finish(job, error=why)

    # ------------------------------------------------------------------ requests
    def _matcher(self, request):
        """The request's compiled guide (``None`` without ``guided_decoding_guide_type``). Raises ValueError."""
        kind = array(request, "guided_decoding_guide_type")
        kind = text(kind.reshape(-1)[0]) if kind is not None and kind.size else ""
        if not kind:
            return None
        if self.guides is None:
            raise ValueError("guided decoding is off in this model (guided_decoding_backend and xgrammar_tokenizer_info_path "
                             "are unset: build.guided_decoding_backend in the recipe)")
        guide = array(request, "guided_decoding_guide")
        return self.guides.matcher(kind, text(guide.reshape(-1)[0]) if guide is not None and guide.size else None)

    def _submit(self, request) -> None:
        sender = request.get_response_sender()
        if scalar(request, "stop", False):
            rid = request.request_id()
            with self.lock:
                targets = [j for j in self.jobs.values() if rid and j.triton_id == rid]
            for job in targets:
                self._cancel(job)
            sender.send(flags=FINAL)
            return
        job = None
        try:
            for name, limit in (("beam_width", 1), ("num_return_sequences", 1)):
                if int(scalar(request, name, 1)) > limit:
                    raise ValueError(f"{name} > 1 is not supported by the CPU engine (greedy, one sequence)")
            if parse_word_list(array(request, "bad_words_list")):
                raise ValueError("bad_words_list is not supported by the CPU engine")
            if np.any(array(request, "embedding_bias")) or any(array(request, n) is not None for n in ("lora_weights", "lora_config")):
                raise ValueError("embedding_bias, lora_weights and lora_config are not supported by the CPU engine (lora_task_id selects a LoRA adapter of its build)")
            ids = array(request, "input_ids")
            if ids is None:
                raise ValueError("input_ids is required")
            n = int(scalar(request, "input_lengths", ids.size))
            input_ids = ids.reshape(-1)[:n].tolist()
            end_id = scalar(request, "end_id", None)
            matcher = self._matcher(request)
            job = Job(
                request=request, sender=sender, triton_id=request.request_id(), input_ids=input_ids,
                streaming=bool(scalar(request, "streaming", False)),
                exclude_input=bool(scalar(request, "exclude_input_in_output", self.params.exclude_input_in_output)),
                want_in=bool(scalar(request, "return_num_input_tokens", False)),
                want_out=bool(scalar(request, "return_num_output_tokens", False)),
                want_perf=bool(scalar(request, "return_perf_metrics", False)),
                arrival_ns=time.time_ns(),
                wanted=frozenset(request.requested_output_names()),
            )
            ctx = bool(scalar(request, "return_context_logits", False)) and "context_logits" in job.wanted
            if bool(scalar(request, "return_generation_logits", False)):
                raise ValueError("return_generation_logits is not supported by the CPU engine (context logits are)")
            job.ctx_logits = [] if ctx else None
            with self.lock:
                self.jobs[id(job)] = job
            job.engine_id = self.engine.add_request(
                input_ids,
                max_new_tokens=int(scalar(request, "request_output_len")),
                min_tokens=int(scalar(request, "min_tokens", 0)),
                end_id=None if end_id is None or int(end_id) < 0 else int(end_id),
                stop_words=parse_word_list(array(request, "stop_words_list")),
                on_tokens=lambda new, fin, j=job: self._on_tokens(j, new, fin),
                on_error=lambda msg, j=job: self._finish(j, error=msg),
                matcher=matcher, lora_task_id=scalar(request, "lora_task_id", None),
                on_context_logits=(lambda t, j=job: j.ctx_logits.append(t)) if ctx else None,
                **encoder_kwargs(*(array(request, name) for name in ENCODER_INPUTS)),
            )
            if job.done:  # finished (client gone) before the engine's id was known here
                self.engine.cancel(job.engine_id)
        except Exception as e:
            if job is not None:  # queue full: the client may retry, UNAVAILABLE as Triton's own queue limit answers
                self._finish(job, error=str(e), code=pb_utils.TritonError.UNAVAILABLE if isinstance(e, self.queue_full) else None)
            else:
                sender.send(pb_utils.InferenceResponse(output_tensors=[], error=pb_utils.TritonError(str(e))), flags=FINAL)

    def execute(self, requests):
        for request in requests:
            self._submit(request)
        return None

    def _watch_cancellations(self) -> None:
        period = self.params.cancellation_check_period_ms / 1000.0
        while not self.closing.wait(period):
            with self.lock:
                jobs = list(self.jobs.values())
            for job in jobs:
                with job.final_lock:  # never ask a request whose final response is out (see Job.final_lock)
                    if job.done:
                        continue
                    try:
                        cancelled = job.request.is_cancelled()
                    except Exception:
                        cancelled = False
                if cancelled:
                    self._cancel(job, "request cancelled by the client")

    def finalize(self):
        st = self.engine.stats()
        if st["forward_passes"]:
            n = st["forward_passes"]
            pb_utils.Logger.log_info(
                f"tensorrt_llm (CPU): {n} steps, {st['tokens']} tokens generated, mean step {1e3 * st['step_s'] / n:.1f} ms "
                f"(forward {1e3 * st['forward_s'] / n:.1f} ms), mean tokens per step {sum(k * v for k, v in st['batch_sizes'].items()) / n:.1f}"
            )
        self.closing.set()
        self.engine.shutdown()  # in-flight jobs get on_error → final error response
        self.watcher.join(timeout=5)
        self.reporter.join(timeout=5)
        self.gauges.clear()  # a MetricFamily must outlive its Metric objects
        self.families.clear()
