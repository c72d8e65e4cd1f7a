"""Calibration and evaluation text for ModelOpt PTQ.

``prepare(spec, tokenizer, base_dir)`` turns a recipe's ``quantization.calibration`` section into
tokenized calibration batches and held-out evaluation batches:

1. :func:`calib.sources.open_source` reads records from ``embedded`` (offline: CPython's
   ``pydoc_data.topics`` + public-domain plays in calib/data, see calib/README.md), a local
   ``.txt``/``.jsonl``/``.parquet`` file, or a Hugging Face ``datasets`` name (``cnn_dailymail``
   3.0.0 field ``article`` like TensorRT-LLM, ``pile``; needs network and ``datasets``);
2. :func:`calib.sampling.pack` packs consecutive records into samples of ``max_seq_length`` tokens;
3. :func:`calib.sampling.split` shuffles them by ``seed`` and holds out ``eval_samples`` first,
   so evaluation text never overlaps calibration text;
4. :func:`calib.sampling.batches` tokenizes into ``batch_size`` batches with attention masks.
"""

from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import Any

from pipeline.core import artifacts
from pipeline.core.errors import UserError
from pipeline.quantize.calib.sampling import Sample, batches, pack, split
from pipeline.quantize.calib.sources import (
    EMBEDDED,
    HF_DATASETS,
    RecordSource,
    embedded_texts,
    open_source,
    paragraphs,
)

__all__ = [
    "EMBEDDED", "HF_DATASETS", "CalibData", "RecordSource", "Sample", "batches", "embedded_texts", "open_source",
    "pack", "paragraphs", "prepare", "split",
]


@dataclasses.dataclass
class CalibData:
    """Calibration and held-out evaluation samples, ready to batch.

    Attributes:
        calib: calibration samples (``len ≤ spec.size``).
        eval: held-out evaluation samples (``len == spec.eval_samples``), disjoint from ``calib``.
        max_seq_length / batch_size: from the spec; tokens per sample / samples per batch.
        source: the :class:`RecordSource` (name, content hash, description).
        requested: ``spec.size``; ``len(calib)`` is smaller when the source has too little text.
    """

    calib: list[Sample]
    eval: list[Sample]
    max_seq_length: int
    batch_size: int
    source: RecordSource
    requested: int

    def calib_batches(self, tokenizer: Any) -> list[dict[str, Any]]:
        """Calibration batches: ``input_ids``/``attention_mask`` LongTensor[B ≤ batch_size, T ≤ max_seq_length]."""
        return list(batches(tokenizer, [s.text for s in self.calib], self.max_seq_length, self.batch_size))

    def eval_batches(self, tokenizer: Any, batch_size: int | None = None) -> list[dict[str, Any]]:
        """Evaluation batches like :meth:`calib_batches`, of ``batch_size`` (default: the spec's)."""
        return list(batches(tokenizer, [s.text for s in self.eval], self.max_seq_length, batch_size or self.batch_size))

    def summary(self) -> dict[str, Any]:
        """JSON-able description for manifests (dataset, hash, sample counts, a hash of the sample texts)."""
        return {
            "dataset": self.source.name,
            "description": self.source.description,
            "content_hash": self.source.content_hash,
            "calib_samples": len(self.calib),
            "calib_samples_requested": self.requested,
            "eval_samples": len(self.eval),
            "max_seq_length": self.max_seq_length,
            "batch_size": self.batch_size,
            "samples_hash": artifacts.stable_hash([[s.text for s in self.calib], [s.text for s in self.eval]]),
        }


def prepare(spec: Any, tokenizer: Any, base_dir: Path) -> CalibData:
    """Build :class:`CalibData` for a :class:`pipeline.recipe.CalibrationSpec`.

    Args:
        spec: the recipe's ``quantization.calibration`` (dataset, text_field, size,
            max_seq_length, batch_size, seed, eval_samples).
        tokenizer: the model's HF tokenizer (token counts and batches use it).
        base_dir: the recipe's directory (relative dataset paths resolve against it).

    Raises:
        UserError: see :func:`calib.sources.open_source`; or the source has too little text for
            the evaluation samples plus at least one calibration sample.
    """
    source = open_source(spec.dataset, text_field=spec.text_field, base_dir=base_dir, seed=spec.seed)
    limit = None if source.finite else spec.size + spec.eval_samples
    samples = pack(source.records, tokenizer, spec.max_seq_length, limit=limit)
    if len(samples) < spec.eval_samples + 1:
        raise UserError(
            f"quantization.calibration.dataset {spec.dataset!r}: only {len(samples)} samples of "
            f"{spec.max_seq_length} tokens, need eval_samples {spec.eval_samples} + at least 1 for calibration"
        )
    cal, held = split(samples, spec.size, spec.eval_samples, spec.seed)
    return CalibData(cal, held, spec.max_seq_length, spec.batch_size, source, spec.size)
