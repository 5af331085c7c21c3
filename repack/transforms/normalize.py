"""`--normalize`: make every image hit the fastest GPU decode path (baseline 4:2:0 RGB JPEG).

An input *conforms* when it is a baseline (SOF0), 8-bit, 3-component YCbCr JPEG with 4:2:0
chroma subsampling, no EXIF orientation other than 1, and no side longer than ``max_side``.
Conforming inputs pass through byte-for-byte (no generation loss). Everything else is
decoded and re-encoded:

- mode: 16-bit (I;16*, I) is scaled to 8 bits by a fixed shift, never by the image's own range:
  I;16* (16-bit PNG/TIFF) ``>> 8``; 32-bit I (TIFF, older Pillow's 16-bit PNG) clamped to 0..65535
  then ``>> 8``; transparency (RGBA, LA, and P, L or RGB with a transparent colour: PNG's tRNS) is
  composited over white;
  L, CMYK, YCbCr-less, palette -> RGB;
- animation (GIF, WebP): the first frame;
- EXIF orientation is applied to the pixels; EXIF is not copied (so the tag is gone); the source
  size is reported as displayed (after the orientation's transpose), like the output size;
- ``max_side``: the longer side is reduced to ``max_side`` (aspect kept, never upscaled):
  JPEG DCT-domain draft to >= 2x the target, then Lanczos with an integer reduce() first when
  the factor allows (reducing_gap 2, as Pillow's thumbnail); the size is computed from the source's,
  so one picture as JPEG and as PNG comes out the same size;
- written as baseline (non-progressive) JPEG, 4:2:0, at ``quality``; the ICC profile of a source
  whose colours are RGB (RGB, RGBA, palette) is kept.

Every input is first checked by a full decode (``inspect_image``, whatever ``--verify`` says), so a corrupt
input (a PNG with a corrupt IDAT, a truncated JPEG) is quarantined, never converted nor passed through; decompression
bombs are refused before any pixel is decoded (the declared size against ``max_pixels``).

Memory: a conversion decodes the whole image, so whatever ``--max-pixels`` allows, the decoded
image may take at most ``NORMALIZE_MEMORY_CAP`` bytes (256 MiB: about 89 megapixels of 8-bit
RGB), measured at the size it decodes to (a JPEG with ``max_side`` decodes reduced in the DCT
domain first). A larger one is quarantined with both numbers, before any pixel is decoded; the
conversion's copies (RGB, resize) keep a worker's peak at a small multiple of the cap.
"""

from __future__ import annotations

import io
from dataclasses import dataclass

import numpy as np
from PIL import Image, ImageOps

from pipelines.pil_images import ORIENTATION_TAG, cmyk_as_stored, first_shown_frame  # the readers' decode: alike
from repack.transforms.image_check import (DECODE_MEMORY_CAP, BadImage, ImageInfo, decode_failure, inspect_image,
                                           pil)

pil()  # the project's Pillow settings (pixel limit, no truncated loads) before any use here

JPEG_MAX_SIDE = 65500  # libjpeg's largest side: a wider picture fails inside the encoder
NORMALIZE_MEMORY_CAP = DECODE_MEMORY_CAP  # bytes the decoded image of a conversion may take (module docstring)
_SOF_MARKERS = {0xC0, 0xC1, 0xC2, 0xC3, 0xC5, 0xC6, 0xC7, 0xC9, 0xCA, 0xCB, 0xCD, 0xCE, 0xCF}


@dataclass(frozen=True)
class NormalizeOptions:
    quality: int = 90
    max_side: int | None = None
    max_pixels: int = 178_956_970


@dataclass(frozen=True)
class Normalized:
    """The bytes to store and what was done: ``reasons`` is empty when the input passed through."""

    data: bytes
    ext: str
    width: int
    height: int
    reasons: tuple[str, ...]
    source_size: tuple[int, int] = (0, 0)


@dataclass(frozen=True)
class JpegHeader:
    sof: int                      # the SOFn marker byte (0xC0 = baseline)
    precision: int
    sampling: tuple[tuple[int, int], ...]  # (h, v) per component


def jpeg_header(data: bytes) -> JpegHeader | None:
    """Parse JPEG markers up to the first SOFn: frame type, precision, sampling factors."""
    pos, n = 2, len(data)
    while pos + 4 <= n:
        if data[pos] != 0xFF:
            return None
        marker = data[pos + 1]
        if marker == 0xFF:  # fill byte
            pos += 1
            continue
        if marker in (0xD8, 0x01) or 0xD0 <= marker <= 0xD7:
            pos += 2
            continue
        length = int.from_bytes(data[pos + 2:pos + 4], "big")
        if marker in _SOF_MARKERS:
            seg = data[pos + 4:pos + 2 + length]
            if len(seg) < 6:
                return None
            count = seg[5]
            sampling = tuple((seg[6 + 3 * i + 1] >> 4, seg[6 + 3 * i + 1] & 15) for i in range(count)
                             if 6 + 3 * i + 1 < len(seg))
            return JpegHeader(marker, seg[0], sampling)
        if marker == 0xDA:  # start of scan before any frame header
            return None
        pos += 2 + length
    return None


