"""Reduced-size JPEG decode (issue 19.2): ``decode_image(data, "RGB", draft=(224, 224))`` vs the
full decode, one process, on REPACK_BENCH_DRAFT_IMAGES (default 150) real-photo JPEGs whose
shorter side is 1,000-1,600 px (tests.tools.photos: crops of scikit-image's photos, rescaled,
quality 85-95), and the same with the resize to 224x224 a transform does after it; the two
decodes of each photo are timed back to back, REPACK_BENCH_REPEATS (default 3) passes, medians.
The pixel difference: both decodes resized to 224x224 (bilinear), mean absolute difference
(0-255 scale) and PSNR, averaged over the photos.

Decoded reading, DataLoader with 2 workers, shuffled: the photos packed by `repack images`
and read through ImageShardDataset vs the same photos as a folder of files (a map-style
Dataset), each with the same decode and transform (``decode_image`` + resize 224 + tensor),
with and without the draft decode. The draft is applied to the raw bytes the reader yields
(``decode=False``), as the ``draft_size`` option of the readers will do.
"""

from __future__ import annotations

import io
import math
import os
import random
import statistics
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
from PIL import Image

from pipelines.pil_images import decode_image
from tests.benchmarks.verdicts import verdict

TARGET = (224, 224)


def photos(count: int, seed: int = 19) -> list[bytes]:
    """``count`` JPEGs whose shorter side is 1,000-1,600 px (crops of the real sample photos)."""
    from tests.tools.photos import load_photos, render

    rng = random.Random(seed)
    sources = [p.convert("RGB") for p in load_photos().values()]
    out = []
    for i in range(count):
        image = render(sources[i % len(sources)], rng, 1000, 1600)
        scale = rng.randint(1000, 1600) / min(image.size)
        image = image.resize((round(image.width * scale), round(image.height * scale)), Image.BICUBIC)
        buf = io.BytesIO()
        image.save(buf, "JPEG", quality=rng.randint(85, 95))
        out.append(buf.getvalue())
    return out


def _interleaved_seconds(datas: list[bytes], resize: bool) -> tuple[float, float]:
    """(full, draft) decode seconds over ``datas``, the two timed back to back on each photo (in
    alternating order), so a load change on the shared machine hits both alike."""
    totals = [0.0, 0.0]
    for i, data in enumerate(datas):
        for which in ((0, 1) if i % 2 == 0 else (1, 0)):
            started = time.perf_counter()
            image = decode_image(data, "RGB", draft=TARGET if which else None)
            if resize:
                image.resize(TARGET, Image.BILINEAR)
            totals[which] += time.perf_counter() - started
    return totals[0], totals[1]


def difference(datas: list[bytes]) -> tuple[float, float]:
    """(mean absolute difference, mean PSNR dB) of draft vs full decode, both resized to 224x224."""
    maes, psnrs = [], []
    for data in datas:
        full = np.asarray(decode_image(data, "RGB").resize(TARGET, Image.BILINEAR), dtype=np.float64)
        small = np.asarray(decode_image(data, "RGB", draft=TARGET).resize(TARGET, Image.BILINEAR), dtype=np.float64)
        maes.append(float(np.mean(np.abs(full - small))))
        mse = float(np.mean((full - small) ** 2))
        psnrs.append(10 * math.log10(255 ** 2 / mse) if mse else 99.0)
    return statistics.mean(maes), statistics.mean(psnrs)


class _DecodedBytes:
    """Wraps a reader of (bytes, label) samples: decode_image (optionally drafted) + resize 224 + tensor."""

    def __init__(self, draft) -> None:
        self.draft = draft

    def __call__(self, data: bytes):
        from tests.benchmarks.bench_images import to_224

        return to_224(decode_image(data, "RGB", draft=self.draft))


def _shards(packed: Path, draft):
    from torch.utils.data import IterableDataset

    from pipelines.torch_webdataset import ImageShardDataset

    decode = _DecodedBytes(draft)

    class Decoded(IterableDataset):
        def __iter__(self):
            for data, label in ImageShardDataset(packed, decode=False, shuffle=True):
                yield decode(data), label

    return Decoded(), {}


def _folder(files: list[Path], draft):
    decode = _DecodedBytes(draft)

    class Folder:
        def __len__(self) -> int:
            return len(files)

        def __getitem__(self, i: int):
            return decode(files[i].read_bytes()), int(files[i].parent.name[1:])

    return Folder(), {"shuffle": True}


