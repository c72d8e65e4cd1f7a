"""``CpuEngine``: in-flight batching on a paged KV cache, on CPU, for the Triton ``tensorrt_llm`` model.

The scheduler, the paged KV cache and the batched forward are transformers' continuous batching
(``transformers.generation.continuous_batching``, 5.14: ``ContinuousBatchingManager``), not a
hand-rolled loop: one background thread schedules every active request into each forward pass
(prefill chunks and decode tokens of many requests packed into one ``[1, tokens]`` batch, up to
``max_num_tokens``), requests added at any time join the running batch at the next step, and KV
blocks of ``tokens_per_block`` tokens come from a fixed pool of ``kv_cache_blocks`` blocks.

This module adds what the TensorRT-LLM request interface needs on top:

- ``min_tokens`` / ``end_id`` per request (TensorRT-LLM semantics): ``end_id`` is masked out of
  the logits while fewer than ``min_tokens`` tokens were generated (a per-request continuous-batching
  logits processor, one int per request per step); ``end_id`` ``None``/negative never stops. The
  end token itself is not returned (TensorRT-LLM excludes it from ``sequence_length``).
- validation against the engine limits with :class:`ValueError` messages meant for the client;
- a dispatcher thread that turns the library's per-step outputs into ``on_tokens`` callbacks.

Greedy decoding only (``do_sample=False``), as the engine stage builds it.
"""

from __future__ import annotations

import itertools
import json
import logging
import os
import queue
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

log = logging.getLogger(__name__)

ENGINE_CONFIG = "engine_config.json"
#: How long shutdown waits for the scheduler thread (s); the thread only runs short forward passes.
_STOP_TIMEOUT_S = 30.0
#: Poll period of the dispatcher thread on the output queue (s): bounds shutdown latency only.
_POLL_S = 0.05

TokensCallback = Callable[[list[int], bool], None]
ErrorCallback = Callable[[str], None]


def _eos_suppressor_cls():
    """The per-request ``end_id``-below-``min_tokens`` logits processor (built lazily: transformers import)."""
    from transformers.generation.continuous_batching.cb_logits_processors import ContinuousBatchingLogitsProcessor

    class MinTokensEndIdSuppressor(ContinuousBatchingLogitsProcessor):
        """Sets the ``end_id`` logit to -inf for a request that has generated fewer than ``min_tokens`` tokens.

        Per-request kwargs (``add_request(..., end_id=int, min_tokens=int)``); the tensor argument is one
        int32 per scheduled request: the token id to mask, or -1.
        """

        supported_kwargs: dict[str, type] = {"end_id": int, "min_tokens": int}
        ignored_kwargs: tuple[str, ...] = ()

        def fill_defaults(self, int32_tensor: torch.Tensor) -> None:
            int32_tensor.fill_(-1)

        def prepare_tensor_args(self, requests_with_new_token) -> torch.Tensor:
            ids = []
            for fr in requests_with_new_token:
                st = fr.state
                kw = st.logit_processor_kwargs
                ids.append(kw["end_id"] if len(st.generated_tokens) < kw.get("min_tokens", 0) else -1)
            return torch.tensor(ids, dtype=torch.int32)

        def __call__(self, scores: torch.Tensor, tensor_arg: torch.Tensor) -> torch.Tensor:
            ids = tensor_arg[: scores.size(0)].long()
            rows = (ids >= 0).nonzero().squeeze(1)
            if rows.numel():
                scores[rows, ids[rows]] = float("-inf")
            return scores

    return MinTokensEndIdSuppressor


class _Request:
    __slots__ = ("on_tokens", "on_error", "end_id", "sent", "done")

    def __init__(self, on_tokens: TokensCallback, on_error: ErrorCallback | None, end_id: int):
        self.on_tokens, self.on_error, self.end_id = on_tokens, on_error, end_id
        self.sent = 0  # generated tokens already passed to on_tokens
        self.done = False


