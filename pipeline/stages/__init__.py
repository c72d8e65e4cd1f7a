"""The pipeline, one typed ``run()`` per stage, in order:

    recipe (pipeline.recipe.load_recipe) → quantize → engine → triton_repo   (build: pipeline.stages.build)
        → serve → bench → eval            (a running deployment)
    tune (sweeps all of the above) · deploy (Kubernetes manifests of a build)

Each build stage writes one directory of a :class:`~pipeline.layout.BuildLayout` atomically with a
manifest and returns a typed result (:mod:`pipeline.stages.results`); ``serve`` returns a
:class:`~pipeline.stages.serve.ServeHandle` and ``bench`` a :class:`~pipeline.stages.bench.BenchResult`.
The CLI (:mod:`pipeline.commands`) only parses flags, calls ``run()`` and renders.
"""