def reading(datas: list[bytes], work: Path, repeats: int) -> list[dict]:
    """Decoded reading rows: repack shards vs the folder, full and draft decode, 2 workers."""
    from torch.utils.data import DataLoader

    src = work / "photos"
    files = []
    for i, data in enumerate(datas):
        path = src / f"c{i % 10}" / f"p{i:05d}.jpg"
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_bytes(data)
        files.append(path)
    packed = work / "packed"
    subprocess.run([sys.executable, "-m", "repack", "images", str(src), str(packed), "--overwrite", "--quiet",
                    "--shard-size", str(max(10, len(files) // 8))], check=True, capture_output=True)
    runs: dict[tuple[str, bool], list[float]] = {}
    for _ in range(repeats):
        for draft in (False, True):
            for kind, make in (("folder", lambda d: _folder(files, d)), ("repack", lambda d: _shards(packed, d))):
                dataset, options = make(TARGET if draft else None)
                started = time.perf_counter()
                got = sum(1 for _ in DataLoader(dataset, batch_size=None, num_workers=2, **options))
                assert got == len(files), f"{kind} delivered {got} of {len(files)}"
                runs.setdefault((kind, draft), []).append(len(files) / (time.perf_counter() - started))
    rate = {key: statistics.median(values) for key, values in runs.items()}
    rows = []
    for draft in (False, True):
        what = "draft decode" if draft else "full decode"
        rows.append({"measure": f"ImageShardDataset, {what} + 224", "rate": round(rate[("repack", draft)], 1),
                     "baseline": f"folder Dataset, {what} + 224", "baseline_rate": round(rate[("folder", draft)], 1),
                     "ratio": round(rate[("repack", draft)] / rate[("folder", draft)], 3), "target": 1.0})
    rows.append({"measure": "ImageShardDataset, draft decode + 224", "rate": round(rate[("repack", True)], 1),
                 "baseline": "ImageShardDataset, full decode + 224", "baseline_rate": round(rate[("repack", False)], 1),
                 "ratio": round(rate[("repack", True)] / rate[("repack", False)], 3), "target": None})
    return rows


def main(out_dir=None) -> dict:
    datas = photos(int(os.environ.get("REPACK_BENCH_DRAFT_IMAGES") or 150))
    repeats = int(os.environ.get("REPACK_BENCH_REPEATS") or 3)
    sizes = [Image.open(io.BytesIO(d)).size for d in datas]
    runs: dict[tuple[bool, bool], list[float]] = {}
    for _ in range(repeats):
        for resize in (False, True):
            full, draft = _interleaved_seconds(datas, resize)
            runs.setdefault((resize, False), []).append(full)
            runs.setdefault((resize, True), []).append(draft)
    rate = {key: len(datas) / statistics.median(times) for key, times in runs.items()}
    mae, psnr = difference(datas)
    work = Path(out_dir or "bench-out").absolute() / "decode"
    rows_read = reading(datas, work, repeats)
    rows = []
    for resize, what in ((False, "decode"), (True, "decode + resize 224")):
        full, draft = rate[(resize, False)], rate[(resize, True)]
        rows.append({"measure": f"{what}, draft (224, 224)", "rate": round(draft, 1),
                     "baseline": f"{what}, full size", "baseline_rate": round(full, 1),
                     "ratio": round(draft / full, 3), "target": 1.8 if not resize else None})
    mean_px = statistics.mean(w * h for w, h in sizes)
    lines = [f"draft decode: {len(datas)} JPEG photos, {min(min(s) for s in sizes)}-{max(max(s) for s in sizes)} px, "
             f"{mean_px / 1e6:.2f} Mpx mean, {statistics.mean(map(len, datas)) / 1e3:.0f} KB mean, 1 process",
             f"{'measure':<36} {'img/s':>8}  {'baseline':<30} {'img/s':>8} {'ratio':>6}  target"]
    for r in rows:
        lines.append(f"{r['measure']:<36} {r['rate']:>8.1f}  {r['baseline']:<30} {r['baseline_rate']:>8.1f} "
                     f"{r['ratio']:>5.2f}x  {verdict(r['ratio'], r['target'])}")
    lines.append(f"pixel difference after resizing both to 224x224: mean abs {mae:.2f} / 255, PSNR {psnr:.1f} dB")
    lines.append("decoded reading, DataLoader 2 workers, shuffled, same decode + resize 224 + tensor:")
    for r in rows_read:
        lines.append(f"  {r['measure']:<40} {r['rate']:>7.1f}  {r['baseline']:<38} {r['baseline_rate']:>7.1f} "
                     f"{r['ratio']:>5.2f}x  {verdict(r['ratio'], r['target'])}")
    rows += rows_read
    table = "\n".join(lines)
    print(table)
    return {"images": len(datas), "rows": rows, "mean_abs_diff": round(mae, 3), "psnr_db": round(psnr, 2),
            "table": table}


if __name__ == "__main__":
    main(sys.argv[1] if len(sys.argv) > 1 else "bench-out")
