"""The search space of ``trtpipe recipe new``: what the planner can judge, for a model on N GPUs of one kind.

Dimensions (docs/recipe-new.md):

* serving path ``build.engine``: ``pytorch`` and ``tensorrt`` on a GPU (``--engine`` keeps one), ``cpu`` on the host;
* ``quantization.qformat`` and ``kv_cache_dtype``: those the support matrix lists for the path × the GPU's
  architecture (:func:`pipeline.recipe.qformats.searched`, the ONE rule file pipeline/data/qformat_rules.yaml);
* parallelism: TP ∈ {1, 2, 4, 8} × PP ∈ {1, 2, 4} with TP × PP ≤ min(N, 8) (one instance within one 8-GPU node),
  × EP ∈ {1, TP} for a MoE model on the pytorch path; N // (TP × PP) replicas of the instance on the N GPUs;
* ``max_num_tokens`` ∈ :data:`TOKEN_BUDGETS` (chunked prefill on); ``max_batch_size`` and the CUDA-graph batch sizes
  are not enumerated on a GPU but derived from the planner's answer (the largest concurrency within the SLO);
* on the cpu target: qformat × ``max_batch_size`` ∈ :data:`CPU_BATCHES`, the KV dtype paired with the qformat as the
  shipped CPU recipes pair it, ``build.cpu.num_threads`` = this host's cores (the planner's host rates are measured
  with all of them: threads are not a dimension it can judge).

A :class:`Candidate` becomes a recipe mapping (:func:`recipe_dict`), which the recipe validator then accepts or
refuses: every cross-field rule (heads divisible by TP, EP dividing TP and the experts, AWQ block sizes, …) is the
validator's, not re-written here.
"""

from __future__ import annotations

import dataclasses
import os
from pathlib import Path
from typing import Any

from pipeline.core import hardware
from pipeline.core.errors import UserError
from pipeline.core.geometry import ModelGeometry, geometry_for_source
from pipeline.recipe import qformats
from pipeline.recipe.model import EMBEDDED_SMOLLM2
from pipeline.recipe.quant import BLOCK_QFORMATS
from pipeline.recipe.serving_path import PATHS, TRITON, ServingPath, builder_paths

TP_SIZES = (1, 2, 4, 8)
PP_SIZES = (1, 2, 4)
#: GPUs of one model instance at most: one 8-GPU NVLink node (AIConfigurator's agg search stops at TP 8 too:
#: ai-dynamo/aiconfigurator src/aiconfigurator/sdk/task_v2.py@614b9c8c:970-978, tag v0.11.0)
MAX_INSTANCE_GPUS = 8
#: max_num_tokens tried per path: the first is the one every layout is judged with, the others refine the best layouts
TOKEN_BUDGETS = {"gpu": (8192, 2048, 4096, 16384), "cpu": (1024, 256, 4096)}
#: the largest max_batch_size searched: AIConfigurator's agg batch list ends at 1024 (src/aiconfigurator/sdk/sweep.py@614b9c8c:81-89);
#: the CPU engine's shipped recipes use 32
BATCH_CAP = {"gpu": 1024, "cpu": 32}
#: max_batch_size tried on the CPU engine (the written one is lowered to the SLO's concurrency when that is smaller)
CPU_BATCHES = (32, 16, 8, 4)
#: calibration of the written recipes: the shipped GPU recipes' (TensorRT-LLM quantize.py defaults, cnn_dailymail 512
#: × 512) and the CPU default's (embedded text; int4_awq smaller, as tunes/smollm2_cpu.yaml)
CALIBRATION = {"gpu": {"dataset": "cnn_dailymail", "size": 512, "max_seq_length": 512, "batch_size": 1, "seed": 1234},
               "cpu": {"dataset": "embedded", "size": 64, "max_seq_length": 256, "batch_size": 8, "seed": 1234},
               "cpu_awq": {"dataset": "embedded", "size": 16, "max_seq_length": 128, "batch_size": 8, "seed": 1234}}


