"""``CpuEngine``: in-flight batching on a slot KV cache, on CPU, for the Triton ``tensorrt_llm`` model.

One scheduler thread owns the :class:`~pipeline.cpu_runtime.model.Decoder` and runs steps back to
back while there is work. Each step (TensorRT-LLM's in-flight batching):

1. takes new requests and cancellations (requests join and leave between steps);
2. admits waiting requests FIFO while a KV slot is free (every admitted request owns a slot of
   ``max_seq_len`` tokens, so it can always finish: TensorRT-LLM's ``GUARANTEED_NO_EVICT``);
3. packs one token for every decoding sequence plus prefill chunks of admitted prompts into one
   batch of at most ``max_num_tokens`` tokens (a prompt longer than what is left is split across
   steps when chunked prefill is on; with it off the whole prompt must fit one step);
4. runs one forward pass and picks each sequence's next token greedily, with ``end_id`` masked out
   while fewer than ``min_tokens`` tokens were generated and, for a guided request, every token its grammar
   forbids masked out (:mod:`pipeline.cpu_runtime.guided`, xgrammar; a completed grammar ends the sequence);
5. finishes sequences on ``end_id`` (not returned, as in TensorRT-LLM), ``max_new_tokens`` or a stop
   word (returned), frees their slots, and hands every sequence's new tokens to the delivery thread,
   which calls ``on_tokens`` while the next step already runs.

KV capacity (:func:`pipeline.cpu_runtime.kv.kv_slots`, which says how): ``kv_cache.max_tokens`` and
``kv_cache.free_memory_fraction`` of engine_config.json (the Triton model may override both) → slots of
``max_seq_len`` tokens; ``free_gpu_memory_fraction`` maps to a share of the RAM free at load time.

Greedy decoding only (``do_sample=False``), in engine_config ``compute_dtype``: ``float32`` (the
default; greedy output equals transformers ``generate()``) or ``bfloat16`` (``build.cpu.dtype``;
see :class:`~pipeline.cpu_runtime.model.Decoder`).
"""

from __future__ import annotations

import collections
import contextlib
import itertools
import json
import logging
import os
import queue
import threading
import time
from pathlib import Path
from typing import Any

import torch

from pipeline.core.geometry import geometry_from_dict
from pipeline.cpu_runtime.batch import build_step
from pipeline.cpu_runtime.cross_attention import request_cross
from pipeline.cpu_runtime.delivery import deliver_loop
from pipeline.cpu_runtime.guided import advance, mask
from pipeline.cpu_runtime.host import CoreShare, release_freed_heap, release_openmp_pool
from pipeline.cpu_runtime.kv import kv_slots
from pipeline.cpu_runtime.lora import LoraSet, selected, step_for
from pipeline.cpu_runtime.model import COMPUTE_DTYPES, Decoder
from pipeline.cpu_runtime.prefix import prefix_cache
from pipeline.cpu_runtime.requests import (
    ContextLogitsCallback,
    ErrorCallback,
    Health,
    QueueFullError,
    SequenceState,
    TokensCallback,
    checked_request,
)
from pipeline.cpu_runtime.speculative import NGramSpeculator
from pipeline.cpu_runtime.timeline import STEP_GAUGES, StepTimeline

log = logging.getLogger(__name__)

ENGINE_CONFIG = "engine_config.json"
#: Name of this runtime in engine_config.json / manifests / stats.
RUNTIME = "trtpipe-torch"
#: How long shutdown waits for the engine threads (s); a step takes well under a second.
_STOP_TIMEOUT_S = 30.0

