"""Where and what to bench: :class:`BenchTarget` (run-time facts, not recipe knobs) and the served build's recipe."""

from __future__ import annotations

import dataclasses
import functools
from pathlib import Path
from typing import TYPE_CHECKING, Any

from pipeline.core.errors import UserError
from pipeline.core.layout import BuildLayout
from pipeline.recipe.bench import Flag

if TYPE_CHECKING:
    from pipeline.recipe.schema import Recipe


def _flag(name: str, help: str, kind: Any = str, shows_default: bool = False) -> dict[str, Flag]:
    return {"flag": Flag(name, help, kind, shows_default=shows_default)}


@dataclasses.dataclass(frozen=True)
class BenchTarget:
    """Where and what to bench (run-time facts, not recipe knobs); a field with a flag is a ``trtpipe bench`` option.

    ``url`` is Triton's gRPC ``host:port`` (``None``: the default of ``api``, :data:`pipeline.bench.apis.DEFAULT_URLS`);
    ``api`` the protocol (``grpc`` | ``triton-http`` | ``openai``, :mod:`pipeline.bench.apis`), ``openai_endpoint``
    ``completions`` | ``chat`` and ``served_model`` the OpenAI model name (default: the server's only one); ``layout`` the build the server runs (its tokenizer and
    manifests go into the results' provenance); ``tokenizer`` overrides the build's tokenizer directory;
    ``out`` is the run directory (default ``artifacts/bench/<YYYYmmdd-HHMMSS>``); ``metrics_url`` Triton's
    Prometheus endpoint (default ``http://<host of url>:8002/metrics`` when it answers).
    """

    url: str | None = dataclasses.field(default="localhost:8001", metadata=_flag("--url", (
        "Server endpoint: grpc host:port (default localhost:8001); triton-http http://host:port (default :8000); openai "
        "http://host:port/v1 (default :8000/v1).")))
    api: str = dataclasses.field(default="grpc", metadata=_flag("--api", (
        "grpc (Triton ModelStreamInfer) | triton-http (Triton generate_stream, SSE) | openai (any OpenAI-compatible "
        "server: vLLM, TGI, trtllm-serve, Triton's OpenAI frontend)."), shows_default=True))
    openai_endpoint: str | None = dataclasses.field(default=None, metadata=_flag("--openai-endpoint", (
        "With --api openai: completions (exact-ISL prompt text; the default for text) | chat (chat/completions; the "
        "chat template adds tokens, ISL = the server's prompt_tokens; the default with --image-*, as /v1/completions "
        "takes no images).")))
    served_model: str | None = None
    server_pid: int | None = None  # the server's pid for process telemetry (tune knows it; else found by URL)
    layout: BuildLayout | None = None
    tokenizer: Path | None = dataclasses.field(default=None, metadata=_flag(
        "--tokenizer", "HF tokenizer dir (default: the last build's).", Path))
    out: Path | None = dataclasses.field(default=None, metadata=_flag(
        "--out", "Run directory (default artifacts/bench/<YYYYmmdd-HHMMSS>).", Path))
    metrics_url: str | None = dataclasses.field(default=None, metadata=_flag("--metrics-url", (
        "Triton's Prometheus endpoint (default http://<--url host>:8002/metrics when it answers); queue/compute deltas "
        "per load point.")))

    def __post_init__(self) -> None:
        if self.openai_endpoint is None:  # a target built without the CLI (tune): text prompts
            object.__setattr__(self, "openai_endpoint", "completions")

    def tokenizer_dir(self) -> Path | None:
        """``tokenizer``, else the build's (:func:`build_tokenizer`), else ``None``.

        Raises:
            UserError: ``tokenizer`` is given but is not a directory.
        """
        if self.tokenizer is not None:
            if not Path(self.tokenizer).is_dir():
                raise UserError(f"--tokenizer {self.tokenizer}: no such directory")
            return Path(self.tokenizer)
        return build_tokenizer(self.layout)


def build_tokenizer(layout: BuildLayout | None) -> Path | None:
    """The tokenizer a client of the build should use (:func:`pipeline.triton_repo.client_tokenizer_dir`), or ``None``."""
    if layout is None:
        return None
    from pipeline.triton_repo import client_tokenizer_dir

    return client_tokenizer_dir(layout)


def build_recipe(layout: BuildLayout | None) -> Recipe | None:
    """The build's ``recipe.yaml``, parsed once per file version (the spec and the GPU count of a run both read it);
    ``None`` without a build or when it does not load (a stale or unreadable one must not block an explicit bench)."""
    if layout is None or not layout.recipe_file.is_file():
        return None
    st = layout.recipe_file.stat()
    return _load_build_recipe(str(layout.recipe_file.resolve()), st.st_mtime_ns, st.st_size)


@functools.lru_cache(maxsize=4)
def _load_build_recipe(path: str, mtime_ns: int, size: int) -> Recipe | None:
    from pipeline.core.errors import TrtpipeError
    from pipeline.recipe.load import load_recipe

    try:
        return load_recipe(Path(path))
    except TrtpipeError:
        return None


def build_gpus(layout: BuildLayout | None) -> int | None:
    """GPUs one model instance of the build uses: ``target.tp_size × target.pp_size`` of its recipe.yaml;
    ``None`` without a build or a readable recipe (tok/s per GPU is then not reported)."""
    recipe = build_recipe(layout)
    return None if recipe is None else recipe.target.tp_size * recipe.target.pp_size


def detached_trtllm_serve_build(api: str, url: str | None) -> BuildLayout | None:
    """With ``--api openai``: the build that a detached ``trtpipe serve --detach`` trtllm-serve server (the real one or
    trtpipe's CPU stand-in) serves at ``url`` (``None``: the OpenAI default URL), so that the bench takes its bench
    section, tokenizer and provenance as it does for a detached Triton; ``None`` for any other API, URL or server."""
    if api != "openai":
        return None
    from pipeline.bench.apis import DEFAULT_URLS
    from pipeline.serve.registry import TRTLLM_SERVE, detached_build

    build = detached_build(url or DEFAULT_URLS["openai"], frontend=TRTLLM_SERVE)
    return BuildLayout(build) if build is not None else None
