"""Helpers shared by trtpipe's python-backend models (copied next to each model.py).

Parameters are parsed once, strictly: a malformed value raises :class:`ParameterError` naming the
parameter, and the model fails to load (no silent fallback to a default). Only numpy and the standard
library are imported at module level; tokenizers is imported inside :func:`load_tokenizer`.
"""

from __future__ import annotations

import os
from typing import Any, Callable

import numpy as np

_TRUE = {"true", "1", "yes"}
_FALSE = {"false", "0", "no"}


def apply_pythonpath() -> None:
    """Put ``$PYTHONPATH``'s entries first on ``sys.path``, as a normal interpreter does.

    The python backend stub (Triton 2.51) starts its embedded interpreter without applying
    PYTHONPATH (measured: the variable is set, ``sys.path`` lacks it), so a model importing trtpipe
    would get the installed copy instead of the source checkout that built the repository.
    """
    import sys

    for entry in reversed([p for p in os.environ.get("PYTHONPATH", "").split(os.pathsep) if p]):
        if entry not in sys.path:
            sys.path.insert(0, entry)


class ParameterError(ValueError):
    """A model-config parameter is missing or malformed."""


def raw_parameters(model_config: dict[str, Any]) -> dict[str, str]:
    """``{key: string_value}`` of a model config's ``parameters`` (as passed to ``initialize``)."""
    return {k: v.get("string_value", "") for k, v in model_config.get("parameters", {}).items()}


def parse_bool(name: str, raw: str) -> bool:
    """``true/false/1/0/yes/no`` (any case) → bool; anything else raises ParameterError."""
    low = raw.strip().lower()
    if low in _TRUE:
        return True
    if low in _FALSE:
        return False
    raise ParameterError(f"parameter {name}={raw!r}: expected true or false")


def parse_int(name: str, raw: str, *, minimum: int | None = None) -> int:
    """Decimal integer ≥ ``minimum``; anything else raises ParameterError."""
    try:
        value = int(raw.strip())
    except ValueError:
        raise ParameterError(f"parameter {name}={raw!r}: expected an integer") from None
    if minimum is not None and value < minimum:
        raise ParameterError(f"parameter {name}={raw!r}: must be >= {minimum}")
    return value


def get_param(params: dict[str, str], name: str, parse: Callable[[str, str], Any], default: Any = ...) -> Any:
    """Parse parameter ``name``; missing → ``default`` (or ParameterError when no default given)."""
    if name not in params or params[name] == "":
        if default is ...:
            raise ParameterError(f"parameter {name} is required")
        return default
    raw = params[name]
    if raw.startswith("${"):
        raise ParameterError(f"parameter {name}={raw!r}: unfilled template placeholder")
    return parse(name, raw)


def resolve_dir(model_dir: str, value: str) -> str:
    """An absolute directory: ``value`` as is, or relative to the model's directory."""
    path = value if os.path.isabs(value) else os.path.normpath(os.path.join(model_dir, value))
    if not os.path.isdir(path):
        raise ParameterError(f"directory {value!r} (resolved to {path}) does not exist")
    return path


def load_tokenizer(tokenizer_dir: str):
    """The directory's tokenizer (``tokenizers``, no transformers: see tokenizer.py), offline."""
    from tokenizer import load_tokenizer as load

    return load(tokenizer_dir)


def default_end_pad_ids(tokenizer: Any) -> tuple[int, int]:
    """Default end/pad ids of a request that names none: the tokenizer's (``tokenizer.py``'s one end-id rule,
    ``end_pad_ids``: generation_config.json first, then the tokenizer files), as upstream's ``SamplingParams._setup``
    takes them (pad falls back to end); -1 when unknown (never ends on a token)."""
    end = tokenizer.eos_token_id
    end = -1 if end is None else int(end)
    pad = tokenizer.pad_token_id
    return end, end if pad is None else int(pad)


def scalar(request: Any, name: str, default: Any = None) -> Any:
    """The first element of optional input ``name`` of a pb_utils request, or ``default``."""
    import triton_python_backend_utils as pb_utils

    t = pb_utils.get_input_tensor_by_name(request, name)
    if t is None:
        return default
    arr = t.as_numpy()
    return arr.reshape(-1)[0].item() if arr.size else default


def array(request: Any, name: str) -> np.ndarray | None:
    """Optional input ``name`` of a pb_utils request as a numpy array (``None`` when absent)."""
    import triton_python_backend_utils as pb_utils

    t = pb_utils.get_input_tensor_by_name(request, name)
    return None if t is None else t.as_numpy()


def text(value: Any) -> str:
    """A TYPE_STRING element (bytes or str) as str."""
    return value.decode("utf-8") if isinstance(value, (bytes, np.bytes_)) else str(value)


def word_list(tokenizer: Any, words: list[str]) -> np.ndarray:
    """TensorRT-LLM's ``[2, L]`` stop/bad-words format: row 0 = concatenated ids (0-padded),
    row 1 = end offset of each word (-1-padded). No words → ``[[0], [-1]]``."""
    ids: list[int] = []
    offsets: list[int] = []
    for w in words:
        if not w:
            continue
        ids.extend(tokenizer.encode(w, add_special_tokens=False))
        offsets.append(len(ids))
    width = max(len(ids), len(offsets), 1)
    out = np.zeros((2, width), dtype=np.int32)
    out[1, :] = -1
    out[0, : len(ids)] = ids
    out[1, : len(offsets)] = offsets
    return out


def parse_word_list(arr: np.ndarray | None) -> list[list[int]]:
    """Inverse of :func:`word_list` for one request (``[2, L]`` or ``[1, 2, L]``) → list of id sequences."""
    if arr is None:
        return []
    arr = np.asarray(arr).reshape(2, -1)
    words, start = [], 0
    for end in arr[1]:
        if end < 0:
            break
        words.append([int(t) for t in arr[0, start:end]])
        start = int(end)
    return [w for w in words if w]
