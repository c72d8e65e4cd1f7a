"""The serve stage: Triton on a built model repository, or a trtllm-serve build (``serving.frontend: trtllm-serve``).

* :mod:`pipeline.serve.stage`: :func:`~pipeline.serve.stage.run` (start, wait ready, a :class:`ServeHandle`),
  :class:`ServeOptions`, server-log pruning.
* :mod:`pipeline.serve.compat`: what to serve (:class:`ServeTarget`) and whether this runtime can serve it
  (:func:`check_runtime`).
* :mod:`pipeline.serve.frontend`: the build's frontend and its command line; a trtllm-serve build served with
  Triton's lifecycle (:func:`~pipeline.serve.frontend.serve_trtllm`, process in :mod:`pipeline.serve.trtllm_process`).
* trtpipe's CPU stand-in for trtllm-serve (not TensorRT-LLM), the cpu target's, lives beside the runtime it wraps:
  :mod:`pipeline.cpu_runtime.openai` (started as ``<python> -m pipeline.cpu_runtime.openai``).
* :mod:`pipeline.serve.registry`: the detached server (either frontend) recorded in ``artifacts/serve.json``.
"""
