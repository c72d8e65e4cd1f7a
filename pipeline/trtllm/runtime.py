"""What a machine offers a TensorRT engine, and whether a built engine can run on it.

The engine stage's file names (``trtllm-build``'s output directory, see :mod:`pipeline.engine.tensorrt`),
the runtime probe (TensorRT-LLM / TensorRT versions from package metadata, GPUs from ``nvidia-smi``) and the
compatibility check the serve stage runs before starting Triton. ``tensorrt_llm`` is never imported in this
process: a version probe runs in a child interpreter.
"""

from __future__ import annotations

import importlib.util
import shutil
import subprocess
import sys
from importlib import metadata
from pathlib import Path
from typing import Any

from pipeline.core.artifacts import changed_files, file_hashes

ENGINE_DIR = "."
SCRIPT = "trtllm_build.sh"
BUILD_CONFIG = "build_config.json"
MODEL_CONFIG = "checkpoint_config.json"
BUILD_LOG = "build.log"
TIMING_CACHE = "timing.cache"
#: Files trtpipe writes next to the engine; everything else in the stage dir is trtllm-build output.
OWN_FILES = frozenset({SCRIPT, BUILD_CONFIG, MODEL_CONFIG, BUILD_LOG, TIMING_CACHE, "manifest.json"})
#: Seconds allowed for ``nvidia-smi`` / a version probe subprocess.
PROBE_TIMEOUT_S = 20.0


def _dist_version(*names: str) -> str | None:
    for n in names:
        try:
            return metadata.version(n)
        except metadata.PackageNotFoundError:
            continue
    return None


def _import_version(module: str) -> str | None:
    """``module.__version__`` from a child interpreter (keeps heavy imports out of this process)."""
    if importlib.util.find_spec(module) is None:
        return None
    try:
        out = subprocess.run([sys.executable, "-c", f"import {module}; print({module}.__version__)"],
                             capture_output=True, text=True, timeout=PROBE_TIMEOUT_S, check=True)
    except (OSError, subprocess.SubprocessError):
        return None
    return out.stdout.strip().splitlines()[-1] if out.stdout.strip() else None


def gpu_facts() -> list[dict[str, str]]:
    """``[{name, compute_capability}]`` per visible GPU from ``nvidia-smi``; ``[]`` without it or on error."""
    smi = shutil.which("nvidia-smi")
    if smi is None:
        return []
    try:
        out = subprocess.run([smi, "--query-gpu=name,compute_cap", "--format=csv,noheader"],
                             capture_output=True, text=True, timeout=PROBE_TIMEOUT_S, check=True)
    except (OSError, subprocess.SubprocessError):
        return []
    gpus = []
    for line in out.stdout.splitlines():
        name, _, cc = line.rpartition(",")
        if name.strip():
            gpus.append({"name": name.strip(), "compute_capability": cc.strip()})
    return gpus


def runtime_facts() -> dict[str, Any]:
    """What this machine offers an engine: ``tensorrt_llm`` and ``tensorrt`` versions (``None`` when absent)
    and ``gpus`` (``[{name, compute_capability}]``, empty on CPU). Nothing heavy is imported here."""
    return {
        "tensorrt_llm": _dist_version("tensorrt_llm", "tensorrt-llm") or _import_version("tensorrt_llm"),
        "tensorrt": _dist_version("tensorrt", "tensorrt-cu13", "tensorrt-cu12") or _import_version("tensorrt"),
        "gpus": gpu_facts(),
    }


def check_engine_compatible(manifest: dict[str, Any], runtime: dict[str, Any], *, stage_dir: Path | None = None) -> list[str]:
    """Why the engine of ``manifest`` cannot be served on ``runtime`` (:func:`runtime_facts`); ``[]`` = compatible.

    Checks: the engine was built; TensorRT-LLM and TensorRT versions equal the build's; at least
    world_size GPUs with the build GPU's compute capability; and, when ``stage_dir`` (the engine stage
    directory) is given, every recorded engine file still has its sha256.
    """
    problems: list[str] = []
    status = manifest.get("status")
    if status != "built":
        problems.append(f"the engine was not built (status {status!r}); run `trtpipe build` where trtllm-build exists")
        return problems
    versions = manifest.get("versions") or {}
    for key, label in (("tensorrt_llm", "TensorRT-LLM"), ("tensorrt", "TensorRT")):
        want, have = versions.get(key), runtime.get(key)
        if want and have is None:
            problems.append(f"{label} is not installed here; the engine was built with {label} {want}")
        elif want and have != want:
            problems.append(f"engine built with {label} {want}, this runtime has {have}: rebuild the engine")
    want_cc = (manifest.get("gpu") or {}).get("compute_capability")
    gpus = runtime.get("gpus") or []
    world = int(manifest.get("world_size") or 1)
    if not gpus:
        problems.append("no NVIDIA GPU is visible (nvidia-smi)")
    elif len(gpus) < world:
        problems.append(f"the engine needs {world} GPUs (tp×pp), {len(gpus)} visible")
    for i, g in enumerate(gpus[:world]):
        if want_cc and g.get("compute_capability") != want_cc:
            problems.append(f"GPU {i} ({g.get('name')}) has compute capability {g.get('compute_capability')}, "
                            f"the engine was built for {want_cc}: rebuild on this GPU type")
    if stage_dir is not None:
        engine_dir = Path(stage_dir) / manifest.get("engine_dir", ENGINE_DIR)
        problems += [f"engine file {line}" for line in changed_files(engine_dir, manifest.get("engine_files") or {})]
    return problems


def engine_file_hashes(engine_dir: Path) -> dict[str, str]:
    """``{relative path: sha256}`` of trtllm-build's output in ``engine_dir`` (trtpipe's own files excluded)."""
    return {rel: sha for rel, sha in file_hashes(Path(engine_dir)).items() if rel not in OWN_FILES}
