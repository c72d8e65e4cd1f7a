"""Rendering the repository's ``config.pbtxt`` templates: ``templates/<name>.pbtxt.j2`` (jinja2,
``StrictUndefined``), rendered and parsed into ``ModelConfig`` so that an unknown field or a bad enum fails
here, at generation time, not in Triton.
"""

from __future__ import annotations

import functools
from typing import Any

from pipeline.core.errors import StageError
from pipeline.triton.model_config import parse_model_config
from pipeline.triton_repo import TEMPLATES_DIR

#: text that must not survive rendering (unfilled TensorRT-LLM ``${…}`` placeholders or jinja syntax)
PLACEHOLDER_MARKERS = ("${", "{{", "{%", "{#")


@functools.cache
def _jinja_env():
    import jinja2
    from google.protobuf import text_encoding

    env = jinja2.Environment(
        loader=jinja2.FileSystemLoader(str(TEMPLATES_DIR)),
        undefined=jinja2.StrictUndefined,
        keep_trailing_newline=True,
        autoescape=False,
    )
    env.filters["pbstr"] = lambda v: text_encoding.CEscape(str(v), as_utf8=True)
    return env


def render_model_config(template: str, **context: Any):
    """Render ``templates/<template>.pbtxt.j2`` and parse it into a ``ModelConfig``.

    Raises:
        StageError: a template variable is missing, a placeholder survived, or the text is not a
            valid ``ModelConfig`` (unknown field, bad enum, …); the message names the template.
    """
    import jinja2

    try:
        text = _jinja_env().get_template(f"{template}.pbtxt.j2").render(**context)
    except jinja2.UndefinedError as e:
        raise StageError(f"triton_repo/templates/{template}.pbtxt.j2: {e}") from None
    left = [m for m in PLACEHOLDER_MARKERS if m in text]
    if left:
        raise StageError(f"triton_repo/templates/{template}.pbtxt.j2: placeholder {left[0]!r} left after rendering")
    return parse_model_config(text, f"triton_repo/templates/{template}.pbtxt.j2", StageError)