class CpuEngine:
    """A loaded CPU engine directory (``engine_config.json`` + plain HF weights) serving requests.

    ``engine_dir`` is the output of the ``build.engine: cpu`` stage (:mod:`pipeline.engine.cpu`).
    Loading reads the weights with transformers (offline), sets ``torch.set_num_threads`` (process
    wide: ``num_threads`` argument, else engine_config ``num_threads``, else the cores this process
    may run on) and starts
    the scheduler thread plus one dispatcher thread. Raises ``FileNotFoundError`` when
    ``engine_config.json`` is missing and ``ValueError`` when its ``kind`` is not ``cpu``.
    """

    def __init__(self, engine_dir: Path, *, num_threads: int | None = None):
        t0 = time.perf_counter()
        self.engine_dir = Path(engine_dir)
        path = self.engine_dir / ENGINE_CONFIG
        if not path.is_file():
            raise FileNotFoundError(f"{path}: not a CPU engine directory (no {ENGINE_CONFIG})")
        cfg = json.loads(path.read_text())
        if cfg.get("kind") != "cpu":
            raise ValueError(f"{path}: kind is {cfg.get('kind')!r}, expected 'cpu'")
        self._cfg = cfg
        threads = num_threads or cfg.get("num_threads") or len(os.sched_getaffinity(0)) or 1
        torch.set_num_threads(int(threads))

        from transformers import AutoModelForCausalLM, ContinuousBatchingConfig, GenerationConfig, LogitsProcessorList
        from transformers.generation.continuous_batching.cb_logits_processors import (
            ContinuousBatchingLogitsProcessorList,
        )

        dtype = getattr(torch, cfg.get("dtype", "float32"))
        self.model = AutoModelForCausalLM.from_pretrained(
            self.engine_dir, dtype=dtype, attn_implementation=cfg.get("attn_implementation", "sdpa"), local_files_only=True
        ).eval()
        self.vocab_size = int(self.model.config.vocab_size)
        self.forward_passes = 0
        self.model.register_forward_pre_hook(self._count_forward)

        gen = GenerationConfig(do_sample=False, eos_token_id=-1, max_new_tokens=int(cfg["max_seq_len"]))
        cb = ContinuousBatchingConfig(
            block_size=int(cfg["tokens_per_block"]),
            num_blocks=int(cfg["kv_cache_blocks"]),
            max_batch_tokens=int(cfg["max_num_tokens"]),
            max_requests_per_batch=int(cfg["max_batch_size"]),
            allow_block_sharing=bool(cfg.get("enable_block_reuse", False)),
            max_blocks_per_request=0,  # the fast decode path needs flash-attn kernels (CUDA)
            use_cuda_graph=False,
            use_async_batching=False,
            scheduler_type=cfg.get("scheduler", "fifo"),
        )
        self._mgr = self.model.init_continuous_batching(generation_config=gen, continuous_batching_config=cb)
        # Our processor replaces the (empty, greedy) list before start(): the batch processor and its
        # argument buffers are created from mgr.logit_processor in the generation thread.
        procs = ContinuousBatchingLogitsProcessorList(LogitsProcessorList([_eos_suppressor_cls()()]))
        procs.tensors_required = 1
        self._mgr.logit_processor = procs

        self._lock = threading.RLock()
        self._requests: dict[str, _Request] = {}
        self._ids = itertools.count()
        self._closed = False
        self._mgr.start()
        self._dispatcher = threading.Thread(target=self._dispatch_loop, name="cpu-engine-dispatch", daemon=True)
        self._dispatcher.start()
        self.load_time_s = time.perf_counter() - t0

    # ------------------------------------------------------------------ public API
    @property
    def config(self) -> dict:
        """``engine_config.json`` as loaded (a copy)."""
        return dict(self._cfg)

    @property
    def num_active(self) -> int:
        """Requests accepted and not yet finished, failed or cancelled."""
        with self._lock:
            return len(self._requests)

    def add_request(
        self,
        input_ids: list[int],
        *,
        max_new_tokens: int,
        min_tokens: int = 0,
        end_id: int | None = None,
        on_tokens: TokensCallback,
        on_error: ErrorCallback | None = None,
    ) -> str:
        """Queue one greedy generation; returns its request id.

        ``on_tokens(new_token_ids, finished)`` is called from the engine's dispatcher thread after
        every decode step with the tokens generated since the last call, ``finished=True`` exactly
        once, on the last call (``end_id`` generated after ``min_tokens`` tokens, or
        ``max_new_tokens`` reached). With ``min_tokens >= max_new_tokens`` exactly
        ``max_new_tokens`` tokens are returned. The end token is not returned. If the request
        fails inside the engine, ``on_error(message)`` is called instead (or, without
        ``on_error``, ``on_tokens([], True)``). Callbacks must be quick: they run on the thread
        that delivers every request's tokens.

        Raises ``ValueError`` (message meant for the client) when: ``input_ids`` is empty or holds
        ids outside ``[0, vocab_size)``; ``len(input_ids) > max_input_len``; ``len(input_ids) +
        max_new_tokens > max_seq_len``; ``max_new_tokens < 1``; ``min_tokens < 0``; the sequence
        needs more KV blocks than the pool holds; ``max_batch_size`` requests are already in flight.
        Raises ``RuntimeError`` after :meth:`shutdown` or when the scheduler thread has died.
        """
        c = self._cfg
        n = len(input_ids)
        if n == 0:
            raise ValueError("input_ids is empty: a prompt needs at least one token")
        if n > c["max_input_len"]:
            raise ValueError(f"prompt has {n} tokens, more than the engine's max_input_len {c['max_input_len']}")
        if max_new_tokens < 1:
            raise ValueError(f"request_output_len must be at least 1, got {max_new_tokens}")
        if min_tokens < 0:
            raise ValueError(f"min_tokens must be >= 0, got {min_tokens}")
        if n + max_new_tokens > c["max_seq_len"]:
            raise ValueError(
                f"prompt {n} + request_output_len {max_new_tokens} = {n + max_new_tokens} tokens exceeds the "
                f"engine's max_seq_len {c['max_seq_len']}"
            )
        blocks = -(-(n + max_new_tokens) // c["tokens_per_block"])
        if blocks > c["kv_cache_blocks"]:
            raise ValueError(
                f"the sequence needs {blocks} KV blocks but the engine's KV cache holds {c['kv_cache_blocks']}"
            )
        ids = [int(t) for t in input_ids]
        if min(ids) < 0 or max(ids) >= self.vocab_size:
            raise ValueError(f"input_ids hold token ids outside [0, {self.vocab_size})")
        eid = -1 if end_id is None or end_id < 0 else int(end_id)
        with self._lock:
            if self._closed:
                raise RuntimeError("the CPU engine is shut down")
            if self._mgr.fatal_error is not None or not self._mgr.is_running():
                raise RuntimeError(f"the CPU engine's scheduler stopped: {self._mgr.fatal_error}")
            if len(self._requests) >= c["max_batch_size"]:
                raise ValueError(
                    f"{len(self._requests)} requests already in flight: the engine's max_batch_size is {c['max_batch_size']}"
                )
            rid = f"cpu-{next(self._ids)}"
            self._requests[rid] = _Request(on_tokens, on_error, eid)
        try:
            accepted = self._mgr.add_request(
                ids, request_id=rid, max_new_tokens=int(max_new_tokens), streaming=True, eos_token_id=eid,
                end_id=eid, min_tokens=int(min_tokens) if eid >= 0 else 0,
            )
        except BaseException:
            with self._lock:
                self._requests.pop(rid, None)
            raise
        if accepted is None:  # the manager is stopping and dropped it
            with self._lock:
                self._requests.pop(rid, None)
            raise RuntimeError("the CPU engine is shutting down")
        return rid

    def cancel(self, request_id: str) -> None:
        """Stop a request: frees its KV blocks at the next step; no callback runs for it after this
        returns (none is made for the cancellation itself). Unknown/finished ids are ignored."""
        with self._lock:
            req = self._requests.pop(request_id, None)
            if req is None:
                return
            req.done = True
        self._mgr.cancel_request(request_id)

    def shutdown(self) -> None:
        """Stop the scheduler and dispatcher threads (idempotent). Requests still in flight get
        ``on_error("engine shut down")`` (or ``on_tokens([], True)``)."""
        with self._lock:
            if self._closed:
                return
            self._closed = True
        try:
            self._mgr.stop(block=True, timeout=_STOP_TIMEOUT_S, hard_stop=True)
            self._mgr.destroy()
        finally:
            self._dispatcher.join(timeout=_STOP_TIMEOUT_S)
            with self._lock:
                left = list(self._requests.values())
                self._requests.clear()
            for req in left:
                self._fail(req, "engine shut down")

    def stats(self) -> dict[str, Any]:
        """Counters: ``forward_passes`` (batched forwards run so far), ``active`` requests, ``load_time_s``."""
        return {"forward_passes": self.forward_passes, "active": self.num_active, "load_time_s": self.load_time_s}

    def __enter__(self) -> "CpuEngine":
        return self

    def __exit__(self, *exc: object) -> None:
        self.shutdown()

    # ------------------------------------------------------------------ internals
    def _count_forward(self, module, args) -> None:
        self.forward_passes += 1

    @staticmethod
    def _fail(req: _Request, message: str) -> None:
        try:
            if req.on_error is not None:
                req.on_error(message)
            else:
                req.on_tokens([], True)
        except Exception:  # a client callback must not kill the engine
            log.exception("on_error callback failed")

    def _dispatch_loop(self) -> None:
        """Route the library's streaming outputs (cumulative token lists) to per-request callbacks."""
        out_q = self._mgr.output_router.output_queue
        while True:
            try:
                out = out_q.get(timeout=_POLL_S)
            except queue.Empty:
                if self._closed and not self._mgr.is_running():
                    return
                continue
            self._deliver(out)

    def _deliver(self, out) -> None:
        from transformers.generation.continuous_batching import RequestStatus

        with self._lock:
            req = self._requests.get(out.request_id)
            if req is None or req.done:
                return
            if out.status == RequestStatus.FAILED or out.error:
                self._requests.pop(out.request_id, None)
                req.done = True
                self._fail(req, f"request failed in the CPU engine: {out.error}")
                return
            finished = out.status == RequestStatus.FINISHED
            toks = out.generated_tokens
            end = len(toks)
            if finished and end and toks[-1] == req.end_id:
                end -= 1  # TensorRT-LLM does not count/return the end token
            new = toks[req.sent : end]
            req.sent = max(req.sent, end)
            if finished:
                self._requests.pop(out.request_id, None)
                req.done = True
            if new or finished:
                try:
                    req.on_tokens(new, finished)
                except Exception:
                    log.exception("on_tokens callback failed for %s; cancelling it", out.request_id)
                    if not finished:
                        self._requests.pop(out.request_id, None)
                        req.done = True
                        self._mgr.cancel_request(out.request_id)
