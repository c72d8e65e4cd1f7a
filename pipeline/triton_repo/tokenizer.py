"""The tokenizer of trtpipe's python models: Hugging Face ``tokenizers`` (Rust), without transformers.

Importing transformers costs each python-backend stub ~380 MiB of RSS and seconds of start-up;
the pre/postprocessing and BLS models only need encode/decode, which ``tokenizers.Tokenizer`` does
itself (transformers' fast tokenizers call the same object: ``encode_batch(...,
add_special_tokens=...)`` and ``decode(ids, skip_special_tokens=...)``). :func:`load_tokenizer` reads
``tokenizer.json``; a directory without one (a SentencePiece-only checkpoint) falls back to
transformers once, for its converted fast tokenizer.

It is copied next to each python model in a generated repository (like detokenize.py).
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


class Tokenizer:
    """Encode/decode with a ``tokenizers.Tokenizer`` (``backend``).

    ``eos_token_id`` / ``pad_token_id``: ids of the ``eos_token`` / ``pad_token`` named in
    tokenizer_config.json (or special_tokens_map.json), ``None`` when absent.
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
    """The tokenizer in ``tokenizer_dir`` (offline).

    Raises ``FileNotFoundError`` when the directory has neither ``tokenizer.json`` nor a tokenizer
    transformers can convert.
    """
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
        return Tokenizer(backend, ids.get("eos_token"), ids.get("pad_token"))
    try:  # no tokenizer.json: transformers converts the slow tokenizer (only then imported)
        from transformers import AutoTokenizer

        tok = AutoTokenizer.from_pretrained(tokenizer_dir, local_files_only=True)
        backend = tok.backend_tokenizer
    except Exception as e:
        raise FileNotFoundError(f"{tokenizer_dir}: no tokenizer.json and no tokenizer transformers can load ({e})") from e
    return Tokenizer(backend, tok.eos_token_id, tok.pad_token_id)
