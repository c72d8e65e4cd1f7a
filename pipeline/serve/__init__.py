"""The serve stage: Triton on a built model repository.

* :mod:`pipeline.serve.stage`: :func:`~pipeline.serve.stage.run` (start, wait ready, a :class:`ServeHandle`),
  :class:`ServeOptions`, server-log pruning.
* :mod:`pipeline.serve.compat`: what to serve (:class:`ServeTarget`) and whether this runtime can serve it
  (:func:`check_runtime`).
* :mod:`pipeline.serve.registry`: the detached server recorded in ``artifacts/serve.json``.
"""
