"""Image type detection (from content, not the file name) and integrity checks.

Levels:
  none    detect the type from magic bytes and read the header (dimensions for metadata)
  header  + a trailer check (a JPEG's segments walked to its EOI, a PNG's chunks to IEND, a GIF ending with its
          trailer; data after the image's end allowed): catches truncation cheaply
  decode  + proof that the whole image decodes, in bounded memory whatever ``max_pixels``:
          JPEG: a full libjpeg-turbo decode (simplejpeg) in strict mode, so libjpeg's
          "corrupt data" warnings (a truncated stream given a fake end marker, a premature
          end of a scan) are errors; decoded to one luma plane (no colour conversion) at the
          strongest DCT reduction libjpeg offers (1/8: every coefficient is still entropy-decoded,
          and 800 random corruptions were judged alike at full size); a progressive JPEG, whose
          coefficients are held whole, is refused beyond DECODE_MEMORY_CAP from its header.
          PNG: every chunk's CRC, the IHDR, and the whole zlib stream of the IDAT chunks
          inflated piece by piece (never the whole image in memory): it must end exactly at
          the image's size (height x (1 + row bytes), per Adam7 pass when interlaced), with a
          valid filter byte on every row.
          Other formats: Pillow's full decode, refused beyond DECODE_MEMORY_CAP.
"""

from __future__ import annotations

import io
import re
import warnings
import zlib
from dataclasses import dataclass
from functools import cache
from typing import TYPE_CHECKING

from repack.errors import stable_reason

if TYPE_CHECKING:
    from PIL import Image as PILImage


@cache
def pil():
    """PIL's ``Image`` module, set up on first use: a ``--verify none`` pass over JPEG and PNG reads
    headers itself and never imports it (~40 ms of start-up)."""
    from PIL import Image, ImageFile

    ImageFile.LOAD_TRUNCATED_IMAGES = False
    # The pixel limit is ours (``max_pixels``, checked on the declared size right after the header is
    # parsed and before any pixel is decoded); Pillow's own global limit would silently cap it.
    Image.MAX_IMAGE_PIXELS = None
    # Every format plugin loaded now, not inside a sample's timed check (tens of ms that would show
    # up as a bogus "slowest input").
    Image.init()
    return Image


def preload(level: str) -> None:
    """Import what checks at ``level`` use, once in the driver before the pool forks (workers then
    share it instead of each importing it inside its first sample)."""
    if level != "none":
        pil()
    if level == "decode":
        import simplejpeg  # noqa: F401

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


DECODE_MEMORY_CAP = 256 * 2**20  # bytes a `decode` check may allocate for pixels


class BadImage(ValueError):
    """An input that is not a usable image; the message is the quarantine reason."""


@dataclass(frozen=True)
class ImageInfo:
    ext: str
    width: int
    height: int
    mode: str
    progressive: bool = False


def dali_misread(info: ImageInfo) -> str | None:
    """How DALI's image decoder reads this image otherwise than Pillow (and so the PyTorch readers), where it
    decodes it without an error: a gray+alpha TIFF comes out with its alpha in the green channel. None where
    both read the same pixels. Counted in the manifest's ``stats.dali_misreads``; DALI's loaders refuse such a
    dataset (``pipelines.manifest_access.dali_misread_refusal``); ``--normalize`` makes them baseline JPEGs."""
    if info.ext == "tiff" and info.mode in ("LA", "La", "LA;16"):
        return "gray+alpha TIFF"
    return None


def dali_misread_of(data: bytes) -> str | None:
    """``dali_misread`` of an image's bytes (a TIFF's mode, read from its header); None for anything else."""
    if detect_type(data) != "tiff":
        return None
    try:
        return dali_misread(inspect_image(data, "none", max_pixels=1 << 62))
    except BadImage:
        return None


HEIF_BRANDS = {b"avif": "AVIF", b"avis": "AVIF", b"heic": "HEIC", b"heix": "HEIC", b"heim": "HEIC", b"heis": "HEIC",
               b"mif1": "HEIF", b"msf1": "HEIF"}  # an ISO media file's major brand (bytes 8-12 after "ftyp")


def detect_type(data: bytes) -> str | None:
    """Canonical extension of an image from its first bytes, or None."""
    if data[:4] == b"RIFF" and data[8:12] == b"WEBP":
        return "webp"
    for magic, ext in _MAGIC:
        if data.startswith(magic):
            return ext
    return None