@dataclasses.dataclass(frozen=True)
class Request:
    """What the user asked: the model (``source`` as a recipe names it, its geometry), the GPU (None: the host),
    GPUs in all, ISL/OSL (tokens), the latency SLO (ms by key: ttft, itl, tpot, e2e), the serving paths to search
    (rows of :data:`pipeline.recipe.serving_path.PATHS`, all on the same target)."""

    source: str
    geo: ModelGeometry
    gpu: hardware.GpuSpec | None
    num_gpus: int
    isl: int
    osl: int
    slo: dict[str, float]
    paths: tuple[ServingPath, ...]

    @property
    def on_cpu(self) -> bool:
        """True on the cpu target (the CPU engine on this host)."""
        return self.paths[0].on_cpu

    @property
    def kind(self) -> str:
        """``gpu`` or ``cpu`` (the serving-path table's target column)."""
        return self.paths[0].target

    @property
    def target(self) -> str:
        """The recipe's ``target.gpu``: the catalog key or ``cpu``."""
        return self.gpu.key if self.gpu else hardware.CPU_TARGET

    @property
    def arch(self) -> str:
        """The architecture the rules are looked up with (gpus.yaml ``arch``; ``cpu`` on the host)."""
        return self.gpu.arch if self.gpu else hardware.CPU_TARGET

    @property
    def engines(self) -> tuple[str, ...]:
        """``build.engine`` of each path searched."""
        return tuple(p.engine for p in self.paths)


@dataclasses.dataclass(frozen=True)
class Candidate:
    """One point of the space. ``max_batch_size`` is the cap it is planned with; the written recipe lowers it to the
    largest concurrency within the SLO. ``threads``: the CPU engine's ``build.cpu.num_threads`` (None on a GPU)."""

    engine: str
    qformat: str
    kv: str
    tp: int = 1
    pp: int = 1
    ep: int = 1
    max_num_tokens: int = 8192
    max_batch_size: int = 1024
    threads: int | None = None
    target: str = "gpu"

    @property
    def path(self) -> ServingPath:
        """The serving-path row it is built and served on (Triton frontend)."""
        return PATHS[f"{self.engine}/{self.target}/{TRITON}"]

    @property
    def world(self) -> int:
        """GPUs of one instance (TP × PP)."""
        return self.tp * self.pp

    @property
    def layout(self) -> str:
        """``TP2×PP1`` (``×EP2`` for expert parallelism); ``host`` on the CPU."""
        if self.path.on_cpu:
            return f"host {self.threads} thr" if self.threads else "host"
        return f"TP{self.tp}×PP{self.pp}" + (f"×EP{self.ep}" if self.ep > 1 else "")

    @property
    def label(self) -> str:
        """One-line name: ``pytorch fp8 kv fp8 TP2×PP1 tokens 8192``."""
        batch = f" batch {self.max_batch_size}" if self.path.on_cpu else ""
        return f"{self.engine} {self.qformat} kv {self.kv} {self.layout} tokens {self.max_num_tokens}{batch}"


def resolve_gpu(name: str) -> hardware.GpuSpec | None:
    """The catalog GPU ``name`` names (key or alias, any case), or None for ``cpu``.

    Raises:
        UserError: a name neither in the catalog nor ``cpu`` (one line listing the catalog).
    """
    spec = hardware.lookup(name)
    if spec is None and builder_paths(name.strip().lower())[0].on_cpu:
        return None
    if spec is None:
        raise UserError(f"--gpu {name!r}: not in the GPU catalog ({', '.join(sorted(hardware.catalog()))}) nor 'cpu'")
    return spec


