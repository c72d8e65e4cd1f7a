"""``serving.frontend: trtllm-serve`` in the Kubernetes outputs: the server's command line inside the pods, the
facts about its HTTP server that the probes and the monitoring rely on, and its multi-node launcher. The pieces of
the Helm values and values schema that differ from Triton's are rendered by :mod:`pipeline.deploy.helm`
(``trtllm_serve_values`` / ``trtllm_serve_schema``), its KServe runtime by :mod:`pipeline.deploy.manifests`
(``trtllm_serve_runtime``): this module knows nothing of :class:`~pipeline.deploy.spec.DeploySpec`, which
imports it.

The command line is never spelled here: a build directory's is the one its engine stage wrote
(``<build>/engine/trtllm_serve.json``, :mod:`pipeline.engine.pytorch`), with ``--host``/``--port`` set by
:func:`pipeline.serve.frontend.trtllm_serve_argv`; a recipe's is made by the function that writes that file,
:func:`pipeline.trtllm.trtllm_serve.argv`, on the LLM() arguments of :func:`pipeline.trtllm.llmapi.llm_api_kwargs`.
The ``--extra_llm_api_options`` YAML travels as the Triton repository does: on the build volume, at
``<build>/engine/trtllm_serve_options.yaml``, which the argv names by absolute path.

Upstream sources (NVIDIA/TensorRT-LLM, ``file@commit:line``; lines counted in the search index's copies):

* ``tensorrt_llm/commands/serve.py@00209af149e7`` (1.2 line: ``--backend`` still offers ``tensorrt``, :414):
  ``--host`` default ``localhost`` (:403-405), ``--port`` default 8000 (:408-410), ``--tp_size``/``--pp_size``
  (:461, :467), ``--config``/``--extra_llm_api_options`` (:521-523). ``launch_server`` binds the port (:193)
  before it builds the LLM (:201) and serves only once that returns (:229): until the model has loaded, a
  connection is refused and no probe passes.
* ``tensorrt_llm/serve/openai_server.py@00057725d9a6``: ``register_routes`` adds ``GET /health`` (:342);
  ``health()`` answers 200 while ``_check_health()`` holds and 503 otherwise (:484-492); ``/metrics`` is the
  iteration-stats JSON, not Prometheus text (:349-351); ``/prometheus/metrics`` is mounted only when the LLM
  arguments have ``return_perf_metrics`` (:397-399, :418). The older copy ``@e7f7345e31e5`` has the same
  routes (:245, :250, :266-268, :289) but a ``health()`` that always answers 200 (:303-304): there, the
  liveness probe catches only a dead or hung server, not a failed executor. The served model name is the
  checkpoint directory's base name (``@00057725d9a6``:119-121).
* ``tensorrt_llm/llmapi/trtllm-llmapi-launch@020c89e64e49``: the rank comes from ``SLURM_PROCID``, else Open
  MPI's ``OMPI_COMM_WORLD_RANK`` (:6), the world size from ``SLURM_NTASKS`` or ``OMPI_COMM_WORLD_SIZE``
  (:16-24); rank 0 runs the wrapped command (here ``trtllm-serve``) and the MPI leader, every other rank a
  worker (:49-84). ``examples/llm-api/llm_mgmn_trtllm_serve.sh@0bd88711aa8f`` is upstream's multi-node recipe:
  one MPI process per GPU of the model's world (:17), each running ``trtllm-llmapi-launch trtllm-serve …``
  (:38-50), marked experimental (:13). trtpipe starts those processes with the same ``mpirun`` over the
  LeaderWorkerSet group as the Triton path (helm chart ``leaderworkerset.yaml``).
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from pipeline.core.errors import StageError, UserError
from pipeline.core.layout import BuildLayout
from pipeline.engine.pytorch import SERVE_OPTIONS
from pipeline.recipe import Recipe
from pipeline.recipe.serving_path import TRTLLM_SERVE
from pipeline.serve.frontend import SERVE_COMMAND, trtllm_serve_argv
from pipeline.trtllm import trtllm_serve

FRONTEND = TRTLLM_SERVE
#: the server container's name (the Triton path's is ``triton``)
CONTAINER = "trtllm-serve"
#: liveness and readiness route: 200 while the LLM is healthy, 503 otherwise (openai_server.py@00057725d9a6:342,
#: 484-492)
HEALTH_PATH = "/health"
#: Prometheus text route, mounted only with ``return_perf_metrics`` (openai_server.py@00057725d9a6:397-399, 418)
PROMETHEUS_PATH = "/prometheus/metrics"
#: multi-node launcher wrapped around each MPI rank (tensorrt_llm/llmapi/trtllm-llmapi-launch@020c89e64e49:6, 49-84)
LAUNCHER = "trtllm-llmapi-launch"
#: KServe model-format label of the runtime (any name: KServe matches it to the InferenceService's
#: ``modelFormat.name``, kserve pkg/apis/serving/v1beta1/predictor_model.go@1fb781055dd1:133-139)
KSERVE_FORMAT = "trtllm-serve"


def pod_argv(recipe: Recipe, build_dir: str, *, host: str, build: Path | None = None) -> list[str]:
    """The ``trtllm-serve`` argv one pod runs: the engine stage's command with ``--host`` set to ``host`` and
    ``--port`` (TCP port) as the engine stage wrote it (:func:`port_of`).

    Args:
        recipe: the (overridden) recipe.
        build_dir: the build directory inside the pods.
        host: bind address inside the pod.
        build: a ``trtpipe build`` directory: its engine stage's stored argv is used; ``None`` (a recipe):
            the argv is made by :func:`pipeline.trtllm.trtllm_serve.argv`, as the engine stage makes it.

    Raises:
        UserError: ``build`` has no ``engine/trtllm_serve.json`` (built for another frontend).
        StageError: the argv breaks the trtllm-serve contract (:func:`pipeline.trtllm.trtllm_serve.argv_problems`).
    """
    if build is not None:
        stored = _stored(build)
        argv = trtllm_serve_argv(stored, host, port_of(stored["argv"]))
    else:
        from pipeline.trtllm.llmapi import llm_api_kwargs

        layout = BuildLayout(Path(build_dir))
        kwargs = llm_api_kwargs(recipe, layout.hf_ckpt)
        argv = trtllm_serve.argv(kwargs, str(layout.engine / SERVE_OPTIONS), host=host)
    problems = trtllm_serve.argv_problems(argv)
    if problems:
        raise StageError(f"trtllm-serve command line breaks the TensorRT-LLM 1.2.1 contract: {problems[0]}")
    return argv


def port_of(argv: list[str] | tuple[str, ...]) -> int:
    """The TCP port a trtllm-serve argv listens on (its ``--port`` value; upstream default 8000, serve.py@00209af149e7:408-410)."""
    return int(argv[list(argv).index("--port") + 1]) if "--port" in argv else 8000


def stored_build_dir(build: Path) -> str:
    """The build directory the stored argv of ``build`` refers to (absolute), from its checkpoint argument.

    Raises:
        UserError: no ``engine/trtllm_serve.json``, or its paths are not the layout's.
    """
    argv = _stored(build)["argv"]
    layout = BuildLayout(Path("/"))
    depth = len(layout.hf_ckpt.relative_to(layout.root).parts)
    model = Path(argv[1])
    root = model.parents[depth - 1] if len(model.parts) > depth else None
    if root is None or BuildLayout(root).hf_ckpt != model:
        raise UserError(f"{build}: {SERVE_COMMAND} serves {model}, not a build's quantize/hf_ckpt")
    return str(root)


def _stored(build: Path) -> dict[str, Any]:
    path = BuildLayout(build).engine / SERVE_COMMAND
    if not path.is_file():
        raise UserError(f"{build}: serving.frontend is '{FRONTEND}' but the engine stage wrote no {SERVE_COMMAND}: "
                        f"rebuild with --set serving.frontend={FRONTEND}")
    return json.loads(path.read_text())
