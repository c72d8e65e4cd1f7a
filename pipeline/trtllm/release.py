"""The release matrix: which Triton container ships which TensorRT-LLM, TensorRT, CUDA, torch, transformers,
nvidia-modelopt and Python.

The data is ``pipeline/data/release_matrix.yaml`` — the one place trtpipe spells a container tag or a
GPU-stack version; every value carries its upstream source (tensorrtllm_backend release-branch Dockerfiles,
TensorRT-LLM requirements, the Triton Release Compatibility Matrix). The Dockerfile, ``trtpipe serve``'s
runtime check, the engine manifests, the GPU launch and the Kubernetes renderers read it through
:func:`default_release` / :func:`for_tensorrt_llm`.
"""

from __future__ import annotations

import functools
from importlib import resources
from typing import Any

import yaml
from pydantic import BaseModel, ConfigDict

MATRIX_RESOURCE = "data/release_matrix.yaml"


class DynamoRuntime(BaseModel):
    """One NVIDIA Dynamo TensorRT-LLM runtime image (``dynamo_runtimes`` of the matrix)."""

    model_config = ConfigDict(frozen=True, extra="ignore")

    dynamo: str
    image: str
    tensorrt_llm: str
    cuda: str | None = None
    source: str


def _series(version: str) -> tuple[int, int] | None:
    """``(major, minor)`` of a TensorRT-LLM version (``1.2.0rc6.post3`` → ``(1, 2)``)."""
    import re

    m = re.match(r"(\d+)\.(\d+)", version)
    return (int(m.group(1)), int(m.group(2))) if m else None


class Release(BaseModel):
    """One Triton ``<tag>-trtllm-python-py3`` container and the versions inside it (``None`` = not sourced)."""

    model_config = ConfigDict(frozen=True, extra="ignore")

    triton_container: str
    image: str
    tensorrt_llm: str
    default: bool = False
    tensorrt: str | None = None
    triton_server: str | None = None
    cuda: str | None = None
    torch: str | None = None
    transformers: str | None = None
    nvidia_modelopt: str | None = None
    python: str | None = None
    #: the virtual environment holding torch / tensorrt_llm / modelopt (``None``: system site-packages)
    python_env: str | None = None
    numpy: str | None = None
    sources: dict[str, Any] = {}
    #: the Dynamo TensorRT-LLM runtime image for this TensorRT-LLM (same major.minor, newest), ``None``: none sourced
    dynamo_runtime: DynamoRuntime | None = None

    @property
    def dynamo_runtime_image(self) -> str | None:
        """The image ``trtpipe deploy k8s --format dynamo`` uses without ``--dynamo-image``."""
        return self.dynamo_runtime.image if self.dynamo_runtime else None


@functools.cache
def _matrix() -> dict[str, Any]:
    return yaml.safe_load(resources.files("pipeline").joinpath(MATRIX_RESOURCE).read_text())


@functools.cache
def dynamo_runtimes() -> tuple[DynamoRuntime, ...]:
    """Every Dynamo TensorRT-LLM runtime image of the matrix, oldest first."""
    return tuple(DynamoRuntime.model_validate(d) for d in _matrix().get("dynamo_runtimes") or ())


def dynamo_runtime_for(tensorrt_llm: str) -> DynamoRuntime | None:
    """The newest Dynamo runtime image whose TensorRT-LLM has the major.minor of ``tensorrt_llm`` (``None``: none).

    Dynamo's worker loads the build's HF checkpoint with the LLM-API, not a TensorRT engine, so the same release
    series suffices; the image's exact TensorRT-LLM is in :attr:`DynamoRuntime.tensorrt_llm`.
    """
    series = _series(tensorrt_llm)
    matches = [d for d in dynamo_runtimes() if series is not None and _series(d.tensorrt_llm) == series]
    return matches[-1] if matches else None


@functools.cache
def releases() -> tuple[Release, ...]:
    """Every container of the matrix, oldest first."""
    return tuple(Release.model_validate({**r, "dynamo_runtime": dynamo_runtime_for(str(r["tensorrt_llm"]))})
                 for r in _matrix()["releases"])


def default_tensorrt_llm() -> str:
    """The TensorRT-LLM version trtpipe targets by default (``1.2.1``)."""
    return str(_matrix()["default_tensorrt_llm"])


def for_tensorrt_llm(version: str | None = None) -> Release:
    """The container trtpipe uses for TensorRT-LLM ``version`` (default :func:`default_tensorrt_llm`):
    the entry marked ``default`` for it, else the oldest container that ships it.

    Raises:
        KeyError: no container of the matrix ships ``version`` (the message lists the known ones).
    """
    version = version or default_tensorrt_llm()
    matches = [r for r in releases() if r.tensorrt_llm == version]
    if not matches:
        known = ", ".join(f"{r.triton_container}={r.tensorrt_llm}" for r in releases())
        raise KeyError(f"no Triton container of the release matrix ships TensorRT-LLM {version} (known: {known})")
    return next((r for r in matches if r.default), matches[0])


def default_release() -> Release:
    """The container of the default TensorRT-LLM version (26.04 for 1.2.1)."""
    return for_tensorrt_llm(None)


def for_container(tag: str) -> Release:
    """The matrix entry of a container tag such as ``26.04``. Raises ``KeyError`` for an unknown tag."""
    for r in releases():
        if r.triton_container == tag:
            return r
    raise KeyError(f"container {tag!r} is not in the release matrix ({', '.join(r.triton_container for r in releases())})")


# ------------------------------------------------------------------------------- inside an image
#: distributions whose installed version must equal the matrix entry of the image (name in Release → dist names)
CHECKED_DISTS = {"tensorrt_llm": ("tensorrt_llm", "tensorrt-llm"), "transformers": ("transformers",),
                 "nvidia_modelopt": ("nvidia-modelopt",), "torch": ("torch",)}


def installed_versions() -> dict[str, str | None]:
    """The installed versions of :data:`CHECKED_DISTS` in this Python (``None`` = not installed)."""
    from importlib import metadata

    out: dict[str, str | None] = {}
    for field, dists in CHECKED_DISTS.items():
        out[field] = None
        for d in dists:
            try:
                out[field] = metadata.version(d)
                break
            except metadata.PackageNotFoundError:
                continue
    return out


def image_problems(release: Release, installed: dict[str, str | None]) -> list[str]:
    """Where the packages of this Python differ from what the matrix says ``release``'s image ships."""
    out = []
    for field in CHECKED_DISTS:
        want, have = getattr(release, field), installed.get(field)
        if want is None:
            continue
        if have is None:
            out.append(f"{field}: not installed here, {release.image} ships {want}")
        elif have != want:
            out.append(f"{field}: {have} installed, {release.image} ships {want} (pipeline/data/release_matrix.yaml)")
    return out


def parse_freeze(text: str) -> dict[str, str]:
    """``{normalized name: version}`` from ``pip list --format=freeze`` output (``name==version`` lines)."""
    import re

    out = {}
    for line in text.splitlines():
        name, sep, version = line.strip().partition("==")
        if sep:
            out[re.sub(r"[-_.]+", "-", name).lower()] = version
    return out


def moved_packages(before: str, after: str) -> list[str]:
    """Packages of the image (``before``, a ``pip list --format=freeze``) that an install changed or removed."""
    b, a = parse_freeze(before), parse_freeze(after)
    return [f"{name} {version} -> {a.get(name, 'removed')}" for name, version in sorted(b.items()) if a.get(name) != version]
