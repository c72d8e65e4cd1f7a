"""Images made on this machine, never fetched: scikit-image's bundled photographs and seeded synthetic images.

scikit-image ships a few photographs inside its wheel (``skimage/data/*.png``; ``skimage.data.astronaut()`` etc.
read them from the installed package, no download). They are real photographs — edges, textures, skin, text —
which a calibration or parity run wants; the synthetic images give any size deterministically from a seed, as a
benchmark's image workload needs (AIPerf draws sizes from N(mean, stddev) and sends PNG/JPEG: ai-dynamo/aiperf@db4f6397
dataset/generator/image.py:29-57, as read in docs/reference/multimodal-vlm.md §5; issue #46 item 6).
"""

from __future__ import annotations

import functools
import io

import numpy as np
from PIL import Image

from pipeline.core.errors import UserError

#: scikit-image sample photographs bundled in its wheel (RGB; height × width in pixels)
BUNDLED_SAMPLES = ("astronaut", "chelsea", "coffee", "rocket")  # 512×512, 300×451, 400×600, 427×640


def bundled_sample(name: str) -> Image.Image:
    """One of scikit-image's bundled photographs as an RGB PIL image.

    Args:
        name: one of :data:`BUNDLED_SAMPLES`.

    Returns:
        an RGB image (astronaut 512×512, chelsea 451×300, coffee 600×400, rocket 640×427; width × height).

    Raises:
        UserError: a name outside :data:`BUNDLED_SAMPLES` (others in ``skimage.data`` may need a download).
    """
    if name not in BUNDLED_SAMPLES:
        raise UserError(f"image sample {name!r}: not one of the bundled samples {', '.join(BUNDLED_SAMPLES)}")
    import skimage.data

    return Image.fromarray(np.asarray(getattr(skimage.data, name)())).convert("RGB")


@functools.cache
def _source(name: str) -> Image.Image:
    return bundled_sample(name)


def resized_sample(width: int, height: int, index: int) -> Image.Image:
    """Bundled photograph ``index`` (modulo :data:`BUNDLED_SAMPLES`) resized to ``width × height`` pixels (bicubic,
    aspect ratio not kept) — AIPerf's synthetic image: a bundled source image resized to the sampled size
    (ai-dynamo/aiperf@db4f6397 aiperf/dataset/generator/image.py:54-55). The sources are read once per process.

    Args:
        width, height: the size in pixels (≥ 1).
        index: which bundled photograph (any integer; taken modulo the number of samples).

    Returns:
        an RGB PIL image of ``width × height`` pixels; the same arguments always give the same pixels.

    Raises:
        UserError: a non-positive size.
    """
    if width <= 0 or height <= 0:
        raise UserError(f"image size {width}×{height}: both sides must be ≥ 1 pixel")
    src = _source(BUNDLED_SAMPLES[index % len(BUNDLED_SAMPLES)])
    return src.resize((width, height), Image.Resampling.BICUBIC)


def bundled_samples() -> list[Image.Image]:
    """All :data:`BUNDLED_SAMPLES` in order, as RGB PIL images (4 photographs of different sizes and aspects)."""
    return [bundled_sample(n) for n in BUNDLED_SAMPLES]


def synthetic_image(width: int, height: int, seed: int) -> Image.Image:
    """A deterministic RGB image: smooth colour gradients plus seeded noise blocks (not flat, so resizing and
    normalisation see real variation).

    Args:
        width, height: size in pixels (≥ 1).
        seed: the numpy ``default_rng`` seed; the same (width, height, seed) always gives the same pixels.

    Returns:
        an RGB PIL image of ``width × height`` pixels, uint8.

    Raises:
        UserError: a non-positive size.
    """
    if width <= 0 or height <= 0:
        raise UserError(f"image size {width}×{height}: both sides must be ≥ 1 pixel")
    rng = np.random.default_rng(seed)
    y, x = np.mgrid[0:height, 0:width].astype(np.float32)
    phase = rng.uniform(0, 2 * np.pi, size=3).astype(np.float32)
    freq = rng.uniform(1, 4, size=3).astype(np.float32)
    chans = [127.5 + 100 * np.sin(freq[c] * (x / max(width, 1) + y / max(height, 1)) * np.pi + phase[c])
             for c in range(3)]
    img = np.stack(chans, axis=-1)
    img += rng.normal(0, 12, size=img.shape).astype(np.float32)
    return Image.fromarray(np.clip(img, 0, 255).astype(np.uint8)).convert("RGB")


def encode(image: Image.Image, fmt: str = "png") -> bytes:
    """The image as file bytes in ``fmt`` (``png`` or ``jpeg``, AIPerf's ``--image-format`` names).

    Raises:
        UserError: another format.
    """
    if fmt not in ("png", "jpeg"):
        raise UserError(f"image format {fmt!r}: use png or jpeg")
    buf = io.BytesIO()
    image.save(buf, format=fmt.upper())
    return buf.getvalue()
