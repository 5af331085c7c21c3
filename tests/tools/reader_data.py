"""Small real datasets for the reader tests and benchmarks, written by the real `repack` CLI."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

from tests.conftest import run_repack

VP8 = ("-c:v", "libvpx", "-deadline", "realtime", "-g", "8", "-pix_fmt", "yuv420p")


ALL = ("lmdb_a", "lmdb_b", "text_a", "text_b", "video")


def reader_datasets(base: Path, photos_per_class: int = 6, documents_scale: int = 1,
                    names: tuple[str, ...] = ALL) -> dict[str, str]:
    """Two LMDB image datasets (24 and 18 photos), two token memmaps (120 and 60 documents, times
    ``documents_scale``) and, with ffmpeg + libvpx, a video dataset of two VP8 clips (30 and 23
    frames): {name: root}, of those in ``names`` only (a test builds what it reads)."""
    from tests.tools.photos import make_photo_tree
    from tests.tools.text import documents, gpt2_tokenizer, write_tokenizer

    out = {}
    for name, classes, seed in (("lmdb_a", 4, 3), ("lmdb_b", 3, 4)):
        if name not in names:
            continue
        make_photo_tree(base / f"{name}-src", per_class=photos_per_class, classes=classes, seed=seed, max_side=64,
                        min_side=32)
        run_repack("images", base / f"{name}-src", base / name, "--to", "lmdb", "--quiet")
        out[name] = str(base / name)
    if {"text_a", "text_b"} & set(names):
        write_tokenizer(gpt2_tokenizer(), base / "tok")
    for name, count, seed in (("text_a", 120, 11), ("text_b", 60, 12)):
        if name not in names:
            continue
        src = base / f"{name}.jsonl"
        src.write_text("".join(json.dumps({"text": d}) + "\n" for d in documents(count * documents_scale, seed=seed)))
        run_repack("text", src, base / name, "--tokenizer", base / "tok", "--quiet")
        out[name] = str(base / name)
    if "video" in names and shutil.which("ffmpeg"):
        from tests.tools.videos import encoders, make_index_clip

        if "libvpx" in encoders():
            make_index_clip(base / "vsrc/a/one.webm", 30, VP8, size=(32, 32))
            make_index_clip(base / "vsrc/b/two.webm", 23, VP8, size=(32, 32))
            run_repack("video", base / "vsrc", base / "video", "--transcode", "--dali-reader", "experimental",
                       "--quiet")
            out["video"] = str(base / "video")
    return out
