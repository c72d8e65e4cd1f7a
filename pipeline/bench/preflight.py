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


def preflight(spec: BenchSpec, *, url: str | None, api: str = "grpc", openai_endpoint: str = "completions",
              served_model: str | None = None, tokenizer: Path | None = None, metrics_url: str | None = None,
              metrics: bool = True, status: Callable[[str], None] = lambda s: None) -> Preflight:
    """Check the server and model before any load (one line per finding on ``status``).

    Args:
        spec: the bench section; ``spec.model`` is the Triton model (``served_model`` for ``api="openai"``).
        url: server URL (``None``: the default of ``api``); api / openai_endpoint: see :class:`~pipeline.bench.apis.Api`.
        tokenizer: the tokenizer directory that will be used (some interfaces cannot run without one).
        metrics_url: Triton's Prometheus endpoint; default ``http://<host>:8002/metrics`` when it answers (Triton
            targets only). An explicit endpoint that does not answer is a note, not an error.
        metrics: ``False``: no Prometheus endpoint at all (the soak does not scrape).

    Raises:
        UserError: unreachable server, unknown/not-ready model, a text or LLM-API model without a tokenizer.
    """
    from pipeline.bench.server_metrics import probe

    proto = Api.make(api, url, openai_endpoint)
    info = proto.preflight(served_model if proto.name == "openai" else spec.model)
    if proto.name == "openai":
        spec = spec.model_copy(update={"model": info.name})
        status(f"{info.name} at {proto.url}: OpenAI /{info.config['endpoint']}, streaming")
    else:
        status(f"{info.name} on {proto.url}: {info.interface} interface, Triton {info.server.get('version', '?')} ({api})")
    _needs_tokenizer(spec, info, tokenizer)
    notes = _osl_caveats(proto, info)
    for note in notes:
        status(f"warning: {note}")
    wanted = metrics and (proto.is_triton or bool(metrics_url))
    scraped, why = probe(metrics_url, proto.url) if wanted else (None, None)
    if why and metrics_url:  # the default endpoint not answering is normal (another port, or no metrics): silent
        notes.append(why)
        status(f"note: {why}")
    return Preflight(proto, info, spec, scraped, notes)
