"""Triton ``config.pbtxt`` files as typed ``ModelConfig`` messages (tritonclient's ``model_config_pb2``).

Templates are data: ``triton_repo/templates/<name>.pbtxt.j2`` (jinja2, ``StrictUndefined``), rendered and
then parsed into ``ModelConfig`` so that an unknown field or a bad enum fails here, at generation time,
not in Triton; files are written back with protobuf ``text_format``. ``triton_repo/layouts.yaml`` says
which models each engine kind's repository holds.
"""

from __future__ import annotations

import functools
from pathlib import Path
from typing import Any

import yaml

from pipeline.errors import StageError, UserError

#: text that must not survive rendering (unfilled TensorRT-LLM ``${…}`` placeholders or jinja syntax)
PLACEHOLDER_MARKERS = ("${", "{{", "{%", "{#")


@functools.cache
def package_dir() -> Path:
    """Directory of the ``triton_repo`` package (works for an editable install made before it had an
    ``__init__.py``, where it imports as a namespace package)."""
    import triton_repo

    return Path(next(iter(triton_repo.__path__))).resolve()


@functools.cache
def layouts() -> dict[str, Any]:
    """The parsed ``triton_repo/layouts.yaml`` (models per engine kind and fixed values)."""
    return yaml.safe_load((package_dir() / "layouts.yaml").read_text())


@functools.cache
def _jinja_env():
    import jinja2
    from google.protobuf import text_encoding

    env = jinja2.Environment(
        loader=jinja2.FileSystemLoader(str(package_dir() / "templates")),
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


def write_model_config(path: Path, cfg) -> None:
    """Write ``cfg`` as protobuf text to ``path`` (``config.pbtxt``)."""
    from google.protobuf import text_format

    Path(path).write_text(text_format.MessageToString(cfg, as_utf8=True))


def load_model_config(path: str | Path):
    """Parse a ``config.pbtxt`` (or a model dir containing one) into ``tritonclient``'s ``ModelConfig``.

    Raises:
        UserError: the file is missing or is not a valid ``ModelConfig``.
    """
    path = Path(path)
    if path.is_dir():
        path = path / "config.pbtxt"
    try:
        text = path.read_text()
    except OSError as e:
        raise UserError(f"{path}: cannot read model config ({e.strerror})") from None
    return parse_model_config(text, str(path), UserError)


def parse_model_config(text: str, where: str, error: type[Exception]):
    """``text`` (protobuf text format) as a ``ModelConfig``; an unknown field or bad enum raises ``error``
    with one line naming ``where``."""
    from google.protobuf import text_format
    from tritonclient.grpc import model_config_pb2

    cfg = model_config_pb2.ModelConfig()
    try:
        text_format.Parse(text, cfg)
    except text_format.ParseError as e:
        raise error(f"{where}: not a valid ModelConfig, the Triton model config ({e})") from None
    return cfg
