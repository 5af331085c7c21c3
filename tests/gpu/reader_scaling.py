"""Issue 19's reader figures on the device machine's quiet CPUs (and its GPU); one JSON line each.

    python -m tests.gpu.reader_scaling --out DIR [--images 4000] [--repeats 5] [--parts raw,decoded,gpu]

  raw      tests.benchmarks.bench_images.raw_ratios (ImageShardDataset(batch_size=64) against the
           folder Dataset, plain wds.WebDataset and the transport alone), with 2 workers pinned to
           2 CPUs (the issue's 2-core setting, without the shared VM's noise) and with 16 workers
  decoded  PIL decode + resize 224 through a DataLoader: the reader (one at a time, and batch_size=64)
           against the folder Dataset, same workers and CPUs as above
  gpu      raw batches from ImageShardDataset(decode=False, batch_size=256) decoded by nvJPEG
           (torchvision.io.decode_jpeg on cuda) against the folder Dataset decoding with PIL
  s3       tests.benchmarks.bench_s3's reads (the reader on s3:// against the same reader on the
           local copy, raw bytes and decoded, medians) with the loopback S3 server (rclone serve s3)
           on CPUs of its own and the loader pinned to 2 others, as a real object store's CPUs are
           not the training node's; also with batch_size=64

Photos are generated in parallel (tests.gpu.gpu_images) into DIR/images-data and packed with the CLI.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from pathlib import Path


def _pinned(cpus: int):
    all_cpus = sorted(os.sched_getaffinity(0))
    return set(all_cpus[:cpus])


def decoded_rates(packed: Path, files: list[Path], workers: int, repeats: int) -> dict:
    """bench_images' decoded epochs (the reader one at a time and in batches, the folder), alternated, medians."""
    from tests.benchmarks.bench_images import read_rate

    seconds: dict[str, list[float]] = {"repack": [], "repack-batched": [], "folder": []}
    for _ in range(repeats):
        for kind in seconds:
            took, got = read_rate(kind, packed, files, workers)
            assert got == len(files), (kind, got)
            seconds[kind].append(took)
    rate = {k: len(files) / statistics.median(v) for k, v in seconds.items()}
    return {"repack": round(rate["repack"], 1), "repack_batched": round(rate["repack-batched"], 1),
            "folder": round(rate["folder"], 1), "ratio": round(rate["repack"] / rate["folder"], 3),
            "ratio_batched": round(rate["repack-batched"] / rate["folder"], 3)}


def gpu_rates(packed: Path, files: list[Path], workers: int, repeats: int) -> dict:
    import torch
    import torchvision
    from torch.utils.data import DataLoader
    from torchvision.io import decode_jpeg

    from pipelines.torch_webdataset import ImageShardDataset
    from tests.benchmarks.bench_images import FolderDataset

    def nvjpeg() -> tuple[float, int]:
        dataset = ImageShardDataset(packed, decode=False, shuffle=True, seed=0, batch_size=256)
        started, count = time.perf_counter(), 0
        for jpegs, labels in DataLoader(dataset, batch_size=None, num_workers=workers):
            images = decode_jpeg(list(jpegs), device="cuda")
            small = [torch.nn.functional.interpolate(i[None].float(), size=(224, 224), mode="bilinear") for i in images]
            count += len(small)
        torch.cuda.synchronize()
        return time.perf_counter() - started, count

    def folder() -> tuple[float, int]:
        loader = DataLoader(FolderDataset(files), batch_size=256, num_workers=workers, shuffle=True)
        started = time.perf_counter()
        count = sum(len(labels) for _, labels in loader)
        return time.perf_counter() - started, count

    seconds: dict[str, list[float]] = {"nvjpeg_from_shards": [], "folder_pil": []}
    nvjpeg()  # CUDA context and nvJPEG handles
    for _ in range(repeats):
        for kind, run in (("nvjpeg_from_shards", nvjpeg), ("folder_pil", folder)):
            took, got = run()
            assert got == len(files), (kind, got)
            seconds[kind].append(took)
    rate = {k: len(files) / statistics.median(v) for k, v in seconds.items()}
    return {k: round(v, 1) for k, v in rate.items()} | {
        "ratio": round(rate["nvjpeg_from_shards"] / rate["folder_pil"], 2), "torchvision": torchvision.__version__,
        "gpu": torch.cuda.get_device_name(0)}


