"""`--normalize`: every kind of non-conforming input becomes a baseline 4:2:0 RGB JPEG, conforming
inputs pass through byte-for-byte, --max-side downscales (never up), bombs are quarantined."""

from __future__ import annotations

import io
import json
import struct
import zlib

import numpy as np
import pytest
from PIL import Image

from repack.transforms.image_check import BadImage
from repack.transforms.normalize import NormalizeOptions, jpeg_header, normalize_image
from tests.conftest import read_manifest_json, run_repack
from tests.tools.photos import load_photos

PHOTO = load_photos()["chelsea"].crop((0, 0, 120, 90))  # real RGB photo, 120x90


def encode(image: Image.Image, fmt: str, **kw) -> bytes:
    buf = io.BytesIO()
    image.save(buf, fmt, **kw)
    return buf.getvalue()


def assert_conforming(data: bytes) -> Image.Image:
    header = jpeg_header(data)
    assert header is not None and header.sof == 0xC0 and header.precision == 8
    assert header.sampling == ((2, 2), (1, 1), (1, 1))
    image = Image.open(io.BytesIO(data))
    assert image.mode == "RGB" and not image.info.get("progressive")
    assert image.getexif().get(0x0112) is None
    return image


def mean_abs_diff(a: Image.Image, b: Image.Image) -> float:
    """Mean absolute RGB difference at 1/3 scale (box-averaged: palette dithering averages out)."""
    a, b = a.convert("RGB").reduce(3), b.convert("RGB").reduce(3)
    return float(np.abs(np.asarray(a, np.int16) - np.asarray(b, np.int16)).mean())