def resolve_model(model: str | None, on_cpu: bool, cwd: Path | None = None) -> tuple[str, ModelGeometry]:
    """``(source, geometry)`` of MODEL: a known model (pipeline/data/models.yaml) or a local directory holding a HF
    ``config.json`` (the source is then its absolute path). No MODEL on the CPU target: the embedded SmolLM2.

    Raises:
        UserError: no MODEL on a GPU target; a MODEL neither table nor directory describes.
    """
    if not model:
        if on_cpu:
            model = EMBEDDED_SMOLLM2
        else:
            raise UserError("MODEL: missing; give a known model (e.g. meta-llama/Llama-3.1-8B-Instruct) or a local "
                            "directory with a config.json")
    base = cwd or Path.cwd()
    geo = geometry_for_source(model, base)
    if geo is None:
        raise UserError(f"MODEL {model!r}: geometry unknown: not in pipeline/data/models.yaml and not a local directory "
                        "with a readable config.json")
    path = Path(model).expanduser()
    path = path if path.is_absolute() else base / path
    source = str(path.resolve()) if path.is_dir() and (path / "config.json").is_file() else model
    return source, geo


def _divides_heads(geo: ModelGeometry, tp: int) -> bool:
    """The validator's TP rule, applied early to keep the space small (schema.Recipe._check_parallel)."""
    kv = geo.num_key_value_heads
    return geo.num_attention_heads % tp == 0 and (kv % tp == 0 or tp % kv == 0)


def layouts(geo: ModelGeometry, num_gpus: int, path: ServingPath) -> list[tuple[int, int, int]]:
    """``(tp, pp, ep)`` of one instance within ``num_gpus`` (and :data:`MAX_INSTANCE_GPUS`), TP dividing the heads;
    EP ∈ {1, TP} for a MoE model on an LLM-API path (``moe_expert_parallel_size``; EP dividing the expert count).
    ``[(1, 1, 1)]`` on the CPU."""
    if path.on_cpu:
        return [(1, 1, 1)]
    limit = min(num_gpus, MAX_INSTANCE_GPUS)
    out = []
    for tp in TP_SIZES:
        for pp in PP_SIZES:
            if tp * pp > limit or pp > geo.num_hidden_layers or not _divides_heads(geo, tp):
                continue
            eps = {1}
            if geo.is_moe and path.llm_api and tp > 1 and geo.num_experts % tp == 0:
                eps.add(tp)
            out += [(tp, pp, ep) for ep in sorted(eps)]
    return out


def not_searched(req: Request) -> list[str]:
    """One sentence per qformat / KV dtype the rules leave out on the requested paths × this GPU (with the source)."""
    out = []
    for engine in req.engines:
        for kind, table in (("qformat", qformats.rules()["qformats"]), ("kv", qformats.rules()["kv_cache"])):
            out += [why for name in table if (why := qformats.unsupported(kind, name, engine, req.arch))]
    return out


def candidates(req: Request, num_gpus: int | None = None) -> list[Candidate]:
    """Every candidate of the space at the first token budget (see the module doc); ``num_gpus`` overrides the
    request's (the smallest-N search)."""
    n = req.num_gpus if num_gpus is None else num_gpus
    arch, kind = req.arch, req.kind
    budget = TOKEN_BUDGETS[kind][0]
    cap = BATCH_CAP[kind]
    threads = len(os.sched_getaffinity(0)) if req.on_cpu else None
    out = []
    for path in req.paths:
        engine = path.engine
        if path.on_cpu:  # the CPU engine: qformat × max_batch_size, its KV dtype paired as the shipped CPU recipes
            for q in qformats.searched("qformat", engine, arch):
                kv = "fp8" if q != "full_prec" and "fp8" in qformats.searched("kv", engine, arch) else "none"
                out += [Candidate(engine, q, kv, max_num_tokens=budget, max_batch_size=b, threads=threads, target=kind)
                        for b in CPU_BATCHES]
            continue
        for q in qformats.searched("qformat", engine, arch):
            for kv in qformats.searched("kv", engine, arch):
                for tp, pp, ep in layouts(req.geo, n, path):
                    out.append(Candidate(engine, q, kv, tp, pp, ep, budget, cap, threads, kind))
    return out


