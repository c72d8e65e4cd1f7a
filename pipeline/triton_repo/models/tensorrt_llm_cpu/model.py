"""trtpipe's CPU ``tensorrt_llm`` model: the TensorRT-LLM tensorrt_llm interface on the CPU engine.

Same inputs/outputs as the C++ ``tensorrtllm`` backend (config generated from the same template):
input_ids, input_lengths, request_output_len, end_id, pad_id, streaming, min_tokens, stop,
stop_words_list, exclude_input_in_output, lora_task_id (one of the build's adapters, engine_config.json ``lora``;
lora_weights / lora_config, which send an adapter, are refused), return_num_input_tokens / return_num_output_tokens /
return_perf_metrics, … → output_ids [beam=1, n], sequence_length [1], num_input_tokens,
num_output_tokens (tokens generated in THIS response), arrival/first_scheduled/first_token/
last_token_time_ns. Decoding is greedy (sampling inputs are accepted and ignored); beam_width and
num_return_sequences must be 1; bad_words_list and embedding_bias are rejected.

Decoupled: ``execute`` only submits requests to :class:`pipeline.cpu_runtime.engine.CpuEngine`; the
engine's delivery thread calls back with new tokens and this model sends one response per engine
step when streaming (the last one carries TRITONSERVER_RESPONSE_COMPLETE_FINAL), or one response with
every token otherwise. end_id absent or -1 never stops on EOS; stop words end the request with the
word included. A request with ``stop=true`` cancels the running request with the same request id. A
watcher thread cancels requests whose client went away (``request.is_cancelled()``) every
``cancellation_check_period_ms``. Every error becomes a ``TritonError`` response with the final
flag: a client is never left waiting.

Text (``build.cpu.detokenize: engine``, the parameter ``tokenizer_dir``): the model also outputs
``text_output`` (BYTES [1, 1]), decoded per request by an incremental detokenizer (detokenize.py: spaces
and multi-byte characters intact; what an incomplete UTF-8 sequence held back is flushed into the final
response), and the ensemble maps it directly instead of calling postprocessing for every streamed step.

Only the outputs the request asked for are built (``request.requested_output_names()``, python_backend
src/pb_stub.cc@a2564ea:1844), and the tensors
of a response stay referenced until ``send`` returns. The python backend prunes unrequested outputs after
releasing the GIL (python_backend src/response_sender.cc@a2564ea:124-129, ``ResponseSender::Send``): a
pruned tensor whose last owner was the response frees its numpy array there, without the GIL. Sending
output_ids + sequence_length + text_output to an ensemble that asked for text_output only killed the stub
in the first of three runs at c = 16 with ``sys.setswitchinterval(2e-4)`` (2026-11-26); building only the
requested outputs, it served 4 × 32 requests under the same setting.

Parameters (strict: every one listed here is read, and any other key fails the load, so the
generated config.pbtxt carries only what this model honours): gpt_model_path (engine dir),
max_beam_width (must be 1), exclude_input_in_output, cancellation_check_period_ms, cpu_num_threads
(optional), tokenizer_dir (optional; required when the config declares text_output) and
skip_special_tokens. The KV cache, scheduler and chunked-prefill settings are the engine directory's
``engine_config.json`` (pipeline/engine/cpu.py), sized at load by pipeline.cpu_runtime.kv.kv_slots.
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
)
from detokenize import IncrementalDetokenizer

FINAL = pb_utils.TRITONSERVER_RESPONSE_COMPLETE_FINAL
#: Every parameter this model reads (anything else in config.pbtxt is refused).
PARAMETERS = (
    "gpt_model_path", "max_beam_width", "exclude_input_in_output", "cancellation_check_period_ms", "cpu_num_threads",
    "tokenizer_dir", "skip_special_tokens",
)


@dataclasses.dataclass(frozen=True)
class Params:
    """Parsed model parameters."""

    engine_dir: str
    exclude_input_in_output: bool
    cancellation_check_period_ms: int
    num_threads: int | None
    #: set: the model writes ``text_output`` (relative to the model directory, like every tokenizer_dir)
    tokenizer_dir: str | None
    skip_special_tokens: bool

    @classmethod
    def parse(cls, raw: dict[str, str]) -> "Params":
        """Raises :class:`ParameterError` for an unknown key, a malformed value or a setting the engine cannot honour."""
        unknown = sorted(set(raw) - set(PARAMETERS))
        if unknown:
            raise ParameterError(f"parameter {unknown[0]} is not read by the CPU tensorrt_llm model (it reads: {', '.join(PARAMETERS)})")
        beam = get_param(raw, "max_beam_width", lambda n, v: parse_int(n, v, minimum=1), 1)
        if beam != 1:
            raise ParameterError(f"parameter max_beam_width={beam}: the CPU engine decodes greedily (1 beam)")
        return cls(
            engine_dir=get_param(raw, "gpt_model_path", lambda n, v: v),
            exclude_input_in_output=get_param(raw, "exclude_input_in_output", parse_bool, False),
            cancellation_check_period_ms=get_param(
                raw, "cancellation_check_period_ms", lambda n, v: parse_int(n, v, minimum=1), 100
            ),
            num_threads=get_param(raw, "cpu_num_threads", lambda n, v: parse_int(n, v, minimum=1), None),
            tokenizer_dir=get_param(raw, "tokenizer_dir", lambda n, v: v, None),
            skip_special_tokens=get_param(raw, "skip_special_tokens", parse_bool, True),
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

        p = self.params
        self.tokenizer = None
        if p.tokenizer_dir is not None:
            self.tokenizer = load_tokenizer(resolve_dir(args["model_repository"], p.tokenizer_dir))
        self.engine = CpuEngine(p.engine_dir, num_threads=p.num_threads)
        rt = self.engine.runtime
        pb_utils.Logger.log_info(
            f"tensorrt_llm (CPU): {rt['runtime']} {rt['gemm']} GEMMs, {rt['kernels']} kernels, {rt['dtype']}, "
            f"{rt['threads']} threads, KV "
            f"{rt['kv_slots']} slots × {rt['kv_slot_len']} tokens, loaded in {self.engine.load_time_s:.1f} s"
        )
        self.lock = threading.Lock()
        self.jobs: dict[int, Job] = {}  # keyed by id(job)
        self.closing = threading.Event()
        self.watcher = threading.Thread(target=self._watch_cancellations, name="cancel-watch", daemon=True)
        self.watcher.start()

    # ------------------------------------------------------------------ responses
    def _finish(self, job: Job, tensors=None, error: str | None = None) -> None:
        """Send the last response (or just the final flag) exactly once."""
        with job.final_lock:
            with self.lock:
                if job.done:
                    return
                job.done = True
                self.jobs.pop(id(job), None)
            self._send_final(job, tensors, error)

    @staticmethod
    def _send_final(job: Job, tensors, error: str | None) -> None:
        try:
            if error is not None:
                job.sender.send(pb_utils.InferenceResponse(output_tensors=[], error=pb_utils.TritonError(error)), flags=FINAL)
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
            if array(request, "embedding_bias") is not None and np.any(array(request, "embedding_bias")):
                raise ValueError("embedding_bias is not supported by the CPU engine")
            if array(request, "lora_weights") is not None or array(request, "lora_config") is not None:
                raise ValueError("lora_weights / lora_config are not taken by the CPU engine: it serves its build's "
                                 "adapters (build.lora), selected by lora_task_id")
            lora_task_id = scalar(request, "lora_task_id", None)
            ids = array(request, "input_ids")
            if ids is None:
                raise ValueError("input_ids is required")
            n = int(scalar(request, "input_lengths", ids.size))
            input_ids = ids.reshape(-1)[:n].tolist()
            end_id = scalar(request, "end_id", None)
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
                lora_task_id=None if lora_task_id is None else int(lora_task_id),
            )
            if job.done:  # finished (client gone) before the engine's id was known here
                self.engine.cancel(job.engine_id)
        except Exception as e:
            if job is not None:
                self._finish(job, error=str(e))
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
