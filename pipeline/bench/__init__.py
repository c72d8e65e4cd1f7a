"""``trtpipe bench``: an asyncio Triton gRPC load generator with exact ISL/OSL and LLM metrics.

Layers (one concern per module, docs/reference/style-by-example.md §5):

* :mod:`.records` — one :class:`~.records.RequestRecord` per request (receipt timestamps).
* :mod:`.prompts` — exact-ISL synthetic prompts (token ids or text), dataset prompts.
* :mod:`.client` — readiness/metadata checks and one decoupled gRPC stream per request.
* :mod:`.loadgen` — concurrency (closed loop) and request-rate (open loop) drivers.
* :mod:`.stats`, :mod:`.metrics` — metric definitions (docs/reference/benchmark-metrics.md §5.1) over records.
* :mod:`.run` — a whole benchmark: scenarios × load points, warmup, CPU self-check, faults.
* :mod:`.exporters`, :mod:`.console`, :mod:`.plots`, :mod:`.compare` — outputs that read only
  the exported run directory (``bench.json``, ``summary.csv``).
"""
