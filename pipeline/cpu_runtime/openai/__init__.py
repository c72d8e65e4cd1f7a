"""trtpipe's CPU stand-in for ``trtllm-serve`` — an OpenAI-compatible server over the CPU engine's LLM facade
(:class:`pipeline.cpu_runtime.llm.LLM`). It is NOT TensorRT-LLM: it speaks the part of trtllm-serve's HTTP interface
that ``trtpipe bench --api openai`` and an operator use, so that a ``serving.frontend: trtllm-serve`` build runs for
real on the cpu target. Run as ``python -m pipeline.cpu_runtime.openai MODEL [trtllm-serve flags]``; on GPU targets
``trtpipe serve`` runs the real ``trtllm-serve`` instead.

- :mod:`.protocol`: request models, their validation and mapping onto the facade, response bodies (no HTTP).
- :mod:`.routes`: the FastAPI app (:func:`~pipeline.cpu_runtime.openai.routes.create_app`): routes, streaming,
  client disconnects, ``/health`` from :meth:`LLM.health <pipeline.cpu_runtime.llm.LLM.health>`.
- :mod:`.images`: the images of ``image_url`` chat content parts.
- :mod:`.cli`: trtllm-serve's command line → ``LLM()`` arguments, bind, load, serve (``__main__``).

Nothing is imported here, so ``pipeline.cpu_runtime.openai.protocol`` loads without FastAPI.
"""
