"""Issue 48 item 3: the PyTorch backend's KV capacity as its executor computes it (tensorrt_llm/_torch/pyexecutor/_util.py
@d8ae02ca KvCacheCreator), on worked cases derived by hand from that code, and in the plan of the shipped recipes."""

from __future__ import annotations

import pytest
from support import shipped_recipe

from pipeline.plan import plan_recipe
from pipeline.plan.kv_runtime import (
    cuda_graph_batch,
    dummy_request_lengths,
    estimation_tokens,
    pytorch_kv_tokens,
    pytorch_reserve,
)

PYTORCH = "llama31_8b_h200_fp8_pytorch"
EAGLE = "llama31_8b_h200_fp8_eagle3"
GIB, KIB = 1 << 30, 1 << 10


def test_dummy_requests_and_estimation_cache_worked_case():
    """max_num_tokens 8192, max_seq_len 2049: prompts of min(8192, 2048) tokens → 4 × 2048. Each holds its prompt + 1
    generated token + 1 for the overlap scheduler = 2050 tokens → ceil(2050 / 32) = 65 blocks; 4 × 65 × 32 = 8320.
    With EAGLE-3 (v = 3, 2 extra KV tokens) and the overlap scheduler: + 3 (overlap) + 3 + 2 → 2058 → still 65 blocks;
    without the overlap scheduler: 2048 + 1 + 3 + 2 = 2054 → 65. A 5000-token budget: 2048, 2048, 904."""
    assert dummy_request_lengths(8192, 2049) == [2048] * 4
    assert dummy_request_lengths(5000, 2049) == [2048, 2048, 904]
    assert dummy_request_lengths(8192, 100_000) == [8192]
    assert estimation_tokens(8192, 2049, 32) == 4 * 65 * 32
    assert estimation_tokens(8192, 2049, 32, max_draft_len=3, extra_kv_tokens=2) == 4 * 65 * 32
    assert estimation_tokens(8192, 2049, 32, overlap_scheduler=False) == 4 * 65 * 32  # 2049 → 65 blocks
    # 2047-token prompts + 2 = 2049 → 65 blocks; + 1 only → 2048 = 64 blocks exactly
    assert estimation_tokens(2047, 4096, 32) == 65 * 32 and estimation_tokens(2047, 4096, 32, overlap_scheduler=False) == 64 * 32
    assert estimation_tokens(8192, 2049, 32, beam_width=2) == 2 * 4 * 65 * 32


def test_kv_tokens_worked_case_and_the_temporary_cache_cancels():
    """total 100 GiB, peak without the temporary cache 40 GiB, fraction 0.9, 64 KiB per token:
    (60 GiB × 0.9) // 64 KiB = 884,736 tokens = 27,648 blocks of 32. The runtime measures the peak WITH its temporary
    cache and adds the cache back (_cal_max_tokens): the same figure."""
    total, peak, kv = 100 * GIB, 40 * GIB, 64 * KIB
    assert pytorch_kv_tokens(total, peak, kv, 0.9, 32) == 884_736
    tmp = estimation_tokens(8192, 2049, 32)
    runtime = int(((total - (peak + tmp * kv)) + tmp * kv) * 0.9 // kv)
    assert pytorch_kv_tokens(total, peak, kv, 0.9, 32) == runtime // 32 * 32
    assert pytorch_kv_tokens(total, peak, kv, None, 32) == pytorch_kv_tokens(total, peak, kv, 0.9, 32)  # None → 0.9
    assert pytorch_kv_tokens(total, peak, kv, 0.9, 32, max_tokens=1000) == 1000
    assert pytorch_kv_tokens(total, total + 1, kv, 0.9, 32) == 0
    # a draft model's KV bytes per token join the target's (:106-109): 64 + 4 KiB → fewer tokens
    assert pytorch_kv_tokens(total, peak, kv + 4 * KIB, 0.9, 32) == int(60 * GIB * 0.9 // (68 * KIB)) // 32 * 32


def test_cuda_graph_batch_follows_the_config():
    r = shipped_recipe(PYTORCH)
    assert cuda_graph_batch(r.build) == 2048  # batch_sizes up to max_batch_size 2048
    assert cuda_graph_batch(shipped_recipe(EAGLE).build) == 512  # max_batch_size 512
    assert cuda_graph_batch(shipped_recipe(PYTORCH, ["build.pytorch.cuda_graph_config=null"]).build) == 0
    assert cuda_graph_batch(shipped_recipe(PYTORCH, ["build.pytorch.cuda_graph_config.batch_sizes=null"]).build) == 128


def test_pytorch_plan_uses_the_runtime_arithmetic():
    """The plan's KV tokens are (total − weights − reserve) × fraction // KV bytes per token in whole blocks, recomputed
    here from the plan's own memory figures; the reserve holds the estimation pass's logits (3 dummy prompts) and the
    CUDA-graph pool, not max_batch_size logits rows."""
    r = shipped_recipe(PYTORCH)
    m = plan_recipe(r).memory
    free = m.total_bytes - m.weights.per_gpu_bytes - m.activation_bytes - m.overhead_bytes
    assert m.kv_tokens == int(free * 0.95 // m.kv_token_bytes) // 32 * 32
    from pipeline.core.geometry import known_geometry

    res = pytorch_reserve(known_geometry(r.model.source), r.build, max_seq_len=8192, act_dtype_bytes=2, tp_size=1)
    assert m.activation_bytes == res.total_bytes and res.dummy_requests == 2  # 8192 tokens in prompts of 8191 + 1
    assert res.dummy_logits_bytes == 2 * 128_256 * 4
    # without CUDA graphs the pool is gone and the KV cache grows by about its size
    m0 = plan_recipe(shipped_recipe(PYTORCH, ["build.pytorch.cuda_graph_config=null"])).memory
    assert m0.activation_bytes == res.total_bytes - res.cuda_graph_pool_bytes
    assert (m0.kv_tokens - m.kv_tokens) * m.kv_token_bytes == pytest.approx(res.cuda_graph_pool_bytes * 0.95, rel=0.01)


def test_engine_path_keeps_its_sizing():
    """The TensorRT engine path's reserve still holds max_batch_size logits rows (runtime buffers before the fraction)."""
    r = shipped_recipe("llama31_8b_h200_fp8")
    m = plan_recipe(r).memory
    assert m.activation_bytes >= r.build.max_batch_size * 128_256 * 4
