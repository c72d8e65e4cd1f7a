"""Calibration text sources: each turns ``calibration.dataset`` into an ordered stream of records.

A *record* is one unit of text in source order: a paragraph (.txt, embedded corpus), a JSON
line's field (.jsonl), a row (.parquet, HF ``datasets``). :mod:`calib.sampling` packs
consecutive records into samples of ``max_seq_length`` tokens.
"""

from __future__ import annotations

import dataclasses
import gzip
import json
import re
from collections.abc import Iterable, Iterator
from importlib import resources
from pathlib import Path

from pipeline.core import artifacts
from pipeline.core.errors import UserError
from pipeline.core.recipe_paths import recipe_path

EMBEDDED = "embedded"
#: Shipped text files in calib/data (source and licence in calib/README.md).
SHIPPED_FILES = ("shakespeare.txt.gz",)
#: HF ``datasets`` known by short name: (path, config name, text field). Copied from ModelOpt 0.47
#: ``modelopt/torch/utils/dataset_utils.py`` SUPPORTED_DATASET_CONFIG (cnn_dailymail is also
#: TensorRT-LLM quantize.py's default ``--calib_dataset``, field ``article``).
HF_DATASETS: dict[str, tuple[str, str | None, str]] = {
    "cnn_dailymail": ("abisee/cnn_dailymail", "3.0.0", "article"),
    "pile": ("monology/pile-uncopyrighted", None, "text"),
    "wikitext": ("Salesforce/wikitext", "wikitext-103-v1", "text"),
    "c4": ("allenai/c4", "en", "text"),
}
_PARAGRAPH = re.compile(r"\n[ \t]*\n+")


@dataclasses.dataclass
class RecordSource:
    """An ordered stream of text records and where it came from.

    Attributes:
        name: the ``calibration.dataset`` spelling.
        records: the records in source order (a list for finite local sources, an iterator for HF).
        finite: whether ``records`` is a complete list (samples are then shuffled over all of it).
        content_hash: hex sha256 identifying the text (file bytes, corpus text, or the HF id).
        description: one line for manifests and logs.
    """

    name: str
    records: Iterable[str]
    finite: bool
    content_hash: str
    description: str


def paragraphs(text: str) -> list[str]:
    """Split ``text`` on blank lines into stripped, non-empty paragraphs (order kept)."""
    return [p.strip() for p in _PARAGRAPH.split(text) if p.strip()]


def open_source(dataset: str, *, text_field: str | None, base_dir: Path, seed: int) -> RecordSource:
    """Resolve ``calibration.dataset`` into a :class:`RecordSource`.

    Args:
        dataset: ``embedded``, a local ``.txt``/``.jsonl``/``.parquet`` path (relative to
            ``base_dir``), a HF ``datasets`` name (short names in :data:`HF_DATASETS`), or a local
            dataset directory for ``datasets`` (a basename like ``cnn_dailymail`` selects its field).
        text_field: JSON key / column holding the text (default ``text``; ``article`` for
            cnn_dailymail).
        base_dir: the recipe's directory.
        seed: shuffles HF streams (local sources are shuffled later, by :mod:`calib.sampling`).

    Raises:
        UserError: a missing file, a record without the text field, a missing optional extra
            (pyarrow, datasets), or an unreachable HF dataset.
    """
    if dataset == EMBEDDED:
        return embedded_source()
    path = recipe_path(dataset, base_dir)  # the one rule for a path a recipe names
    suffix = path.suffix.lower()
    if path.is_dir():  # a dataset saved/cloned locally (as quantize.py --calib_dataset DIR): HF `datasets` reads it
        return _hf(str(path), text_field, seed, known=path.name)
    if suffix in (".txt", ".jsonl", ".parquet") or path.exists():
        if not path.is_file():
            raise UserError(f"quantization.calibration.dataset {dataset!r}: no such file ({path})")
        if suffix == ".txt":
            return RecordSource(dataset, paragraphs(path.read_text(errors="replace")), True,
                                artifacts.sha256_file(path), f"{path.name} (paragraphs)")
        if suffix == ".jsonl":
            return _jsonl(path, dataset, text_field or "text")
        if suffix == ".parquet":
            return _parquet(path, dataset, text_field or "text")
        raise UserError(f"quantization.calibration.dataset {dataset!r}: expected a .txt, .jsonl or .parquet file")
    return _hf(dataset, text_field, seed)