def _trailer_problem(ext: str, data: bytes) -> str | None:
    """Why the image is not whole (its own end is not in the file), else None; whatever follows its end is
    allowed (a Motion Photo's MP4 after a JPEG). JPEG: its segments walked to the end marker that follows its
    last scan (an EXIF thumbnail's end marker lies inside its APP1 segment). PNG: its chunks walked to IEND.
    GIF: its trailer byte last (zero padding after it allowed)."""
    if ext == "jpg":
        whole = _jpeg_ends(data)
    elif ext == "png":
        ended, cut = _png_walk(data)
        if cut is not None:
            return f"truncated PNG (chunk {cut!r} runs past the end of the file)"
        whole = ended
    elif ext == "gif":
        whole = data.rstrip(b"\0").endswith(b";")
    else:
        whole = True
    return None if whole else f"truncated {ext.upper()} (no end marker)"


_ENTROPY_END = re.compile(rb"\xff[^\x00\xd0-\xd7\xff]")  # the marker after a scan's data (not stuffing, RST, fill)


def _jpeg_ends(data: bytes) -> bool:
    """Whether a JPEG's markers, walked from its start (segments by their lengths, scans to the marker after
    their entropy-coded data), reach its end-of-image marker within ``data``."""
    pos, size = 2, len(data)
    while pos + 2 <= size:
        if data[pos] != 0xFF:  # extraneous bytes before a marker: skipped, as libjpeg does (its decode warns)
            pos = data.find(b"\xff", pos)
            if pos < 0:
                return False
            continue
        marker = data[pos + 1]
        if marker == 0xFF:  # fill
            pos += 1
        elif marker == 0xD9:
            return True
        elif 0xD0 <= marker <= 0xD7 or marker == 0x01:  # no length
            pos += 2
        else:
            if pos + 4 > size:
                return False
            length = int.from_bytes(data[pos + 2:pos + 4], "big")
            if length < 2:
                return False
            pos += 2 + length
            if marker == 0xDA:
                found = _ENTROPY_END.search(data, pos)
                if found is None:
                    return False
                pos = found.start()
    return False


def _png_walk(data: bytes) -> tuple[bool, str | None]:
    """A PNG's chunks walked by their lengths from its signature: (whether IEND is reached, the type of a chunk
    whose declared length runs past the end of ``data`` first, or None)."""
    pos, size = 8, len(data)
    while pos + 12 <= size:
        kind = data[pos + 4:pos + 8]
        if kind == b"IEND":
            return True, None
        pos += 12 + int.from_bytes(data[pos:pos + 4], "big")
        if pos > size:
            return False, kind.decode("latin-1")
    return False, None


_JPEG_SOF = frozenset(range(0xC0, 0xD0)) - {0xC4, 0xC8, 0xCC}
_JPEG_MODES = {1: "L", 3: "RGB", 4: "CMYK"}
_PNG_MODES = {0: "L", 2: "RGB", 3: "P", 4: "LA", 6: "RGBA"}


def _header_segments(data: bytes, pos: int = 2, limit: int | None = None):
    """(marker, position) of each marker segment of a JPEG's header from ``pos`` (fill bytes skipped, segments
    walked by their lengths) within its first ``limit`` bytes, up to and including its first SOS."""
    end = len(data) if limit is None else min(len(data), limit)
    while pos + 4 <= end and data[pos] == 0xFF:
        marker = data[pos + 1]
        if marker == 0xFF:
            pos += 1
            continue
        yield marker, pos
        length = int.from_bytes(data[pos + 2:pos + 4], "big")
        if marker == 0xDA or length < 2:
            return
        pos += 2 + length


def _jpeg_sof(data: bytes, limit: int | None = 1 << 20) -> tuple[int, int] | None:
    """(marker, position) of a JPEG's first SOF segment within its first ``limit`` bytes, or None."""
    return next(((marker, pos) for marker, pos in _header_segments(data, limit=limit) if marker in _JPEG_SOF), None)