def awq_block_size(geo: ModelGeometry, tp: int) -> int | None:
    """The largest of 128, 64, 32 dividing every Linear input dim per TP rank (ModelOpt's AWQ groups), or None."""
    dims = [d // tp if d % tp == 0 else d for d in geo.linear_input_dims]
    return next((bs for bs in (128, 64, 32) if all(d % bs == 0 for d in dims)), None)


def graph_sizes(max_batch_size: int) -> list[int]:
    """CUDA-graph batch sizes: powers of two below ``max_batch_size``, then ``max_batch_size`` itself (NVIDIA's
    published PyTorch-backend runs capture 1, 2, 4, …; recipes/llama31_8b_h200_fp8_pytorch.yaml)."""
    sizes = [1 << i for i in range(20) if (1 << i) < max_batch_size]
    return sizes + [max_batch_size]


def recipe_dict(c: Candidate, req: Request, *, name: str, concurrency: list[int] | None = None) -> dict[str, Any]:
    """The recipe mapping of candidate ``c`` for ``req`` (what the validator and the planner take).

    Lengths: ``max_input_len`` = ISL, ``max_seq_len`` = ISL + OSL; chunked prefill on; the KV fraction 0.9
    (TensorRT-LLM's default). ``concurrency``: the bench load points (default 1 and ``max_batch_size``).
    """
    on_cpu = c.path.on_cpu
    quant: dict[str, Any] = {"qformat": c.qformat, "kv_cache_dtype": c.kv}
    if c.qformat in BLOCK_QFORMATS:
        quant["awq_block_size"] = awq_block_size(req.geo, c.tp) or 128
    calib = "cpu_awq" if on_cpu and c.qformat in BLOCK_QFORMATS else req.kind
    quant["calibration"] = dict(CALIBRATION[calib])
    seq = req.isl + req.osl
    build: dict[str, Any] = {"engine": c.engine, "max_batch_size": c.max_batch_size, "max_input_len": req.isl,
                             "max_seq_len": seq, "max_num_tokens": c.max_num_tokens, "tokens_per_block": 32}
    if on_cpu:
        build["kv_cache_config"] = {"max_tokens": c.max_batch_size * seq, "enable_block_reuse": False}
        build["cpu"] = {"dtype": "float32", **({"num_threads": c.threads} if c.threads else {})}
    else:
        build["enable_chunked_prefill"] = True
        build["kv_cache_config"] = {"free_gpu_memory_fraction": 0.9}
    if not on_cpu and "build.pytorch" not in c.path.unread_knobs:  # the LLM-API path: CUDA graphs
        build["pytorch"] = {"cuda_graph_config": {"enable_padding": True, "batch_sizes": graph_sizes(c.max_batch_size)}}
    if not on_cpu and "build.workers" not in c.path.unread_knobs and c.world > 1:  # trtllm-build: one worker per rank
        build["workers"] = c.world
    target: dict[str, Any] = {"gpu": req.target}
    if not on_cpu:
        target.update(num_gpus=c.world, tp_size=c.tp, pp_size=c.pp)
        if c.ep > 1:
            target["ep_size"] = c.ep
    dtype = "float32" if on_cpu else (req.geo.torch_dtype if req.geo.torch_dtype in ("float16", "bfloat16") else "auto")
    conc = sorted(set(concurrency or [1, c.max_batch_size]))
    bench: dict[str, Any] = {"scenarios": [{"isl": req.isl, "osl": req.osl}], "concurrency": conc}
    if on_cpu:
        bench.update(requests_per_load=2, min_requests=2, warmup_requests=1)
    return {"name": name, "description": f"trtpipe recipe new: {req.source} on {req.target}, {c.label}",
            "model": {"source": req.source, "dtype": dtype}, "target": target, "quantization": quant, "build": build,
            "bench": bench}
