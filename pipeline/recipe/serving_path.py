"""The serving path of a recipe: ``build.engine`` × target (GPU | CPU) × ``serving.frontend`` (× modality), one row
of a small frozen table, resolved once (issue #45 item 1).

Every stage that used to branch on the engine kind, the frontend or "target is CPU" reads the row instead:
:func:`serving_path` is the one dispatch from a recipe, :func:`path_of_engine` the one from a built engine's
``manifest.json`` (the engine stage writes the row's key there as ``serving_path``; a manifest written before that
key existed is read by the one fallback in :func:`path_of_engine`). A combination not in :data:`PATHS` is refused
with one line naming the field at fault (:func:`path_problem`).

The rows (``engine/target/frontend``, modality ``text``; a recipe with a ``vision:`` section resolves to the same key
with ``/vision``: the two engine-path rows below, whose repository adds ``multimodal_encoders``):

=============================  ==========  ==============================================================
key                            builder     serves with
=============================  ==========  ==============================================================
``tensorrt/gpu/triton``        tensorrt    Triton, the C++ ``tensorrtllm`` backend (inflight_batcher_llm)
``pytorch/gpu/triton``         pytorch     Triton, trtpipe's ``llmapi`` python model (``tensorrt_llm.LLM``)
``pytorch/gpu/trtllm-serve``   pytorch     TensorRT-LLM's ``trtllm-serve`` (the engine stage's argv)
``cpu/cpu/triton``             cpu         Triton, trtpipe's CPU ``tensorrt_llm`` python model
``pytorch/cpu/triton``         cpu         Triton, the ``llmapi`` model over the CPU engine's LLM facade
``pytorch/cpu/trtllm-serve``   cpu         trtpipe's CPU stand-in for trtllm-serve (pipeline.cpu_runtime.openai)
``tensorrt/gpu/triton/vision`` tensorrt    Triton, the C++ backend + ``multimodal_encoders`` (TensorRT vision engine)
``cpu/cpu/triton/vision``      cpu         Triton, the CPU ``tensorrt_llm`` model + ``multimodal_encoders`` (onnxruntime)
=============================  ==========  ==============================================================

The repository layouts (which Triton models, which ``tensorrt_llm`` implementation) were ``layouts:`` of
``pipeline/triton_repo/layouts.yaml`` (docs/reference/triton-model-repository.md §3); the fixed values of a
repository (container paths, tokenizer file names) stay there. This module imports nothing of trtpipe but
:mod:`pipeline.core.hardware` and the build section's types (:data:`pipeline.recipe.build.BUILD_TYPES`, whence each
row's ``unread_knobs``), so every stage may read it.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Literal

from pipeline.core import hardware
from pipeline.core.errors import IncompatibleArtifactError
from pipeline.recipe.build import BUILD_TYPES

#: the ``serving.frontend`` names: the one spelling of each
TRITON = "triton"
TRTLLM_SERVE = "trtllm-serve"
FRONTENDS = (TRITON, TRTLLM_SERVE)
#: the ``modality`` column: ``text``, and ``vision`` (a recipe with a ``vision:`` section; issue #46)
TEXT = "text"
VISION = "vision"
#: the vision families whose images take the vision rows (cross-attention over trtpipe's vision encoder: mllama); a
#: family whose images become prompt tokens (Qwen2-VL) serves on the text rows (the PyTorch backend runs its tower)
CROSS_ATTENTION_FAMILIES = ("mllama",)

#: the ensemble layout of the C++ backend and the CPU engine (docs/reference/triton-model-repository.md §3.1)
ENSEMBLE_MODELS = ("ensemble", "preprocessing", "tensorrt_llm", "postprocessing", "tensorrt_llm_bls")
#: the multimodal layout (tensorrtllm_backend docs/multimodal.md@efb8a497:200-217: inflight_batcher_llm + the
#: multimodal ensemble and multimodal_encoders)
MULTIMODAL_MODELS = (*ENSEMBLE_MODELS, "multimodal_encoders")
#: the LLM-API layout: one python model configured by 1/model.yaml (§3.7)
LLMAPI_MODELS = ("tensorrt_llm",)


def _build_fields(engine: str) -> list[str]:
    return list(BUILD_TYPES[engine].model_fields)


def _unread(engine: str) -> tuple[str, ...]:
    """The ``build`` knobs ``build.engine`` = ``engine`` never reads: the fields of the other engines' build types
    that its own type lacks (refused by type when a recipe sets them: pipeline/recipe/build.py), in declaration
    order."""
    own = set(_build_fields(engine))
    names = dict.fromkeys(f for e in BUILD_TYPES for f in _build_fields(e) if f not in own)
    return tuple(f"build.{f}" for f in names)


#: recipe knobs only ``trtllm-build`` reads (no PyTorch-backend equivalent: the LLM API has no plugins, KV-cache
#: type, build workers nor opt_num_tokens; pipeline/data/trtllm_1.2.1_llmapi_contract.yaml lists every LLM() argument):
#: the knobs the PyTorch build type lacks (:func:`_unread`)
TRT_ONLY_KNOBS = _unread("pytorch")
#: recipe knobs only the PyTorch LLM-API backend reads: the PyTorch build type's fields no other type has
PYTORCH_ONLY_KNOBS = tuple(f"build.{f}" for f in _build_fields("pytorch")
                           if not any(f in BUILD_TYPES[e].model_fields for e in BUILD_TYPES if e != "pytorch"))


@dataclasses.dataclass(frozen=True)
class ServingPath:
    """One real way trtpipe builds and serves a model; every field is what some stage used to branch on.

    Attributes:
        engine: ``build.engine`` (``tensorrt`` | ``pytorch`` | ``cpu``).
        target: ``gpu`` | ``cpu`` (``target.gpu`` is ``cpu`` or a GPU of the catalog).
        frontend: ``serving.frontend`` (:data:`TRITON` | :data:`TRTLLM_SERVE`).
        builder: the engine-stage module under ``pipeline.engine`` that builds it (``tensorrt`` | ``pytorch`` | ``cpu``).
        repo_models: the Triton models of its repository.
        tensorrt_llm_model: the implementation of the repository's ``tensorrt_llm`` model: ``cpp`` (the C++
            ``tensorrtllm`` backend), ``cpu`` (trtpipe's CPU-engine python model), ``llmapi`` (trtpipe's LLM-API model).
        reads_trtllm_checkpoint: the engine is built from the quantize stage's TensorRT-LLM checkpoint (else the
            unified HF checkpoint).
        loads_checkpoint_at_start: the server loads the quantize stage's HF checkpoint when it starts (its hashes
            are then checked before serving).
        runtime_in_engine: the engine directory holds the runtime (KV cache, scheduler, ``LLM()`` arguments), so the
            engine stage hashes the recipe's runtime fields.
        server: the process that serves it: ``tritonserver`` | ``trtllm-serve`` | ``trtllm-serve-cpu`` (trtpipe's
            CPU stand-in).
        deployable: ``trtpipe deploy k8s`` renders it (GPU paths).
        tokenizer: where a client's tokenizer lives: ``repo`` (the repository's ``preprocessing/tokenizer``) or
            ``hf_ckpt`` (the quantize stage's checkpoint).
        efficiency: the planner's efficiency model on this path's own target: ``tensorrt`` (fitted on NVIDIA's
            TensorRT-LLM numbers), ``pytorch`` (the PyTorch-backend fit), ``cpu`` (the host's measured rates).
        unread_knobs: recipe knobs this path's engine never reads: the fields of the other engines' build types that
            its own lacks (:data:`pipeline.recipe.build.BUILD_TYPES`; a recipe that sets one is refused by type).
        lm_head_copy: the engine holds a tied ``lm_head`` as its own copy (a TensorRT engine; the planner counts it).
        twin: the key of the same engine/frontend on the other target (what ``trtpipe plan --gpu`` plans).
        modality: ``text`` | ``vision`` (the modality column: a vision row's repository adds ``multimodal_encoders``).
    """

    engine: Literal["tensorrt", "pytorch", "cpu"]
    target: Literal["gpu", "cpu"]
    frontend: str
    builder: str
    repo_models: tuple[str, ...]
    tensorrt_llm_model: Literal["cpp", "cpu", "llmapi"]
    reads_trtllm_checkpoint: bool
    loads_checkpoint_at_start: bool
    runtime_in_engine: bool
    server: Literal["tritonserver", "trtllm-serve", "trtllm-serve-cpu"]
    deployable: bool
    tokenizer: Literal["repo", "hf_ckpt"]
    efficiency: Literal["tensorrt", "pytorch", "cpu"]
    unread_knobs: tuple[str, ...]
    lm_head_copy: bool
    twin: str
    modality: str = TEXT

    @property
    def key(self) -> str:
        """``engine/target/frontend`` (with ``/modality`` for a modality other than text): written into the engine
        stage's manifest as ``serving_path``."""
        base = f"{self.engine}/{self.target}/{self.frontend}"
        return base if self.modality == TEXT else f"{base}/{self.modality}"

    @property
    def on_cpu(self) -> bool:
        """True on the cpu target (the CPU engine runs it on this host)."""
        return self.target == hardware.CPU_TARGET

    @property
    def trtllm_serve(self) -> bool:
        """True when trtllm-serve (or trtpipe's CPU stand-in for it) serves it instead of Triton."""
        return self.server != "tritonserver"

    @property
    def llm_api(self) -> bool:
        """True when the engine is configured by ``LLM()`` keyword arguments (the ``llmapi`` model or trtllm-serve)."""
        return self.tensorrt_llm_model == "llmapi"

    @property
    def ensemble(self) -> bool:
        """True for the ensemble repository layout (preprocessing → tensorrt_llm → postprocessing, BLS)."""
        return self.tensorrt_llm_model != "llmapi"

    @property
    def native_cpu_kernels(self) -> bool:
        """True when the CPU engine's own builder and model serve it (``build.engine: cpu``): ``trtpipe build`` checks
        the native-kernel choice (``$TRTPIPE_CPU_KERNELS``) before the first stage."""
        return self.engine == "cpu"

    @property
    def expert_parallel(self) -> bool:
        """True when ``target.ep_size`` > 1 can be honoured: the LLM-API argument ``moe_expert_parallel_size`` on a
        GPU (the PyTorch backend on a GPU target)."""
        return self.engine == "pytorch" and not self.on_cpu

    def gpu_fit(self, pytorch_fit_shipped: bool) -> str | None:
        """The fitted GPU efficiency model that covers this path's own engine (``tensorrt`` | ``pytorch``), or
        ``None``: none does (the CPU engine planned on a GPU; the PyTorch backend when its fit file does not ship)."""
        fits = {"tensorrt": "tensorrt", "pytorch": "pytorch" if pytorch_fit_shipped else None}
        return fits.get(self.engine)

    def on(self, target: str) -> ServingPath:
        """This path on ``target`` (``gpu`` | ``cpu``): itself, or its :attr:`twin` (a cpu recipe planned on a GPU
        is planned as ``tensorrt``, a GPU one on the host as the CPU engine)."""
        return self if target == self.target else PATHS[self.twin]


_T, _F = True, False
#: the table: one row per real path; columns in :data:`_COLUMNS` order (repo_models follows tensorrt_llm_model)
_COLUMNS = ("engine", "target", "frontend", "builder", "tensorrt_llm_model", "reads_trtllm_checkpoint",
            "loads_checkpoint_at_start", "runtime_in_engine", "lm_head_copy", "deployable", "server", "tokenizer",
            "efficiency", "twin")
_ROWS = (
    # engine   target frontend      builder     trtllm    trt_ckpt  at_start  rt_in_eng lm_head deploy server
    #   tokenizer  efficiency  twin   (unread_knobs: from the engine's build type, _unread)
    ("tensorrt", "gpu", TRITON, "tensorrt", "cpp", _T, _F, _F, _T, _T, "tritonserver",
     "repo", "tensorrt", "cpu/cpu/triton"),
    ("pytorch", "gpu", TRITON, "pytorch", "llmapi", _F, _T, _T, _F, _T, "tritonserver",
     "hf_ckpt", "pytorch", "pytorch/cpu/triton"),
    ("pytorch", "gpu", TRTLLM_SERVE, "pytorch", "llmapi", _F, _T, _T, _F, _T, "trtllm-serve",
     "hf_ckpt", "pytorch", "pytorch/cpu/trtllm-serve"),
    ("cpu", "cpu", TRITON, "cpu", "cpu", _F, _F, _T, _F, _F, "tritonserver",
     "repo", "cpu", "tensorrt/gpu/triton"),
    ("pytorch", "cpu", TRITON, "cpu", "llmapi", _F, _F, _T, _F, _F, "tritonserver",
     "hf_ckpt", "cpu", "pytorch/gpu/triton"),
    ("pytorch", "cpu", TRTLLM_SERVE, "cpu", "llmapi", _F, _F, _T, _F, _F, "trtllm-serve-cpu",
     "hf_ckpt", "cpu", "pytorch/gpu/trtllm-serve"),
)
#: the vision rows (modality :data:`VISION`): the engine path only (pipeline/recipe/vision.py ``image_engines``)
_VISION_ROWS = (
    ("tensorrt", "gpu", TRITON, "tensorrt", "cpp", _T, _F, _F, _T, _T, "tritonserver",
     "repo", "tensorrt", "cpu/cpu/triton/vision"),
    ("cpu", "cpu", TRITON, "cpu", "cpu", _F, _F, _T, _F, _F, "tritonserver",
     "repo", "cpu", "tensorrt/gpu/triton/vision"),
)


def _path(row: tuple[Any, ...], modality: str = TEXT) -> ServingPath:
    cols = dict(zip(_COLUMNS, row, strict=True))
    models = {TEXT: ENSEMBLE_MODELS, VISION: MULTIMODAL_MODELS}[modality]
    return ServingPath(repo_models=LLMAPI_MODELS if cols["tensorrt_llm_model"] == "llmapi" else models,
                       unread_knobs=_unread(cols["engine"]), modality=modality, **cols)


#: every real serving path by its :attr:`ServingPath.key`
PATHS: dict[str, ServingPath] = {p.key: p for p in [*map(_path, _ROWS), *(_path(r, VISION) for r in _VISION_ROWS)]}


class ServingPathError(ValueError):
    """A recipe combination with no row in :data:`PATHS`; ``loc`` is the field at fault, ``message`` one line."""

    def __init__(self, loc: str, message: str):
        super().__init__(f"{loc}: {message}")
        self.loc = loc
        self.message = message


def _target_of(gpu: str) -> str:
    return "cpu" if gpu == hardware.CPU_TARGET else "gpu"


def builder_paths(gpu: str, frontend: str = TRITON) -> list[ServingPath]:
    """The text rows serving on ``target.gpu`` = ``gpu`` through ``frontend`` whose engine is its own builder (the
    native path of each engine on that target: ``tensorrt``/``pytorch`` on a GPU, ``cpu`` on the host), table order."""
    target = _target_of(gpu)
    return [p for p in PATHS.values()
            if p.target == target and p.frontend == frontend and p.modality == TEXT and p.engine == p.builder]


def on_cpu_target(gpu: str) -> bool:
    """True when ``target.gpu`` names the CPU target (the one spelling test of it outside the rows)."""
    return _target_of(gpu) == hardware.CPU_TARGET


def serves_with_triton(frontend: str) -> bool:
    """True when ``serving.frontend`` (or a server record's ``frontend``) is Triton (the one spelling test of the
    frontend outside the rows; the other is trtllm-serve)."""
    return frontend == TRITON


def path_problem(engine: str, gpu: str, frontend: str, modality: str = TEXT) -> tuple[str, str] | None:
    """``(field, message)`` when ``build.engine`` × ``target.gpu`` × ``serving.frontend`` has no row in :data:`PATHS`
    (``None``: it has one). The engine that does not run on the target is named first (``build.engine``), then a
    frontend that does not serve that engine (``serving.frontend``)."""
    target = _target_of(gpu)
    rows = [p for p in PATHS.values() if p.modality == modality]
    if not any(p.engine == engine and p.target == target for p in rows):
        return ("build.engine", (f"engine '{engine}' does not run on target '{gpu}': use engine cpu or pytorch with "
                                 "target cpu, and tensorrt or pytorch with a GPU"))
    if not any(p.engine == engine and p.target == target and p.frontend == frontend for p in rows):
        engines = sorted({p.engine for p in rows if p.frontend == frontend})
        return ("serving.frontend", (f"{frontend} serves only build.engine: {', '.join(engines)}, not build.engine "
                                     f"'{engine}'; use frontend {TRITON}"))
    return None


def unread_knobs(engine: str, gpu: str) -> tuple[str, ...]:
    """The recipe knobs that ``build.engine`` never reads on ``target.gpu`` (the same for every frontend; empty
    when the engine does not run there)."""
    target = _target_of(gpu)
    return next((p.unread_knobs for p in PATHS.values() if (p.engine, p.target) == (engine, target)), ())


def serving_path(recipe: Any, *, target: str | None = None) -> ServingPath:
    """The row of :data:`PATHS` for ``recipe`` (a :class:`pipeline.recipe.Recipe`); with ``target`` (``gpu`` |
    ``cpu``), the same engine and frontend on that target (:meth:`ServingPath.on`).

    Raises:
        ServingPathError: the combination has no row (a validated recipe always has one).
    """
    engine, gpu, frontend = recipe.build.engine, recipe.target.gpu, recipe.serving.frontend
    modality = VISION if getattr(getattr(recipe, "vision", None), "family", None) in CROSS_ATTENTION_FAMILIES else TEXT
    problem = path_problem(engine, gpu, frontend, modality)
    if problem:
        raise ServingPathError(*problem)
    base = f"{engine}/{_target_of(gpu)}/{frontend}"
    path = PATHS[base if modality == TEXT else f"{base}/{modality}"]
    return path if target is None else path.on(target)


def path_of_engine(manifest: dict[str, Any]) -> ServingPath | None:
    """The serving path an engine stage's ``manifest.json`` was built for; ``None`` for an empty manifest.

    The engine stage writes its key as ``serving_path``. Manifests written before that key existed (the one fallback):
    the engine kind is ``engine_kind``, the target is ``cpu`` when the CPU engine wrote it (``runtime``
    ``trtpipe-torch``), and the frontend is the manifest's ``frontend`` (the GPU PyTorch builder wrote it) or its
    consumed ``serving.frontend`` (the CPU builder), else ``triton``.

    Raises:
        IncompatibleArtifactError: a key or combination that is not a row of :data:`PATHS` (a manifest of another
            trtpipe).
    """
    if not manifest:
        return None
    key = manifest.get("serving_path")
    if key is None:  # written before the engine stage recorded its path
        engine = str(manifest.get("engine_kind"))
        target = "cpu" if manifest.get("runtime") == "trtpipe-torch" or engine == "cpu" else "gpu"
        frontend = manifest.get("frontend") or (manifest.get("consumed") or {}).get("serving.frontend") or TRITON
        key = f"{engine}/{target}/{frontend}"
    if key not in PATHS:
        raise IncompatibleArtifactError(f"engine manifest: serving_path '{key}' is not a serving path of this trtpipe "
                                        f"({', '.join(PATHS)}): rebuild with `trtpipe build RECIPE --force`")
    return PATHS[key]
