"""The eval tasks: which articles are summarized, and against which reference.

* ``embedded``: 30 article/summary pairs shipped in ``pipeline/eval/data/embedded_summaries.jsonl``
  (articles from CPython's ``pydoc_data.topics``, PSF-2.0; summaries written for trtpipe, Apache-2.0;
  see ``LICENSE-embedded.md`` there). Offline.
* ``agreement``: label-free. Passages of the embedded calibration corpus (:mod:`calib`) that the
  recipe's calibration did not use (its held-out ``eval_samples`` first); the candidate is scored
  against the baseline's outputs only.
* a path to a ``.jsonl`` file with ``article`` and ``highlights`` (optional ``id``) per line.
* ``cnn_dailymail``: the 3.0.0 ``test`` split through HF ``datasets`` (needs ``pip install
  'trtpipe[datasets]'`` and network).

Samples are drawn without replacement by ``seed`` (``numpy.random.default_rng``) when the task has
more than ``n``; their order is the task's.
"""

from __future__ import annotations

import dataclasses
import json
from importlib import resources
from pathlib import Path
from typing import Any

import numpy as np

from pipeline.core import artifacts
from pipeline.core.errors import UserError

EMBEDDED_FILE = "embedded_summaries.jsonl"
#: the instruction put before every article (chat template of the build's tokenizer around it)
INSTRUCTION = "Summarize the following text in one to three sentences.\n\n"


@dataclasses.dataclass(frozen=True)
class EvalSample:
    """One prompt of a task: its id, the article, and the reference summary (``None``: label-free)."""

    id: str
    article: str
    reference: str | None


@dataclasses.dataclass(frozen=True)
class Task:
    """A loaded task: name, samples, whether it has labels, and a content hash of the samples."""

    name: str
    samples: list[EvalSample]
    labelled: bool

    @property
    def data_hash(self) -> str:
        """sha256 of the selected samples (ids, articles, references)."""
        return artifacts.stable_hash([dataclasses.astuple(s) for s in self.samples])


def _select(samples: list[EvalSample], n: int, seed: int) -> list[EvalSample]:
    if len(samples) <= n:
        return samples
    keep = sorted(np.random.default_rng(seed).choice(len(samples), size=n, replace=False).tolist())
    return [samples[i] for i in keep]


def _jsonl(path: Path, shown: str) -> list[EvalSample]:
    out = []
    for i, line in enumerate(path.read_text().splitlines(), 1):
        if not line.strip():
            continue
        try:
            row = json.loads(line)
            out.append(EvalSample(str(row.get("id", i)), str(row["article"]), str(row["highlights"])))
        except (ValueError, KeyError, TypeError) as e:
            raise UserError(f"{shown}:{i}: not a JSON object with `article` and `highlights` ({type(e).__name__})") from None
    if not out:
        raise UserError(f"{shown}: no samples")
    return out


def embedded() -> list[EvalSample]:
    """The 30 shipped article/summary pairs."""
    path = resources.files("pipeline.eval").joinpath("data", EMBEDDED_FILE)
    return _jsonl(Path(str(path)), EMBEDDED_FILE)


def agreement(calibration: Any, tokenizer: Any, base_dir: Path) -> list[EvalSample]:
    """Passages of the calibration corpus the recipe's calibration did not use (held-out first).

    Args:
        calibration: the recipe's ``quantization.calibration`` (its dataset must be ``embedded``).
    """
    from pipeline.quantize.calib import EMBEDDED, pack, split
    from pipeline.quantize.calib.sources import embedded_source

    if calibration.dataset != EMBEDDED:
        raise UserError(f"--task agreement uses the embedded calibration text; this recipe calibrates on "
                        f"{calibration.dataset!r}")
    samples = pack(embedded_source().records, tokenizer, calibration.max_seq_length)
    cal, held = split(samples, calibration.size, calibration.eval_samples, calibration.seed)
    seen = {s.text for s in cal} | {h.text for h in held}  # by text: the corpus repeats some passages
    rest = []
    for s in samples:
        if s.text not in seen:
            seen.add(s.text)
            rest.append(s)
    return [EvalSample(f"calib-{i}", s.text, None) for i, s in enumerate(held + rest)]


