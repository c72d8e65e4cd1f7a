"""Numeric bounds of recipe fields, each with where it comes from.

* :data:`INT32_MAX` — TensorRT-LLM sizes are ``SizeType32`` (int32): the C++ ``tensorrtllm`` backend parses
  every integer parameter with ``std::stoi`` (tensorrtllm_backend ``inflight_batcher_llm/src/model_state.cc
  @c2e65b88d852:271-275``, pipeline/data/triton_backend_contract.yaml ``parameter_parsing``), and Triton's
  ``max_batch_size`` / ``max_queue_size`` are ``int32`` in ``model_config.proto``.
* :data:`INT64_MAX` — byte counts (``kv_cache_host_memory_bytes``: ``std::stoull``, same file :297-301).
* :data:`SEED_MAX` — seeds go to ``numpy.random.default_rng`` / ``torch.manual_seed`` and are kept in
  ``[0, 2**32)`` so every consumer accepts them.
* The other bounds are trtpipe's own sanity limits (named where used): values far beyond what a machine
  can run, refused early with one line instead of failing late.
"""

from __future__ import annotations

INT32_MAX = 2**31 - 1
INT64_MAX = 2**63 - 1
SEED_MAX = 2**32 - 1
#: streams one bench client keeps open (asyncio gRPC streams on one connection; trtpipe's limit)
MAX_CONCURRENCY = 65536
#: requests one load point may send / warm up with (trtpipe's limit: a day of traffic at 100 req/s)
MAX_REQUESTS = 10_000_000
#: longest per-request timeout / measurement window (s): one day / one week
MAX_TIMEOUT_S = 86_400.0
MAX_DURATION_S = 604_800.0
#: calibration / evaluation samples (trtpipe's limit: ModelOpt calibrates on 512 by default)
MAX_SAMPLES = 1_000_000
#: Triton model instances / CPU threads per process (trtpipe's limit; checked against the machine at validate time)
MAX_INSTANCES = 1024


def is_power_of_two(n: int) -> bool:
    """True for 1, 2, 4, 8, …"""
    return n > 0 and n & (n - 1) == 0
