"""Benchmark of issue 3: LMDB reading and `--normalize` repacking, against baselines in one run.

Dataset: REPACK_BENCH_LMDB_IMAGES (default 1500) real photos (10% PNG) of mixed sizes, longer
side 400..2200, generated once into OUT/lmdb-data and reused. Rows (images/s; ratio = measure /
baseline):

  read   DataLoader, one shuffled epoch, decode + resize to 224x224, the same num_workers (the
         usable CPUs): LMDB map-style Dataset vs the WebDataset reader vs the original files,
         with a warm and a cold page cache (posix_fadvise DONTNEED on every file involved)
  pack   `repack images --to lmdb --normalize --max-side 512` (all CPUs, and --workers 1) vs a
         plain PIL loop in one process: open -> convert RGB -> resize (longer side 512, Lanczos)
         -> save JPEG q90
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path


from tests.benchmarks.bench_images import FolderDataset, drop_cache, image_files, to_224, usable_cpus, warm

ROOT = Path(__file__).resolve().parents[2]


def make_dataset(data_dir: Path, count: int) -> Path:
    from tests.tools.photos import make_photo_tree

    src = data_dir / f"photos-{count}"
    if not (src / ".complete").exists():
        shutil.rmtree(src, ignore_errors=True)
        started = time.perf_counter()
        make_photo_tree(src, per_class=max(1, count // 10), seed=11, min_side=400, max_side=2200, png_share=0.1)
        print(f"[lmdb] generated {count} photos in {time.perf_counter() - started:.0f} s", file=sys.stderr)
        (src / ".complete").write_text("ok\n")
    return src


def repack(src: Path, out: Path, *args: str) -> float:
    """Wall seconds of one fresh run of the real CLI."""
    shutil.rmtree(out, ignore_errors=True)
    started = time.perf_counter()
    proc = subprocess.run([sys.executable, "-m", "repack", "images", str(src), str(out), "--quiet", *args],
                          capture_output=True, text=True, cwd=ROOT)
    if proc.returncode != 0:
        raise RuntimeError(f"repack exited {proc.returncode}: {proc.stderr[-2000:]}")
    return time.perf_counter() - started


def read_epoch(kind: str, lmdb_out: Path, wds_out: Path, files: list[Path], workers: int) -> tuple[float, int]:
    from torch.utils.data import DataLoader

    if kind == "lmdb":
        from pipelines.torch_lmdb import LmdbImageDataset

        loader = DataLoader(LmdbImageDataset(lmdb_out, transform=to_224), batch_size=64, num_workers=workers,
                            shuffle=True)
    elif kind == "webdataset":
        from pipelines.torch_webdataset import ImageShardDataset

        loader = DataLoader(ImageShardDataset(wds_out, transform=to_224, shuffle=True, seed=0), batch_size=64,
                            num_workers=workers)
    else:
        loader = DataLoader(FolderDataset(files), batch_size=64, num_workers=workers, shuffle=True)
    started = time.perf_counter()
    count = sum(len(labels) for _, labels in loader)
    return time.perf_counter() - started, count


def pil_loop(files: list[Path], out: Path, max_side: int = 512) -> float:
    """Baseline: one process, open -> convert -> resize -> save JPEG for every file."""
    from PIL import Image

    shutil.rmtree(out, ignore_errors=True)
    out.mkdir(parents=True)
    started = time.perf_counter()
    for i, path in enumerate(files):
        with Image.open(path) as image:
            rgb = image.convert("RGB")
            w, h = rgb.size
            if max(w, h) > max_side:
                scale = max_side / max(w, h)
                rgb = rgb.resize((max(1, round(w * scale)), max(1, round(h * scale))), Image.LANCZOS)
            rgb.save(out / f"{i:08d}.jpg", "JPEG", quality=90)
    return time.perf_counter() - started


def main(out_dir) -> dict:
    out_dir = Path(out_dir)
    count = int(os.environ.get("REPACK_BENCH_LMDB_IMAGES") or 1500)
    workers = usable_cpus()
    src = make_dataset(out_dir / "lmdb-data", count)
    files = image_files(src)
    work = out_dir / "lmdb-work"
    lmdb_out, wds_out, norm_out = work / "lmdb", work / "wds", work / "lmdb-normalized"
    warm(files)
    repack(src, lmdb_out, "--to", "lmdb", "--verify", "none", "--shard-size", "250")
    repack(src, wds_out, "--to", "webdataset", "--verify", "none", "--shard-size", "250")
    rows = []
    rates: dict[str, float] = {}
    for cache in ("warm", "cold"):
        for kind in ("files", "webdataset", "lmdb"):
            involved = {"lmdb": [lmdb_out / "data.lmdb"], "webdataset": sorted(wds_out.glob("shard-*")),
                        "files": files}[kind]
            drop_cache(involved) if cache == "cold" else warm(involved)
            seconds, n = read_epoch(kind, lmdb_out, wds_out, files, workers)
            assert n == len(files), f"{kind} read {n} of {len(files)}"
            rates[f"{kind}-{cache}"] = n / seconds
        for kind in ("lmdb", "webdataset"):
            rows.append({"measure": f"read {kind} ({cache} cache, {workers} workers)", "rate": rates[f"{kind}-{cache}"],
                         "baseline": f"original files ({cache})", "baseline_rate": rates[f"files-{cache}"]})
        rows.append({"measure": f"read lmdb ({cache} cache)", "rate": rates[f"lmdb-{cache}"],
                     "baseline": f"webdataset ({cache})", "baseline_rate": rates[f"webdataset-{cache}"]})
    warm(files)
    pil_seconds = pil_loop(files, work / "pil-loop")
    shutil.rmtree(work / "pil-loop", ignore_errors=True)
    norm = ("--to", "lmdb", "--normalize", "--max-side", "512", "--shard-size", "100")
    all_seconds = repack(src, norm_out, *norm)
    one_seconds = repack(src, work / "lmdb-normalized-1", *norm, "--workers", "1")
    manifest = json.loads((norm_out / "manifest.json").read_text())
    rows.append({"measure": f"repack --normalize --max-side 512 ({workers} workers)", "rate": len(files) / all_seconds,
                 "baseline": "PIL open/convert/resize/save, 1 proc", "baseline_rate": len(files) / pil_seconds})
    rows.append({"measure": "repack --normalize --max-side 512 (--workers 1)", "rate": len(files) / one_seconds,
                 "baseline": "PIL open/convert/resize/save, 1 proc", "baseline_rate": len(files) / pil_seconds})
    for r in rows:
        r["ratio"] = round(r["rate"] / r["baseline_rate"], 2)
        r["rate"], r["baseline_rate"] = round(r["rate"], 1), round(r["baseline_rate"], 1)
    lines = [f"lmdb/normalize: {len(files)} photos, {sum(p.stat().st_size for p in files) / 1e6:.0f} MB, "
             f"{workers} CPUs; normalize converted {manifest['stats']['normalize']['converted']}, passed through "
             f"{manifest['stats']['normalize']['passed_through']}",
             f"{'measure':<52} {'img/s':>8}  {'baseline':<38} {'img/s':>8} {'ratio':>6}"]
    lines += [f"{r['measure']:<52} {r['rate']:>8.0f}  {r['baseline']:<38} {r['baseline_rate']:>8.0f} {r['ratio']:>5.2f}x"
              for r in rows]
    text = "\n".join(lines)
    print(text, flush=True)
    shutil.rmtree(work, ignore_errors=True)
    return {"images": len(files), "workers": workers, "rows": rows, "table": text}


if __name__ == "__main__":
    main(Path(sys.argv[1] if len(sys.argv) > 1 else "bench-out"))
