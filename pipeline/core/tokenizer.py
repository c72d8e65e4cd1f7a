"""trtpipe's one tokenizer wrapper and its one end-id rule: Hugging Face ``tokenizers`` (Rust), without transformers.

Two users load a tokenizer this way: the python models of a generated Triton repository (pre/postprocessing, BLS, the
CPU ``tensorrt_llm`` model; this file is copied next to each of them as ``tokenizer.py``,
``pipeline/triton_repo/layouts.yaml`` ``shared_python``) and the CPU LLM-API facade (:mod:`pipeline.cpu_runtime.llm`).
So this module imports nothing of ``pipeline`` (a repository on the stock Triton image has no trtpipe) and sits in
``pipeline/core``, the lowest layer both can import.

Importing transformers costs each python-backend stub ~380 MiB of RSS and seconds of start-up; these users only need
encode/decode, which ``tokenizers.Tokenizer`` does itself (transformers' fast tokenizers call the same object:
``encode_batch(..., add_special_tokens=...)`` and ``decode(ids, skip_special_tokens=...)``). :func:`load_tokenizer`
reads ``tokenizer.json``; a directory without one (a SentencePiece-only checkpoint) falls back to transformers once,
for its converted fast tokenizer.

**The end-id rule** (:func:`end_pad_ids`, applied once when the tokenizer is loaded): the end id is
``generation_config.json``'s ``eos_token_id`` (the first entry of a list: what ``generate()`` stops on), else the
tokenizer's own ``eos_token``; the pad id is ``generation_config.json``'s ``pad_token_id``, else the tokenizer's
``pad_token``, else the end id. The loaded :class:`Tokenizer` answers them as ``eos_token_id`` / ``pad_token_id``,
the attributes upstream reads its defaults from: the LLM API's ``SamplingParams._setup`` takes ``end_id =
tokenizer.eos_token_id``, ``pad_id = tokenizer.pad_token_id``, else ``end_id``
(NVIDIA/TensorRT-LLM tensorrt_llm/sampling_params.py@000a01de66f0:336-341), and the Triton ensemble's preprocessing
encodes the tokenizer's ``eos_token`` (``pad_token``, else ``eos_token``) for ``OUT_END_ID`` / ``OUT_PAD_ID``
(triton-inference-server/tensorrtllm_backend all_models/inflight_batcher_llm/preprocessing/1/model.py@c2e65b88d852:116-122).
trtpipe differs in one point: ``generation_config.json`` comes first, so a chat model whose tokenizer names one end
token and whose generation config another stops where ``generate()`` does.
"""

from __future__ import annotations

import json
import os
from collections.abc import Sequence
from typing import Any

#: Files read for the special tokens, in order of precedence (transformers' layout).
_SPECIAL_FILES = ("tokenizer_config.json", "special_tokens_map.json")


def _token_text(value: Any) -> str | None:
    """A special token as written in tokenizer_config.json: ``"<s>"`` or ``{"content": "<s>", ...}``."""
    if isinstance(value, dict):
        value = value.get("content")
    return value if isinstance(value, str) and value else None


def _first_id(value: Any) -> int | None:
    """A token id as generation_config.json writes it: an int, a list of them (the first counts), or absent."""
    if isinstance(value, list):
        return int(value[0]) if value else None
    return None if value is None else int(value)


def end_pad_ids(tokenizer_dir: str, tokenizer_eos: int | None, tokenizer_pad: int | None) -> tuple[int | None, int | None]:
    """The one end-id rule (module docstring): ``(end_id, pad_id)`` of the model in ``tokenizer_dir``, from its
    ``generation_config.json`` first, else the tokenizer's own ``tokenizer_eos`` / ``tokenizer_pad`` ids (``None``
    when it names none); the pad id falls back to the end id. ``(None, None)`` when nothing names an end token."""
    gen: dict[str, Any] = {}
    path = os.path.join(tokenizer_dir, "generation_config.json")
    if os.path.isfile(path):
        with open(path) as f:
            gen = json.load(f)
    end = _first_id(gen.get("eos_token_id"))
    end = tokenizer_eos if end is None else end
    pad = _first_id(gen.get("pad_token_id"))
    pad = tokenizer_pad if pad is None else pad
    return end, end if pad is None else pad


class Tokenizer:
    """Encode/decode with a ``tokenizers.Tokenizer`` (``backend``), in the transformers spelling the LLM API and the
    python models use (``add_special_tokens``, ``skip_special_tokens``).

    ``eos_token_id`` / ``pad_token_id``: the default end and pad ids of :func:`end_pad_ids` (``None`` when unknown),
    set by :func:`load_tokenizer`.
    """

    def __init__(self, backend: Any, eos_token_id: int | None = None, pad_token_id: int | None = None):
        self.backend = backend
        self.eos_token_id = eos_token_id
        self.pad_token_id = pad_token_id

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        """Token ids of ``text`` (``add_special_tokens`` applies tokenizer.json's post-processor, e.g. BOS)."""
        return self.backend.encode(text, add_special_tokens=add_special_tokens).ids

    def decode(self, ids: Sequence[int], skip_special_tokens: bool = True, clean_up_tokenization_spaces: bool = False) -> str:
        """Text of ``ids``. ``clean_up_tokenization_spaces`` must be False (transformers' legacy clean-up is not done)."""
        if clean_up_tokenization_spaces:
            raise ValueError("clean_up_tokenization_spaces is not supported (trtpipe always decodes without it)")
        return self.backend.decode(list(ids), skip_special_tokens=skip_special_tokens)


def load_tokenizer(tokenizer_dir: str) -> Tokenizer:
    """The tokenizer in ``tokenizer_dir`` (offline), its end and pad ids set by :func:`end_pad_ids`.

    Raises ``FileNotFoundError`` when the directory has neither ``tokenizer.json`` nor a tokenizer
    transformers can convert.
    """
    tokenizer_dir = str(tokenizer_dir)
    path = os.path.join(tokenizer_dir, "tokenizer.json")
    special: dict[str, Any] = {}
    for name in reversed(_SPECIAL_FILES):
        p = os.path.join(tokenizer_dir, name)
        if os.path.isfile(p):
            with open(p) as f:
                special.update({k: v for k, v in json.load(f).items() if k in ("eos_token", "pad_token")})
    if os.path.isfile(path):
        from tokenizers import Tokenizer as RustTokenizer

        backend = RustTokenizer.from_file(path)
        backend.no_truncation()  # as transformers does before encoding without truncation/padding
        backend.no_padding()
        ids = {k: (backend.token_to_id(t) if (t := _token_text(v)) else None) for k, v in special.items()}
        eos, pad = ids.get("eos_token"), ids.get("pad_token")
    else:
        try:  # no tokenizer.json: transformers converts the slow tokenizer (only then imported)
            from transformers import AutoTokenizer

            tok = AutoTokenizer.from_pretrained(tokenizer_dir, local_files_only=True)
            backend = tok.backend_tokenizer
        except Exception as e:
            raise FileNotFoundError(f"{tokenizer_dir}: no tokenizer.json and no tokenizer transformers can load ({e})") from e
        eos, pad = tok.eos_token_id, tok.pad_token_id
    return Tokenizer(backend, *end_pad_ids(tokenizer_dir, eos, pad))


def tokenizer_json_or_none(tokenizer_dir: str) -> Tokenizer | None:
    """:func:`load_tokenizer` for a directory with a ``tokenizer.json``, else ``None`` (the CPU LLM facade then
    yields token ids without text)."""
    return load_tokenizer(tokenizer_dir) if os.path.isfile(os.path.join(str(tokenizer_dir), "tokenizer.json")) else None
