"""``image_url`` content parts of the trtllm-serve CPU stand-in's chat route (issue #47 item 3): what upstream's
trtllm-serve does with them, restated for the stand-in (:mod:`pipeline.cpu_runtime.openai`).

Upstream read: ``UTILS`` = tensorrt_llm/inputs/utils.py@00a8667c4547, ``MIO`` = tensorrt_llm/inputs/media_io.py
@0142b193cc02 (undated copies of the index; no 1.2.1-tagged copy is readable).

- ``data:`` URLs: base64 only ("Only base64 data URLs are supported for now", UTILS ``load_base64_image`` :45-55),
  decoded with PIL and converted to RGB (MIO ``_load_and_convert_image``: ``Image.open`` + ``load`` + RGB).
- ``http``/``https`` URLs are fetched (UTILS ``load_image`` :77-79 → MIO ``_safe_request_get``): only to public
  (global) addresses (``_validate_url``), at most 5 redirects, 30 s timeout, at most 200 MB
  (``_MAX_RESPONSE_BYTES``). The stand-in does the same with urllib.
- local paths and ``file:`` URLs: upstream opens them (UTILS :82-83; the 1.4.0rc4 docs gate them behind
  ``TRTLLM_MEDIA_ALLOWED_LOCAL_PATH``, shared/reference/multimodal-vlm.md §3). The stand-in refuses them: a served
  endpoint does not read its host's files. Any other scheme: "Unsupported URL scheme" (UTILS :84-85).
- **Too large**: Qwen2-VL's processor resizes any image down within ``max_pixels`` (the token rule), so "oversized"
  here means what upstream's decode itself refuses: PIL's decompression-bomb limit, ``Image.open`` raising
  ``DecompressionBombError`` above 2 × ``Image.MAX_IMAGE_PIXELS`` (178,956,970 px) — checked on the header, before
  the pixels are decoded — and the 200 MB byte cap, applied to ``data:`` payloads too.

Every refusal is one ``ValueError`` line naming the content part (the route answers HTTP 400; the server keeps
serving).
"""

from __future__ import annotations

import base64
import binascii
import ipaddress
import socket
import warnings
from io import BytesIO
from typing import Any
from urllib.parse import urljoin, urlparse

#: MIO ``_MAX_RESPONSE_BYTES``: the largest image payload, bytes
MAX_IMAGE_BYTES = 200 * 1024 * 1024
#: MIO ``_MAX_REDIRECTS`` and ``_safe_request_get``'s timeout (seconds)
MAX_REDIRECTS, FETCH_TIMEOUT_S = 5, 30


def max_image_pixels() -> int:
    """Width × height above which an image is refused: PIL's ``DecompressionBombError`` threshold
    (2 × ``Image.MAX_IMAGE_PIXELS``), the limit upstream's ``Image.open`` applies."""
    from PIL import Image

    return 2 * int(Image.MAX_IMAGE_PIXELS or 89_478_485)


def decode_image(data: bytes, where: str, pixel_limit: int | None = None) -> Any:
    """RGB PIL image of ``data`` (bytes of a PNG/JPEG/…); ``where`` names the part in errors.

    Raises:
        ValueError: more than :data:`MAX_IMAGE_BYTES`, not an image PIL can decode, or more pixels than
            ``pixel_limit`` (default :func:`max_image_pixels`).
    """
    from PIL import Image

    if len(data) > MAX_IMAGE_BYTES:
        raise ValueError(f"{where}: {len(data)} bytes exceed the {MAX_IMAGE_BYTES}-byte image limit")
    limit = pixel_limit or max_image_pixels()
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", Image.DecompressionBombWarning)
            im = Image.open(BytesIO(data))
            w, h = im.size
            if w * h > limit:
                raise ValueError(f"{where}: image of {w}×{h} px exceeds the {limit}-pixel limit")
            im.load()
    except Image.DecompressionBombError:
        raise ValueError(f"{where}: image exceeds the {limit}-pixel limit") from None
    except (OSError, SyntaxError) as e:  # PIL: UnidentifiedImageError, truncated or broken files
        raise ValueError(f"{where}: cannot decode the image ({str(e).splitlines()[0] if str(e) else type(e).__name__})") from None
    return im.convert("RGB") if im.mode != "RGB" else im