class CpuEngine:
    """A loaded CPU engine directory (``engine_config.json`` + plain HF weights) serving requests.

    ``engine_dir`` is the output of the ``build.engine: cpu`` stage (:mod:`pipeline.engine.cpu`).
    Loading maps the weights, packs them for oneDNN, sets ``torch.set_num_threads`` (process wide:
    ``num_threads`` argument, else engine_config ``num_threads``, both kept as given; else the cores this process may
    run on, less one for each core other processes keep busy, re-counted every 0.5 s of stepping:
    :class:`~pipeline.cpu_runtime.host.CoreShare`), sizes the KV cache (module docstring; ``kv_max_tokens`` / ``kv_free_memory_fraction``
    override engine_config's ``kv_cache``, ``enable_chunked_prefill`` its ``enable_chunked_prefill``), ``speculative_config``
    (LLM-API ``NGram``: :mod:`.speculative`), ``block_reuse`` (tokens per block of prompt-prefix KV reuse: :mod:`.prefix`),
    ``max_queue_size`` (> 0) bounds the requests accepted beyond the KV slots (TensorRT-LLM's executor
    ``max_queue_size``; ``None``/0: unbounded, as upstream), releases the calling thread's OpenMP workers
    (:func:`release_openmp_pool`: with them alive the engine's own would sleep at every barrier) and starts the
    scheduler and delivery threads.

    Raises ``FileNotFoundError`` when ``engine_config.json`` is missing, ``ValueError`` when its
    ``kind`` is not ``cpu``, the runtime is another one, its ``compute_dtype`` is unknown, or the KV
    cache cannot hold one sequence, and :class:`~pipeline.cpu_runtime.model.UnsupportedModelError` for an
    unsupported model.
    """

    #: trtpipe's Prometheus gauges of ``iteration_stats()["stepStats"]`` (timeline.py), for the served CPU model
    step_gauges = STEP_GAUGES

    def __init__(self, engine_dir: Path, *, num_threads: int | None = None, kv_max_tokens: int | None = None,
                 kv_free_memory_fraction: float | None = None, enable_chunked_prefill: bool | None = None,
                 max_queue_size: int | None = None, speculative_config: dict[str, Any] | None = None,
                 block_reuse: int | None = None):
        t0 = time.perf_counter()
        self.engine_dir = Path(engine_dir)
        path = self.engine_dir / ENGINE_CONFIG
        if not path.is_file():
            raise FileNotFoundError(f"{path}: not a CPU engine directory (no {ENGINE_CONFIG})")
        cfg = json.loads(path.read_text())
        if cfg.get("kind") != "cpu":
            raise ValueError(f"{path}: kind is {cfg.get('kind')!r}, expected 'cpu'")
        if cfg.get("runtime", RUNTIME) != RUNTIME:
            raise ValueError(f"{path}: runtime {cfg.get('runtime')!r} is not {RUNTIME!r}: rebuild the engine stage")
        compute = cfg.get("compute_dtype", "float32")
        if compute not in COMPUTE_DTYPES:
            raise ValueError(f"{path}: compute_dtype {compute!r} is not one of {', '.join(COMPUTE_DTYPES)}")
        self.dtype = COMPUTE_DTYPES[compute]
        self.speculation = NGramSpeculator.from_config(speculative_config, cfg)  # n-gram drafts (speculative.py) or None
        self.threads = int(num_threads or cfg.get("num_threads") or len(os.sched_getaffinity(0)) or 1)
        self._share = None if num_threads or cfg.get("num_threads") else CoreShare(self.threads)  # neighbours' cores
        torch.set_num_threads(self.threads)
        kv = cfg.get("kv_cache") or {}
        kv_dtype = kv.get("dtype", "float32")  # engines built before the bfloat16 KV cache kept float32 K/V
        if kv_dtype not in COMPUTE_DTYPES:
            raise ValueError(f"{path}: kv_cache.dtype {kv_dtype!r} is not one of {', '.join(COMPUTE_DTYPES)}")
        self.kv_dtype = COMPUTE_DTYPES[kv_dtype]
        max_tokens = kv_max_tokens if kv_max_tokens is not None else kv.get("max_tokens")
        fraction = kv_free_memory_fraction if kv_free_memory_fraction is not None else kv.get("free_memory_fraction", 0.9)
        model_cfg = json.loads((self.engine_dir / "config.json").read_text())
        import psutil

        geo = geometry_from_dict(model_cfg)
        # the weights are about to take their size out of the available memory
        weights = sum(f.stat().st_size for f in self.engine_dir.glob("*.safetensors"))
        slots, self.kv_tokens = kv_slots(
            max_batch_size=int(cfg["max_batch_size"]), max_seq_len=int(cfg["max_seq_len"]),
            bytes_per_token=geo.kv_bytes_per_token(self.kv_dtype.itemsize),
            available_bytes=psutil.virtual_memory().available - weights,
            max_tokens=max_tokens, free_memory_fraction=float(fraction))
        # The decoder is built on the scheduler thread that runs it (packed on another thread, every step ran ~1.6 ×
        # slower: SmolLM2, 2 cores, 18.8 → 29.2 ms at 1 sequence), and this thread keeps no OpenMP workers (~1.5 ×).
        release_openmp_pool()
        self._built = threading.Event()
        self._build_error: BaseException | None = None
        self._cfg = cfg
        self.chunked = bool(cfg.get("enable_chunked_prefill", False) if enable_chunked_prefill is None else enable_chunked_prefill)

        self._cv = threading.Condition()
        self._inbox: collections.deque[SequenceState] = collections.deque()
        self._cancels: list[SequenceState] = []
        self._requests: dict[str, SequenceState] = {}  # accepted, not finished/cancelled (under _cv)
        self.max_queue_size = int(max_queue_size or 0)
        self._in_slots = 0  # len(_active), published by the scheduler thread for iteration_stats
        self._ids = itertools.count()
        self._closed = False
        self._fatal: str | None = None
        # scheduler-thread state
        self._waiting: collections.deque[SequenceState] = collections.deque()
        self._active: list[SequenceState] = []  # index = KV slot (kept compact)
        self._out: queue.SimpleQueue = queue.SimpleQueue()
        self._counters = {"forward_passes": 0, "forward_s": 0.0, "step_s": 0.0, "tokens": 0}
        self._batch_hist: collections.Counter = collections.Counter()
        self.timeline = StepTimeline()  # per-step kinds, times and the gaps between steps (trtpipe profile)
        self._thread = threading.Thread(target=self._loop, args=(slots, int(cfg["max_seq_len"]), block_reuse),
                                        name="cpu-engine", daemon=True)
        self._delivery = threading.Thread(target=deliver_loop, args=(self,), name="cpu-engine-deliver", daemon=True)
        self._thread.start()
        self._built.wait()
        if self._build_error is not None:
            self._thread.join()
            raise self._build_error
        self.vocab_size = self.model.geo.vocab_size
        release_freed_heap()
        self._delivery.start()
        self.load_time_s = time.perf_counter() - t0

    # ------------------------------------------------------------------ public API
    @property
    def config(self) -> dict:
        """``engine_config.json`` as loaded (a copy)."""
        return dict(self._cfg)

    @property
    def runtime(self) -> dict[str, Any]:
        """What serves: runtime name, GEMM kernels, the other kernels (:attr:`Decoder.kernels`), dtype, KV cache
        dtype, threads (the most; ``threads_now``: beside the current neighbours), KV slots × slot length, KV tokens."""
        return {"runtime": RUNTIME, "gemm": self.model.gemm, "kernels": self.model.kernels,
                "dtype": str(self.dtype).removeprefix("torch."),
                "kv_dtype": str(self.model.cache.dtype).removeprefix("torch."), "threads": self.threads,
                "threads_now": self._share.threads if self._share else self.threads,
                "kv_slots": self.model.cache.slots, "kv_slot_len": self.model.cache.slot_len, "kv_tokens": self.kv_tokens}

    @property
    def num_active(self) -> int:
        """Requests accepted and not yet finished, failed or cancelled (running or waiting for a slot)."""
        with self._cv:
            return len(self._requests)

    def add_request(self, input_ids: list[int], *, max_new_tokens: int, min_tokens: int = 0, end_id: int | None = None,
                    stop_words: list[list[int]] | None = None, on_tokens: TokensCallback,
                    on_error: ErrorCallback | None = None, matcher: Any = None,
                    on_context_logits: ContextLogitsCallback | None = None, lora_task_id: int | None = None,
                    multimodal: Any = None, encoder_input_features: Any = None, cross_attention_mask: Any = None,
                    skip_cross_attn_blocks: bool = False) -> str:
        """Queue one greedy generation (LoRA adapter ``lora_task_id`` of :attr:`lora`, if given); returns its request id.

        ``on_tokens(new_token_ids, finished)`` is called from the engine's delivery thread after
        every step that produced tokens for this request, ``finished=True`` exactly once, on the
        last call (``end_id`` generated after ``min_tokens`` tokens, ``max_new_tokens`` reached, or
        a ``stop_words`` sequence generated — the stop word is returned, the end token is not).
        With ``min_tokens >= max_new_tokens`` exactly ``max_new_tokens`` tokens are returned.
        ``end_id`` ``None``/negative never stops. If the engine fails or shuts down,
        ``on_error(message)`` is called instead (or, without ``on_error``, ``on_tokens([], True)``).
        Callbacks must be quick: one thread delivers every request's tokens. ``matcher``: its guide (Guides.matcher).

        A request beyond the free KV slots waits (FIFO) and joins the running batch when a slot frees.
        ``on_context_logits`` (TensorRT-LLM's ``return_context_logits``): called from the delivery thread, before
        the tokens of the same step, with float32 logits ``[n, vocab]`` of every position of each prefill chunk.
        mllama: ``encoder_input_features`` ``[E, hidden]``, ``cross_attention_mask`` ``[rows, E]``: cross_attention.request_cross.

        Raises :class:`~pipeline.cpu_runtime.requests.QueueFullError` when ``max_queue_size`` requests already wait
        beyond the KV slots (refused at once, nothing queued), and ``ValueError`` (message meant for the client) when: ``input_ids`` is empty or holds
        ids outside ``[0, vocab_size)``; ``len(input_ids) > max_input_len``; ``len(input_ids) +
        max_new_tokens > max_seq_len``; ``max_new_tokens < 1``; ``min_tokens < 0``; chunked prefill is
        off and the prompt exceeds ``max_num_tokens``; ``lora_task_id`` names no adapter of this engine.
        ``RuntimeError`` after :meth:`shutdown` or when the scheduler thread has died.

        ``multimodal`` (:class:`pipeline.cpu_runtime.mrope.PromptMultimodal`): image embeddings spliced into the
        prompt's placeholder rows and, for an M-RoPE model (Qwen2-VL), the prompt's 3-D positions; ``ValueError`` when
        its shapes do not fit the prompt or the model.
        """
        ids, min_tokens, eid, words = checked_request(self._cfg, self.chunked, self.model.embed.shape[0], input_ids,
                                                      max_new_tokens, min_tokens, end_id, stop_words)
        if multimodal is not None:  # image embeddings + M-RoPE positions (pipeline/cpu_runtime/mrope.py)
            multimodal.check(len(ids), self.model.geo.hidden_size)
            if multimodal.positions is not None and self.model.mrope_section is None:
                raise ValueError("M-RoPE positions given, but this engine's model has no mrope_section")
        cross = request_cross(self.model.cross, self._cfg, len(ids), encoder_input_features, cross_attention_mask,
                              skip_cross_attn_blocks)
        with self._cv:
            if not (state := self.health()).ok:
                raise RuntimeError(state.reason)
            queued = len(self._requests) - self.model.cache.slots  # beyond the slots, whether admitted yet or not
            if self.max_queue_size and queued >= self.max_queue_size:
                raise QueueFullError(
                    f"Maximum queue size of {self.max_queue_size} has been reached, please try again later: "
                    f"{queued} requests wait for one of the {self.model.cache.slots} KV-cache slots (max_queue_size)")
            rid = f"cpu-{next(self._ids)}"
            seq = SequenceState(rid, ids, int(max_new_tokens), min_tokens, eid, words, on_tokens, on_error, matcher,
                                on_context_logits)
            seq.lora = selected(self.lora, lora_task_id)  # ValueError for an id no adapter has
            seq.mm = multimodal
            seq.cross = cross  # (features, mask) until admission computes its cross K/V
            self._requests[rid] = seq
            self._inbox.append(seq)
            self._cv.notify()
        return rid

    def health(self) -> Health:
        """``Health(True, "")`` while the engine takes requests, else why not: shut down, or the scheduler failed (its
        error; the scheduler thread ends only then or on shutdown)."""
        with self._cv:
            why = "the CPU engine is shut down" if self._closed else self._fatal and f"the CPU engine's scheduler stopped: {self._fatal}"
        return Health(not why, why or "")

    def cancel(self, request_id: str) -> None:
        """Stop a request: its slot frees at the next step; no callback runs for it after this
        returns (none is made for the cancellation itself). Unknown/finished ids are ignored."""
        with self._cv:
            seq = self._requests.pop(request_id, None)
            if seq is None:
                return
            self._cancels.append(seq)
            self._cv.notify()
        with seq.lock:
            seq.done = True

    def shutdown(self) -> None:
        """Stop the scheduler and delivery threads (idempotent). Requests still in flight get
        ``on_error("engine shut down")`` (or ``on_tokens([], True)``)."""
        with self._cv:
            if self._closed:
                return
            self._closed = True
            self._cv.notify_all()
        self._thread.join(timeout=_STOP_TIMEOUT_S)
        with self._cv:
            left = list(self._requests.values())
            self._requests.clear()
        for seq in left:
            self._out.put(("error", seq, "engine shut down"))
        self._out.put(None)
        self._delivery.join(timeout=_STOP_TIMEOUT_S)

    def stats(self) -> dict[str, Any]:
        """Counters: ``forward_passes``, ``forward_s`` (time in the decoder), ``step_s`` (whole steps:
        scheduling + forward + sampling), ``tokens`` generated, ``batch_sizes`` ({tokens in a step:
        steps}), ``active`` requests, ``load_time_s``."""
        return {**self._counters, "batch_sizes": dict(self._batch_hist), "active": self.num_active,
                "load_time_s": self.load_time_s, **({"speculative": self.speculation.stats()} if self.speculation else {})}

    def iteration_stats(self) -> dict[str, Any]:
        """The latest state, named as TensorRT-LLM's iteration stats (``LLM.get_stats()``, executor ``IterationStats``):
        ``numActiveRequests`` (in a KV slot), ``numQueuedRequests`` (waiting for one), ``maxNumActiveRequests`` and
        ``kvCacheStats`` ``{maxNumBlocks, freeNumBlocks, usedNumBlocks, tokensPerBlock}``: a block here is one slot of
        ``max_seq_len`` tokens (each admitted request owns one, module docstring)."""
        with self._cv:
            accepted, used = len(self._requests), self._in_slots
        slots = self.model.cache.slots
        return {**({"specDecodingStats": self.speculation.iteration_stats()} if self.speculation else {}),
            "stepStats": self.timeline.stats(),  # trtpipe's: cumulative step timeline (timeline.py)
            "numActiveRequests": used, "numQueuedRequests": max(accepted - used, 0), "maxNumActiveRequests": slots,
            "kvCacheStats": {"maxNumBlocks": slots, "freeNumBlocks": slots - used, "usedNumBlocks": used,
                             "tokensPerBlock": self.model.cache.slot_len, **self.prefix.kv_cache_stats()}}

    def __enter__(self) -> "CpuEngine":
        return self

    def __exit__(self, *exc: object) -> None:
        self.shutdown()

    # ------------------------------------------------------------------ scheduler thread
    def _loop(self, slots: int, slot_len: int, block_reuse: int | None) -> None:
        try:
            torch.set_num_threads(self.threads)  # OpenMP's thread count is per thread
            self.model = Decoder(self.engine_dir, slots=slots, slot_len=slot_len, dtype=self.dtype, kv_dtype=self.kv_dtype)
            self.lora = LoraSet.from_engine_config(self.engine_dir, self._cfg, self.model.geo)  # adapters by task id
            self.prefix = prefix_cache(self.model.cache, block_reuse)  # prompt-prefix KV block reuse (prefix.py)
        except BaseException as e:  # reported by __init__ in the caller's thread
            self._build_error = e
            return
        finally:
            self._built.set()
        try:
            with torch.inference_mode():
                self._run()
        except BaseException as e:  # a bug, or out of memory: fail everything, refuse new requests
            log.exception("CPU engine scheduler failed")
            with self._cv:
                self._fatal = f"{type(e).__name__}: {e}"
                left = list(self._requests.values())
                self._requests.clear()
            for seq in left:
                self._out.put(("error", seq, f"request failed in the CPU engine: {self._fatal}"))

    def _run(self) -> None:
        while True:
            with self._cv:
                while not (self._inbox or self._cancels or self._active or self._waiting or self._closed):
                    if self._share:
                        self._share.pause()
                    self._cv.wait()
                if self._closed:
                    return
                self._waiting.extend(self._inbox)
                self._inbox.clear()
                cancels, self._cancels = self._cancels, []
            for seq in cancels:
                self._release(seq)
            self._admit()
            if self._active:
                self._step()

    def _admit(self) -> None:
        slots = self.model.cache.slots
        while self._waiting and len(self._active) < slots:
            seq = self._waiting.popleft()
            if seq.done:
                continue
            seq.slot = len(self._active)
            if seq.cross is not None:  # mllama: the cross K/V, once per request
                seq.cross = self.model.cross.prepare(*seq.cross)
            self.prefix.admit(seq, self._active)  # a stored prefix's K/V into the slot, seq.prefilled past it
            self._active.append(seq)
        self._in_slots = len(self._active)

    def _release(self, seq: SequenceState) -> None:
        """Free ``seq``'s slot (moving the last slot's sequence into it) or drop it from the queue."""
        if seq.slot is None:
            with contextlib.suppress(ValueError):
                self._waiting.remove(seq)
            return
        self.prefix.release(seq)  # its prompt's blocks kept for reuse (when on)
        hole, last = seq.slot, len(self._active) - 1
        seq.slot = None
        if hole != last:
            moved = self._active[last]
            self.model.cache.move(last, hole, moved.prefilled + len(moved.generated))
            moved.slot = hole
            self._active[hole] = moved
        self._active.pop()
        self._in_slots = len(self._active)

    def _retire(self, finished: list[SequenceState], out: list) -> None:
        """After a step: forget and release the ``finished`` sequences' slots, then queue the step's ``out`` items for
        the delivery thread (one place for the plain and the speculative step)."""
        if finished:
            with self._cv:
                for seq in finished:
                    self._requests.pop(seq.rid, None)
            for seq in finished:
                self._release(seq)
        for item in out:
            self._out.put(item)

    def _step(self) -> None:
        t0 = time.perf_counter()
        if self._share and (n := self._share.poll()):
            torch.set_num_threads(n)  # this thread's OpenMP team, the kernels' ``threads`` (model.py)
        if self.speculation is not None and self.speculation.step(self, t0):  # a step that verified n-gram drafts
            return
        gen = sum(1 for s in self._active if s.prefilled == len(s.prompt) and s.generated)  # decoding sequences
        batch, seqs, ctx_seqs = build_step(self._active, int(self._cfg["max_num_tokens"]), self.chunked)
        if batch.tokens.numel() == 0:
            return
        batch.lora = step_for(batch.slots, [s.lora for s in self._active]) if self.lora is not None else None
        batch.cross = [s.cross for s in self._active] if self.model.cross is not None else None
        t1 = time.perf_counter()
        logits = self.model.forward(batch)
        t2 = time.perf_counter()
        off = len(seqs)
        for seq, n in ctx_seqs:  # delivered before the step's tokens (one queue, in order)
            self._out.put(("logits", seq, logits[off:off + n].clone()))
            off += n
        logits = logits[:len(seqs)]
        ban = [(r, s.end_id) for r, s in enumerate(seqs) if len(s.generated) < s.min_tokens]
        if ban:
            r, e = zip(*ban)
            logits[list(r), list(e)] = float("-inf")
        mask(logits, [s.matcher for s in seqs])
        next_ids = logits.argmax(-1).tolist() if seqs else []
        out, finished = [], []
        for seq, tok in zip(seqs, next_ids):
            seq.generated.append(tok)
            if tok == seq.end_id or advance(seq.matcher, tok):
                out.append(("tokens", seq, [], True))
                finished.append(seq)
                continue
            end = len(seq.generated) >= seq.max_new or any(
                len(w) <= len(seq.generated) and seq.generated[-len(w):] == w for w in seq.stop_words
            )
            out.append(("tokens", seq, [tok], end))
            if end:
                finished.append(seq)
        self._retire(finished, out)
        c = self._counters
        c["forward_passes"] += 1
        c["forward_s"] += t2 - t1
        c["step_s"] += time.perf_counter() - t0
        c["tokens"] += len(seqs)
        self._batch_hist[int(batch.tokens.numel())] += 1
        self.timeline.record(t0, t1, t2, time.perf_counter(), int(batch.tokens.numel()) - gen, gen, bool(self._active))
