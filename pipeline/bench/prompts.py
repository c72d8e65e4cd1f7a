"""Prompts of an exact input length (ISL, tokens): synthetic token ids, text, or a JSONL dataset.

* Token interface (``tensorrt_llm``): ISL ids drawn uniformly from the vocabulary with a seeded
  RNG, special tokens excluded — trtllm-bench's ``token-norm-dist`` with stdev 0
  (docs/reference/benchmark-metrics.md §5.2). Without a tokenizer the ids come from ``[1000, 32000)``, valid
  for any vocabulary of at least 32 000 entries (Llama-2 and larger).
* Text interface (``ensemble``/``tensorrt_llm_bls``): random vocabulary words decoded to text,
  then re-encoded with the model's tokenizer and fixed up (trim/extend) until the text encodes to
  exactly ISL tokens (``add_special_tokens=False``, as TensorRT-LLM's preprocessing counts
  the prompt by default). Raises when it cannot converge.
* Dataset: JSONL lines with ``"text"``/``"prompt"`` (text) or ``"input_ids"`` (tokens); the
  length is whatever the line holds (counted with the tokenizer when one is given).
"""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path
from typing import Any

import numpy as np

from pipeline.core.errors import UserError

#: id range used without a tokenizer (any vocabulary of ≥ 32 000 tokens contains it)
FALLBACK_ID_RANGE = (1000, 32000)
_MAX_FIXUPS = 50


@dataclasses.dataclass(frozen=True)
class Prompt:
    """One prompt: token ids and/or text, and its length in tokens; with an image workload its ``images``
    (:class:`~pipeline.bench.images.BenchImage`) and the ``image_tokens`` they cost the model (not in ``num_tokens``)."""

    num_tokens: int
    ids: np.ndarray | None = None
    text: str | None = None
    images: tuple[Any, ...] = ()
    image_tokens: int = 0


def _allowed_ids(tokenizer: Any) -> np.ndarray:
    """Vocabulary ids that are not special tokens (added/control tokens excluded)."""
    special = set(getattr(tokenizer, "all_special_ids", []) or [])
    special |= set(getattr(tokenizer, "added_tokens_decoder", {}) or {})
    n = len(tokenizer)
    return np.array([i for i in range(n) if i not in special], dtype=np.int32)


def token_prompts(n: int, isl: int, *, seed: int, tokenizer: Any = None) -> list[Prompt]:
    """``n`` prompts of exactly ``isl`` random token ids (seeded; special tokens excluded)."""
    rng = np.random.default_rng(seed)
    if tokenizer is not None:
        pool = _allowed_ids(tokenizer)
        return [Prompt(isl, ids=rng.choice(pool, size=isl).astype(np.int32)) for _ in range(n)]
    lo, hi = FALLBACK_ID_RANGE
    return [Prompt(isl, ids=rng.integers(lo, hi, size=isl, dtype=np.int32)) for _ in range(n)]


def _word_ids(tokenizer: Any) -> np.ndarray:
    """Ids of plain word tokens (letters, optionally a leading space) — these re-tokenize stably."""
    pool = _allowed_ids(tokenizer)
    words = []
    for i in pool.tolist():
        s = tokenizer.decode([i])
        core = s[1:] if s.startswith(" ") else s
        if s.startswith(" ") and 2 <= len(core) <= 10 and core.isascii() and core.isalpha():
            words.append(i)
    return np.array(words or pool.tolist(), dtype=np.int32)


def exact_text(tokenizer: Any, isl: int, rng: np.random.Generator, words: np.ndarray | None = None,
               prefix: str = "") -> str:
    """Text that encodes to exactly ``isl`` tokens with ``tokenizer`` (``add_special_tokens=False``); with ``prefix``
    (a text of fewer than ``isl`` tokens) the text starts with it and its tokens are the prefix's own tokens (only
    the random rest is fixed up), so prompts that share ``prefix`` share their first tokens (KV-cache reuse).

    Raises:
        UserError: no exact text found after 50 fix-ups (a tokenizer that merges everything).
    """
    words = _word_ids(tokenizer) if words is None else words
    head = tokenizer.encode(prefix, add_special_tokens=False) if prefix else []
    need = isl - len(head)
    ids = rng.choice(words, size=need).tolist()
    for _ in range(_MAX_FIXUPS):
        text = prefix + tokenizer.decode(ids).rstrip() if prefix else tokenizer.decode(ids).strip()
        got = tokenizer.encode(text, add_special_tokens=False)
        kept = got[:len(head)] == head
        if len(got) == isl and kept:
            return text
        tail = got[len(head):] if kept else rng.choice(words, size=need).tolist()  # merged into the prefix: redraw
        ids = tail[:need] if len(tail) > need else tail + rng.choice(words, size=need - len(tail)).tolist()
    raise UserError(f"could not build a text prompt of exactly {isl} tokens with this tokenizer")


