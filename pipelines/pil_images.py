"""Decoding a stored image for the PyTorch readers, with 16-bit samples scaled correctly.

Pillow's ``convert("L"/"RGB")`` clips a 16-bit (``I;16*``) or 32-bit integer (``I``) grayscale
image to 0..255 instead of scaling it, so a mid-gray 16-bit PNG comes back white. Here such an
image is scaled to 8 bits first, by the same fixed rule ``repack --normalize`` uses: ``>> 8``
(mode ``I`` clamped to 0..65535 first), then converted to the requested mode.

Reduced-size JPEG decode (opt-in, ``draft``): libjpeg scales the DCT by 1/2, 1/4 or 1/8 while
decoding (Pillow's ``Image.draft``), the largest factor that keeps both sides at least the
requested (width, height); a 1,000+ px photo for a 224 crop then decodes a quarter to a
sixteenth of the pixels. Other formats decode at full size. The user's transform resizes
the result as before.
"""

from __future__ import annotations

import io

import numpy as np
from PIL import Image, ImageChops

WIDE_GRAY_MODES = ("I;16", "I;16B", "I;16L", "I;16N", "I")


def to_8bit_gray(image: Image.Image) -> Image.Image:
    """A 16/32-bit integer grayscale image as 8-bit ``L`` (``>> 8``); other modes unchanged."""
    if image.mode not in WIDE_GRAY_MODES:
        return image
    values = np.asarray(image)
    if image.mode == "I":
        values = np.clip(values, 0, 65535)
    return Image.fromarray((values.astype(np.uint32) >> 8).astype(np.uint8), "L")


ORIENTATION_TAG = 274
_UNDO_ORIENTATION = {2: Image.Transpose.FLIP_LEFT_RIGHT, 3: Image.Transpose.ROTATE_180,
                     4: Image.Transpose.FLIP_TOP_BOTTOM, 5: Image.Transpose.TRANSPOSE, 6: Image.Transpose.ROTATE_90,
                     7: Image.Transpose.TRANSVERSE, 8: Image.Transpose.ROTATE_270}  # each orientation's inverse


def tiff_orientation(image: Image.Image) -> int:
    """The orientation tag of a TIFF as opened, before it is loaded (1 for any other image). Pillow applies a
    TIFF's orientation itself as it loads it (no other format's): every reader here, and DALI, decodes the
    stored pixels; the orientation is ``--normalize``'s to apply."""
    if image.format != "TIFF":
        return 1
    value = image.tag_v2.get(ORIENTATION_TAG, 1)
    return value if value in _UNDO_ORIENTATION else 1


def stored_size(image: Image.Image) -> tuple[int, int]:
    """(width, height) of the pixels as stored (Pillow gives a TIFF of orientation 5-8 its sides swapped)."""
    width, height = image.size
    return (height, width) if tiff_orientation(image) in (5, 6, 7, 8) else (width, height)


def pixels_as_stored(image: Image.Image) -> Image.Image:
    """``image`` (just opened) loaded with its pixels as stored: a TIFF's orientation, which Pillow applied while
    loading, undone."""
    undo = _UNDO_ORIENTATION.get(tiff_orientation(image))
    image.load()
    return image.transpose(undo) if undo is not None else image


def first_shown_frame(image: Image.Image) -> Image.Image:
    """An animated PNG whose default image is no frame of its animation (``default_image``): seeked to the
    animation's first frame, the picture DALI decodes; any other image unchanged."""
    if image.format == "PNG" and image.info.get("default_image") and getattr(image, "n_frames", 1) > 1:
        image.seek(1)
    return image


def cmyk_as_stored(image: Image.Image) -> Image.Image:
    """A CMYK JPEG as its bytes say. Pillow reads every CMYK JPEG as Adobe's inverted CMYK; one without
    Adobe's APP14 marker holds plain CMYK (as libjpeg and DALI read it), so Pillow's values are inverted back
    (its picture came out near black). Other images unchanged."""
    if image.mode == "CMYK" and image.format == "JPEG" and "adobe" not in image.info:
        return ImageChops.invert(image)
    return image


def check_draft(draft) -> tuple[int, int] | None:
    """``draft`` as a (width, height) tuple of positive ints, or None; a clear error otherwise."""
    if draft is None:
        return None
    try:
        width, height = (int(v) for v in draft)
    except (TypeError, ValueError):
        raise ValueError(f"draft size must be (width, height), got {draft!r}") from None
    if width < 1 or height < 1 or (width, height) != tuple(draft):
        raise ValueError(f"draft size must be two positive integers (width, height), got {draft!r}")
    return width, height


def allow_pixels(checked: int) -> None:
    """Let this process's Pillow decode images of up to ``checked`` pixels, the ``--max-pixels`` a dataset's
    check let in (``manifest_access.checked_pixels``): over Pillow's own bomb limit (~179 MP) a sample the check
    had packed was refused. The limit only rises (a process may read several datasets)."""
    if Image.MAX_IMAGE_PIXELS is not None and checked > Image.MAX_IMAGE_PIXELS:
        Image.MAX_IMAGE_PIXELS = checked  # its warning at that many pixels, its error at twice as many


def decode_image(data: bytes, mode: str | None, draft: tuple[int, int] | None = None) -> Image.Image:
    """Decode ``data``; convert to ``mode`` (None: the stored mode, except 16-bit gray becomes 8-bit L).

    ``draft`` (width, height): decode a JPEG at the strongest DCT reduction (1/2, 1/4, 1/8) that
    keeps both sides at least that large; None (and any other format) decodes at full size."""
    size = check_draft(draft)
    image = Image.open(io.BytesIO(data))
    if size is not None and image.format == "JPEG":
        image.draft(None, size)
    if tiff_orientation(image) != 1:
        image = pixels_as_stored(image)
    image = to_8bit_gray(cmyk_as_stored(first_shown_frame(image)))
    if mode is not None and image.mode != mode:
        return image.convert(mode)
    image.load()
    return image
