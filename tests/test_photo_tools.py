"""The generated photo inputs of the tests (tests/tools/photos.py): the bundled photos are decoded
once per process (a decode of all ten costs ~0.15 s, and helpers such as write_jpegs look one up
per file they write), and every lookup is a copy that its caller may change."""

from __future__ import annotations

from PIL import Image

from tests.test_images_job import write_jpegs
from tests.tools.photos import PHOTOS, load_photos, photo_dir


def test_photos_are_decoded_once_and_each_lookup_is_a_fresh_copy(tmp_path, monkeypatch):
    load_photos()["coffee"]  # decoded here at the latest
    opened = []
    real_open = Image.open
    monkeypatch.setattr(Image, "open", lambda *args, **kwargs: opened.append(args[0]) or real_open(*args, **kwargs))
    written = sorted(write_jpegs(tmp_path / "jpegs", 20).iterdir())
    assert len(written) == 20 and not opened  # no photo decoded again for 20 JPEGs

    changed = load_photos()["coffee"]
    changed.paste((0, 0, 0), (0, 0, changed.width, changed.height))
    with real_open(photo_dir() / PHOTOS["coffee"]) as original:
        assert load_photos()["coffee"].tobytes() == original.convert("RGB").tobytes()
    assert list(load_photos()) == list(PHOTOS) and len(load_photos()) == len(PHOTOS)
