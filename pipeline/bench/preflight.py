"""Before any load: reach the server, find the model, apply the interface rules, probe Triton's metrics.

:func:`preflight` is the first step of a benchmark (:func:`pipeline.bench.run.execute`): everything here fails fast
with one :class:`~pipeline.core.errors.UserError` (exit 2) and nothing is written. What it learns is a
:class:`Preflight`: the protocol, the model's interface (:class:`~pipeline.bench.client.ModelInfo`), the spec with the
served model's name, the Prometheus endpoint that answered, and the notes to record in bench.json.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from pathlib import Path
from typing import Any

from pipeline.bench.apis import Api
from pipeline.core.errors import UserError
from pipeline.core.layout import BuildLayout
from pipeline.recipe.bench import BenchSpec


@dataclasses.dataclass(frozen=True)
class Preflight:
    """What the checks found: ``api`` (URL normalized), the model ``info``, the ``spec`` to run (its ``model`` is the
    served name for OpenAI servers), ``metrics_url`` (``None``: no scrape) and ``notes`` (caveats of this run)."""

    api: Api
    info: Any
    spec: BenchSpec
    metrics_url: str | None
    notes: list[str]
    images: Any = None  # the images.ImagePlan of an image workload


def _needs_tokenizer(spec: BenchSpec, info: Any, tokenizer: Path | None) -> None:
    """Raise when the interface needs the model's tokenizer and there is none (LLM-API output, exact-ISL text)."""
    if tokenizer is not None:
        return
    if info.interface == "llmapi":
        raise UserError(
            f"model {info.name!r} (LLM-API) returns text without token counts: counting output tokens needs its "
            "tokenizer — pass --tokenizer DIR (no tokenizer found in the last build)"
        )
    if info.interface in ("text", "openai", "openai-chat") and spec.dataset is None:
        raise UserError(
            f"model {info.name!r} takes text: exact-ISL prompts need its tokenizer — pass --tokenizer DIR "
            "(no tokenizer found in the last build)"
        )


def _osl_caveats(api: Api, info: Any) -> list[str]:
    """Why OSL may not be exact on this interface (each becomes a note and a warning line)."""
    from pipeline.bench.client import LLMAPI_OSL_WARNING

    notes = []
    if info.interface == "llmapi" and "sampling_param_min_tokens" not in info.inputs:  # upstream's llmapi model
        notes.append(LLMAPI_OSL_WARNING)
    if api.name == "openai" and "min_tokens" not in info.inputs:
        notes.append("the server rejected min_tokens/ignore_eos: OSL is only max_tokens, requests may stop short at EOS")
    return notes


@dataclasses.dataclass(frozen=True)
class BuildLimits:
    """The sequence limits of the build a server runs (tokens): ``max_input_len`` (longest prompt), ``max_seq_len``
    (prompt + output) and ``source`` (the file they were read from, named in a refusal)."""

    max_input_len: int | None
    max_seq_len: int | None
    source: str


def build_limits(layout: BuildLayout | None) -> BuildLimits | None:
    """The limits of the build at ``layout``: ``max_seq_len`` from its engine manifest (every engine kind records the
    resolved value), ``max_input_len`` from the manifest's ``engine_config`` (CPU engine), else the build's
    ``recipe.yaml`` (``build.max_input_len``: trtllm-build's ``--max_input_len`` / the LLM-API's). ``None`` without
    a build or an engine manifest (nothing to check against)."""
    from pipeline.bench.target import build_recipe
    from pipeline.core.artifacts import read_manifest

    if layout is None:
        return None
    manifest = read_manifest(layout.engine)
    if not manifest:
        return None
    seq = manifest.get("max_seq_len")
    inp = (manifest.get("engine_config") or {}).get("max_input_len")
    if inp is None and (recipe := build_recipe(layout)) is not None:
        inp = recipe.build.max_input_len
    return BuildLimits(int(inp) if inp is not None else None, int(seq) if seq is not None else None,
                       str(layout.engine / "manifest.json"))


