"""Triton ``config.pbtxt`` files as typed ``ModelConfig`` messages (tritonclient's ``model_config_pb2``).

Templates are data: ``triton_repo/templates/<name>.pbtxt.j2`` (jinja2, ``StrictUndefined``), rendered and
then parsed into ``ModelConfig`` so that an unknown field or a bad enum fails here, at generation time,
not in Triton; files are written back with protobuf ``text_format``. ``triton_repo/layouts.yaml`` says
which models each engine kind's repository holds.
"""

from __future__ import annotations

from pathlib import Path

from pipeline.core.errors import UserError


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
