"""Image inputs of trtpipe's multimodal repository (copied next to every model.py; numpy, PIL and the standard
library only, so the rules are tested without Triton).

The ensemble takes exactly one of three image forms (tensorrtllm_backend docs/multimodal.md@efb8a497:334-340,
``pipeline/data/triton_multimodal_contract.yaml`` ``behaviour``):

- ``image_input``: FP16 ``[batch, num_images·tiles, 3, tile, tile]`` pixel values already processed by the checkpoint's
  image processor (→ ``multimodal_encoders.IMAGE``);
- ``image_bytes_input``: UINT8 ``[batch, num_images, H, W, C]`` (or ``[batch, num_images, C, H, W]``) DECODED pixels,
  as upstream's client sends ``np.array([[pil_rgb_image]])`` (tools/multimodal/client.py@c2e65b88d852:301-306);
- ``image_url_input``: STRING ``[batch, num_images]``: ``data:image/…;base64,…`` URLs are decoded here; http(s) is
  fetched only when the preprocessing parameter ``allow_http_image_urls`` is true (upstream always fetches,
  preprocessing/1/model.py@c2e65b88d852:778-792); any other scheme is refused.

Every refusal is an :class:`ImageInputError` whose text is one line naming the input at fault; the models answer it
as INVALID_ARGUMENT (HTTP 400) and keep serving.
"""

from __future__ import annotations

import base64
import binascii
import io
import urllib.parse
import urllib.request

import numpy as np

#: the ensemble's image inputs, in upstream's order; the preprocessing model's names for the last two
IMAGE_FORMS = ("image_input", "image_bytes_input", "image_url_input")
PREPROCESSING_INPUT = {"image_bytes_input": "IMAGE_BYTES", "image_url_input": "IMAGE_URL"}
#: bytes read at most from an http(s) image URL (when allowed) and from a data: URL's payload
MAX_IMAGE_BYTES = 32 * 1024 * 1024
HTTP_TIMEOUT_S = 10.0


class ImageInputError(ValueError):
    """A request's image input the server refuses (answered as INVALID_ARGUMENT); the message is one line."""


def _present(value) -> bool:
    return value is not None and getattr(value, "size", 1) > 0


def one_image_form(inputs: dict) -> str | None:
    """The one image form a request carries (a key of :data:`IMAGE_FORMS`), or ``None`` for a text-only request.

    Args:
        inputs: ``{form name: numpy array or None}`` (an empty array counts as absent).

    Raises:
        ImageInputError: more than one form is populated ("You may populate only one", docs/multimodal.md@efb8a497:340).
    """
    given = [name for name in IMAGE_FORMS if _present(inputs.get(name))]
    if len(given) > 1:
        raise ImageInputError(f"{' and '.join(given)}: send exactly one of {', '.join(IMAGE_FORMS)} per request")
    return given[0] if given else None


def _open_image(data: bytes, what: str):
    from PIL import Image, UnidentifiedImageError

    try:
        img = Image.open(io.BytesIO(data))
        img.load()
    except (UnidentifiedImageError, OSError, ValueError, SyntaxError) as e:
        raise ImageInputError(f"{what}: not a decodable image ({type(e).__name__}, {len(data)} bytes)") from None
    return img.convert("RGB")


def decode_data_url(url: str, what: str = "image_url_input"):
    """The RGB ``PIL.Image`` of a ``data:image/<type>;base64,<payload>`` URL (RFC 2397).

    Raises:
        ImageInputError: not a data URL, a media type that is not ``image/*``, not base64, a payload over
            :data:`MAX_IMAGE_BYTES`, or bytes that are not an image.
    """
    if not url.startswith("data:") or "," not in url:
        raise ImageInputError(f"{what}: not a data: URL")
    header, payload = url[5:].split(",", 1)
    parts = [p.strip().lower() for p in header.split(";")]
    media = parts[0] or "text/plain"
    if not media.startswith("image/"):
        raise ImageInputError(f"{what}: data: URL of media type '{media}', not an image")
    if "base64" not in parts[1:]:
        raise ImageInputError(f"{what}: data: URL is not base64-encoded (data:{media};base64,...)")
    if len(payload) > MAX_IMAGE_BYTES * 4 // 3 + 4:
        raise ImageInputError(f"{what}: image larger than {MAX_IMAGE_BYTES} bytes")
    try:
        data = base64.b64decode(urllib.parse.unquote(payload), validate=True)
    except (binascii.Error, ValueError):
        raise ImageInputError(f"{what}: data: URL payload is not valid base64") from None
    return _open_image(data, what)


