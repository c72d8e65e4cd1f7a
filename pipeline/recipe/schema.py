"""The root :class:`Recipe` and its cross-field checks."""

from __future__ import annotations

from pathlib import Path

from pydantic import Field, ValidationInfo, model_validator

from pipeline.core import hardware
from pipeline.core.geometry import ModelGeometry, geometry_for_source
from pipeline.recipe import derived
from pipeline.recipe.base import StrictModel
from pipeline.recipe.bench import BenchSpec
from pipeline.recipe.build import BuildSpec, TensorrtBuild
from pipeline.recipe.eval import EvalSpec
from pipeline.recipe.knobs import knob_problems
from pipeline.recipe.model import ModelSpec, TargetSpec
from pipeline.recipe.moe import moe_problems
from pipeline.recipe.quant import BLOCK_QFORMATS, QuantSpec
from pipeline.recipe.serve import ServingSpec
from pipeline.recipe.serving_path import PATHS, TRITON, path_problem, serving_path
from pipeline.recipe.speculative import draft_source, speculative_problems
from pipeline.recipe.vision import AnyVision, vision_problems

#: the validation-context key naming the recipe file's directory (``Recipe.model_validate(data, context={RECIPE_DIR:
#: path.parent})``): a local ``model.source`` and draft resolve against it (pipeline/core/recipe_paths.py)
RECIPE_DIR = "recipe_dir"


class RecipeCheckError(ValueError):
    """A cross-field rule failed; ``loc`` is the dotted field path the message is about."""

    def __init__(self, loc: str, message: str):
        super().__init__(message)
        self.loc = loc
        self.message = message


#: engines none of whose serving paths has an ``ensemble`` model (pytorch: the llmapi repository or trtllm-serve),
#: so an unset ``bench.model`` is ``tensorrt_llm`` there (the serving-path table decides, not a name)
_NO_ENSEMBLE = frozenset(p.engine for p in PATHS.values()) - frozenset(
    p.engine for p in PATHS.values() if "ensemble" in p.repo_models)

