"""Reduced-size JPEG decode (issue 19.2): ``decode_image(data, "RGB", draft=(224, 224))`` vs the
full decode, one process, on REPACK_BENCH_DRAFT_IMAGES (default 150) real-photo JPEGs of
1,000-1,600 px (tests.tools.photos: crops of scikit-image's photos, quality 85-95), and the
same with the resize to 224x224 a transform does after it. Alternated repeats
(REPACK_BENCH_REPEATS, default 3), medians. The pixel difference: both decodes resized to
224x224 (bilinear), mean absolute difference (0-255 scale) and PSNR, averaged over the photos.
"""

from __future__ import annotations

import io
import math
import os
import random
import statistics
import sys
import time

import numpy as np
from PIL import Image

from pipelines.pil_images import decode_image

TARGET = (224, 224)


def photos(count: int, seed: int = 19) -> list[bytes]:
    """``count`` JPEGs of 1,000-1,600 px (longer side) from the real sample photos."""
    from tests.tools.photos import load_photos, render

    rng = random.Random(seed)
    sources = [p.convert("RGB") for p in load_photos().values()]
    out = []
    for i in range(count):
        buf = io.BytesIO()
        render(sources[i % len(sources)], rng, 1000, 1600).save(buf, "JPEG", quality=rng.randint(85, 95))
        out.append(buf.getvalue())
    return out


def _seconds(datas: list[bytes], draft, resize: bool) -> float:
    started = time.perf_counter()
    for data in datas:
        image = decode_image(data, "RGB", draft=draft)
        if resize:
            image.resize(TARGET, Image.BILINEAR)
    return time.perf_counter() - started


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


def main(out_dir=None) -> dict:
    datas = photos(int(os.environ.get("REPACK_BENCH_DRAFT_IMAGES") or 150))
    repeats = int(os.environ.get("REPACK_BENCH_REPEATS") or 3)
    sizes = [Image.open(io.BytesIO(d)).size for d in datas]
    runs: dict[tuple[bool, bool], list[float]] = {}
    for _ in range(repeats):
        for resize in (False, True):
            for draft in (False, True):
                runs.setdefault((resize, draft), []).append(_seconds(datas, TARGET if draft else None, resize))
    rate = {key: len(datas) / statistics.median(times) for key, times in runs.items()}
    mae, psnr = difference(datas)
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
        verdict = "" if r["target"] is None else f">= {r['target']}x " + ("ok" if r["ratio"] >= r["target"] else "MISSED")
        lines.append(f"{r['measure']:<36} {r['rate']:>8.1f}  {r['baseline']:<30} {r['baseline_rate']:>8.1f} "
                     f"{r['ratio']:>5.2f}x  {verdict}")
    lines.append(f"pixel difference after resizing both to 224x224: mean abs {mae:.2f} / 255, PSNR {psnr:.1f} dB")
    table = "\n".join(lines)
    print(table)
    return {"images": len(datas), "rows": rows, "mean_abs_diff": round(mae, 3), "psnr_db": round(psnr, 2),
            "table": table}


if __name__ == "__main__":
    main(sys.argv[1] if len(sys.argv) > 1 else None)