def load_image_url(url: str, *, allow_http: bool, what: str = "image_url_input"):
    """The RGB image an ``image_url_input`` string names: a ``data:`` URL, or http(s) when ``allow_http``.

    Raises:
        ImageInputError: http(s) while not allowed, another scheme, a fetch that fails or returns a non-image.
    """
    url = url.strip()
    scheme = urllib.parse.urlsplit(url).scheme.lower()
    if scheme == "data":
        return decode_data_url(url, what)
    if scheme not in ("http", "https"):
        raise ImageInputError(f"{what}: URL scheme '{scheme or url[:20]}' is not accepted (data: URLs; http(s) when allowed)")
    if not allow_http:
        raise ImageInputError(f"{what}: http(s) image URLs are refused by this server (send a data:image/...;base64 URL or "
                              "image_bytes_input; the preprocessing parameter allow_http_image_urls enables fetching)")
    try:
        with urllib.request.urlopen(url, timeout=HTTP_TIMEOUT_S) as resp:
            data = resp.read(MAX_IMAGE_BYTES + 1)
    except Exception as e:  # URLError, HTTPError, timeouts: the client named a URL that does not answer
        raise ImageInputError(f"{what}: fetching {url[:80]} failed: {e}"[:300]) from None
    if len(data) > MAX_IMAGE_BYTES:
        raise ImageInputError(f"{what}: image larger than {MAX_IMAGE_BYTES} bytes")
    return _open_image(data, what)


def _to_rgb(arr: np.ndarray, what: str):
    from PIL import Image

    if arr.ndim != 3:
        raise ImageInputError(f"{what}: each image must be [H, W, C] or [C, H, W] uint8 pixels, got shape {list(arr.shape)}")
    if arr.shape[-1] not in (1, 3, 4) and arr.shape[0] in (1, 3, 4):
        arr = np.moveaxis(arr, 0, -1)  # [C, H, W] → [H, W, C] (docs/multimodal.md@efb8a497:337 allows both)
    if arr.shape[-1] not in (1, 3, 4) or min(arr.shape[:2]) < 1:
        raise ImageInputError(f"{what}: each image must be [H, W, C] with C in 1, 3, 4 (decoded pixels, as upstream's "
                              f"client sends np.array([[rgb_image]])), got shape {list(arr.shape)}")
    mode = {1: "L", 3: "RGB", 4: "RGBA"}[arr.shape[-1]]
    return Image.fromarray(np.ascontiguousarray(arr if mode != "L" else arr[..., 0]), mode).convert("RGB")


def images_from_bytes(arr: np.ndarray, what: str = "image_bytes_input") -> list:
    """The RGB images of ONE request's ``image_bytes_input``: ``[1, num_images, H, W, C]`` (or ``[num_images, H, W,
    C]``, or one ``[H, W, C]``) uint8 → a list of ``PIL.Image``.

    Raises:
        ImageInputError: not uint8, or a shape that is not decoded pixels.
    """
    arr = np.asarray(arr)
    if arr.dtype != np.uint8:
        raise ImageInputError(f"{what}: must be UINT8 pixels, got {arr.dtype}")
    if arr.ndim == 5:
        if arr.shape[0] != 1:
            raise ImageInputError(f"{what}: one request carries batch 1, got shape {list(arr.shape)}")
        arr = arr[0]
    elif arr.ndim == 3:
        arr = arr[None]
    if arr.ndim != 4:
        raise ImageInputError(f"{what}: expected [batch, num_images, H, W, C] uint8, got shape {list(arr.shape)}")
    return [_to_rgb(a, what) for a in arr]


def images_from_urls(arr: np.ndarray, *, allow_http: bool, what: str = "image_url_input") -> list:
    """The RGB images of ONE request's ``image_url_input`` (strings ``[1, num_images]`` or ``[num_images]``)."""
    urls = [u.decode("utf-8", "replace") if isinstance(u, bytes) else str(u) for u in np.asarray(arr, dtype=object).reshape(-1)]
    if not any(u.strip() for u in urls):
        return []
    return [load_image_url(u, allow_http=allow_http, what=what) for u in urls if u.strip()]


