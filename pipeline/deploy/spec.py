"""What a Kubernetes deployment of one build needs, resolved once from a recipe or a build directory.

:func:`resolve` turns ``RECIPE`` or ``BUILD_DIR`` into a frozen :class:`DeploySpec`: names, the Triton container
of the release matrix for the engine's TensorRT-LLM (:func:`pipeline.trtllm.release.for_tensorrt_llm`), the GPU
layout (tp × pp ranks, GPUs per node, nodes per instance), where the build directory lives inside the pods
(the model repository refers to the engine and checkpoint by absolute path, so the build must be mounted
at the path it was built at), ports and the server argv: Triton's (:func:`pipeline.triton.server.triton_command`)
or, for ``serving.frontend: trtllm-serve``, the build's trtllm-serve command (:mod:`pipeline.deploy.trtllm_serve`),
and the bench defaults. The renderers (:mod:`pipeline.deploy.helm`, :mod:`pipeline.deploy.manifests`) read only
this object.
"""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

from pydantic import BaseModel, ConfigDict

from pipeline.core import hardware
from pipeline.core.errors import UserError
from pipeline.core.layout import LLMAPI_MODEL_YAML, BuildLayout
from pipeline.deploy import trtllm_serve
from pipeline.engine.result import EngineResult
from pipeline.recipe import Recipe
from pipeline.recipe.serving_path import ServingPath, serving_path
from pipeline.serve import stage as _serve_stage
from pipeline.triton.server import CONTAINER_TRITONSERVER, triton_command
from pipeline.triton_repo import layouts
from pipeline.trtllm import release as release_matrix

#: where the trtpipe GPU image keeps builds (Dockerfile: ``artifacts`` → ``/models``, the volume to mount)
DEFAULT_MOUNT_PATH = "/models"
#: tritonserver inside the Triton containers
TRITONSERVER = str(CONTAINER_TRITONSERVER)
#: default ports of ``trtpipe serve`` / tritonserver (pipeline.triton.server.triton_command defaults)
PORTS = {"http": 8000, "grpc": 8001, "metrics": 8002}
#: bind address inside a pod (Service traffic arrives on the pod IP)
POD_HOST = "0.0.0.0"
#: python-backend /dev/shm for one GPU: docs/deploy-gpu.md (`--shm-size=2g`, Docker's 64 MB is too small)
SHM_SINGLE_GPU = "2Gi"
#: memory-backed /dev/shm for multi-GPU pods (NCCL + python backend): NVIDIA's EKS multi-node chart sizes
#: it 256Gi (tutorials Deployment/Kubernetes/EKS_Multinode_Triton_TRTLLM/multinode_helm_chart/chart/templates/
#: deployment.yaml@f59d968829e0). A memory-backed emptyDir is charged to the pod's memory cgroup, so the rendered
#: size is capped at the pod's memory limit (:func:`shm_size`)
SHM_MULTI_GPU = "256Gi"
#: Triton's administrative APIs a pod restricts behind a key, and the header carrying it: the same as local
#: ``trtpipe serve`` off loopback (pipeline.serve.stage.ADMIN_APIS / ADMIN_HEADER)
ADMIN_APIS = _serve_stage.ADMIN_APIS
ADMIN_HEADER = _serve_stage.ADMIN_HEADER
#: the container env var holding the admin key. The kubelet expands ``$(VAR)`` in ``command``/``args`` from the
#: container's env (kubernetes/kubernetes third_party/forked/golang/expansion/expand.go@fde22c3f9aac ``Expand`` /
#: ``MappingFuncFor``: an undefined ``$(name)`` is left as written, so shell ``$((i + 1))`` survives)
ADMIN_KEY_ENV = "TRITON_ADMIN_KEY"
#: key of the admin-key entry in the Secret
ADMIN_SECRET_KEY = "admin-key"
#: startup budget for loading the engine from the volume (s); docs/deploy-gpu.md suggests `--timeout 600`
#: for a large engine on local disk, tripled for network volumes and multi-node start-up
STARTUP_TIMEOUT_S = 1800
#: Helm release / object names must be DNS-1123 labels; 53 leaves room for suffixes (Helm's own limit)
MAX_NAME = 53