def text_prompts(n: int, isl: int, *, seed: int, tokenizer: Any, prefixes: tuple[int, int] = (0, 0)) -> list[Prompt]:
    """``n`` texts of exactly ``isl`` tokens each (verified by re-encoding); ``prefixes = (count, length)``: prompt
    ``i`` starts with shared prefix ``i mod count``, a text of exactly ``length`` tokens (AIPerf's prefix pool)."""
    rng = np.random.default_rng(seed)
    words = _word_ids(tokenizer)
    count, length = prefixes
    heads = [exact_text(tokenizer, length, np.random.default_rng((seed, 1, k)), words) for k in range(count)]
    return [Prompt(isl, text=exact_text(tokenizer, isl, rng, words, heads[i % count] if count else ""))
            for i in range(n)]


def _prefixed_token_prompts(prompts: list[Prompt], prefixes: tuple[int, int], seed: int, tokenizer: Any) -> list[Prompt]:
    """``prompts`` (token ids) with their first ``length`` ids replaced by shared prefix ``i mod count`` (random
    ids of the same pool, seeded), so the ISL is unchanged."""
    count, length = prefixes
    heads = [p.ids[:length] for p in token_prompts(count, length, seed=seed, tokenizer=tokenizer)]
    return [dataclasses.replace(p, ids=np.concatenate([heads[i % count], p.ids[length:]]).astype(np.int32))
            for i, p in enumerate(prompts)]


def dataset_prompts(path: Path, *, tokenizer: Any = None, limit: int | None = None) -> list[Prompt]:
    """Prompts from a JSONL file (``text``/``prompt`` or ``input_ids`` per line).

    Raises:
        UserError: missing file, bad JSON (names the line), or a line without a prompt field.
    """
    path = Path(path)
    try:
        lines = path.read_text().splitlines()
    except OSError as e:
        raise UserError(f"{path}: cannot read dataset ({e.strerror})") from None
    out: list[Prompt] = []
    for lineno, line in enumerate(lines, 1):
        if not line.strip():
            continue
        try:
            row = json.loads(line)
        except ValueError:
            raise UserError(f"{path}:{lineno}: not valid JSON") from None
        if isinstance(row, dict) and "input_ids" in row:
            ids = np.asarray(row["input_ids"], dtype=np.int32)
            text = tokenizer.decode(ids.tolist()) if tokenizer is not None else None
            out.append(Prompt(len(ids), ids=ids, text=text))
        elif isinstance(row, dict) and isinstance(row.get("text", row.get("prompt")), str):
            text = row.get("text", row.get("prompt"))
            ids = np.asarray(tokenizer.encode(text, add_special_tokens=False), np.int32) if tokenizer is not None else None
            out.append(Prompt(len(ids) if ids is not None else -1, ids=ids, text=text))
        else:
            raise UserError(f"{path}:{lineno}: expected an object with `text`, `prompt` or `input_ids`")
        if limit is not None and len(out) >= limit:
            break
    if not out:
        raise UserError(f"{path}: no prompts in dataset")
    return out


def load_tokenizer(path: Path) -> Any:
    """A Hugging Face tokenizer from a local directory (offline).

    Raises:
        UserError: the directory has no loadable tokenizer.
    """
    from transformers import AutoTokenizer
    from transformers.utils import logging as hf_logging

    hf_logging.set_verbosity_error()  # tokenizer-config advisories are noise on a bench console
    try:
        return AutoTokenizer.from_pretrained(str(path), local_files_only=True)
    except Exception as e:  # noqa: BLE001 - any loader failure is the same user-facing problem
        raise UserError(f"{path}: no usable tokenizer ({' '.join(str(e).split())[:200]})") from None


#: distinct synthetic prompts per scenario; requests cycle through them
MAX_UNIQUE_PROMPTS = 512


def added_special_tokens(tokenizer: Any) -> int:
    """Tokens the tokenizer adds to a text by default (e.g. Llama 3's BOS ``<|begin_of_text|>``: 1)."""
    return max(0, len(tokenizer.encode("a")) - len(tokenizer.encode("a", add_special_tokens=False)))