class Recipe(StrictModel):
    """A deployment recipe: one model on one target, from quantization to benchmark."""

    name: str | None = Field(default=None, description="Recipe name (default: the file name without .yaml); names the build dir.")
    description: str = Field(default="", description="Free text.")
    model: ModelSpec = Field(description="The source checkpoint.")
    target: TargetSpec = Field(description="The GPU (or cpu) the deployment is for, and its parallelism.")
    quantization: QuantSpec = Field(default_factory=QuantSpec, description="ModelOpt PTQ: qformat, KV-cache dtype, calibration.")
    build: BuildSpec = Field(default_factory=TensorrtBuild, description="Engine kind and TensorRT-LLM build/KV/scheduler knobs.")
    serving: ServingSpec = Field(default_factory=ServingSpec, description="Triton model-repository parameters.")
    bench: BenchSpec = Field(default_factory=BenchSpec, description="Default ISL/OSL scenarios and load points of `trtpipe bench`.")
    eval: EvalSpec = Field(default_factory=EvalSpec, description="Accuracy gate of `trtpipe eval`: task, sample size, rule.")
    vision: AnyVision | None = Field(default=None, description="Vision-language image path, by family: mllama (cross-attention; tiles, encoder, Triton multimodal knobs) or qwen2_vl / qwen2_5_vl (image tokens in the prompt; PyTorch backend); absent = text-only.")

    # ------------------------------------------------------------------ derived values
    @property
    def gpu(self) -> hardware.GpuSpec | None:
        """The catalog entry of ``target.gpu`` (``None`` for the cpu target); with ``target.mig``, that GPU's slice
        (:func:`~pipeline.core.hardware.mig_slice`: the memory, bandwidth and SM share the planner sizes against)."""
        spec = None if self.target.gpu == hardware.CPU_TARGET else hardware.lookup(self.target.gpu)
        if spec is not None and self.target.mig is not None and self.target.mig in spec.mig:
            return hardware.mig_slice(spec, self.target.mig)
        return spec

    @property
    def triton_max_batch_size(self) -> int:
        """``serving.triton_max_batch_size`` or, when unset, ``build.max_batch_size``."""
        return self.serving.triton_max_batch_size or self.build.max_batch_size

    # ------------------------------------------------------------------ defaults that follow the engine path
    @model_validator(mode="before")
    @classmethod
    def _path_defaults(cls, data: object) -> object:
        """``build.engine`` left unset is ``tensorrt`` (it chooses the section's type); ``bench.model`` left unset
        follows it: ``tensorrt_llm`` for pytorch (the LLM-API repository's only model), else BenchSpec's ``ensemble``;
        an explicit other model on pytorch is refused here (one line naming ``bench.model``)."""
        if not isinstance(data, dict):
            return data
        build, bench = data.get("build"), data.get("bench")
        if isinstance(build, dict) and "engine" not in build:  # the section's type follows build.engine (default)
            data = {**data, "build": {**build, "engine": TensorrtBuild.model_fields["engine"].default}}
        engine = build.get("engine") if isinstance(build, dict) else getattr(build, "engine", None)
        target = data.get("target")
        gpu = target.get("gpu") if isinstance(target, dict) else getattr(target, "gpu", None)
        if isinstance(engine, str) and isinstance(gpu, str):  # before the section's type: the engine × target first
            problem = path_problem(engine, gpu.strip().lower(), TRITON)
            if problem is not None and problem[0] == "build.engine":
                raise RecipeCheckError(*problem)
        if engine not in _NO_ENSEMBLE:
            return data
        # checked before the build section's type, so a --set build.engine=pytorch switch of a TensorRT recipe names
        # its bench.model first, as it did when the knobs of another engine were a defaults comparison
        model = bench.get("model") if isinstance(bench, dict) else (
            bench.model if isinstance(bench, BenchSpec) and "model" in bench.model_fields_set else None)
        if model is not None and model != "tensorrt_llm":
            raise RecipeCheckError("bench.model", f"'{model}' does not exist in the LLM-API (pytorch) model repository: "
                                                  "its only model is tensorrt_llm (text interface)")
        if bench is None or isinstance(bench, dict) and "model" not in bench:
            return {**data, "bench": {**(bench or {}), "model": "tensorrt_llm"}}
        if isinstance(bench, BenchSpec) and "model" not in bench.model_fields_set:
            return {**data, "bench": bench.model_copy(update={"model": "tensorrt_llm"})}
        return data

    # ------------------------------------------------------------------ cross-field checks
    @model_validator(mode="after")
    def _check(self, info: ValidationInfo) -> Recipe:
        # a local model.source resolves against the recipe file's directory, which the loader passes as the validation
        # context ``recipe_dir`` (pipeline/recipe/load.py; without it, the working directory: core/recipe_paths.py)
        base = (info.context or {}).get(RECIPE_DIR) if info is not None else None
        problems = vision_problems(self, base)  # the vision section's rules first (pipeline/recipe/vision.py)
        if problems:
            raise RecipeCheckError(*problems[0])
        self._check_target()
        self._check_formats()
        geo = geometry_for_source(self.model.source, base)  # resolved once for the rules below
        for check in (self._check_lengths, self._check_parallel, self._check_awq, self._check_counts):
            check(geo)
        self._check_knobs()
        self._check_features(geo, base)
        return self

    def _check_knobs(self) -> None:
        problems = knob_problems(self)  # engine-kind-only knobs, frontend, release (pipeline/recipe/knobs.py)
        if problems:
            raise RecipeCheckError(*problems[0])

    def _check_features(self, geo: ModelGeometry | None, base: Path | None) -> None:
        """Speculative decoding and MoE/EP knobs (rules in pipeline/recipe/speculative.py and moe.py)."""
        p, t, src = self.build.pytorch, self.target, self.model.source
        gpu = t.gpu != hardware.CPU_TARGET
        draft = draft_source(p.speculative_config)
        problems = speculative_problems(p.speculative_config, geo, geometry_for_source(draft, base) if draft else None,
                                        gpu_target=gpu, source=src)
        problems += moe_problems(ep_size=t.ep_size, tp_size=t.tp_size, expert_parallel=serving_path(self).expert_parallel, gpu_target=gpu,
                                 moe_config=p.moe_config, attention_dp=p.enable_attention_dp, geo=geo, source=src)
        if problems:
            raise RecipeCheckError(*problems[0])

    def _check_counts(self, geo: ModelGeometry | None) -> None:
        """Counts bounded by other fields, the model or this machine (each message names the number to lower)."""
        import os

        c, b, s = self.quantization.calibration, self.build, self.serving
        if c.batch_size > c.size:
            raise RecipeCheckError("quantization.calibration.batch_size", f"{c.batch_size} exceeds calibration.size {c.size}: lower it")
        if geo is not None and geo.max_position_embeddings and c.max_seq_length > geo.max_position_embeddings:
            raise RecipeCheckError(
                "quantization.calibration.max_seq_length",
                f"{c.max_seq_length} exceeds the model's max_position_embeddings {geo.max_position_embeddings}: lower it",
            )
        if self.target.gpu != hardware.CPU_TARGET:  # CUDA-graph sizes above the largest decode batch (build.py)
            problems = b.cuda_graph_problems()
            if problems:
                raise RecipeCheckError(*problems[0])
        if b.workers > self.target.world_size:
            raise RecipeCheckError(
                "build.workers", f"{b.workers} build processes for {self.target.world_size} rank(s) (tp × pp): lower it "
                "(trtllm-build builds one rank per worker)",
            )
        if self.target.gpu == hardware.CPU_TARGET:  # the CPU deployment runs on this machine: one process per instance
            cores = len(os.sched_getaffinity(0))
            for name in ("preprocessing_instance_count", "postprocessing_instance_count", "bls_instance_count"):
                if getattr(s, name) > 4 * cores:
                    raise RecipeCheckError(f"serving.{name}", f"{getattr(s, name)} processes on {cores} cores: lower it to ≤ {4 * cores}")

    def _check_target(self) -> None:
        t, engine = self.target.gpu, self.build.engine
        if t != hardware.CPU_TARGET and hardware.lookup(t) is None:
            known = ", ".join(sorted(hardware.catalog()))
            raise RecipeCheckError("target.gpu", f"'{t}' is not in the GPU catalog ({known}) nor 'cpu'")
        if self.target.mig is not None:
            spec = hardware.lookup(t)  # None for the cpu target: it has no MIG profiles
            if spec is None or self.target.mig not in spec.mig:
                have = ", ".join(spec.mig) if spec is not None and spec.mig else "none"
                raise RecipeCheckError("target.mig", f"'{self.target.mig}' is not a MIG profile of {t} (its profiles: {have})")
            if self.target.world_size != 1:
                raise RecipeCheckError("target.mig", f"a MIG slice holds one rank: tp_size × pp_size is {self.target.world_size}, not 1")
        # the engine × target rows of pipeline/recipe/serving_path.py (the frontend is checked with the knobs)
        problem = path_problem(engine, t, TRITON)
        if problem is not None:
            raise RecipeCheckError(*problem)

    def _check_formats(self) -> None:
        q = self.quantization
        if self.target.gpu == hardware.CPU_TARGET:
            problems = derived.cpu_engine_problems(self.build)
            if problems:
                raise RecipeCheckError(*problems[0])
            if q.qformat == "nvfp4":
                raise RecipeCheckError(
                    "quantization.qformat",
                    "'nvfp4' cannot be evaluated on CPU (ModelOpt's NVFP4 fake-quant needs CUDA); use fp8 or int4_awq",
                )
            return
        assert self.gpu is not None
        problems = derived.format_problems(q, self.gpu)
        if problems:
            raise RecipeCheckError(*problems[0])

    def _check_lengths(self, geo: ModelGeometry | None) -> None:
        b = self.build
        max_seq = derived.max_seq_len(b, geo.max_position_embeddings if geo is not None else None)
        if max_seq is not None and b.max_input_len > max_seq:
            raise RecipeCheckError(
                "build.max_input_len", f"{b.max_input_len} exceeds max_seq_len {max_seq} (prompt + output must fit)"
            )
        if geo is not None and geo.max_position_embeddings and b.max_seq_len and b.max_seq_len > geo.max_position_embeddings:
            raise RecipeCheckError(
                "build.max_seq_len",
                f"{b.max_seq_len} exceeds the model's max_position_embeddings {geo.max_position_embeddings}",
            )
        if b.max_num_tokens < b.max_input_len and not b.enable_chunked_prefill:
            raise RecipeCheckError(
                "build.max_num_tokens",
                f"{b.max_num_tokens} is smaller than max_input_len {b.max_input_len}: a full prompt would not fit one "
                "batch; raise it or set build.enable_chunked_prefill: true",
            )
        if b.kv_cache_type != "paged":
            raise RecipeCheckError(
                "build.kv_cache_type",
                f"'{b.kv_cache_type}' does not support in-flight batching (batching_strategy inflight_fused_batching needs paged)",
            )
        if self.bench.model != "tensorrt_llm" and not self.serving.decoupled_mode:
            raise RecipeCheckError("serving.decoupled_mode", "false, but the benchmark streams: set it to true")
        for i, sc in enumerate(self.bench.scenarios):
            if sc.isl > b.max_input_len:
                raise RecipeCheckError(
                    f"bench.scenarios.{i}.isl", f"{sc.isl} exceeds build.max_input_len {b.max_input_len}"
                )
            if max_seq is not None and sc.isl + sc.osl > max_seq:
                raise RecipeCheckError(
                    f"bench.scenarios.{i}.osl",
                    f"isl {sc.isl} + osl {sc.osl} = {sc.isl + sc.osl} exceeds max_seq_len {max_seq}",
                )

    def _check_parallel(self, geo: ModelGeometry | None) -> None:
        t = self.target
        if t.world_size > t.num_gpus:
            raise RecipeCheckError(
                "target.tp_size",
                f"tp_size {t.tp_size} × pp_size {t.pp_size} = {t.world_size} exceeds num_gpus {t.num_gpus}",
            )
        if t.gpus_per_node is not None:
            if t.gpus_per_node > t.num_gpus:
                raise RecipeCheckError("target.gpus_per_node", f"{t.gpus_per_node} exceeds num_gpus {t.num_gpus}")
            if t.world_size > t.gpus_per_node and t.world_size % t.gpus_per_node:
                raise RecipeCheckError(
                    "target.gpus_per_node",
                    f"tp_size × pp_size = {t.world_size} spans nodes of {t.gpus_per_node} GPUs but is not a multiple "
                    "of it: every node of a multi-node instance runs the same number of ranks",
                )
        if t.gpu == hardware.CPU_TARGET and t.world_size != 1:
            raise RecipeCheckError("target.tp_size", "the cpu target runs one rank: tp_size and pp_size must be 1")
        if geo is not None:
            if geo.num_attention_heads % t.tp_size or geo.num_key_value_heads % t.tp_size and t.tp_size % geo.num_key_value_heads:
                raise RecipeCheckError(
                    "target.tp_size",
                    f"{t.tp_size} does not divide the model's {geo.num_attention_heads} attention / "
                    f"{geo.num_key_value_heads} KV heads",
                )
            if geo.num_hidden_layers < t.pp_size:
                raise RecipeCheckError("target.pp_size", f"{t.pp_size} exceeds the model's {geo.num_hidden_layers} layers")

    def _check_awq(self, geo: ModelGeometry | None) -> None:
        q = self.quantization
        if q.qformat not in BLOCK_QFORMATS:
            return
        if geo is None:
            return
        tp = self.target.tp_size
        bad = sorted({d for d in geo.linear_input_dims if (d // tp if d % tp == 0 else d) % q.awq_block_size})
        if bad:
            good = [bs for bs in (128, 64, 32) if all((d // tp) % bs == 0 for d in geo.linear_input_dims)]
            hint = f"; use {good[0]}" if good else ""
            raise RecipeCheckError(
                "quantization.awq_block_size",
                f"{q.awq_block_size} does not divide the model's Linear input dims {bad} "
                f"(per tensor-parallel rank){hint}",
            )