def gib(quantity: str) -> float:
    """A Kubernetes binary/decimal memory quantity (``64Gi``, ``2G``, ``512Mi``) in GiB."""
    m = re.fullmatch(r"([0-9.]+)([KMGTPE]i?|k)?", str(quantity).strip())
    if not m:
        raise UserError(f"{quantity!r}: not a Kubernetes memory quantity (e.g. 64Gi)")
    units = {None: 1, "k": 1e3, "K": 1e3, "M": 1e6, "G": 1e9, "T": 1e12, "P": 1e15, "E": 1e18,
             "Ki": 2**10, "Mi": 2**20, "Gi": 2**30, "Ti": 2**40, "Pi": 2**50, "Ei": 2**60}
    return float(m.group(1)) * units[m.group(2)] / 2**30


def shm_size(gpus_per_pod: int, memory_limit: str | None) -> str:
    """The ``/dev/shm`` emptyDir size of a pod: 2Gi for one GPU, 256Gi for several, never above ``memory_limit``.

    A ``medium: Memory`` emptyDir is tmpfs charged to the pod's memory cgroup; the kubelet sizes it to the
    smallest of node allocatable, the pod's memory limit and the volume's sizeLimit (kubernetes/kubernetes
    pkg/volume/emptydir/empty_dir.go@e62f9625cf60 ``calculateEmptyDirMemorySize``), so a sizeLimit above the
    limit only promises space the limit takes back.
    """
    want = SHM_SINGLE_GPU if gpus_per_pod == 1 else SHM_MULTI_GPU
    if memory_limit and gib(want) > gib(memory_limit):
        return memory_limit
    return want


def dns_name(text: str) -> str:
    """``text`` as a DNS-1123 label: lower case, ``[a-z0-9-]``, at most 53 characters, no edge dashes."""
    name = re.sub(r"[^a-z0-9-]+", "-", text.lower()).strip("-")[:MAX_NAME].strip("-")
    if not name:
        raise UserError(f"{text!r}: cannot make a Kubernetes name from it (use letters and digits)")
    return name


def gpu_product_label(gpu_name: str) -> str:
    """The ``nvidia.com/gpu.product`` node label of a GPU: its NVML name with spaces as dashes.

    E.g. ``NVIDIA A100-SXM4-40GB`` → ``NVIDIA-A100-SXM4-40GB``, the value NVIDIA's autoscaling chart selects
    (tutorials TensorRT-LLM_Autoscaling_and_Load_Balancing/chart/llama-3-70b-instruct_values.yaml@9bf511ea3e74).
    """
    return gpu_name.strip().replace(" ", "-")


