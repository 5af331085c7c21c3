"""Decoding a stored image for the PyTorch readers, with 16-bit samples scaled correctly.

Pillow's ``convert("L"/"RGB")`` clips a 16-bit (``I;16*``) or 32-bit integer (``I``) grayscale
image to 0..255 instead of scaling it, so a mid-gray 16-bit PNG comes back white. Here such an
image is scaled to 8 bits first, by the same fixed rule ``repack --normalize`` uses: ``>> 8``
(mode ``I`` clamped to 0..65535 first), then converted to the requested mode.
"""

from __future__ import annotations

import io

import numpy as np
from PIL import Image

WIDE_GRAY_MODES = ("I;16", "I;16B", "I;16L", "I;16N", "I")


def to_8bit_gray(image: Image.Image) -> Image.Image:
    """A 16/32-bit integer grayscale image as 8-bit ``L`` (``>> 8``); other modes unchanged."""
    if image.mode not in WIDE_GRAY_MODES:
        return image
    values = np.asarray(image)
    if image.mode == "I":
        values = np.clip(values, 0, 65535)
    return Image.fromarray((values.astype(np.uint32) >> 8).astype(np.uint8), "L")


def decode_image(data: bytes, mode: str | None) -> Image.Image:
    """Decode ``data``; convert to ``mode`` (None: the stored mode, except 16-bit gray becomes 8-bit L)."""
    image = Image.open(io.BytesIO(data))
    image = to_8bit_gray(image)
    if mode is not None and image.mode != mode:
        return image.convert(mode)
    image.load()
    return image
