"""Which TensorRT-LLM releases still have the TensorRT-engine path (trtllm-build, ``TrtLlmArgs``, the C++
``tensorrtllm`` Triton backend): the ``engine_paths`` table of ``pipeline/data/release_matrix.yaml``, whose
``sources`` cite the upstream release notes, pull requests and code where they were removed.

Kept below the recipe layer (the recipe's own validation refuses ``build.engine: tensorrt`` for a release without
it); :mod:`pipeline.trtllm.release` reads the rest of the same file.
"""

from __future__ import annotations

import functools
import re
from importlib import resources
from typing import Any

import yaml

MATRIX_RESOURCE = "data/release_matrix.yaml"


@functools.cache
def _table() -> dict[str, Any]:
    return yaml.safe_load(resources.files("pipeline").joinpath(MATRIX_RESOURCE).read_text())["engine_paths"]


def tensorrt_engine_last() -> str:
    """The last TensorRT-LLM release with the TensorRT-engine path (``1.3.0rc20``)."""
    return str(_table()["tensorrt_engine_last"])


def version_key(version: str) -> tuple[int, int, int, int, int, int]:
    """A sortable key of a TensorRT-LLM version (``1.3.0rc20`` < ``1.3.0`` < ``1.3.0.post1``; a/b/rc pre-releases).

    Raises:
        ValueError: not ``X.Y.Z`` with an optional ``aN``/``bN``/``rcN`` and ``.postN``.
    """
    m = re.fullmatch(r"(\d+)\.(\d+)\.(\d+)(?:(a|b|rc)(\d+))?(?:\.post(\d+))?", version.strip())
    if not m:
        raise ValueError(f"{version!r} is not a TensorRT-LLM version (X.Y.Z, optionally rcN / .postN)")
    stage = {"a": 0, "b": 1, "rc": 2, None: 3}[m.group(4)]
    return (int(m.group(1)), int(m.group(2)), int(m.group(3)), stage, int(m.group(5) or 0), int(m.group(6) or 0))


def has_tensorrt_engine_path(tensorrt_llm: str) -> bool:
    """Whether TensorRT-LLM ``tensorrt_llm`` still has the TensorRT-engine path and the C++ Triton backend: every
    release up to :func:`tensorrt_engine_last` does.

    Raises:
        ValueError: ``tensorrt_llm`` is not a version string.
    """
    return version_key(tensorrt_llm) <= version_key(tensorrt_engine_last())


#: ``build.engine`` → the ``engine_paths`` key of the last release with its path; an engine absent has no recorded end
_LAST_RELEASE_KEY = {"tensorrt": "tensorrt_engine_last"}


def last_release(engine: str) -> str | None:
    """The last TensorRT-LLM release that still has ``build.engine`` ``engine``'s path, as the release matrix records
    it: :func:`tensorrt_engine_last` for the TensorRT-engine path (``tensorrt``, served by the C++ ``tensorrtllm``
    backend); None for a path with no recorded end (``pytorch``, the LLM API; ``cpu``, trtpipe's own engine)."""
    key = _LAST_RELEASE_KEY.get(engine)
    return str(_table()[key]) if key else None


def engine_path_problem(engine: str, tensorrt_llm: str) -> str | None:
    """One line when ``build.engine`` ``engine`` cannot run on TensorRT-LLM ``tensorrt_llm`` (``None``: it can)."""
    if last_release(engine) is not None and not has_tensorrt_engine_path(tensorrt_llm):
        return (f"TensorRT-LLM {tensorrt_llm} has no TensorRT-engine path nor C++ Triton backend (removed after "
                f"{tensorrt_engine_last()}): use build.engine: pytorch")
    return None
