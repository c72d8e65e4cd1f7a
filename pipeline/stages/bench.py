"""Bench stage: load a running deployment at exact ISL/OSL and measure it.

The recipe's ``bench`` section (:class:`~pipeline.recipe.bench.BenchSpec`) is the bench's only schema: the
CLI's flags are validated overrides of it (:func:`with_overrides`). What is not a recipe knob — where the
server is, which build it serves, where results go — is a :class:`BenchTarget`::

    spec = bench.spec_for(recipe_file=None, layout=BuildLayout(build_dir))        # the build's recipe, or defaults
    spec = bench.with_overrides(spec, {"concurrency": [1, 4]})
    result = bench.run(spec, BenchTarget(url=handle.grpc_url, layout=handle.layout))

The load generator, client and metrics are :mod:`pipeline.bench`; :func:`run` wires them to a target.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from pathlib import Path
from typing import Any

from pipeline.bench.run import BenchResult, execute
from pipeline.errors import UserError
from pipeline.layout import BuildLayout
from pipeline.recipe.bench import BenchSpec


@dataclasses.dataclass(frozen=True)
class BenchTarget:
    """Where and what to bench (run-time facts, not recipe knobs).

    ``url`` is Triton's gRPC ``host:port`` (``None``: the default of ``api``, :data:`pipeline.bench.apis.DEFAULT_URLS`);
    ``api`` the protocol (``grpc`` | ``triton-http`` | ``openai``, :mod:`pipeline.bench.apis`), ``openai_endpoint``
    ``completions`` | ``chat`` and ``served_model`` the OpenAI model name (default: the server's only one); ``layout`` the build the server runs (its tokenizer and
    manifests go into the results' provenance); ``tokenizer`` overrides the build's tokenizer directory;
    ``out`` is the run directory (default ``artifacts/bench/<YYYYmmdd-HHMMSS>``); ``metrics_url`` Triton's
    Prometheus endpoint (default ``http://<host of url>:8002/metrics`` when it answers).
    """

    url: str | None = "localhost:8001"
    api: str = "grpc"
    openai_endpoint: str = "completions"
    served_model: str | None = None
    layout: BuildLayout | None = None
    tokenizer: Path | None = None
    out: Path | None = None
    metrics_url: str | None = None

    def tokenizer_dir(self) -> Path | None:
        """``tokenizer``, else the build's (:meth:`BuildLayout.tokenizer_dir`), else ``None``.

        Raises:
            UserError: ``tokenizer`` is given but is not a directory.
        """
        if self.tokenizer is not None:
            if not Path(self.tokenizer).is_dir():
                raise UserError(f"--tokenizer {self.tokenizer}: no such directory")
            return Path(self.tokenizer)
        return self.layout.tokenizer_dir() if self.layout is not None else None


def spec_for(recipe_file: Path | None, layout: BuildLayout | None) -> BenchSpec:
    """The ``bench`` section to start from: ``recipe_file``'s, else the build's ``recipe.yaml``, else defaults.

    Raises:
        UserError / RecipeError: ``recipe_file`` is given and does not load. A stale or unreadable
            ``recipe.yaml`` of the build is ignored (it must not block an explicit bench).
    """
    from pipeline.errors import TrtpipeError
    from pipeline.recipe.load import load_recipe

    if recipe_file is not None:
        return load_recipe(recipe_file).bench
    if layout is not None and layout.recipe_file.is_file():
        try:
            return load_recipe(layout.recipe_file).bench
        except TrtpipeError:
            pass
    return BenchSpec()


def with_overrides(spec: BenchSpec, overrides: dict[str, Any], flags: dict[str, str] | None = None) -> BenchSpec:
    """``spec`` with ``overrides`` (field name → value; ``None`` values are skipped), re-validated as a whole.

    Args:
        spec: the starting section.
        overrides: new values by :class:`BenchSpec` field name.
        flags: field name → the CLI flag that set it, so an error names what the user typed.

    Raises:
        UserError: a value that :class:`BenchSpec` rejects (one line naming the flag or field).
    """
    from pipeline.recipe.load import override_section

    return override_section(spec, overrides, section="bench", flags=flags)


def run(
    spec: BenchSpec,
    target: BenchTarget,
    *,
    on_progress: Callable[[str, int], Callable[[int], None]] | None = None,
    on_status: Callable[[str], None] | None = None,
) -> BenchResult:
    """Benchmark the deployment at ``target`` as ``spec`` says and write the run directory.

    Args:
        spec: scenarios (ISL/OSL), load points, request counts, SLOs.
        target: server URL, build, tokenizer, output directory.
        on_progress: ``(description, total) -> advance(n)`` for a progress display.
        on_status: receives one-line status messages.

    Returns:
        The :class:`~pipeline.bench.run.BenchResult` (its ``run_dir`` holds bench.json, summary.csv and
        plots). Failed requests, a lost server and Ctrl-C are recorded in it; call
        :func:`pipeline.bench.run.check_outcome` to turn them into errors.

    Raises:
        UserError: unreachable server / model problems (before any load), a missing tokenizer.
    """
    return execute(spec, url=target.url, tokenizer=target.tokenizer_dir(), out=target.out, layout=target.layout,
                   metrics_url=target.metrics_url, on_progress=on_progress, on_status=on_status, api=target.api,
                   openai_endpoint=target.openai_endpoint, served_model=target.served_model)
