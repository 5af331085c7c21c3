"""Image type detection (from content, not the file name) and integrity checks.

Levels:
  none    detect the type from magic bytes and read the header (dimensions for metadata)
  header  + a trailer check (JPEG EOI, PNG IEND, GIF trailer): catches truncation cheaply
  decode  + a full entropy decode; JPEGs are decoded at 1/8 scale through libjpeg's DCT
          scaling (every coefficient is still Huffman-decoded, so truncated or corrupt
          streams fail) which is several times cheaper than a full-resolution decode.
"""

from __future__ import annotations

import io
import warnings
from dataclasses import dataclass

from PIL import Image, ImageFile

ImageFile.LOAD_TRUNCATED_IMAGES = False
# The pixel limit is ours (``max_pixels``, checked on the declared size right after the header is
# parsed and before any pixel is decoded); Pillow's own global limit would silently cap it.
Image.MAX_IMAGE_PIXELS = None
# Load every format plugin now, not inside the first sample's timed check (tens of ms that
# would otherwise show up as a bogus "slowest input" in each worker).
Image.init()

# magic prefix -> canonical extension
_MAGIC: tuple[tuple[bytes, str], ...] = (
    (b"\xff\xd8\xff", "jpg"),
    (b"\x89PNG\r\n\x1a\n", "png"),
    (b"GIF87a", "gif"),
    (b"GIF89a", "gif"),
    (b"BM", "bmp"),
    (b"II*\x00", "tiff"),
    (b"MM\x00*", "tiff"),
)


class BadImage(ValueError):
    """An input that is not a usable image; the message is the quarantine reason."""


@dataclass(frozen=True)
class ImageInfo:
    ext: str
    width: int
    height: int
    mode: str
    progressive: bool = False


def detect_type(data: bytes) -> str | None:
    """Canonical extension of an image from its first bytes, or None."""
    if data[:4] == b"RIFF" and data[8:12] == b"WEBP":
        return "webp"
    for magic, ext in _MAGIC:
        if data.startswith(magic):
            return ext
    return None


def _has_trailer(ext: str, data: bytes) -> bool:
    tail = data[-4096:]
    if ext == "jpg":
        return b"\xff\xd9" in tail
    if ext == "png":
        return b"IEND" in tail
    if ext == "gif":
        return b";" in tail
    return True


_JPEG_SOF = frozenset(range(0xC0, 0xD0)) - {0xC4, 0xC8, 0xCC}
_JPEG_MODES = {1: "L", 3: "RGB", 4: "CMYK"}
_PNG_MODES = {0: "L", 2: "RGB", 3: "P", 4: "LA", 6: "RGBA"}


def _jpeg_header(data: bytes) -> ImageInfo | None:
    """Dimensions from the first SOF marker (no PIL): ~20x cheaper than Image.open."""
    pos, end = 2, min(len(data), 1 << 20)
    while pos + 4 <= end:
        if data[pos] != 0xFF:
            return None
        marker = data[pos + 1]
        if marker == 0xFF:
            pos += 1
            continue
        length = int.from_bytes(data[pos + 2:pos + 4], "big")
        if marker in _JPEG_SOF:
            if pos + 10 > len(data):
                return None
            height = int.from_bytes(data[pos + 5:pos + 7], "big")
            width = int.from_bytes(data[pos + 7:pos + 9], "big")
            mode = _JPEG_MODES.get(data[pos + 9])
            if not width or not height or mode is None:
                return None
            return ImageInfo("jpg", width, height, mode, marker in (0xC2, 0xC6, 0xCA, 0xCE))
        if marker == 0xDA or length < 2:
            return None
        pos += 2 + length
    return None


def _png_header(data: bytes) -> ImageInfo | None:
    if len(data) < 33 or data[12:16] != b"IHDR":
        return None
    width, height = int.from_bytes(data[16:20], "big"), int.from_bytes(data[20:24], "big")
    mode = _PNG_MODES.get(data[25])
    if not width or not height or mode is None:
        return None
    return ImageInfo("png", width, height, mode if data[24] <= 8 else f"{mode};16", data[28] == 1)


def inspect_image(data: bytes, level: str = "decode", max_pixels: int = 178_956_970) -> ImageInfo:
    """Check ``data`` at ``level``; return its type and size, or raise BadImage with the reason."""
    if not data:
        raise BadImage("empty file (0 bytes)")
    ext = detect_type(data)
    if ext is None:
        raise BadImage("not a recognized image format (checked the content, not the name)")
    if level == "none" and ext in ("jpg", "png"):
        info = _jpeg_header(data) if ext == "jpg" else _png_header(data)
        if info is not None and info.width * info.height <= max_pixels:
            return info  # otherwise PIL below gives the precise reason
    with warnings.catch_warnings():
        warnings.simplefilter("error", Image.DecompressionBombWarning)
        try:
            image = Image.open(io.BytesIO(data))
            width, height = image.size
            if width * height > max_pixels:
                raise BadImage(f"decompression bomb: {width}x{height} = {width * height} pixels exceeds "
                               f"--max-pixels {max_pixels}")
            info = ImageInfo(ext, width, height, image.mode, bool(image.info.get("progressive") or image.info.get("progression")))
            if level == "none":
                return info
            if not _has_trailer(ext, data):
                raise BadImage(f"truncated {ext.upper()} (no end marker)")
            if level == "decode":
                if ext == "jpg":
                    image.draft(image.mode, (max(1, width // 8), max(1, height // 8)))
                image.load()
            return info
        except BadImage:
            raise
        except (Image.DecompressionBombError, Image.DecompressionBombWarning) as exc:
            raise BadImage(f"decompression bomb: {exc}") from None
        except Exception as exc:  # noqa: BLE001 - PIL raises many types for bad data
            message = str(exc) or type(exc).__name__
            raise BadImage(f"cannot decode {ext.upper()}: {message}") from None