def make_prompts(spec: Any, info: Any, isl: int, n: int, tokenizer: Any, images: Any = None) -> list[Prompt]:
    """:func:`text_and_token_prompts`, then with ``images`` (an :class:`~pipeline.bench.images.ImagePlan`; at most
    :data:`~pipeline.bench.images.MAX_IMAGE_SETS` synthetic prompts, as each prebuilt request holds its images) each
    prompt gets its images (seeded by ``spec.seed`` and ``isl``) and, where the plan has a placeholder (mllama on Triton), one
    image token per image before the text — the synthetic text is shortened by as many tokens, so the prompt still
    encodes to exactly ``isl`` tokens.

    Raises:
        UserError: as :func:`text_and_token_prompts`; an ISL that cannot hold the image tokens; see
            :func:`pipeline.bench.images.attach`.
    """
    if images is None:
        return text_and_token_prompts(spec, info, isl, n, tokenizer)
    from pipeline.bench.images import MAX_IMAGE_SETS, attach

    n = min(n, MAX_IMAGE_SETS)  # each prebuilt request holds its images (gRPC: decoded pixels): requests cycle
    k = images.workload.per_request if images.placeholder else 0
    if k and isl - k < 1 and spec.dataset is None:
        raise UserError(f"ISL {isl}: the prompt carries {k} image token(s); use ISL > {k}")
    prompts = text_and_token_prompts(spec, info, isl - k, n, tokenizer)
    exact = None if spec.dataset is not None else isl
    return attach(prompts, images, tokenizer, (spec.seed, isl), exact)


def text_and_token_prompts(spec: Any, info: Any, isl: int, n: int, tokenizer: Any) -> list[Prompt]:
    """``n`` (≤ :data:`MAX_UNIQUE_PROMPTS`) prompts of exactly ``isl`` tokens for the model's interface.

    ``spec`` is the :class:`~pipeline.recipe.bench.BenchSpec` (its ``seed`` and ``dataset``), ``info`` the model's
    :class:`~pipeline.bench.client.ModelInfo`. LLM-API and OpenAI servers tokenize with the tokenizer's special tokens
    (``SamplingParams.add_special_tokens`` defaults to true; vLLM's too), so the text has ``isl`` minus those tokens
    (the BOS of Llama 3) and the prompt is recorded as ``isl`` — what the model sees.

    With ``spec.num_prefix_prompts``/``prefix_prompt_length`` set, every prompt starts with one of that many shared
    prefixes of that many tokens (counted in the ISL; :func:`text_prompts`, :func:`_prefixed_token_prompts`).

    Raises:
        UserError: a text model without a tokenizer, token-id dataset prompts without a tokenizer,
            or an ISL smaller than the special tokens the server adds (plus the shared prefix).
    """
    n = min(n, MAX_UNIQUE_PROMPTS)
    pre = (getattr(spec, "num_prefix_prompts", 0), getattr(spec, "prefix_prompt_length", 0))  # shared prefixes
    adds = info.interface in ("llmapi", "openai")
    extra = added_special_tokens(tokenizer) if adds and tokenizer is not None else 0
    if spec.dataset is not None:
        prompts = dataset_prompts(spec.dataset, tokenizer=tokenizer)
        if info.interface == "tokens" and prompts[0].ids is None:
            raise UserError(f"{spec.dataset}: text prompts for model {info.name!r} (token ids) need --tokenizer")
        if extra:
            prompts = [dataclasses.replace(p, num_tokens=p.num_tokens + extra) if p.num_tokens >= 0 else p for p in prompts]
        return prompts
    if info.takes_text:
        if tokenizer is None:
            raise UserError(
                f"model {info.name!r} takes text: exact-ISL prompts need its tokenizer — pass --tokenizer DIR "
                "(no tokenizer found in the last build)"
            )
        if isl - extra < 1:
            raise UserError(f"ISL {isl}: model {info.name!r} adds {extra} special token(s) to every prompt; use ISL > {extra}")
        if pre[1] and pre[1] >= isl - extra:
            raise UserError(f"--prefix-prompt-length {pre[1]}: ISL {isl} leaves no token after the prefix"
                            + (f" and the {extra} special token(s) model {info.name!r} adds" if extra else ""))
        prompts = text_prompts(n, isl - extra, seed=spec.seed + isl, tokenizer=tokenizer, prefixes=pre)
        return [dataclasses.replace(p, num_tokens=isl) for p in prompts] if extra else prompts
    prompts = token_prompts(n, isl, seed=spec.seed + isl, tokenizer=tokenizer)
    return _prefixed_token_prompts(prompts, pre, spec.seed, tokenizer) if pre[1] else prompts
