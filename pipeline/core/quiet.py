"""Keep third-party chatter (transformers/ModelOpt prints, progress bars, UserWarnings) off the
console during a stage, and hand it back so the stage can record it in its manifest."""

from __future__ import annotations

import contextlib
import io
import os
import warnings
from collections.abc import Iterator

#: python loggers of libraries that log routine notes at WARNING level (e.g. ModelOpt's tied-weight export note)
QUIET_LOGGERS = ("modelopt",)


def debug_enabled() -> bool:
    """``TRTPIPE_DEBUG`` is set (and not 0): show library output and tracebacks."""
    return os.environ.get("TRTPIPE_DEBUG", "") not in ("", "0")


def disable_tqdm() -> None:
    """Turn off tqdm bars (transformers' GGUF conversion uses tqdm directly). tqdm reads
    ``TQDM_DISABLE`` when it is imported, so call this at CLI start, before heavy imports."""
    if not debug_enabled():
        os.environ.setdefault("TQDM_DISABLE", "1")


@contextlib.contextmanager
def quiet_libraries() -> Iterator[list[str]]:
    """Silence library output for the duration; yields a list that, on exit, holds the distinct
    warning messages and printed lines (at most 50, in order) for the manifest.

    Our own progress bars and messages go to stderr through rich and are not affected. Set
    ``TRTPIPE_DEBUG=1`` to let everything through.
    """
    log: list[str] = []
    if debug_enabled():
        yield log
        return
    try:
        from transformers.utils import logging as hf_logging
    except ImportError:  # pragma: no cover - transformers is a dependency
        hf_logging = None
    import logging

    verbosity = hf_logging.get_verbosity() if hf_logging else None
    other = {name: logging.getLogger(name).level for name in QUIET_LOGGERS}
    for name in other:
        logging.getLogger(name).setLevel(logging.ERROR)
    if hf_logging:
        hf_logging.set_verbosity_error()
        hf_logging.disable_progress_bar()
    printed = io.StringIO()
    try:
        with warnings.catch_warnings(record=True) as caught, contextlib.redirect_stdout(printed):
            warnings.simplefilter("always")
            yield log
    finally:
        if hf_logging:
            hf_logging.set_verbosity(verbosity)
            hf_logging.enable_progress_bar()
        for name, level in other.items():
            logging.getLogger(name).setLevel(level)
        lines = [f"{w.category.__name__}: {str(w.message).splitlines()[0]}" for w in caught]
        lines += [ln.strip() for ln in printed.getvalue().splitlines() if ln.strip()]
        log.extend(list(dict.fromkeys(lines))[:50])