def s3_rates(packed: Path, repeats: int, cpus: set) -> list[dict]:
    """bench_s3's read rows with the server started on all CPUs, then the loader pinned to ``cpus``."""
    from torch.utils.data import DataLoader

    from pipelines.torch_webdataset import ImageShardDataset
    from tests.benchmarks.bench_s3 import _bulk_upload, _read_rates
    from tests.tools.s3server import bench_server, client, s3_env

    server = bench_server()
    everything = os.sched_getaffinity(0)
    try:
        os.environ.update(s3_env(server.endpoint))
        s3 = client(server.endpoint)
        s3.create_bucket(Bucket="bench")
        files = sorted(p for p in packed.iterdir() if p.suffix in (".tar", ".idx") or p.name == "manifest.json")
        _bulk_upload(s3, files, packed, "bench", "bulk")
        os.sched_setaffinity(0, cpus)
        rows = []
        for name, decode in (("bytes", False), ("decoded", True)):
            got = _read_rates(str(packed), "s3://bench/bulk", decode, repeats)
            rows.append({"read": name, **{k: round(v, 3) for k, v in got.items()}, "ratio": round(got["s3"] / got["local"], 3)})

        def batched(root: str) -> float:
            dataset = ImageShardDataset(root, decode=False, batch_size=64)
            started = time.perf_counter()
            count = sum(len(labels) for _, labels in DataLoader(dataset, batch_size=None, num_workers=2))
            return count / (time.perf_counter() - started)

        runs = {"local": [], "s3": []}
        for _ in range(repeats):
            runs["local"].append(batched(str(packed)))
            runs["s3"].append(batched("s3://bench/bulk"))
        local, remote = (statistics.median(runs[k]) for k in ("local", "s3"))
        rows.append({"read": "bytes, batch_size=64", "local": round(local, 1), "s3": round(remote, 1),
                     "ratio": round(remote / local, 3)})
        return [dict(r, server=server.name, cpus=len(cpus)) for r in rows]
    finally:
        os.sched_setaffinity(0, everything)
        server.stop()


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--images", type=int, default=4000)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--parts", default="raw,decoded,gpu")
    parser.add_argument("--workers", default="2,16", help="loader settings: 2 (2 workers on 2 CPUs), 16 (on all)")
    args = parser.parse_args(argv)
    from tests.benchmarks.bench_images import image_files, raw_ratios, warm
    from tests.gpu.gpu_images import make_photos, pack

    parts = set(args.parts.split(","))
    src, packed = args.out / "images-data", args.out / "packed"
    cpus = len(os.sched_getaffinity(0))
    made = make_photos(src, args.images, cpus)
    if not (packed / "manifest.json").exists():
        pack(src, packed, max(50, args.images // 16))
    files = image_files(src)
    warm(files)
    warm(sorted(packed.glob("*.tar")))
    mean_kb = round(sum(p.stat().st_size for p in files) / len(files) / 1e3, 1)
    everything = os.sched_getaffinity(0)

    def emit(record: dict) -> None:
        print(json.dumps({"images": made, "mean_kb": mean_kb, "load": round(os.getloadavg()[0], 2), **record}),
              flush=True)

    settings = [(2, 2) if w == "2" else (16, cpus) for w in args.workers.split(",")]
    for workers, pinned in settings if parts & {"raw", "decoded"} else ():
        os.sched_setaffinity(0, _pinned(pinned))  # the DataLoader's workers inherit it
        try:
            if "raw" in parts:
                for row in raw_ratios(packed, files, workers, args.repeats):
                    emit({"part": "raw", "workers": workers, "cpus": pinned, **row})
            if "decoded" in parts:
                emit({"part": "decoded", "workers": workers, "cpus": pinned,
                      **decoded_rates(packed, files, workers, max(1, args.repeats - 2))})
        finally:
            os.sched_setaffinity(0, everything)
    if "gpu" in parts:
        emit({"part": "gpu", "workers": 16, **gpu_rates(packed, files, 16, 3)})
    if "s3" in parts:
        for row in s3_rates(packed, args.repeats, _pinned(2)):
            emit({"part": "s3", "workers": 2, **row})


if __name__ == "__main__":
    sys.exit(main())