def check_image_count(n: int, max_num_images: int | None, what: str) -> None:
    """Raise :class:`ImageInputError` when a request carries more than ``max_num_images`` images (``None``: no limit;
    the preprocessing parameter of upstream's, preprocessing/1/model.py@c2e65b88d852:70-85, 518-522)."""
    if max_num_images is not None and n > max_num_images:
        raise ImageInputError(f"{what}: {n} images in one request, more than max_num_images={max_num_images}")


def insert_image_tokens(ids: list[int], n_images: int, image_token_id: int, bos_id: int | None) -> list[int]:
    """``ids`` with ``<|image|>`` tokens added in front (after a leading BOS) until it holds ``n_images`` of them, as
    upstream's client prepends the tag when the prompt lacks it (tools/multimodal/client.py@c2e65b88d852:301-304)."""
    missing = n_images - sum(1 for t in ids if t == image_token_id)
    if missing <= 0:
        return ids
    at = 1 if ids and bos_id is not None and ids[0] == bos_id else 0
    return ids[:at] + [image_token_id] * missing + ids[at:]


def expand_cross_attention_mask(mask: np.ndarray, patches: int, extra_rows: int) -> np.ndarray:
    """Upstream's mask for ``tensorrt_llm``: preprocessing's ``[seq, num_images, tiles]`` (1 = the text row sees that
    tile) → bool ``[seq + extra_rows, num_images·tiles·patches]``: each tile repeated ``patches`` times, the last row
    repeated ``extra_rows`` (= max_tokens) times (multimodal_encoders/1/model.py@c2e65b88d852:381-389)."""
    m = np.asarray(mask).astype(bool)
    m = np.repeat(m.reshape(m.shape[0], -1), patches, axis=1)
    return np.concatenate([m, np.repeat(m[-1:], extra_rows, axis=0)], axis=0) if extra_rows > 0 else m


#: the tensorrt_llm inputs that carry the encoder output (tensorrt_llm/config.pbtxt@0c8de69a:50-57, 343, 413)
ENCODER_INPUTS = ("encoder_input_features", "encoder_output_lengths", "cross_attention_mask", "skip_cross_attn_blocks")


def encoder_kwargs(features, lengths, mask, skip) -> dict:
    """The keyword arguments of ``CpuEngine.add_request`` for one request's encoder inputs (``{}`` when the request has
    none, i.e. a text repository): ``encoder_input_features`` float32 ``[encoder_len, hidden]`` (cut to
    ``encoder_output_lengths``), ``cross_attention_mask`` bool ``[rows, encoder_len]``, ``skip_cross_attn_blocks``.
    A request whose skip flag is true (no image) passes no features."""
    if all(a is None for a in (features, lengths, mask, skip)):
        return {}
    skip_flag = bool(np.asarray(skip).reshape(-1)[0]) if skip is not None and np.asarray(skip).size else False
    if skip_flag or features is None or np.asarray(features).size == 0:
        return {"encoder_input_features": None, "cross_attention_mask": None, "skip_cross_attn_blocks": True}
    feats = np.asarray(features, dtype=np.float32)
    feats = feats.reshape(-1, feats.shape[-1])
    if lengths is not None and np.asarray(lengths).size:
        feats = feats[: int(np.asarray(lengths).reshape(-1)[0])]
    m = None
    if mask is not None and np.asarray(mask).size:
        m = np.asarray(mask).astype(bool)
        m = m.reshape(-1, m.shape[-1])[:, : feats.shape[0]]
    return {"encoder_input_features": feats, "cross_attention_mask": m, "skip_cross_attn_blocks": False}


def cross_attention_mask(ids: list[int], image_token_id: int, tiles_per_image, max_tiles: int, n: int) -> np.ndarray:
    """INT64 ``[len(ids), n, max_tiles]``: transformers' mllama rule (``get_cross_attention_token_mask`` +
    ``convert_sparse_cross_attention_mask_to_dense``): text from an ``<|image|>`` token onward sees that image's real
    tiles (a run of adjacent image tokens sees all of them), rows before the first image token see nothing."""
    mask = np.zeros((len(ids), n, max_tiles), np.int64)
    if n == 0:
        return mask
    from transformers.models.mllama.processing_mllama import (
        convert_sparse_cross_attention_mask_to_dense,
        get_cross_attention_token_mask,
    )

    sparse = get_cross_attention_token_mask(list(ids), image_token_id)
    dense = convert_sparse_cross_attention_mask_to_dense([sparse], [list(map(int, tiles_per_image))], max_tiles, len(ids))
    return np.asarray(dense[0], dtype=np.int64)