def cnn_dailymail() -> list[EvalSample]:
    """CNN/DailyMail 3.0.0 ``test`` (as MLPerf and TensorRT-LLM): ``article`` / ``highlights``."""
    try:
        import datasets
    except ImportError:
        raise UserError("--task cnn_dailymail needs HF datasets: pip install 'trtpipe[datasets]'") from None
    try:
        ds = datasets.load_dataset("cnn_dailymail", "3.0.0", split="test")
    except Exception as e:  # noqa: BLE001 - offline / hub errors of every kind become one line
        raise UserError(f"--task cnn_dailymail: cannot load the dataset ({type(e).__name__}); it needs network") from None
    return [EvalSample(str(r["id"]), r["article"], r["highlights"]) for r in ds]


def check(task: str, base_dir: Path = Path(".")) -> None:
    """Refuse a task name that is neither built in nor an existing ``.jsonl`` file (before any work).

    Raises:
        UserError: one line naming the task.
    """
    if task in ("embedded", "agreement", "cnn_dailymail"):
        return
    path = Path(task) if Path(task).is_absolute() else base_dir / task
    if path.suffix != ".jsonl" or not path.is_file():
        raise UserError(f"--task {task!r}: expected embedded, agreement, cnn_dailymail or an existing .jsonl file")


def load(spec: Any, *, calibration: Any = None, tokenizer: Any = None, base_dir: Path = Path(".")) -> Task:
    """The task named by ``spec.task`` with at most ``spec.n`` samples (selected by ``spec.seed``).

    Raises:
        UserError: unknown task / missing file / malformed JSONL / no network for ``cnn_dailymail`` /
            ``agreement`` without the embedded calibration.
    """
    name = spec.task
    if name == "embedded":
        samples, labelled = embedded(), True
    elif name == "agreement":
        if calibration is None or tokenizer is None:
            raise UserError("--task agreement needs the build's recipe (its calibration) and tokenizer")
        samples, labelled = agreement(calibration, tokenizer, base_dir), False
    elif name == "cnn_dailymail":
        samples, labelled = cnn_dailymail(), True
    else:
        check(name, base_dir)
        path = Path(name) if Path(name).is_absolute() else base_dir / name
        samples, labelled = _jsonl(path, name), True
    return Task(name, _select(samples, spec.n, spec.seed), labelled)


def _wrap(body: str, tokenizer: Any) -> str:
    if getattr(tokenizer, "chat_template", None):
        return tokenizer.apply_chat_template([{"role": "user", "content": body}], tokenize=False, add_generation_prompt=True)
    return body


def prompt_text(article: str, tokenizer: Any, max_input_tokens: int, max_prompt_tokens: int | None = None) -> str:
    """The request text: ``article`` cut to ``max_input_tokens`` tokens, after :data:`INSTRUCTION`, in
    the tokenizer's chat template (user turn + generation prompt) when it has one. With
    ``max_prompt_tokens`` (the engine's ``max_input_len``) the article is cut further so the whole
    prompt fits.

    Raises:
        UserError: the instruction and template alone exceed ``max_prompt_tokens``.
    """
    limit = max_input_tokens
    if max_prompt_tokens is not None:
        overhead = len(tokenizer(_wrap(INSTRUCTION, tokenizer), add_special_tokens=True)["input_ids"]) + 8  # + re-tokenization slack
        if overhead >= max_prompt_tokens:
            raise UserError(f"the eval prompt template alone is {overhead} tokens; build.max_input_len is {max_prompt_tokens}")
        limit = min(limit, max_prompt_tokens - overhead)
    ids = tokenizer(article, add_special_tokens=False)["input_ids"][:limit]
    return _wrap(INSTRUCTION + tokenizer.decode(ids), tokenizer)
