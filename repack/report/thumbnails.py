"""Small JPEG thumbnails as ``data:`` URIs, for the self-contained HTML report.

Inputs may be untrusted (a quarantined file): the declared size is checked from the header
before any pixel is decoded, JPEGs are decoded at a reduced DCT scale (``draft``), and any
failure is a ``ThumbnailError`` with the reason, never a crash."""

from __future__ import annotations

import base64
import io
import re
import warnings

THUMB_SIDE = 96  # px, the longer side of an image thumbnail
FRAME_SIDE = 160  # px, a video frame
MAX_PIXELS = 50_000_000  # declared pixels beyond this are not decoded for a thumbnail
QUALITY = 70


class ThumbnailError(ValueError):
    """An input that gives no thumbnail; the message says why."""


def thumbnail_uri(data: bytes, side: int = THUMB_SIDE) -> str:
    """A ``data:image/jpeg;base64,...`` thumbnail of the image in ``data`` (longer side <= ``side``)."""
    from PIL import Image, UnidentifiedImageError

    if not data:
        raise ThumbnailError("empty file")
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("error", Image.DecompressionBombWarning)
            image = Image.open(io.BytesIO(data))
            width, height = image.size
            if width * height > MAX_PIXELS:
                raise ThumbnailError(f"declares {width}x{height} pixels: not decoded for a thumbnail")
            if image.format == "JPEG":
                image.draft("RGB", (side, side))
            image = image.convert("RGB")
            image.thumbnail((side, side))
            out = io.BytesIO()
            image.save(out, "JPEG", quality=QUALITY)
    except ThumbnailError:
        raise
    except Exception as exc:  # noqa: BLE001 - whatever PIL raises on a bad file is the reason shown
        if isinstance(exc, UnidentifiedImageError):
            raise ThumbnailError("does not decode: not a recognized image (corrupt header)") from None
        detail = re.sub(r"<[^>]* at 0x[0-9a-f]+>", "the file", (str(exc).splitlines() or [""])[0])[:120]
        raise ThumbnailError(f"does not decode: {detail or 'damaged image data'}") from None
    return "data:image/jpeg;base64," + base64.b64encode(out.getvalue()).decode("ascii")