class DeploySpec(BaseModel):
    """Everything the renderers need. Units: ports are TCP ports, sizes Kubernetes quantities, times seconds."""

    model_config = ConfigDict(frozen=True)

    recipe: Recipe
    name: str                    # DNS-1123 name of every object (from the recipe name)
    source: str                  # "recipe" | "build"
    engine: str                  # tensorrt | pytorch
    tensorrt_llm: str            # TensorRT-LLM version of the engine
    release: release_matrix.Release
    tp: int
    pp: int
    world_size: int
    gpus_per_node: int
    nodes: int                   # nodes per model instance (LeaderWorkerSet size when > 1)
    gpus_per_pod: int
    gpu_product: str             # nvidia.com/gpu.product label value
    gpu_resource: str = "nvidia.com/gpu"  # the extended resource a pod requests: nvidia.com/mig-<profile> on a MIG slice
    mount_path: str              # where the volume holding builds is mounted
    build_dir: str               # absolute path of the build directory inside the pods
    bench_model: str
    tokenizer_dir: str           # inside the pods (the bench Job)
    engine_args: dict[str, Any]  # LLM-API arguments (Dynamo worker)
    frontend: str = "triton"     # serving.frontend: triton | trtllm-serve
    serve_argv: tuple[str, ...] = ()  # trtllm-serve only: the argv of one pod (host POD_HOST, port serve_port)
    serve_port: int = PORTS["http"]   # trtllm-serve only: its HTTP port (TCP), the argv's --port

    @property
    def path(self) -> ServingPath:
        """The recipe's serving path (:func:`pipeline.recipe.serving_path.serving_path`)."""
        return serving_path(self.recipe)

    @property
    def serve_host(self) -> str:
        """The bind address of the server inside a pod."""
        return POD_HOST

    @property
    def perf_metrics(self) -> bool:
        """True when the LLM arguments set ``return_perf_metrics`` (trtllm-serve then mounts its Prometheus route)."""
        return bool(self.engine_args.get("return_perf_metrics"))

    @property
    def repository(self) -> str:
        """The Triton model repository inside the pods."""
        return str(BuildLayout(Path(self.build_dir)).triton_repo)

    @property
    def hf_ckpt(self) -> str:
        """The build's unified HF checkpoint inside the pods (what the LLM-API / Dynamo worker loads)."""
        return str(BuildLayout(Path(self.build_dir)).hf_ckpt)

    @property
    def multi_node(self) -> bool:
        """True when one instance spans nodes (rendered as a LeaderWorkerSet)."""
        return self.nodes > 1

    def triton_argv(self, ports: dict[str, int] | None = None, extra_args: list[str] | tuple[str, ...] = ()) -> list[str]:
        """``tritonserver`` argv for one pod (single node): :func:`pipeline.triton.server.triton_command`."""

        from pipeline.triton_repo.vision import tritonserver_options

        p = ports or PORTS
        return triton_command(
            TRITONSERVER, self.repository, http_port=p["http"], grpc_port=p["grpc"], metrics_port=p["metrics"],
            host=POD_HOST, world_size=self.world_size, extra_args=extra_args, **tritonserver_options(self.recipe),
        )


def _engine_manifest(build: Path) -> dict[str, Any]:
    engine = EngineResult.load(BuildLayout(build).engine)
    return engine.manifest if engine is not None else {}


def _referenced_build_dir(build: Path, path: ServingPath) -> str | None:
    """The absolute build directory the repository's configs point at (engine dir / LLM-API model path)."""
    layout = BuildLayout(build)
    repo = layout.triton_repo
    if not path.llm_api:  # the C++ backend's tensorrt_llm model names the engine directory
        from pipeline.triton.model_config import load_model_config

        cfg_path = repo / "tensorrt_llm" / "config.pbtxt"
        if not cfg_path.is_file():
            return None
        params = load_model_config(cfg_path).parameters
        path = params["gpt_model_path"].string_value if "gpt_model_path" in params else ""
        return str(Path(path).parent) if path else None
    import yaml

    model_yaml = repo / LLMAPI_MODEL_YAML
    if not model_yaml.is_file():
        return None
    model = (yaml.safe_load(model_yaml.read_text()) or {}).get("model")
    if not model:
        return None
    # the LLM-API model loads <build>/quantize/hf_ckpt: walk back up as many levels as the layout puts it below the root
    depth = len(layout.hf_ckpt.relative_to(layout.root).parts)
    return str(Path(model).parents[depth - 1])


