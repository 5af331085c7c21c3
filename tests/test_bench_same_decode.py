"""The decoded-read benchmark (issue 19.2) compares like with like: the shard reader's decode
(``pipelines.pil_images.decode_image`` of the member's bytes, mode RGB) followed by the bench's
``to_224`` gives exactly the folder Dataset's pixels (``Image.open(path)`` then ``to_224``), for
RGB and grayscale JPEGs, and ``to_224`` (which skips the no-op RGB copy) gives the pixels of a plain
``convert("RGB").resize(...)``."""

from __future__ import annotations

import io
import random

import numpy as np
import pytest
from PIL import Image

from pipelines.pil_images import decode_image
from tests.benchmarks.bench_images import to_224
from tests.tools.photos import load_photos, render


@pytest.mark.parametrize("name", ["astronaut", "camera"])  # an RGB and a grayscale ("L") photo
def test_reader_decode_and_folder_open_give_the_same_224_pixels(tmp_path, name):
    photo = render(load_photos()[name], random.Random(5), 700, 900)
    path = tmp_path / f"{name}.jpg"
    photo.save(path, "JPEG", quality=90)
    data = path.read_bytes()

    with Image.open(path) as image:
        assert image.mode == ("L" if name == "camera" else "RGB")
        folder = to_224(image)
    reader = to_224(decode_image(data, "RGB"))
    plain = np.asarray(Image.open(io.BytesIO(data)).convert("RGB").resize((224, 224), Image.BILINEAR))

    assert tuple(reader.shape) == (3, 224, 224)
    assert np.array_equal(reader.numpy(), folder.numpy())
    assert np.array_equal(reader.permute(1, 2, 0).numpy(), plain)
