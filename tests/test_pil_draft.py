"""Reduced-size JPEG decode (pipelines.pil_images.decode_image ``draft``) on real photos: never
smaller than requested, the same picture after the resize a transform would do, full decode
for other formats and for sizes the photo cannot shrink to, clear errors for bad sizes."""

from __future__ import annotations

import io
import math
import random

import numpy as np
import pytest
from PIL import Image

from pipelines.pil_images import decode_image
from tests.tools.photos import load_photos, render


def _jpeg(size_px: int, seed: int = 0, quality: int = 90) -> bytes:
    rng = random.Random(seed)
    photo = render(load_photos()["astronaut"], rng, size_px, size_px)
    buf = io.BytesIO()
    photo.save(buf, "JPEG", quality=quality)
    return buf.getvalue()


def psnr(a: Image.Image, b: Image.Image) -> float:
    """Peak signal-to-noise ratio in dB of two same-size 8-bit images."""
    diff = np.asarray(a, dtype=np.float64) - np.asarray(b, dtype=np.float64)
    mse = float(np.mean(diff ** 2))
    return math.inf if mse == 0 else 10 * math.log10(255 ** 2 / mse)


@pytest.mark.parametrize("target", [(224, 224), (300, 100), (1, 1)])
def test_draft_is_never_smaller_than_requested_and_reduces_large_photos(target):
    data = _jpeg(1200)
    full = decode_image(data, "RGB")
    small = decode_image(data, "RGB", draft=target)
    assert small.mode == "RGB"
    assert small.width >= target[0] and small.height >= target[1]
    scale = min(8, min(full.width // target[0], full.height // target[1]))
    expected = 1 << (scale.bit_length() - 1)  # 1, 2, 4 or 8
    assert small.size == (math.ceil(full.width / expected), math.ceil(full.height / expected))
    assert expected > 1


def test_draft_then_resize_looks_like_full_then_resize():
    data = _jpeg(1400, seed=3)
    full = decode_image(data, "RGB").resize((224, 224), Image.BILINEAR)
    small = decode_image(data, "RGB", draft=(224, 224)).resize((224, 224), Image.BILINEAR)
    assert 30.0 < psnr(full, small) < math.inf  # a different decode, the same picture


def test_no_reduction_when_the_photo_is_not_large_enough_and_for_other_formats():
    data = _jpeg(400)
    assert np.array_equal(np.asarray(decode_image(data, "RGB", draft=(224, 224))), np.asarray(decode_image(data, "RGB")))
    buf = io.BytesIO()
    Image.open(io.BytesIO(_jpeg(1200))).save(buf, "PNG")
    png = buf.getvalue()
    assert decode_image(png, "RGB", draft=(224, 224)).size == decode_image(png, "RGB").size


def test_draft_with_mode_conversion():
    gray = decode_image(_jpeg(1200), "L", draft=(224, 224))
    assert gray.mode == "L" and min(gray.size) >= 224 and max(gray.size) < 1200


@pytest.mark.parametrize("bad", [(0, 224), (224,), "224", (224.5, 224), (-1, 5)])
def test_bad_draft_size_is_a_clear_error(bad):
    with pytest.raises(ValueError, match="draft size"):
        decode_image(_jpeg(300), "RGB", draft=bad)


def test_image_shard_dataset_draft_size_decodes_reduced_never_smaller(packed_photos):
    """``ImageShardDataset(draft_size=...)`` hands the size to the reduced JPEG decode: every image is at
    least the requested size, and the JPEGs larger than twice the request come out smaller than in full."""
    from pipelines.torch_webdataset import ImageShardDataset

    full = {s["key"]: s["image"] for s in ImageShardDataset(packed_photos, output="dict")}
    drafted = {s["key"]: s["image"] for s in ImageShardDataset(packed_photos, output="dict", draft_size=(40, 40))}
    assert full.keys() == drafted.keys()
    shrunk = 0
    for key, image in drafted.items():
        assert min(image.size) >= min(40, min(full[key].size)), key
        shrunk += image.size != full[key].size
    assert shrunk > 0
