"""``trtpipe bench``: an asyncio load generator for Triton (gRPC, HTTP) and OpenAI-compatible servers, exact ISL/OSL.

Layers (one concern per module, docs/reference/style-by-example.md §5):

* :mod:`.records` — one :class:`~.records.RequestRecord` per request (receipt timestamps).
* :mod:`.prompts` — exact-ISL synthetic prompts (token ids or text), dataset prompts.
* :mod:`.apis`, :mod:`.client`, :mod:`.http_client` — the protocols: checks and one stream per request.
* :mod:`.loadgen` — concurrency (closed loop) and request-rate (open loop) drivers.
* :mod:`.stats`, :mod:`.metrics` — the metric registry (one :class:`~.metrics.Metric` each) over records.
* :mod:`.results` — typed results: :class:`~.results.LoadPoint`, :class:`~.results.BenchResult`.
* :mod:`.preflight`, :mod:`.run` — a whole benchmark: checks before load, scenarios × load points, recount, export.
* :mod:`.target`, :mod:`.stage`, :mod:`.options` — what to bench, the stage's entry point, the CLI's options.
* :mod:`.soak` — ``trtpipe bench --soak``: streams back to back for minutes, failures/OSL/RSS verdict.
* :mod:`.exporters`, :mod:`.aiperf_export`, :mod:`.summary_csv`, :mod:`.console`, :mod:`.plots`, :mod:`.compare` —
  outputs; plots and compare read only the exported run directory (``bench.json``, ``summary.csv``).
"""