def resolve(target: Path, *, overrides: list[str] | None = None, mount_path: str | None = None) -> DeploySpec:
    """Read ``target`` (a recipe YAML, or a build directory holding ``recipe.yaml``) into a :class:`DeploySpec`.

    Args:
        target: ``recipes/x.yaml`` or ``artifacts/x`` (a ``trtpipe build`` output).
        overrides: ``--set KEY=VALUE`` recipe overrides (re-validated).
        mount_path: where the volume with the builds is mounted in the pods (default ``/models``, or the parent
            of the path a build directory's repository refers to).

    Raises:
        UserError: the target is missing or not a recipe/build, the recipe targets the CPU, the release matrix
            has no container for the engine's TensorRT-LLM, the build is not mountable at its paths, or a
            trtllm-serve build has no stored command (``engine/trtllm_serve.json``).
        StageError: the trtllm-serve command line breaks the 1.2.1 contract.
    """
    from pipeline.recipe import load_recipe
    from pipeline.trtllm.llmapi import llm_api_kwargs

    target = Path(target)
    if target.is_dir():
        recipe_file = BuildLayout(target).recipe_file
        if not recipe_file.is_file():
            raise UserError(f"{target}: not a build directory (no recipe.yaml; run `trtpipe build` first)")
        recipe, source = load_recipe(recipe_file, overrides), "build"
    elif target.is_file() or target.suffix in (".yaml", ".yml"):
        recipe, source = load_recipe(target, overrides), "recipe"
    else:
        raise UserError(f"{target}: no such recipe file or build directory")
    engine, path = recipe.build.engine, serving_path(recipe)
    if not path.deployable:
        raise UserError(
            f"{target}: target.gpu is '{recipe.target.gpu}' (engine {engine}): `trtpipe deploy k8s` renders GPU "
            "deployments in the Triton TensorRT-LLM container; use a GPU recipe"
        )
    frontend = recipe.serving.frontend
    name = dns_name(recipe.name or target.stem)

    manifest = _engine_manifest(target) if source == "build" else {}
    trtllm = ((manifest.get("versions") or {}).get("tensorrt_llm") or (manifest.get("pins") or {}).get("tensorrt_llm")
              or release_matrix.default_tensorrt_llm())
    try:
        rel = release_matrix.for_tensorrt_llm(str(trtllm))
    except KeyError as e:
        raise UserError(f"{target}: engine built with TensorRT-LLM {trtllm}: {e.args[0]}") from None

    t = recipe.target
    node_gpus = t.node_gpus
    nodes = t.nodes_per_instance
    gpus_per_pod = t.world_size if nodes == 1 else node_gpus

    if source == "build":
        referenced = (trtllm_serve.stored_build_dir(target) if path.trtllm_serve
                      else _referenced_build_dir(target, path))
        build_dir = referenced or str(target.resolve())
        mount = mount_path or str(Path(build_dir).parent)
        if not (build_dir + "/").startswith(mount.rstrip("/") + "/"):
            raise UserError(
                f"{target}: its model repository refers to {build_dir}, which is not under --mount-path {mount}: "
                "mount the volume so the build keeps its path, or rebuild under the mount path"
            )
    else:
        mount = (mount_path or DEFAULT_MOUNT_PATH).rstrip("/") or "/"
        build_dir = f"{mount.rstrip('/')}/{recipe.name or target.stem}"
    if not mount.startswith("/"):
        raise UserError(f"--mount-path {mount!r}: must be an absolute path inside the pods")

    pod_layout = BuildLayout(Path(build_dir))
    hf_ckpt = str(pod_layout.hf_ckpt)
    engine_args = {k: v for k, v in llm_api_kwargs(recipe, Path(hf_ckpt)).items() if k not in ("model", "tokenizer", "backend")}
    repo_tokenizer = path.tokenizer == "repo"
    tokenizer = str(pod_layout.triton_repo / layouts()["tokenizer"]["repo_subdir"]) if repo_tokenizer else hf_ckpt
    serve_argv: list[str] = []
    if path.trtllm_serve:
        serve_argv = trtllm_serve.pod_argv(recipe, build_dir, host=POD_HOST, build=target if source == "build" else None)
    return DeploySpec(
        recipe=recipe, name=name, source=source, engine=engine, tensorrt_llm=str(trtllm), release=rel,
        tp=t.tp_size, pp=t.pp_size, world_size=t.world_size, gpus_per_node=node_gpus, nodes=nodes,
        gpus_per_pod=gpus_per_pod, gpu_product=gpu_product_label(hardware.product_name(recipe.target.gpu)), mount_path=mount,
        gpu_resource=hardware.mig_resource(recipe.target.mig) if recipe.target.mig else "nvidia.com/gpu",
        build_dir=build_dir, bench_model=recipe.bench.model, tokenizer_dir=tokenizer, engine_args=engine_args,
        frontend=frontend, serve_argv=tuple(serve_argv),
        serve_port=trtllm_serve.port_of(serve_argv) if serve_argv else PORTS["http"],
    )