def progressive_coefficient_bytes(data: bytes) -> int:
    """Bytes a multi-scan JPEG's decoder holds for the whole image's DCT coefficients (every block of every
    component, 64 x 2 bytes, at the component's sampling: libjpeg keeps them all until the last scan, whatever
    the output scale): a progressive one, or a sequential one whose first scan holds fewer components than the
    frame; 0 for a single-scan one or where the SOF cannot be read (anywhere in the header: APP segments may
    push it past the first MiB)."""
    found = _jpeg_sof(data, None)
    if found is None:
        return 0
    pos = found[1]
    if found[0] not in (0xC2, 0xC6, 0xCA, 0xCE):
        scan = next((at for marker, at in _header_segments(data, pos) if marker == 0xDA), None)
        if scan is None or pos + 10 > len(data) or scan + 5 > len(data) or data[scan + 4] >= data[pos + 9]:
            return 0  # one interleaved scan: decoded row by row
    height, width = int.from_bytes(data[pos + 5:pos + 7], "big"), int.from_bytes(data[pos + 7:pos + 9], "big")
    count = data[pos + 9] if pos + 10 <= len(data) else 0
    factors = [(data[pos + 11 + 3 * c] >> 4, data[pos + 11 + 3 * c] & 15) for c in range(count)
               if pos + 12 + 3 * c <= len(data)]
    if not factors or not all(h and v for h, v in factors):
        return 0
    h_max, v_max = max(h for h, _ in factors), max(v for _, v in factors)
    mcus = -(-width // (8 * h_max)) * -(-height // (8 * v_max))
    return mcus * sum(h * v for h, v in factors) * 128


def _jpeg_header(data: bytes) -> ImageInfo | None:
    """Dimensions from the first SOF marker (no PIL): ~20x cheaper than Image.open."""
    found = _jpeg_sof(data)
    if found is None:
        return None
    marker, pos = found
    if pos + 10 > len(data):
        return None
    height = int.from_bytes(data[pos + 5:pos + 7], "big")
    width = int.from_bytes(data[pos + 7:pos + 9], "big")
    mode = _JPEG_MODES.get(data[pos + 9])
    if not width or not height or mode is None:
        return None
    return ImageInfo("jpg", width, height, mode, marker in (0xC2, 0xC6, 0xCA, 0xCE))


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
        brand = data[8:12] if data[4:8] == b"ftyp" else b""
        if brand in HEIF_BRANDS:  # ISO media: AVIF, HEIC
            raise BadImage(f"{HEIF_BRANDS[brand]} image: not a format repack packs (its readers and DALI decode "
                           "JPEG, PNG, WebP, BMP, TIFF, PNM, JPEG 2000); convert it to one of those first")
        raise BadImage("not a recognized image format (checked the content, not the name)")
    if ext in ("jpg", "png") and level in ("none", "decode"):
        info = _passes_without_pil(ext, data, level, max_pixels)
        if info is not None:
            return info  # otherwise PIL below gives the precise reason
    Image = pil()
    from pipelines.pil_images import stored_size

    with warnings.catch_warnings():
        warnings.simplefilter("error", Image.DecompressionBombWarning)
        try:
            image = Image.open(io.BytesIO(data))
            width, height = stored_size(image)  # as the readers decode it
            if width * height > max_pixels:
                raise BadImage(f"decompression bomb: {width}x{height} = {width * height} pixels exceeds "
                               f"--max-pixels {max_pixels}")
            if image.mode == "F":  # readers and --normalize have no one 8-bit picture of float samples
                raise BadImage(f"{ext.upper()} of floating-point samples (mode F): no 8-bit picture to train on; "
                               "convert it to 8 or 16 bits first")
            info = ImageInfo(ext, width, height, image.mode, bool(image.info.get("progressive") or image.info.get("progression")))
            if level == "none":
                return info
            problem = _trailer_problem(ext, data)
            if problem is not None:
                raise BadImage(problem)
            if level == "decode":
                verify_decodes(ext, data, image)
            return info
        except BadImage:
            raise
        except (Image.DecompressionBombError, Image.DecompressionBombWarning) as exc:
            raise BadImage(f"decompression bomb: {exc}") from None
        except Exception as exc:  # noqa: BLE001 - PIL raises many types for bad data
            raise BadImage(decode_failure(ext, exc)) from None


def _passes_without_pil(ext: str, data: bytes, level: str, max_pixels: int) -> ImageInfo | None:
    """JPEG and PNG at ``none`` and ``decode``: the header read here and the check done without Pillow
    (its ``open`` costs ~10x a tiny JPEG's whole decode); the info when every step passes, else None
    (the caller's Pillow path then finds the reason, so a quarantine reads the same either way).
    ``decode`` proves more than Pillow's ``open`` does (libjpeg-turbo parses every marker and
    entropy-decodes every coefficient; every PNG chunk's CRC is checked, the IHDR's depth and colour
    type must be a combination the PNG spec allows); ``header`` keeps Pillow's ``open`` as its check."""
    info = _jpeg_header(data) if ext == "jpg" else _png_header(data)
    if info is None or info.width * info.height > max_pixels:
        return None
    if level == "none":
        return info
    if _trailer_problem(ext, data) is not None:
        return None
    try:
        if ext == "jpg":
            _verify_jpeg(data, info.width, info.height, info.mode)
        elif data[24] in _PNG_DEPTHS.get(data[25], ()):
            _verify_png(data)
        else:
            return None
    except Exception:  # noqa: BLE001 - any failure: the Pillow path names it
        return None
    return info


def decode_failure(ext: str, exc: BaseException) -> str:
    """A stable quarantine reason for an exception raised while reading an image."""
    if isinstance(exc, pil().UnidentifiedImageError):
        return f"cannot decode {ext.upper()}: not identified by Pillow (corrupt header or chunk)"
    message = stable_reason(exc)
    return f"cannot decode {ext.upper()}: {message.split(': ', 1)[1] if ': ' in message else message}"


def verify_decodes(ext: str, data: bytes, image: PILImage.Image) -> None:
    """Prove the whole image decodes (see the module docstring); BadImage (or another exception) if not."""
    if ext == "jpg":
        _verify_jpeg(data, *image.size, image.mode)
    elif ext == "png":
        _verify_png(data)
    else:
        _fits_the_cap(ext, image)
        image.load()
        for frame in range(1, getattr(image, "n_frames", 1)):  # an animation or pages: every frame (a cut one
            image.seek(frame)                                    # fails here), each measured before it is read
            _fits_the_cap(ext, image)
            image.load()
        if getattr(image, "n_frames", 1) > 1:
            image.seek(0)


def _fits_the_cap(ext: str, image: PILImage.Image) -> None:
    """BadImage where decoding ``image``'s current frame needs more than DECODE_MEMORY_CAP bytes (a TIFF's
    second page may declare 20000x20000 behind an 8x8 first one)."""
    sample_bytes = 2 if image.mode.startswith("I;16") else 4 if image.mode in ("I", "F") else 1
    need = image.size[0] * image.size[1] * len(image.getbands()) * sample_bytes
    if need > DECODE_MEMORY_CAP:
        raise BadImage(f"{ext.upper()} of {image.size[0]}x{image.size[1]} needs {need} bytes to decode, over "
                       f"the {DECODE_MEMORY_CAP}-byte decode cap (use --verify header)")


def _verify_jpeg(data: bytes, width: int, height: int, mode: str) -> None:
    import simplejpeg

    coefficients = progressive_coefficient_bytes(data)
    if coefficients > DECODE_MEMORY_CAP:  # held whatever the reduction a decode asks for
        raise BadImage(f"multi-scan JPG of {width}x{height} holds {coefficients} bytes of coefficients to decode, "
                       f"over the {DECODE_MEMORY_CAP}-byte decode cap (use --verify header)")
    factor = 1
    while width * height // (factor * factor) > DECODE_MEMORY_CAP and factor < 8:
        factor *= 2
    colorspace = "CMYK" if mode == "CMYK" else "GRAY"
    try:
        simplejpeg.decode_jpeg(data, colorspace=colorspace, strict=True, min_factor=factor,
                               min_width=1, min_height=1)
    except ValueError as exc:
        raise BadImage(f"cannot decode JPG: {stable_reason(exc).split(': ', 1)[-1]}") from None


_PNG_CHANNELS = {0: 1, 2: 3, 3: 1, 4: 2, 6: 4}
_PNG_DEPTHS = {0: (1, 2, 4, 8, 16), 2: (8, 16), 3: (1, 2, 4, 8), 4: (8, 16), 6: (8, 16)}  # colour type: bit depths
_ADAM7 = ((0, 0, 8, 8), (4, 0, 8, 8), (0, 4, 4, 8), (2, 0, 4, 4), (0, 2, 2, 4), (1, 0, 2, 2), (0, 1, 1, 2))
_INFLATE_PIECE = 1 << 20
_PNG_FILTERS = bytes(range(5))  # the valid filter-type bytes (None, Sub, Up, Average, Paeth)


def _png_rows(width: int, height: int, bits_per_pixel: int, interlaced: bool) -> list[tuple[int, int]]:
    """(rows, bytes per row including the filter byte) of each pass of the image."""
    passes = _ADAM7 if interlaced else ((0, 0, 1, 1),)
    out = []
    for x0, y0, dx, dy in passes:
        cols, rows = max(0, -(-(width - x0) // dx)), max(0, -(-(height - y0) // dy))
        if cols and rows:
            out.append((rows, 1 + -(-(cols * bits_per_pixel) // 8)))
    return out


def _verify_png(data: bytes) -> None:
    """Chunk CRCs, then the IDAT stream inflated in pieces against the exact size and filter bytes."""
    pos, n = 8, len(data)
    have_header = False
    inflater = zlib.decompressobj()
    rows: list[tuple[int, int]] = []
    row_left, pass_index, rows_left, filters_bad, produced, expected = 0, 0, 0, 0, 0, 0
    seen_iend = False

    def consume(chunk: bytes) -> None:
        nonlocal row_left, pass_index, rows_left, filters_bad, produced
        produced += len(chunk)
        i, n_chunk = 0, len(chunk)
        while i < n_chunk:
            if row_left == 0:
                while rows_left == 0 and pass_index < len(rows):
                    rows_left, pass_index = rows[pass_index][0], pass_index + 1
                if rows_left == 0:
                    return  # past the image: counted in ``produced``
                # every row of this pass that starts in this chunk at once (C speed: a 1-pixel-wide
                # PNG of millions of rows must not cost a Python step per row)
                width = rows[pass_index - 1][1]
                starts = min(rows_left, (n_chunk - i + width - 1) // width)
                filters_bad += len(chunk[i:i + (starts - 1) * width + 1:width].translate(None, _PNG_FILTERS))
                rows_left -= starts
                step = min(starts * width, n_chunk - i)
                row_left = starts * width - step
                i += step
                continue
            step = min(row_left, n_chunk - i)
            row_left -= step
            i += step

    while pos + 12 <= n and not seen_iend:
        length = int.from_bytes(data[pos:pos + 4], "big")
        kind = data[pos + 4:pos + 8]
        end = pos + 8 + length
        if end + 4 > n:
            raise BadImage(f"truncated PNG (chunk {kind.decode('latin-1')!r} runs past the end of the file)")
        if zlib.crc32(data[pos + 4:end]) != int.from_bytes(data[end:end + 4], "big"):
            raise BadImage(f"corrupt PNG: bad CRC in chunk {kind.decode('latin-1')!r}")
        if kind == b"IHDR":
            width = int.from_bytes(data[pos + 8:pos + 12], "big")
            height = int.from_bytes(data[pos + 12:pos + 16], "big")
            depth, color, interlace = data[pos + 16], data[pos + 17], data[pos + 20]
            if color not in _PNG_CHANNELS or depth not in (1, 2, 4, 8, 16):
                raise BadImage(f"corrupt PNG: bit depth {depth} / colour type {color}")
            rows = _png_rows(width, height, depth * _PNG_CHANNELS[color], interlace == 1)
            expected = sum(r * b for r, b in rows)
            have_header = True
        elif kind == b"IDAT":
            if not have_header:
                raise BadImage("corrupt PNG: image data before the header")
            consume(inflater.decompress(data[pos + 8:end], _INFLATE_PIECE))
            while inflater.unconsumed_tail and produced <= expected:
                consume(inflater.decompress(inflater.unconsumed_tail, _INFLATE_PIECE))
        elif kind == b"IEND":
            seen_iend = True
        pos = end + 4
    if not seen_iend:
        raise BadImage("truncated PNG (no IEND chunk)")
    if not inflater.eof or produced != expected:
        raise BadImage(f"corrupt PNG: image data inflates to {produced} bytes, the header needs {expected}"
                       + ("" if inflater.eof else " (zlib stream incomplete)"))
    if filters_bad:
        raise BadImage(f"corrupt PNG: {filters_bad} row(s) with an invalid filter type")
