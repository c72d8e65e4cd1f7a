"""The PyTorch backend's KV-cache sizing, as TensorRT-LLM's PyTorch executor computes it (issue 48, item 3).

Read in ``tensorrt_llm/_torch/pyexecutor/_util.py`` @d8ae02caed59708512e5aa578a09bb09f365bfed (``KvCacheCreator``;
line numbers counted in the stored copy of that revision); a later revision (``_cal_max_memory`` /
``configure_kv_cache_capacity``, commit not identified in the index) keeps the same arithmetic:

1. **The estimation pass.** Before the real cache exists, ``try_prepare_estimation`` (:180-191) sets
   ``kv_cache_config.max_tokens`` to :func:`estimation_tokens` (``_get_token_num_for_estimation``, :150-178): dummy
   context requests filling ``max_num_tokens`` tokens in prompts of ``min(max_num_tokens, max_seq_len − 1)`` tokens
   (``_create_dummy_context_requests``, :123-148, built with ``net_max_seq_len − 1``, :52-53), each with 1 extra token
   (+1 with the overlap scheduler, + max_draft_len with speculation, twice with both, + the drafter's extra KV tokens),
   rounded up to whole blocks, × beam width. The executor runs them (one ``max_tokens=1`` generation each).
2. **The peak.** ``estimate_max_tokens`` (:193-269) empties the caching allocator, runs the dummy requests and reads
   ``torch_peak = allocated_bytes.all.peak`` (weights + the temporary KV cache + the activations of a
   ``max_num_tokens`` forward) and ``extra_cost = (total − free) − torch allocated`` after the pass (memory outside
   torch: CUDA context, NCCL, "CUDA graphs", :250-253); ``peak = torch_peak + extra_cost``.
3. **The fraction** (``_cal_max_tokens``, :100-121): ``available = (total − peak + temporary KV tokens × KV bytes per
   token) × free_gpu_memory_fraction`` — the temporary cache is added back, so it cancels out of the result —
   ``max_tokens = available // KV bytes per token``, where the KV bytes per token add a draft model's
   (``_draft_model_engine``, :106-109); ``free_gpu_memory_fraction`` None means 0.9 (:94-98). Then
   ``min(max_tokens, kv_cache_config.max_tokens)`` when the user set one (:267-269).

What the planner cannot measure it estimates (:func:`pytorch_reserve`): the forward's activations with
:func:`pipeline.plan.memory.activation_bytes`' per-token factor, the logits only of the dummy requests' last tokens
(``max_tokens=1``: not ``max_batch_size`` rows as the engine path's runtime buffers), and the CUDA-graph pool: graphs
are captured largest batch first into one shared private pool (``_cuda_graph_mem_pool``, model_engine /
cuda_graph_runner, commit not identified), so the pool is estimated as one decode forward of the largest captured batch
× (1 + max_draft_len) tokens with its fp32 logits [D]. The engine path (TensorRT) differs: its activations are the
engine's device memory for ``max_num_tokens`` and its runtime buffers hold ``max_batch_size`` logits rows, before the
fraction is applied to what is free (:mod:`pipeline.plan.capacity`, unchanged).
"""

from __future__ import annotations

import math

from pydantic import BaseModel

from pipeline.core.geometry import ModelGeometry
from pipeline.plan import memory as mem

#: free_gpu_memory_fraction when the config leaves it None (_util.py@d8ae02ca:94-98)
DEFAULT_FRACTION = 0.9
#: captured CUDA-graph batch when cuda_graph_config gives neither batch_sizes nor max_batch_size (TensorRT-LLM 1.2.1
#: CudaGraphConfig default 128, docs/llm-api.md; pipeline/recipe/build.py CudaGraphSpec)
DEFAULT_CUDA_GRAPH_BATCH = 128


class PytorchReserve(BaseModel):
    """What the PyTorch executor's estimation pass sees besides weights and KV cache (bytes per GPU)."""

    forward_activation_bytes: int
    dummy_logits_bytes: int
    cuda_graph_batch: int
    cuda_graph_pool_bytes: int
    dummy_requests: int

    @property
    def total_bytes(self) -> int:
        """Everything above, bytes."""
        return self.forward_activation_bytes + self.dummy_logits_bytes + self.cuda_graph_pool_bytes