def check_lengths(spec: BenchSpec, limits: BuildLimits | None) -> None:
    """Refuse, before any request, a scenario the served build cannot run (every request would fail).

    Raises:
        UserError: one line naming the scenario, the build's limit (and where it was read) and the fix: an ISL over
            ``max_input_len``, or ISL + OSL over ``max_seq_len``.
    """
    if limits is None:
        return
    for s in spec.scenarios:
        if limits.max_input_len is not None and s.isl > limits.max_input_len:
            raise UserError(
                f"ISL {s.isl} exceeds the served build's max_input_len {limits.max_input_len} ({limits.source}): every "
                f"request would fail — lower --isl to ≤ {limits.max_input_len}, or rebuild with --set "
                f"build.max_input_len={s.isl} (and build.max_seq_len ≥ {s.isl + s.osl})")
        if limits.max_seq_len is not None and s.isl + s.osl > limits.max_seq_len:
            fits = limits.max_seq_len - s.isl
            lower = f"lower --osl to ≤ {fits}, or " if fits >= 1 else ""
            raise UserError(
                f"ISL {s.isl} + OSL {s.osl} = {s.isl + s.osl} tokens exceeds the served build's max_seq_len "
                f"{limits.max_seq_len} ({limits.source}): every request would fail — {lower}rebuild with --set "
                f"build.max_seq_len={s.isl + s.osl} (and kv_cache_config.max_tokens to match)")


def preflight(spec: BenchSpec, *, url: str | None, api: str = "grpc", openai_endpoint: str = "completions",
              served_model: str | None = None, tokenizer: Path | None = None, metrics_url: str | None = None,
              metrics: bool = True, layout: BuildLayout | None = None, status: Callable[[str], None] = lambda s: None) -> Preflight:
    """Check the server and model before any load (one line per finding on ``status``).

    Args:
        spec: the bench section; ``spec.model`` is the Triton model (``served_model`` for ``api="openai"``).
        url: server URL (``None``: the default of ``api``); api / openai_endpoint: see :class:`~pipeline.bench.apis.Api`.
        tokenizer: the tokenizer directory that will be used (some interfaces cannot run without one).
        metrics_url: Triton's Prometheus endpoint; default ``http://<host>:8002/metrics`` when it answers (Triton
            targets only). An explicit endpoint that does not answer is a note, not an error.
        metrics: ``False``: no Prometheus endpoint at all (the soak does not scrape).
        layout: the build the server runs; its sequence limits are checked before the server is asked anything
            (:func:`check_lengths`).

    Raises:
        UserError: image options the build cannot take (:func:`pipeline.bench.images.check_build`, before the server
            is asked anything) or the model's interface cannot (:func:`pipeline.bench.images.plan`), a scenario the
            build cannot run, unreachable server, unknown/not-ready model, a text or LLM-API
            model without a tokenizer.
    """
    from pipeline.bench import images
    from pipeline.bench.server_metrics import probe
    from pipeline.bench.target import build_recipe

    proto = Api.make(api, url, openai_endpoint)
    checked = images.check_build(spec, build_recipe(layout), tokenizer)  # image options vs the build, before the server
    if layout is not None and (not proto.is_triton or (layout.triton_repo / spec.model).is_dir()):
        check_lengths(spec, build_limits(layout))  # (a Triton model not in the build's repository: not its limits)
    info = proto.preflight(served_model if proto.name == "openai" else spec.model)
    if proto.name == "openai":
        spec = spec.model_copy(update={"model": info.name})
        status(f"{info.name} at {proto.url}: OpenAI /{info.config['endpoint']}, streaming")
    else:
        status(f"{info.name} on {proto.url}: {info.interface} interface, Triton {info.server.get('version', '?')} ({api})")
    _needs_tokenizer(spec, info, tokenizer)
    image_plan = images.plan(checked, info, proto.name, tokenizer)
    notes = _osl_caveats(proto, info)
    for note in notes:
        status(f"warning: {note}")
    wanted = metrics and (proto.is_triton or bool(metrics_url))
    scraped, why = probe(metrics_url, proto.url) if wanted else (None, None)
    if why and metrics_url:  # the default endpoint not answering is normal (another port, or no metrics): silent
        notes.append(why)
        status(f"note: {why}")
    return Preflight(proto, info, spec, scraped, notes, image_plan)