def sixteen_bit_png() -> bytes:
    gradient = (np.arange(64 * 48, dtype=np.uint32).reshape(48, 64) * 65535 // (64 * 48 - 1)).astype(np.uint16)
    image = Image.fromarray(gradient)
    assert image.mode.startswith("I;16")
    return encode(image, "PNG")


def animated_gif() -> bytes:
    frames = [PHOTO.convert("P"), PHOTO.transpose(Image.FLIP_LEFT_RIGHT).convert("P")]
    return encode(frames[0], "GIF", save_all=True, append_images=frames[1:], duration=50)


def rgba_png() -> bytes:
    rgba = PHOTO.convert("RGBA")
    alpha = Image.new("L", rgba.size, 255)
    alpha.paste(0, (0, 0, 60, 90))  # left half fully transparent
    rgba.putalpha(alpha)
    return encode(rgba, "PNG")


CASES = {
    "grayscale JPEG": (lambda: encode(PHOTO.convert("L"), "JPEG", quality=90), "mode L"),
    "CMYK JPEG": (lambda: encode(PHOTO.convert("CMYK"), "JPEG", quality=90), "mode CMYK"),
    "progressive JPEG": (lambda: encode(PHOTO, "JPEG", quality=90, progressive=True), "progressive JPEG"),
    "4:4:4 JPEG": (lambda: encode(PHOTO, "JPEG", quality=90, subsampling=0), "chroma subsampling 1x1 (not 4:2:0)"),
    "palette PNG": (lambda: encode(PHOTO.convert("P"), "PNG"), "format png"),
    "RGBA PNG": (rgba_png, "format png"),
    "16-bit PNG": (sixteen_bit_png, "mode I;16"),
    "WebP": (lambda: encode(PHOTO, "WEBP", quality=90), "format webp"),
    "BMP": (lambda: encode(PHOTO, "BMP"), "format bmp"),
    "TIFF": (lambda: encode(PHOTO, "TIFF"), "format tiff"),
    "animated GIF": (animated_gif, "animated (first frame kept)"),
}


@pytest.mark.parametrize("name", sorted(CASES))
def test_non_conforming_inputs_become_baseline_420_rgb_jpeg(name):
    make, reason = CASES[name]
    data = make()
    source = Image.open(io.BytesIO(data))
    result = normalize_image(data, NormalizeOptions(quality=90))
    assert reason in result.reasons
    out = assert_conforming(result.data)
    assert out.size == source.size == (result.width, result.height)
    if name == "RGBA PNG":  # transparency composited over white, the opaque half kept
        pixels = np.asarray(out)
        assert pixels[:, :50].min() > 240 and mean_abs_diff(out.crop((70, 0, 120, 90)), PHOTO.crop((70, 0, 120, 90))) < 6
    elif name == "16-bit PNG":  # scaled to 8 bits, not clipped at 255
        pixels = np.asarray(out.convert("L"), np.float64)
        assert pixels[0, 0] < 3 and pixels[-1, -1] > 250 and 110 < pixels.mean() < 145
    elif name == "animated GIF":
        source.seek(0)
        assert mean_abs_diff(out, source) < 12
    elif name == "CMYK JPEG":
        assert mean_abs_diff(out, PHOTO) < 12
    else:
        assert mean_abs_diff(out, source) < 8


def test_conforming_jpeg_passes_through_byte_for_byte():
    data = encode(PHOTO, "JPEG", quality=75)  # Pillow's default: baseline, 4:2:0
    result = normalize_image(data, NormalizeOptions(quality=95, max_side=512))
    assert result.reasons == () and result.data is data and (result.width, result.height) == (120, 90)


def test_exif_orientation_applied_and_dropped():
    exif = Image.Exif()
    exif[0x0112] = 6  # rotate 90 degrees clockwise to display
    data = encode(PHOTO, "JPEG", quality=90, exif=exif.tobytes())
    result = normalize_image(data, NormalizeOptions())
    assert "EXIF orientation" in result.reasons
    out = assert_conforming(result.data)
    assert out.size == (90, 120)
    assert mean_abs_diff(out, PHOTO.transpose(Image.ROTATE_270)) < 8


def test_max_side_downscales_never_upscales():
    big = load_photos()["astronaut"]  # 512x512
    data = encode(big.crop((0, 0, 512, 300)), "JPEG", quality=90)
    result = normalize_image(data, NormalizeOptions(max_side=128))
    assert result.reasons == ("longer side > max_side",)
    out = assert_conforming(result.data)
    assert out.size == (128, 75) and result.source_size == (512, 300)
    reference = big.crop((0, 0, 512, 300)).resize((128, 75), Image.LANCZOS)
    assert mean_abs_diff(out, reference) < 6
    small = encode(PHOTO, "JPEG", quality=90)
    assert normalize_image(small, NormalizeOptions(max_side=512)).data is small


def chunk(kind: bytes, body: bytes) -> bytes:
    """A PNG chunk of ``kind`` holding ``body``, its CRC right."""
    return struct.pack(">I", len(body)) + kind + body + struct.pack(">I", zlib.crc32(kind + body))


def png_declaring(width: int, height: int) -> bytes:
    """A tiny, valid-looking PNG whose header declares width x height pixels."""
    ihdr = struct.pack(">IIBBBBB", width, height, 8, 2, 0, 0, 0)
    return b"\x89PNG\r\n\x1a\n" + chunk(b"IHDR", ihdr) + chunk(b"IDAT", zlib.compress(b"\x00" * 64)) + chunk(b"IEND", b"")


def test_decompression_bomb_is_refused_before_decoding():
    with pytest.raises(BadImage, match="decompression bomb: 60000x60000"):
        normalize_image(png_declaring(60000, 60000), NormalizeOptions())
    with pytest.raises(BadImage, match="--max-pixels 10000"):
        normalize_image(encode(PHOTO, "PNG"), NormalizeOptions(max_pixels=10_000))


def test_cli_normalize_counts_conversions(tmp_path):
    src = tmp_path / "src" / "cat"
    src.mkdir(parents=True)
    (src / "a_conforming.jpg").write_bytes(encode(PHOTO, "JPEG", quality=80))
    (src / "b_gray.png").write_bytes(encode(PHOTO.convert("L"), "PNG"))
    (src / "c_big.jpg").write_bytes(encode(load_photos()["astronaut"], "JPEG", quality=90))
    (src / "d_bomb.png").write_bytes(png_declaring(50000, 50000))
    out = tmp_path / "out"
    run_repack("images", tmp_path / "src", out, "--normalize", "--max-side", "256", "--quality", "85", "--quiet")
    m = read_manifest_json(out)
    assert m["stats"]["normalize"] == {"converted": 2, "passed_through": 1,
                                       "reasons": {"format png": 1, "longer side > max_side": 1, "mode L": 1}}
    assert m["stats"]["formats"] == {"jpg": 3}
    assert [q["source"] for q in m["quarantine"]] == ["cat/d_bomb.png"]
    assert "decompression bomb" in m["quarantine"][0]["reason"]
    import tarfile

    with tarfile.open(out / "shard-000000.tar") as tar:
        members = {mem.name.split(".", 1)[1] + ":" + mem.name.split("_", 1)[1].split(".")[0]: tar.extractfile(mem).read()
                   for mem in tar.getmembers()}
    assert members["jpg:a_conforming"] == (src / "a_conforming.jpg").read_bytes()
    assert assert_conforming(members["jpg:c_big"]).size == (256, 256)
    meta = json.loads(members["json:c_big"])
    assert meta["source_width"] == 512 and meta["width"] == 256 and meta["normalized"] == ["longer side > max_side"]
    inspect = run_repack("inspect", out).stdout
    assert "normalize: 2 converted, 1 passed through unchanged" in inspect


def uniform_gray(value: int, fmt: str) -> bytes:
    """A 16x16 image of one value: a 16-bit PNG (mode I;16) or a 32-bit integer TIFF (mode I)."""
    if fmt == "PNG":
        image = Image.fromarray(np.full((16, 16), value, np.uint16))
        assert image.mode == "I;16"
    else:
        image = Image.fromarray(np.full((16, 16), value, np.int32), "I")
    data = encode(image, fmt)
    assert Image.open(io.BytesIO(data)).mode == ("I;16" if fmt == "PNG" else "I")
    return data


@pytest.mark.parametrize("fmt", ["PNG", "TIFF"])
def test_sixteen_bit_scaling_is_fixed_not_by_the_image_maximum(fmt):
    """200 and 1000 are dark 16-bit values: >> 8 gives 0 and 3 in every image, whatever its maximum."""
    cases = [(200, 0), (1000, 3), (40000, 156), (65535, 255)]
    if fmt == "TIFF":  # mode I is clamped to the 16-bit range first
        cases += [(-5, 0), (70000, 255)]
    for value, expected in cases:
        result = normalize_image(uniform_gray(value, fmt), NormalizeOptions())
        out = np.asarray(assert_conforming(result.data).convert("L"), np.int16)
        assert np.abs(out - expected).max() <= 1, (value, out.min(), out.max())


def test_source_size_is_in_displayed_orientation():
    exif = Image.Exif()
    exif[0x0112] = 6  # stored 120x90, displayed 90x120
    data = encode(PHOTO, "JPEG", quality=90, exif=exif.tobytes())
    result = normalize_image(data, NormalizeOptions())
    assert result.source_size == (result.width, result.height) == (90, 120)
    smaller = normalize_image(data, NormalizeOptions(max_side=60))
    assert smaller.source_size == (90, 120) and (smaller.width, smaller.height) == (45, 60)
    plain = normalize_image(encode(PHOTO, "PNG"), NormalizeOptions())
    assert plain.source_size == (plain.width, plain.height) == (120, 90)


@pytest.mark.parametrize("mode,key", [("L", 0), ("RGB", (0, 0, 0)), ("P", 0)])
def test_png_transparent_colour_is_white_in_every_mode(mode, key):
    """PNG's one transparent colour (tRNS) of a gray or RGB image is transparency as a palette's is: over white
    (it came out black for L and RGB)."""
    base = Image.new("RGB", (64, 64), (200, 30, 30))
    base.paste((0, 0, 0), (0, 0, 32, 64))  # the left half: the key colour
    image = base.convert(mode) if mode != "P" else base.quantize(2)
    if mode == "P":
        key = image.getpixel((0, 0))
    data = encode(image, "PNG", transparency=key)
    out = Image.open(io.BytesIO(normalize_image(data, NormalizeOptions()).data)).convert("RGB")
    assert min(out.getpixel((8, 32))) > 245, out.getpixel((8, 32))
    assert max(out.getpixel((56, 32))) < 250


@pytest.mark.parametrize("mode", ["RGB", "RGBA", "P"])
def test_icc_profile_of_rgb_colours_is_kept(mode):
    from PIL import ImageCms

    profile = ImageCms.ImageCmsProfile(ImageCms.createProfile("sRGB")).tobytes()
    image = PHOTO.convert(mode)
    data = encode(image, "PNG", icc_profile=profile)
    out = Image.open(io.BytesIO(normalize_image(data, NormalizeOptions()).data))
    assert out.info.get("icc_profile") == profile


def test_max_side_size_comes_from_the_source_not_the_draft():
    """A 1000x333 JPEG drafted to 250x84 came out 100x34; the same picture as PNG 100x33 (333 * 0.1 = 33.3)."""
    picture = load_photos()["astronaut"].resize((1000, 333))
    for fmt in ("JPEG", "PNG"):
        result = normalize_image(encode(picture, fmt), NormalizeOptions(max_side=100))
        assert (result.width, result.height) == (100, 33), fmt


def _png16(color_type: int, pixels, trns: bytes) -> bytes:
    """A 16-bit PNG (gray: colour type 0, RGB: 2) of ``pixels`` (uint16) with the tRNS chunk ``trns``."""
    height, width = pixels.shape[:2]
    raw = b"".join(b"\x00" + row.astype(">u2").tobytes() for row in pixels)
    return (b"\x89PNG\r\n\x1a\n" + chunk(b"IHDR", struct.pack(">IIBBBBB", width, height, 16, color_type, 0, 0, 0))
            + chunk(b"tRNS", trns) + chunk(b"IDAT", zlib.compress(raw)) + chunk(b"IEND", b""))


def test_sixteen_bit_transparent_colours():
    """16-bit gray with a tRNS gray: its transparent pixels come out white (they were gray: the key was lost
    with the >> 8). 16-bit RGB with a tRNS colour: Pillow holds 8-bit pixels and another reduction of the key,
    which matched opaque bright red (it came out white); such a colour is not applied."""
    gray = np.full((8, 16), 0x8000, np.uint16)
    gray[:, :8] = 0x1234
    out = np.asarray(Image.open(io.BytesIO(normalize_image(_png16(0, gray, struct.pack(">H", 0x1234)),
                                                           NormalizeOptions()).data)))
    assert out[4, 2].min() > 245 and abs(int(out[4, 13, 0]) - 128) < 8
    rgb = np.zeros((8, 16, 3), np.uint16)
    rgb[:, :8] = (0xFFFF, 0, 0)
    rgb[:, 8:] = (0x00FF, 0, 0)
    out = np.asarray(Image.open(io.BytesIO(normalize_image(_png16(2, rgb, struct.pack(">HHH", 0x00FF, 0, 0)),
                                                           NormalizeOptions()).data)))
    assert out[4, 2, 0] > 240 and out[4, 2, 1:].max() < 15


def plain_cmyk_jpeg() -> tuple[bytes, np.ndarray]:
    """A CMYK JPEG without Adobe's APP14 marker (plain, not inverted CMYK: as libjpeg and DALI read it), and
    the RGB picture it holds: a red and a blue block on gray 200."""
    from PIL import ImageChops

    picture = np.full((48, 64, 3), 200, np.uint8)
    picture[:12, :16] = (255, 0, 0)
    picture[-12:, -16:] = (0, 0, 255)
    data = encode(ImageChops.invert(Image.fromarray(picture).convert("CMYK")), "JPEG", quality=95)
    at = data.find(b"\xff\xee")  # Pillow writes APP14 for CMYK: cut it out
    return data[:at] + data[at + 2 + struct.unpack(">H", data[at + 2:at + 4])[0]:], picture


def test_a_cmyk_jpeg_without_adobe_marker_keeps_its_colours(tmp_path):
    """Pillow reads every CMYK JPEG as Adobe's inverted CMYK: one without the marker came out near black from
    --normalize and from the PyTorch reader, while DALI decoded its colours."""
    from pipelines.pil_images import decode_image

    data, picture = plain_cmyk_jpeg()
    normalized = normalize_image(data, NormalizeOptions())
    assert np.abs(np.asarray(Image.open(io.BytesIO(normalized.data)), np.int16) - picture).mean() < 6
    assert np.abs(np.asarray(decode_image(data, "RGB"), np.int16) - picture).mean() < 6
    assert np.abs(dali_decode(data) - np.asarray(decode_image(data, "RGB"), np.int16)).mean() < 2


def dali_decode(data: bytes) -> np.ndarray:
    """``data`` decoded by DALI's image decoder (CPU) as the image pipeline runs it (no orientation applied)."""
    from nvidia.dali import fn, pipeline_def, types

    @pipeline_def(batch_size=1, num_threads=1, device_id=None)
    def decode():
        encoded = fn.external_source(source=lambda: [np.frombuffer(data, np.uint8)], batch=True, dtype=types.UINT8)
        return fn.decoders.image(encoded, device="cpu", output_type=types.RGB, adjust_orientation=False)

    pipe = decode()
    pipe.build()
    return np.array(pipe.run()[0].at(0)).astype(np.int16)


def test_a_rotated_tiff_is_read_as_stored_by_every_reader_and_turned_by_normalize():
    """Pillow applies a TIFF's orientation as it loads it (DALI does not): the check sizes the stored pixels,
    the PyTorch readers decode them as DALI does, and --normalize turns the picture as displayed."""
    from pipelines.pil_images import decode_image
    from repack.transforms.image_check import inspect_image

    stored = np.full((48, 64, 3), 200, np.uint8)
    stored[:12, :16] = (255, 0, 0)
    exif = Image.Exif()
    exif[0x0112] = 6
    data = encode(Image.fromarray(stored), "TIFF", exif=exif.tobytes())
    info = inspect_image(data)
    assert (info.width, info.height) == (64, 48)
    assert np.array_equal(np.asarray(decode_image(data, "RGB")), stored)
    assert np.array_equal(dali_decode(data), stored)
    normalized = normalize_image(data, NormalizeOptions(max_side=32))
    assert (normalized.width, normalized.height) == (24, 32) and normalized.source_size == (48, 64)
    shown = np.asarray(Image.fromarray(stored).transpose(Image.Transpose.ROTATE_270).resize((24, 32)), np.int16)
    assert np.abs(np.asarray(Image.open(io.BytesIO(normalized.data)), np.int16) - shown).mean() < 8


def test_an_animated_png_whose_default_image_is_no_frame_reads_its_first_frame():
    """APNG's default image outside the animation: DALI decodes the animation's first frame, and so do the
    PyTorch readers and --normalize (they took the default image)."""
    from pipelines.pil_images import decode_image

    frames = [Image.new("RGB", (32, 24), colour) for colour in ((0, 255, 0), (255, 0, 0), (0, 0, 255))]
    buffer = io.BytesIO()
    frames[0].save(buffer, "PNG", save_all=True, append_images=frames[1:], default_image=True)
    data = buffer.getvalue()
    red = np.zeros((24, 32, 3), np.int16) + (255, 0, 0)
    assert np.array_equal(dali_decode(data), red)
    assert np.array_equal(np.asarray(decode_image(data, "RGB"), np.int16), red)
    normalized = normalize_image(data, NormalizeOptions())
    assert np.abs(np.asarray(Image.open(io.BytesIO(normalized.data)), np.int16) - red).mean() < 4


def test_a_picture_wider_than_a_jpeg_holds_is_named_so():
    wide = encode(Image.new("RGB", (70000, 1), (10, 20, 30)), "PNG")
    with pytest.raises(BadImage, match="at most 65500 pixels a side; --max-side"):
        normalize_image(wide, NormalizeOptions())
    assert normalize_image(wide, NormalizeOptions(max_side=4096)).width == 4096


def test_an_avif_or_heic_is_named_not_unrecognized():
    from repack.transforms.image_check import inspect_image

    for brand, said in ((b"avif", "AVIF image"), (b"heic", "HEIC image")):
        with pytest.raises(BadImage, match=f"{said}: not a format repack packs"):
            inspect_image(struct.pack(">I", 24) + b"ftyp" + brand + b"\0\0\0\0mif1" + b"\0" * 64)
