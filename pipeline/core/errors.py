"""Error hierarchy mapped to process exit codes by :mod:`pipeline.cli`.

A :class:`UserError` is a mistake in what the user gave us (recipe, path, flag, unreachable
server): the CLI prints its message as one line, with no traceback, and exits 2. Any other
:class:`TrtpipeError` is a failure of a stage that ran (exit 1). Nothing else should be raised
on purpose for a user-facing condition.
"""

from __future__ import annotations


class TrtpipeError(Exception):
    """A failure that the CLI reports as one line; ``exit_code`` is the process exit status."""

    exit_code: int = 1


class UserError(TrtpipeError):
    """Bad input: recipe, path, flag or an unreachable server. Exit code 2."""

    exit_code = 2


class RecipeError(UserError):
    """A recipe that does not validate. The message names file, line and field path."""


class StageError(TrtpipeError):
    """A stage that started but failed (tool crashed, export failed, server died). Exit code 1."""


class MissingToolError(TrtpipeError):
    """A GPU-only tool (``trtllm-build``, ``tensorrt_llm``) is absent on this machine. Exit code 3.

    Raised after everything that can be produced without the tool has been written (e.g. the
    exact ``trtllm-build`` command and ``build_config.json``).
    """

    exit_code = 3


class IncompatibleArtifactError(TrtpipeError):
    """An artifact does not match the runtime (stale engine, other TensorRT-LLM, other GPU). Exit 4."""

    exit_code = 4