def dummy_request_lengths(max_num_tokens: int, max_seq_len: int) -> list[int]:
    """Prompt lengths of the estimation pass's dummy requests (``_create_dummy_context_requests``, :123-148): prompts of
    ``min(max_num_tokens, max_seq_len − 1)`` tokens until ``max_num_tokens`` are used, the last one shorter."""
    length = min(max_num_tokens, max(1, max_seq_len - 1))
    out, left = [], max_num_tokens
    while left > 0:
        out.append(min(length, left))
        left -= out[-1]
    return out


def estimation_tokens(max_num_tokens: int, max_seq_len: int, tokens_per_block: int, *, beam_width: int = 1,
                      overlap_scheduler: bool = True, max_draft_len: int = 0, extra_kv_tokens: int = 0) -> int:
    """Tokens of the temporary KV cache of the estimation pass (``_get_token_num_for_estimation``, :150-178): per dummy
    request its prompt + 1 generated token (+1 with the overlap scheduler and + max_draft_len with speculation, counted
    twice when both) + the drafter's extra KV tokens, rounded up to whole blocks; all × tokens_per_block × beam."""
    extra = 1
    if overlap_scheduler:
        extra += 1 + max_draft_len
    if max_draft_len:
        extra += max_draft_len + extra_kv_tokens
    blocks = sum(math.ceil((n + extra) / tokens_per_block) for n in dummy_request_lengths(max_num_tokens, max_seq_len))
    return blocks * tokens_per_block * beam_width


def cuda_graph_batch(build) -> int:
    """The largest decode batch a CUDA graph is captured for (0: graphs off): max of ``batch_sizes`` not above
    ``build.max_batch_size`` (larger ones are never captured), else ``max_batch_size`` of the config, else 128."""
    cg = build.pytorch.cuda_graph_config
    if cg is None:
        return 0
    if cg.batch_sizes:
        return max([b for b in cg.batch_sizes if b <= build.max_batch_size] or [0])
    return min(cg.max_batch_size or DEFAULT_CUDA_GRAPH_BATCH, build.max_batch_size)


def pytorch_reserve(geo: ModelGeometry, build, *, max_seq_len: int, act_dtype_bytes: int, tp_size: int,
                    max_draft_len: int = 0) -> PytorchReserve:
    """The estimation pass's activations (bytes per GPU): a ``max_num_tokens`` forward with
    :func:`~pipeline.plan.memory.activation_bytes`' per-token factor; the fp32 logits of each dummy request's last token
    (vocab / tp each); the CUDA-graph pool = one decode forward of :func:`cuda_graph_batch` × (1 + max_draft_len)
    tokens with their fp32 logits (an estimate, see the module docstring)."""
    n_dummy = len(dummy_request_lengths(build.max_num_tokens, max_seq_len))
    per_row_logits = mem.pad_vocab(geo.vocab_size, tp_size) / tp_size * mem.LOGITS_BYTES * build.max_beam_width
    forward = mem.activation_bytes(geo, max_num_tokens=build.max_num_tokens, max_batch_size=0, act_dtype_bytes=act_dtype_bytes,
                                   tp_size=tp_size)
    graph = cuda_graph_batch(build)
    pool = 0 if graph == 0 else mem.activation_bytes(geo, max_num_tokens=graph * (1 + max_draft_len), max_batch_size=graph,
                                                     max_beam_width=1 + max_draft_len, act_dtype_bytes=act_dtype_bytes,
                                                     tp_size=tp_size)
    return PytorchReserve(forward_activation_bytes=forward, dummy_logits_bytes=math.ceil(n_dummy * per_row_logits),
                          cuda_graph_batch=graph, cuda_graph_pool_bytes=pool, dummy_requests=n_dummy)


def pytorch_kv_tokens(total_bytes: int, peak_bytes: int, kv_token_bytes: int, fraction: float | None, tokens_per_block: int,
                      max_tokens: int | None = None) -> int:
    """KV tokens the PyTorch executor allocates: ``(total − peak) × fraction // kv_token_bytes`` (the temporary cache it
    adds back is inside ``peak`` and cancels), fraction None → 0.9, floored to whole blocks of ``tokens_per_block``
    (the pool is paged), then min with ``max_tokens`` when set. ``peak_bytes``: weights + activations + CUDA-graph pool
    + memory outside torch, per GPU; ``kv_token_bytes``: target + draft KV bytes per token."""
    frac = DEFAULT_FRACTION if fraction is None else fraction
    tokens = max(int((total_bytes - peak_bytes) * frac // kv_token_bytes), 0)
    tokens = tokens // tokens_per_block * tokens_per_block
    return tokens if max_tokens is None else min(tokens, max_tokens)
