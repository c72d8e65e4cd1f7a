"""Memory formulas of the planner: weight bytes per qformat (:mod:`pipeline.core.weights`, re-exported here; the
build stages size their disk needs with it too), runtime reserve, KV capacity. (KV-cache bytes per token:
:meth:`pipeline.core.geometry.ModelGeometry.kv_bytes_per_token`, the one rule.)

Every function is pure (geometry + numbers in, bytes or tokens out) so that tests can check them on a
toy geometry by hand. Units: bytes (B) unless the name says otherwise; 1 GiB = 2^30 B, 1 MiB = 2^20 B.

Layout assumed (Llama/Mistral decoder, what the shipped recipes use): per layer 7 bias-free Linear
layers (q, k, v, o, gate, up, down) + 2 RMSNorm weight vectors; an embedding table; a final norm; an
lm_head. ModelOpt quantizes the Linear layers of the decoder only: the embedding, the norms and the
lm_head stay in the model dtype (quantize.py ``--quantize_lm_head`` default False).
"""

from __future__ import annotations

import math

from pipeline.core.geometry import ModelGeometry
from pipeline.core.weights import (  # noqa: F401 - the weight formulas, shared with the build stages
    DTYPE_BYTES,
    QFORMAT_WEIGHT_BYTES,
    WeightBytes,
    linear_storage_bytes,
    pad_vocab,
    weight_bytes,
)

MIB = 1 << 20
GIB = 1 << 30

#: CUDA context + driver/library state per GPU process (estimate: 300–600 MiB is what a CUDA 12
#: context with lazy module loading takes on Ampere/Hopper; TensorRT and cuBLAS add their own).
CUDA_CONTEXT_BYTES = 512 * MIB
#: TensorRT/cuBLAS workspaces, executor/decoder buffers, the Triton backend's own allocations
#: (estimate; not published by TensorRT-LLM).
RUNTIME_FIXED_BYTES = 512 * MIB
#: NCCL buffers per rank when tp_size × pp_size > 1 (estimate).
NCCL_BYTES = 256 * MIB
#: Live activation tensors per batched token, in units of (activation dtype bytes): TensorRT reuses one
#: decoder layer's buffers for all layers, whose peak is ~ residual + normed input + fused QKV output +
#: attention output + fused gate/up output + SiLU·up product (estimate from the graph; TensorRT-LLM
#: docs: "activation size will be close to max number of input tokens * some constant factor").
#: factor(tokens) = 4 × hidden + (heads + 2 kv_heads) × head_dim / tp + 3 × intermediate / tp.
LOGITS_BYTES = 4  # fp32 logits (TensorRT-LLM checkpoint logits_dtype default float32)


def activation_bytes(geo: ModelGeometry, *, max_num_tokens: int, max_batch_size: int, max_beam_width: int = 1,
                     act_dtype_bytes: int = 2, tp_size: int = 1) -> int:
    """Estimated activation + I/O buffer bytes per GPU (not the KV cache): grows with max_num_tokens.

    activations = max_num_tokens × act_dtype_bytes × (4 × hidden + (heads + 2 × kv_heads) × head_dim / tp
                  + 3 × MLP width a token passes through / tp)   (MoE: experts per token × expert width)
    logits      = max_batch_size × max_beam_width × padded_vocab / tp × 4 B (fp32 generation logits)

    An estimate: TensorRT computes the real figure at build time (``ICudaEngine.device_memory_size``,
    printed as "Total Activation Memory" at verbose log level); the PyTorch backend measures it with a
    profiling forward pass of max_num_tokens tokens. Llama-3.1-8B, 8192 tokens, batch 2048:
    8192 × 2 × 65,536 = 1.0 GiB + 2048 × 128,256 × 4 = 1.0 GiB.
    """
    per_token = (
        4 * geo.hidden_size
        + (geo.num_attention_heads + 2 * geo.num_key_value_heads) * geo.head_dim / tp_size
        + 3 * geo.active_mlp_width / tp_size
    )
    acts = max_num_tokens * act_dtype_bytes * per_token
    logits = max_batch_size * max_beam_width * pad_vocab(geo.vocab_size, tp_size) / tp_size * LOGITS_BYTES
    return math.ceil(acts + logits)


def fixed_overhead_bytes(world_size: int = 1) -> int:
    """CUDA context + runtime fixed buffers per GPU (bytes): CUDA_CONTEXT_BYTES + RUNTIME_FIXED_BYTES
    (+ NCCL_BYTES when world_size > 1). 1 GiB for one GPU. Estimates, see the constants."""
    return CUDA_CONTEXT_BYTES + RUNTIME_FIXED_BYTES + (NCCL_BYTES if world_size > 1 else 0)


def kv_capacity_tokens(free_bytes: int, fraction: float, kv_token_bytes: int, tokens_per_block: int,
                       max_tokens: int | None = None) -> tuple[int, int]:
    """Tokens the paged KV cache holds and the bytes it allocates: ``(tokens, pool_bytes)``.

    blocks = floor(max(free_bytes, 0) × fraction / (tokens_per_block × kv_token_bytes));
    tokens = blocks × tokens_per_block; with ``max_tokens`` set, tokens = min(tokens,
    ceil(max_tokens / tokens_per_block) × tokens_per_block) (KvCacheConfig: "the minimum will be used").
    pool_bytes = tokens × kv_token_bytes.
    """
    block_bytes = tokens_per_block * kv_token_bytes
    blocks = int(max(free_bytes, 0) * fraction // block_bytes)
    if max_tokens is not None:
        blocks = min(blocks, math.ceil(max_tokens / tokens_per_block))
    tokens = blocks * tokens_per_block
    return tokens, tokens * kv_token_bytes


def blocks_per_sequence(seq_tokens: int, tokens_per_block: int, beam_width: int = 1) -> int:
    """Paged blocks one sequence of ``seq_tokens`` tokens holds: ceil(seq_tokens / tokens_per_block) × beam."""
    return math.ceil(seq_tokens / tokens_per_block) * beam_width


def max_sequences(kv_tokens: int, seq_tokens: int, tokens_per_block: int, beam_width: int = 1) -> int:
    """Sequences of ``seq_tokens`` (ISL + OSL) that fit at once: floor(kv_blocks / blocks_per_sequence).

    This is what GUARANTEED_NO_EVICT admits: it reserves a request's full ISL + OSL up front.
    """
    return (kv_tokens // tokens_per_block) // blocks_per_sequence(seq_tokens, tokens_per_block, beam_width)
