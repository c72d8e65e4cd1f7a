"""Images through trtpipe's ``llmapi`` Triton model (issue #47 item 4): upstream's optional ``image_url`` input, added to
TensorRT-LLM's llmapi model after 1.2.1 by NVIDIA/TensorRT-LLM PR #18381 (copied next to the model's model.py; numpy,
PIL and the standard library only, so the rules are tested without Triton).

Upstream (``triton_backend/all_models/llmapi/tensorrt_llm/config.pbtxt@0a71057313ec``):

- the input: ``image_url`` ``TYPE_STRING`` ``dims [ -1 ]`` ``optional: true``, one entry per image (:62-67), "only read
  when ``triton_config.multimodal`` is set in model.yaml" (:54-55);
- its rules (:57-61): "``http(s)://`` URLs the server can reach, and inline ``data:`` URIs. Local filesystem paths and
  ``file://`` URLs are rejected: this input is client-controlled, so accepting them would let a caller make the server
  read any image file its process can open."

trtpipe's model follows them: a ``data:image/…;base64,…`` URL is decoded, an http(s) URL fetched (10 s, 32 MiB at most),
``file://`` and anything without a scheme (a local path) refused before any file is touched, any other scheme refused.
Upstream declares no limit on the images of one request; trtpipe's build has one (``vision.max_images_per_request`` →
the model parameter ``max_num_images``), checked before any image is decoded or fetched.

The images go to ``LLM.generate_async`` as upstream's LLM API takes them: ``{"prompt": text, "multi_modal_data":
{"image": [PIL.Image, …]}}``. The prompt carries one image placeholder per image, as the Qwen2-VL chat template writes
it (``<|vision_start|><|image_pad|><|vision_end|>``, whose ``<|image_pad|>`` the processor expands to the image's
tokens: transformers 5.x processing_qwen2_vl.py:44, 58-61); a text without one gets them before it (upstream's model
adds placeholders itself, its callers "send a plain question": PR #18381 ``_convert_request``). Every refusal is an
:class:`ImageInputError` whose message is one line naming ``image_url``; the model answers it as INVALID_ARGUMENT.
"""

from __future__ import annotations

import json
import urllib.parse
from pathlib import Path
from typing import Any

import numpy as np
from _vision import ImageInputError, check_image_count, load_image_url

#: upstream's input name (config.pbtxt@0a71057313ec:63) and trtpipe's output of the image tokens one request cost
INPUT = "image_url"
COUNT_OUTPUT = "num_image_tokens"
#: the schemes upstream accepts (config.pbtxt@0a71057313ec:57-58)
SCHEMES = ("data", "http", "https")
#: Qwen2-VL's per-image placeholder (its chat template) and the tokens' config.json id keys
PLACEHOLDER_TOKENS = {"vision_start_token_id": "<|vision_start|>", "image_token_id": "<|image_pad|>",
                      "vision_end_token_id": "<|vision_end|>"}


def urls_of(arr: Any) -> list[str]:
    """The non-empty strings of one request's ``image_url`` tensor (bytes or str, any shape), in order."""
    if arr is None:
        return []
    vals = np.asarray(arr, dtype=object).reshape(-1)
    urls = [v.decode("utf-8", "replace") if isinstance(v, (bytes, np.bytes_)) else str(v) for v in vals]
    return [u.strip() for u in urls if u.strip()]


def check_url(url: str) -> None:
    """Refuse what upstream's ``image_url`` refuses (config.pbtxt@0a71057313ec:57-61).

    Raises:
        ImageInputError: a ``file://`` URL, a local path (no scheme, or a drive letter), or a scheme other than
            ``data``, ``http``, ``https``.
    """
    scheme = urllib.parse.urlsplit(url).scheme.lower()
    if scheme == "file":
        raise ImageInputError(f"{INPUT}: file:// URLs are refused (client-controlled input; send a data:image/...;base64 URL)")
    if not scheme or len(scheme) == 1 or url.startswith(("/", ".", "~", "\\")):
        raise ImageInputError(f"{INPUT}: local paths are refused ({url[:60]!r}; send a data:image/...;base64 URL or http(s))")
    if scheme not in SCHEMES:
        raise ImageInputError(f"{INPUT}: URL scheme '{scheme}' is not accepted (data:, http:, https:)")