def nonconformity(data: bytes, info: ImageInfo, image: Image.Image, max_side: int | None) -> list[str]:
    """Why an opened image is not a pass-through baseline 4:2:0 RGB JPEG (empty list: it is)."""
    reasons: list[str] = []
    if info.ext != "jpg":
        reasons.append(f"format {info.ext}")
    else:
        header = jpeg_header(data)
        if header is None:
            reasons.append("unparsable JPEG header")
        else:
            if header.sof == 0xC2 or header.sof in (0xC6, 0xCA, 0xCE):
                reasons.append("progressive JPEG")
            elif header.sof != 0xC0:
                reasons.append(f"non-baseline JPEG (SOF{header.sof - 0xC0})")
            if header.precision != 8:
                reasons.append(f"{header.precision}-bit JPEG")
            if len(header.sampling) == 3 and header.sampling != ((2, 2), (1, 1), (1, 1)):
                h, v = header.sampling[0]
                reasons.append(f"chroma subsampling {h}x{v} (not 4:2:0)")
        if image.mode != "RGB":
            reasons.append(f"mode {image.mode}")
        elif image.info.get("adobe_transform") == 0:
            reasons.append("RGB-coded JPEG (not YCbCr)")
    if info.ext == "jpg" or info.ext in ("png", "webp", "tiff"):
        try:
            orientation = image.getexif().get(ORIENTATION_TAG, 1)
        except Exception:  # noqa: BLE001 - a broken EXIF block is not worth a quarantine
            orientation = 1
        if orientation not in (1, None):
            reasons.append("EXIF orientation")
    if max_side is not None and max(info.width, info.height) > max_side:
        reasons.append("longer side > max_side")
    if info.ext != "jpg" and image.mode != "RGB":
        reasons.append(f"mode {image.mode}")
    return reasons


SIXTEEN_BIT_MODES = ("I;16", "I;16B", "I;16L", "I;16N")
RGB_PROFILED = ("RGB", "RGBA", "RGBa", "P")  # modes whose ICC profile describes RGB colours: kept in the JPEG
TRANSPOSING_ORIENTATIONS = (5, 6, 7, 8)  # EXIF orientations that swap width and height


def to_8bit(image: Image.Image) -> np.ndarray:
    """A 16-bit (I;16*) or 32-bit integer (I) grayscale image as uint8, by a fixed ``>> 8``.

    The scale depends on the mode only (an all-1000 image becomes 3 whatever else it holds);
    mode I is clamped to 0..65535 first.
    """
    values = np.asarray(image)
    if image.mode == "I":
        values = np.clip(values, 0, 65535)
    return (values.astype(np.uint32) >> 8).astype(np.uint8)


def _displayed_size(width: int, height: int, image: Image.Image) -> tuple[int, int]:
    """(width, height) as displayed: swapped when the image's EXIF orientation transposes it."""
    try:
        orientation = image.getexif().get(ORIENTATION_TAG, 1)
    except Exception:  # noqa: BLE001 - as in nonconformity: a broken EXIF block is ignored
        orientation = 1
    return (height, width) if orientation in TRANSPOSING_ORIENTATIONS else (width, height)


def _to_rgb(image: Image.Image, depth16_rgb: bool = False) -> Image.Image:
    """Any Pillow mode -> 8-bit RGB (16-bit scaled, transparency over white). ``depth16_rgb``: a 16-bit RGB PNG,
    which Pillow holds as 8-bit RGB while its transparent colour (tRNS) keeps another reduction of the 16-bit
    key: it matched opaque pixels (bright red came out white), so such a colour is not applied."""
    mode = image.mode
    if mode in SIXTEEN_BIT_MODES or mode == "I":
        key = image.info.get("transparency")
        wide = np.asarray(image)
        gray = Image.fromarray(to_8bit(image), "L")
        if isinstance(key, int):  # the 16-bit transparent gray, matched before the values are reduced
            alpha = Image.fromarray(np.where(wide == key, 0, 255).astype(np.uint8), "L")
            gray = Image.merge("LA", (gray, alpha))
        image, mode = gray, gray.mode
    if depth16_rgb and mode == "RGB":
        image.info.pop("transparency", None)
    if mode == "F":
        image = image.convert("L")
        mode = "L"
    if mode in ("P", "L", "RGB") and "transparency" in image.info:  # a palette entry's, or PNG's one transparent
        image = image.convert("RGBA")                                 # gray or RGB colour (tRNS)
        mode = image.mode
    elif mode == "P":
        image = image.convert("RGB")
        mode = image.mode
    if mode in ("RGBA", "LA", "PA", "RGBa", "La"):
        rgba = image.convert("RGBA")
        background = Image.new("RGBA", rgba.size, (255, 255, 255, 255))
        return Image.alpha_composite(background, rgba).convert("RGB")
    return image if mode == "RGB" else image.convert("RGB")


