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

from collections.abc import Callable
from pathlib import Path
from typing import Any

from pipeline.bench.results import BenchResult
from pipeline.bench.target import BenchTarget, build_recipe
from pipeline.core.layout import BuildLayout
from pipeline.recipe.bench import BenchSpec


def spec_for(recipe_file: Path | None, layout: BuildLayout | None) -> BenchSpec:
    """The ``bench`` section to start from: ``recipe_file``'s, else the build's ``recipe.yaml``, else defaults.

    Raises:
        UserError / RecipeError: ``recipe_file`` is given and does not load. A stale or unreadable
            ``recipe.yaml`` of the build is ignored (it must not block an explicit bench).
    """
    from pipeline.recipe.load import load_recipe

    if recipe_file is not None:
        return load_recipe(recipe_file).bench
    recipe = build_recipe(layout)
    return recipe.bench if recipe is not None else BenchSpec()


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
        The :class:`~pipeline.bench.results.BenchResult` (its ``run_dir`` holds bench.json, summary.csv and
        plots). Failed requests, a lost server and Ctrl-C are recorded in it; call
        :func:`pipeline.bench.results.check_outcome` to turn them into errors.

    Raises:
        UserError: unreachable server / model problems (before any load), a missing tokenizer.
    """
    from pipeline.bench.run import execute

    return execute(spec, target, on_progress=on_progress, on_status=on_status)