def load_images(arr: Any, max_num_images: int | None) -> list:
    """The RGB ``PIL.Image`` list of one request's ``image_url`` tensor (empty: a text-only request).

    Raises:
        ImageInputError: more than ``max_num_images`` URLs, a refused URL (:func:`check_url`), a ``data:`` URL that is
            not an image (media type, base64, undecodable bytes), an http(s) URL that does not answer with an image.
    """
    urls = urls_of(arr)
    check_image_count(len(urls), max_num_images, INPUT)
    for url in urls:
        check_url(url)
    return [load_image_url(url, allow_http=True, what=INPUT) for url in urls]


def _token_texts(ckpt: Path) -> dict[int, str]:
    """``{id: text}`` of a checkpoint's added tokens (tokenizer.json ``added_tokens``, tokenizer_config.json
    ``added_tokens_decoder``)."""
    out: dict[int, str] = {}
    for name, pick in (("tokenizer.json", lambda d: d.get("added_tokens") or []),
                       ("tokenizer_config.json", lambda d: [dict(v, id=int(k)) for k, v in (d.get("added_tokens_decoder") or {}).items()])):
        try:
            data = json.loads((ckpt / name).read_text())
        except (OSError, ValueError):
            continue
        for tok in pick(data) if isinstance(data, dict) else []:
            if isinstance(tok, dict) and tok.get("content") is not None and tok.get("id") is not None:
                out.setdefault(int(tok["id"]), str(tok["content"]))
    return out


class Placeholders:
    """The image placeholder of a checkpoint and its image token id (``config.json`` ``image_token_id`` and the
    vision start/end ids, named by the tokenizer's added tokens; Qwen2-VL's texts when a file does not say).

    Args:
        dirs: checkpoint / tokenizer directories; the first ``config.json`` naming an ``image_token_id`` wins, in a
            directory or its ``vision/`` (the CPU engine directory keeps the full checkpoint config there:
            pipeline/cpu_runtime/multimodal.py ``VISION_DIR``); the tokens' texts come from the first directory.
    """

    def __init__(self, dirs: list[str | Path]):
        cfg: dict = {}
        self.source = Path(dirs[0]) if dirs else None
        for d in [c for base in dirs for c in (Path(base), Path(base) / "vision")]:
            try:
                data = json.loads((d / "config.json").read_text())
            except (OSError, ValueError):
                continue
            if isinstance(data, dict) and (data.get("image_token_id") is not None or
                                           (data.get("text_config") or {}).get("image_token_id") is not None):
                cfg = data
                break
        texts = _token_texts(self.source) if self.source is not None else {}
        ids = {k: cfg.get(k) if cfg.get(k) is not None else (cfg.get("text_config") or {}).get(k) for k in PLACEHOLDER_TOKENS}
        self.image_token_id: int | None = None if ids["image_token_id"] is None else int(ids["image_token_id"])
        parts = {k: texts.get(int(i), PLACEHOLDER_TOKENS[k]) if i is not None else PLACEHOLDER_TOKENS[k] for k, i in ids.items()}
        self.image_token = parts["image_token_id"]
        self.text = parts["vision_start_token_id"] + parts["image_token_id"] + parts["vision_end_token_id"]

    def prompt(self, text: str, n_images: int) -> str:
        """``text`` with one placeholder per image: as sent when it already carries exactly ``n_images`` image tokens,
        else with the placeholders put before it.

        Raises:
            ImageInputError: the text carries image tokens, but not one per image.
        """
        have = text.count(self.image_token)
        if have == 0:
            return self.text * n_images + text
        if have != n_images:
            raise ImageInputError(f"{INPUT}: text_input carries {have} {self.image_token} token(s) for {n_images} image(s)")
        return text

    def count(self, prompt_token_ids: Any) -> int | None:
        """Image tokens in a request's prompt token ids (the placeholders the processor expanded); ``None`` when the
        checkpoint names no ``image_token_id``."""
        if self.image_token_id is None or prompt_token_ids is None:
            return None
        return sum(1 for t in prompt_token_ids if int(t) == self.image_token_id)