def _check_public(url: str, where: str) -> None:
    """MIO ``_validate_url``: the host must resolve to global, non-multicast addresses only."""
    host = urlparse(url).hostname
    if not host:
        raise ValueError(f"{where}: URL has no hostname")
    try:
        infos = socket.getaddrinfo(host, None, proto=socket.IPPROTO_TCP)
    except socket.gaierror:
        raise ValueError(f"{where}: cannot resolve {host!r}") from None
    for *_, addr in infos:
        ip = ipaddress.ip_address(addr[0])
        if not ip.is_global or ip.is_multicast:
            raise ValueError(f"{where}: URL resolves to a non-public address ({ip})")


def _fetch(url: str, where: str) -> bytes:
    """GET ``url`` as MIO ``_safe_request_get``: public hosts, ≤ :data:`MAX_REDIRECTS` redirects (each checked),
    ≤ :data:`MAX_IMAGE_BYTES`, :data:`FETCH_TIMEOUT_S` s; an answer whose Content-Type is not ``image/*`` is refused."""
    import urllib.error
    import urllib.request

    class _NoRedirect(urllib.request.HTTPRedirectHandler):
        def redirect_request(self, *a: Any, **k: Any) -> None:
            return None

    opener = urllib.request.build_opener(_NoRedirect)
    for _ in range(MAX_REDIRECTS + 1):
        _check_public(url, where)
        try:
            resp = opener.open(url, timeout=FETCH_TIMEOUT_S)
        except urllib.error.HTTPError as e:
            if e.code in (301, 302, 303, 307, 308) and e.headers.get("Location"):
                url = urljoin(url, e.headers["Location"])
                continue
            raise ValueError(f"{where}: fetching the image failed: HTTP {e.code}") from None
        except (urllib.error.URLError, OSError) as e:
            raise ValueError(f"{where}: fetching the image failed: {e}") from None
        with resp:
            ctype = resp.headers.get_content_type()
            if not ctype.startswith("image/"):
                raise ValueError(f"{where}: the URL is not an image (Content-Type {ctype})")
            data = resp.read(MAX_IMAGE_BYTES + 1)
        return data
    raise ValueError(f"{where}: too many redirects")


def load_image_url(url: str, where: str = "image_url", pixel_limit: int | None = None) -> Any:
    """An ``image_url`` part's image as RGB PIL (module docstring for the rules).

    Raises:
        ValueError: one line naming ``where``: a non-base64 or non-image ``data:`` URL, a local path or ``file:``
            URL, another scheme, a failed or non-image fetch, an undecodable or oversized image.
    """
    if not isinstance(url, str) or not url:
        raise ValueError(f"{where}: url must be a non-empty string")
    scheme = urlparse(url).scheme.lower()
    if scheme == "data":
        spec, _, payload = url[5:].partition(",")
        media, _, enc = spec.partition(";")
        if enc != "base64":
            raise ValueError(f"{where}: only base64 data URLs are supported")
        if media and not media.lower().startswith("image/"):
            raise ValueError(f"{where}: the data URL is not an image (media type {media})")
        try:
            data = base64.b64decode(payload, validate=True)
        except (binascii.Error, ValueError):
            raise ValueError(f"{where}: the data URL is not valid base64") from None
        return decode_image(data, where, pixel_limit)
    if scheme in ("http", "https"):
        return decode_image(_fetch(url, where), where, pixel_limit)
    if scheme in ("", "file"):
        raise ValueError(f"{where}: local files are not served by trtpipe's CPU stand-in (send a data: or http(s) URL)")
    raise ValueError(f"{where}: unsupported URL scheme {scheme!r}")


def chat_images(messages: list[dict[str, Any]], pixel_limit: int | None = None) -> list[Any]:
    """The images of a chat request's ``image_url`` content parts, in message order (RGB PIL).

    Raises:
        ValueError: a malformed part or an image :func:`load_image_url` refuses (one line naming
            ``messages[i].content[j]``).
    """
    out = []
    for i, m in enumerate(messages):
        content = m.get("content") if isinstance(m, dict) else None
        if not isinstance(content, list):
            continue
        for j, part in enumerate(content):
            if not isinstance(part, dict) or part.get("type") != "image_url":
                continue
            where = f"messages[{i}].content[{j}].image_url"
            spec = part.get("image_url")
            url = spec.get("url") if isinstance(spec, dict) else spec
            out.append(load_image_url(url, where, pixel_limit))
    return out
