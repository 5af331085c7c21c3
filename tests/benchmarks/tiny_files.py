"""Many tiny input files for the scale benchmark, made in parallel and deterministically.

``tiny_jpegs(root, start, count)`` writes JPEGs number ``start .. start+count-1`` (32x32 RGB, ~700 B
each, every one distinct) as ``root/cNNN/NNNNNNNN.jpg``: file ``i`` goes to class folder ``i % 1000``,
so a tree of N files holds 1,000 classes and files ``N ..`` added later (``--append``) land in the same
folders. ``tiny_texts(root, start, count)`` does the same for ``.txt`` files of ~700 B of English
sentences (Python's bundled documentation). File ``i``'s bytes depend on ``i`` alone (its own seeded
generator), so any split of the work over processes gives the same tree.

Both fan the numbers out over a process pool (one process per usable core), in contiguous slices.
"""

from __future__ import annotations

import io
import os
import random
from concurrent.futures import ProcessPoolExecutor
from pathlib import Path

CLASSES = 1000
SIDE = 32
TEXT_BYTES = 700


def file_path(root: Path, index: int, suffix: str) -> Path:
    """Where file number ``index`` lives: ``root/c{index % 1000:03d}/{index:08d}{suffix}``."""
    return root / f"c{index % CLASSES:03d}" / f"{index:08d}{suffix}"


def jpeg_bytes(index: int) -> bytes:
    """JPEG number ``index``: a smooth 32x32 colour field from a 4x4 seed grid plus light noise."""
    import numpy as np
    from PIL import Image

    rng = np.random.default_rng(index)
    grid = Image.fromarray(rng.integers(0, 256, (4, 4, 3), dtype=np.uint8)).resize((SIDE, SIDE), Image.BILINEAR)
    pixels = np.asarray(grid, dtype=np.int16) + rng.integers(-24, 25, (SIDE, SIDE, 3), dtype=np.int16)
    buf = io.BytesIO()
    Image.fromarray(pixels.clip(0, 255).astype(np.uint8)).save(buf, "JPEG", quality=85, optimize=True)
    return buf.getvalue()


_SENTENCES: list[str] = []


def text_bytes(index: int) -> bytes:
    """Text file number ``index``: seeded random English sentences, about 700 bytes, UTF-8."""
    if not _SENTENCES:
        from tests.tools.text import sentences

        _SENTENCES.extend(sentences())
    rng = random.Random(index)
    parts, size = [], 0
    while size < TEXT_BYTES:
        sentence = rng.choice(_SENTENCES)
        parts.append(sentence)
        size += len(sentence) + 1
    return (" ".join(parts) + "\n").encode()


def _write_slice(kind: str, root: str, start: int, stop: int) -> int:
    make, suffix = (jpeg_bytes, ".jpg") if kind == "jpg" else (text_bytes, ".txt")
    base = Path(root)
    for index in range(start, stop):
        file_path(base, index, suffix).write_bytes(make(index))
    return stop - start


def _make(kind: str, root: Path, start: int, count: int, workers: int | None) -> Path:
    root = Path(root)
    for c in range(min(CLASSES, start + count)):
        (root / f"c{c:03d}").mkdir(parents=True, exist_ok=True)
    workers = workers or len(os.sched_getaffinity(0))
    step = max(1, -(-count // (workers * 8)))  # a few slices per process: even finish
    slices = [(s, min(s + step, start + count)) for s in range(start, start + count, step)]
    with ProcessPoolExecutor(workers) as pool:
        done = sum(pool.map(_write_slice, [kind] * len(slices), [str(root)] * len(slices),
                            *zip(*slices, strict=True)) if slices else [])
    if done != count:
        raise RuntimeError(f"{root}: wrote {done} of {count} files")
    return root


def tiny_jpegs(root: str | os.PathLike, start: int, count: int, workers: int | None = None) -> Path:
    """Write JPEGs number ``start .. start+count-1`` under ``root`` (see the module docstring)."""
    return _make("jpg", Path(root), start, count, workers)


def tiny_texts(root: str | os.PathLike, start: int, count: int, workers: int | None = None) -> Path:
    """Write text files number ``start .. start+count-1`` under ``root`` (see the module docstring)."""
    return _make("txt", Path(root), start, count, workers)
