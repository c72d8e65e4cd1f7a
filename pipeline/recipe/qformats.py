"""Which qformat / KV-cache dtype runs on which GPU architecture and serving path, and its accuracy risk.

The rules live in ONE data file, ``pipeline/data/qformat_rules.yaml`` (each one cited to TensorRT-LLM's or ModelOpt's
support matrix there). The recipe validator reads :func:`needs` (the tensor cores a format needs:
:func:`pipeline.recipe.derived.format_problems`), ``trtpipe recipe new`` reads :func:`engine_archs` (what it
searches) and :func:`accuracy` (what it states). This module imports nothing of trtpipe but the package's data.
"""

from __future__ import annotations

import functools
from importlib import resources
from typing import Any

import yaml

RULES_FILE = "data/qformat_rules.yaml"


@functools.cache
def rules() -> dict[str, Any]:
    """The parsed ``qformat_rules.yaml`` (``sources``, ``qformats``, ``kv_cache``, ``risk_order``)."""
    return yaml.safe_load(resources.files("pipeline").joinpath(RULES_FILE).read_text())


def _entry(kind: str, name: str) -> dict[str, Any]:
    table = rules()["qformats" if kind == "qformat" else "kv_cache"]
    if name not in table:
        raise KeyError(f"{kind} {name!r} has no rule in {RULES_FILE}")
    return table[name]


def needs(qformat: str) -> str | None:
    """Tensor cores ``qformat`` needs: ``"fp8"`` (Ada, Hopper, Blackwell), ``"fp4"`` (Blackwell) or None.
    Raises KeyError for a qformat without a rule."""
    return _entry("qformat", qformat)["needs"]


def kv_needs(kv_cache_dtype: str) -> str | None:
    """Tensor cores a KV-cache dtype needs (``"fp8"`` or None). Raises KeyError for one without a rule."""
    return _entry("kv", kv_cache_dtype)["needs"]


def qformats_needing(feature: str) -> frozenset[str]:
    """The qformats whose GEMMs need ``feature`` tensor cores (``"fp8"`` or ``"fp4"``)."""
    return frozenset(q for q, r in rules()["qformats"].items() if r["needs"] == feature)


def engine_archs(kind: str, name: str, engine: str) -> tuple[str, ...]:
    """GPU architectures (gpus.yaml ``arch``; ``cpu`` for the CPU engine) the support matrix lists ``name`` for on
    serving path ``engine`` (``tensorrt`` | ``pytorch`` | ``cpu``); ``kind`` is ``qformat`` or ``kv``. Empty: never."""
    rule = _entry(kind, name)["engines"].get(engine)
    return tuple(rule["archs"]) if rule else ()


def unsupported(kind: str, name: str, engine: str, arch: str) -> str | None:
    """Why ``name`` is not searched on ``engine`` × ``arch`` (one sentence citing the matrix), or None when it is."""
    rule = _entry(kind, name)["engines"].get(engine)
    if rule and arch in rule["archs"]:
        return None
    src = rule["source"] if rule else "cpu_engine"
    listed = ", ".join(rule["archs"]) if rule and rule["archs"] else "no architecture"
    return f"{kind} {name} on the {engine} path: listed for {listed} ({src}), not {arch}"


def searched(kind: str, engine: str, arch: str) -> list[str]:
    """Every qformat (``kind`` ``qformat``) or KV dtype (``kv``) listed for ``engine`` × ``arch``, in file order."""
    table = rules()["qformats" if kind == "qformat" else "kv_cache"]
    return [n for n in table if unsupported(kind, n, engine, arch) is None]


def accuracy(qformat: str) -> tuple[str, str]:
    """``(risk, source)`` of ``qformat``: risk one of ``risk_order`` (none … medium); source the citation text."""
    acc = _entry("qformat", qformat)["accuracy"]
    src = acc["source"]
    return acc["risk"], rules()["sources"].get(src, src)


def risk_rank(qformat: str) -> int:
    """Position of ``qformat``'s accuracy risk in ``risk_order`` (0 = none): the order a tie is broken in."""
    return rules()["risk_order"].index(accuracy(qformat)[0])


def source(key: str) -> str:
    """The citation text of source ``key`` (e.g. ``trt_matrix``)."""
    return rules()["sources"][key]