# ----------------------------------------------------------------------------------- embedded
def embedded_texts() -> list[tuple[str, str]]:
    """The embedded corpus as ``[(name, text)]``: CPython's ``pydoc_data.topics`` (PSF licence,
    present in every CPython install; ~465 K characters) then the shipped files in calib/data."""
    import pydoc_data.topics as topics

    out = [(f"pydoc_data.topics:{k}", topics.topics[k]) for k in sorted(topics.topics)]
    for fname in SHIPPED_FILES:
        raw = resources.files("pipeline.quantize.calib").joinpath("data", fname).read_bytes()
        out.append((fname, (gzip.decompress(raw) if fname.endswith(".gz") else raw).decode()))
    return out


def embedded_source() -> RecordSource:
    """The offline default: paragraphs of :func:`embedded_texts` (≈ 1.06 M characters)."""
    records: list[str] = []
    for _name, text in embedded_texts():
        records.extend(paragraphs(text))
    digest = artifacts.stable_hash(records)
    return RecordSource(EMBEDDED, records, True, digest,
                        "embedded: CPython pydoc_data.topics (PSF) + 5 Shakespeare plays (public domain)")


# ----------------------------------------------------------------------------------- files
def _jsonl(path: Path, shown: str, field: str) -> RecordSource:
    records = []
    with open(path, encoding="utf-8") as f:
        for n, line in enumerate(f, 1):
            if not line.strip():
                continue
            try:
                obj = json.loads(line)
            except ValueError as e:
                raise UserError(f"{path}:{n}: not valid JSON ({e.msg})") from None
            if not isinstance(obj, dict) or not isinstance(obj.get(field), str):
                raise UserError(
                    f"{path}:{n}: no string field {field!r} (set quantization.calibration.text_field)"
                )
            if obj[field].strip():
                records.append(obj[field].strip())
    return RecordSource(shown, records, True, artifacts.sha256_file(path), f"{path.name} (JSON lines, field {field!r})")


def _parquet(path: Path, shown: str, field: str) -> RecordSource:
    try:
        import pyarrow.parquet as pq
    except ImportError:
        raise UserError(
            f"quantization.calibration.dataset {shown!r}: reading .parquet needs pyarrow: pip install 'trtpipe[parquet]'"
        ) from None
    schema = pq.read_schema(path)
    if field not in schema.names:
        raise UserError(f"{path}: no column {field!r} (columns: {', '.join(schema.names)}; set quantization.calibration.text_field)")
    col = pq.read_table(path, columns=[field]).column(field).to_pylist()
    records = [t.strip() for t in col if isinstance(t, str) and t.strip()]
    return RecordSource(shown, records, True, artifacts.sha256_file(path), f"{path.name} (parquet, column {field!r})")


# ----------------------------------------------------------------------------------- HF datasets
def _hf(name: str, text_field: str | None, seed: int, known: str | None = None) -> RecordSource:
    hf_path, config, default_field = HF_DATASETS.get(known or name, (name, None, "text"))
    if known:
        hf_path = name
    field = text_field or default_field
    hint = "or use `dataset: embedded` (offline text shipped with trtpipe) or a local .txt/.jsonl file"
    try:
        import datasets
    except ImportError:
        raise UserError(
            f"quantization.calibration.dataset {name!r} is a Hugging Face dataset, which needs the `datasets` "
            f"package: pip install 'trtpipe[datasets]' ({hint})"
        ) from None
    try:
        stream = datasets.load_dataset(hf_path, config, split="train", streaming=True)
        stream = stream.shuffle(seed=seed, buffer_size=10_000)
        first = next(iter(stream))
    except Exception as e:  # network/hub/cache errors come in many types (ConnectionError, OSError, ...)
        raise UserError(
            f"quantization.calibration.dataset {name!r} ({hf_path}) cannot be loaded — offline or unknown? "
            f"({type(e).__name__}); {hint}"
        ) from None
    if field not in first:
        raise UserError(f"HF dataset {hf_path}: no field {field!r} (fields: {', '.join(first)}); set quantization.calibration.text_field")

    def gen() -> Iterator[str]:
        for row in stream:
            text = row.get(field)
            if isinstance(text, str) and text.strip():
                yield text.strip()

    digest = artifacts.stable_hash(["hf", hf_path, config, field, seed, datasets.__version__])
    return RecordSource(name, gen(), False, digest, f"HF dataset {hf_path}{f' ({config})' if config else ''}, field {field!r}")