def _target_size(width: int, height: int, max_side: int | None) -> tuple[int, int] | None:
    if max_side is None or max(width, height) <= max_side:
        return None
    scale = max_side / max(width, height)
    return max(1, round(width * scale)), max(1, round(height * scale))


def decoded_bytes(image: Image.Image) -> int:
    """Bytes of ``image``'s pixels once decoded at its current (possibly drafted) size and mode."""
    mode = image.mode
    sample = 2 if mode.startswith("I;16") else 4 if mode in ("I", "F") else 1
    return image.size[0] * image.size[1] * len(image.getbands()) * sample


def _check_budget(image: Image.Image, ext: str) -> None:
    """BadImage when decoding ``image`` would exceed NORMALIZE_MEMORY_CAP."""
    need = decoded_bytes(image)
    if need > NORMALIZE_MEMORY_CAP:
        width, height = image.size
        hint = "" if ext != "jpg" else "; --max-side lets a JPEG decode reduced"
        raise BadImage(f"--normalize would decode {ext.upper()} of {width}x{height} ({image.mode}) into {need} bytes, "
                       f"over the {NORMALIZE_MEMORY_CAP}-byte decode budget{hint}")


def normalize_image(data: bytes, options: NormalizeOptions) -> Normalized:
    """Pass ``data`` through if it conforms, else convert it; BadImage on bad input. Checked by a full decode
    whatever ``--verify`` says (docs/failure-model.md: a corrupt input is quarantined, never re-encoded or
    passed through as normalized)."""
    info = inspect_image(data, "decode", options.max_pixels)  # a corrupt input is never converted
    try:
        image = first_shown_frame(Image.open(io.BytesIO(data)))
        if info.ext != "jpg":  # never passed through, so converted: and reading a PNG's EXIF decodes it whole
            _check_budget(image, info.ext)
        reasons = nonconformity(data, info, image, options.max_side)
    except BadImage:
        raise
    except Exception as exc:  # noqa: BLE001
        raise BadImage(decode_failure(info.ext, exc)) from None
    if not reasons:
        return Normalized(data, "jpg", info.width, info.height, (), (info.width, info.height))
    if getattr(image, "n_frames", 1) > 1:
        reasons.append("animated (first frame kept)")
    try:
        target = _target_size(info.width, info.height, options.max_side)
        if target is not None and info.ext == "jpg":
            image.draft(None, (target[0] * 2, target[1] * 2))
        _check_budget(image, info.ext)  # before any pixel is decoded
        icc = image.info.get("icc_profile") if image.mode in RGB_PROFILED else None
        rotated = "EXIF orientation" in reasons  # the displayed size read before loading: Pillow applies a TIFF's
        source_size = _displayed_size(info.width, info.height, image) if rotated else (info.width, info.height)
        image.load()                                          # orientation as it loads it, and drops the tag
        image = cmyk_as_stored(image)
        if rotated:
            image = ImageOps.exif_transpose(image)  # a TIFF's is done: no tag is left
        rgb = _to_rgb(image, info.ext == "png" and data[24:26] == b"\x10\x02")  # IHDR: depth 16, colour type 2
        if target is not None:  # the size from the source's (as displayed), not the drafted decode's: a JPEG and a
            final = _target_size(*source_size, options.max_side)  # PNG of one picture come out alike
            if final is not None and final != rgb.size:
                rgb = rgb.resize(final, Image.LANCZOS, reducing_gap=2.0)  # as Image.thumbnail
        if max(rgb.size) > JPEG_MAX_SIDE:
            raise BadImage(f"{info.ext.upper()} of {rgb.size[0]}x{rgb.size[1]}: a JPEG holds at most {JPEG_MAX_SIDE} "
                           "pixels a side; --max-side makes it fit")
        out = io.BytesIO()
        save = {"quality": options.quality, "subsampling": 2, "progressive": False, "optimize": False}
        if icc:
            save["icc_profile"] = icc
        rgb.save(out, "JPEG", **save)
    except BadImage:
        raise
    except Exception as exc:  # noqa: BLE001 - PIL raises many types for bad data
        raise BadImage(decode_failure(info.ext, exc)) from None
    return Normalized(out.getvalue(), "jpg", rgb.size[0], rgb.size[1], tuple(dict.fromkeys(reasons)),
                      source_size)
