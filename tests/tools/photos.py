"""Generate small image datasets from the real photographs bundled in scikit-image's package data.

Random crops, rescales and JPEG qualities of ~10 source photos, one class per photo.
Only the image files are used (located through the package's spec, skimage is not imported).
"""

from __future__ import annotations

import functools
import importlib.util
import io
import os
import random
from collections.abc import Iterator, Mapping
from pathlib import Path

from PIL import Image

PHOTOS = {
    "astronaut": "astronaut.png", "coffee": "coffee.png", "chelsea": "chelsea.png", "rocket": "rocket.jpg",
    "motorcycle": "motorcycle_left.png", "hubble": "hubble_deep_field.jpg", "retina": "retina.jpg",
    "ihc": "ihc.png", "brick": "brick.png", "camera": "camera.png",
}


def photo_dir() -> Path:
    spec = importlib.util.find_spec("skimage")
    if spec is None or not spec.submodule_search_locations:
        raise RuntimeError("scikit-image is not installed (pip install scikit-image): it ships the sample photos")
    return Path(list(spec.submodule_search_locations)[0]) / "data"


@functools.cache
def _decoded() -> dict[str, Image.Image]:
    folder = photo_dir()
    return {name: Image.open(folder / file).convert("RGB" if name not in ("brick", "camera") else "L")
            for name, file in PHOTOS.items()}


class _Copies(Mapping):
    """The decoded photos by name; each lookup is a fresh copy, so a caller may change what it gets."""

    def __getitem__(self, name: str) -> Image.Image:
        return _decoded()[name].copy()

    def __iter__(self) -> Iterator[str]:
        return iter(PHOTOS)

    def __len__(self) -> int:
        return len(PHOTOS)


def load_photos() -> Mapping[str, Image.Image]:
    """The photos by name (RGB; brick and camera grayscale), decoded once per process (decoding all
    takes ~0.15 s, a copy of one well under 1 ms): each lookup returns a fresh copy."""
    return _Copies()


def render(photo: Image.Image, rng: random.Random, min_side: int, max_side: int) -> Image.Image:
    """A random crop of ``photo`` rescaled so its longer side is in [min_side, max_side]."""
    w, h = photo.size
    frac = rng.uniform(0.35, 1.0)
    cw, ch = max(8, int(w * frac * rng.uniform(0.8, 1.0))), max(8, int(h * frac * rng.uniform(0.8, 1.0)))
    x, y = rng.randint(0, w - cw), rng.randint(0, h - ch)
    crop = photo.crop((x, y, x + cw, y + ch))
    side = rng.randint(min_side, max_side)
    scale = side / max(cw, ch)
    return crop.resize((max(1, round(cw * scale)), max(1, round(ch * scale))), Image.BILINEAR)


def encode(image: Image.Image, rng: random.Random, png_share: float) -> tuple[bytes, str]:
    buf = io.BytesIO()
    if rng.random() < png_share:
        image.save(buf, "PNG")
        return buf.getvalue(), "png"
    image.save(buf, "JPEG", quality=rng.randint(50, 95))
    return buf.getvalue(), "jpg"


def make_photo_tree(out: str | os.PathLike, per_class: int = 30, classes: int = 10, seed: int = 0,
                    min_side: int = 64, max_side: int = 400, png_share: float = 0.1) -> list[Path]:
    """Write an ImageFolder tree ``out/<class>/<class>_NNNN.<ext>``; returns the files, sorted."""
    rng = random.Random(seed)
    photos = load_photos()
    out = Path(out)
    written = []
    for name in list(PHOTOS)[:classes]:
        (out / name).mkdir(parents=True, exist_ok=True)
        photo = photos[name]
        for i in range(per_class):
            data, ext = encode(render(photo, rng, min_side, max_side), rng, png_share)
            path = out / name / f"{name}_{i:04d}.{ext}"
            path.write_bytes(data)
            written.append(path)
    return sorted(written)
