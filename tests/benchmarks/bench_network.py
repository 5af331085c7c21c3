"""Network storage, the headline (issue 19.4): shards against one object per image, with real
latency on every request.

A loopback S3 server (tests.tools.s3server.bench_server: rclone serve s3 when installed, else
moto) sits behind tests.tools.latency_proxy.LatencyProxy, which adds
REPACK_BENCH_LATENCY_MS (default 10) to every request. Beside the `repack images` shards
(s3://bench<set>/shards) the same images lie one object each (s3://bench<set>/objects/...), one
bucket per image set.
Both are read through the proxy by a DataLoader with the same 2 workers, raw bytes:

  shards   ImageShardDataset("s3://.../shards", decode=False, batch_size=64) (batches made in the workers)
  objects  a map-style Dataset doing one GET per image (boto3, one client per worker), DataLoader batch 64:
           one request in flight per worker, 2 in all (latency-bound by construction)
  objects, threads  the same Dataset with ``__getitems__`` (the DataLoader's batched fetch) getting a
           batch's 64 images on a thread pool of REPACK_BENCH_NET_THREADS (default 32) per worker:
           32 GETs in flight per worker, as a user who reads objects writes it

on ~100 KB photos (REPACK_BENCH_NET_IMAGES, default 4000: bench_images' photos, so `make bench`
generates no other set, and 2-3 s epochs that repeat steadier than 0.6 s ones) and ~10 KB images
(the same count, JPEGs of 150-210 px). images/s and the ratios shards / objects (target >= 10x on ~100 KB, against 2 in flight) and
shards / objects with threads. Also the shards' time to the first sample and their rate after it (the profile: a worker
delivers nothing until it has read the blocks up to its shuffle window's first sample, 70-110 MB
of the first 1,000-sample window at 4,000 photos, 14-60 MB at 1,000).
"""

from __future__ import annotations

import io
import os
import random
import shutil
import statistics
import subprocess
import sys
import time
from pathlib import Path

from tests.benchmarks.verdicts import verdict
from tests.tools.latency_proxy import LatencyProxy
from tests.tools.s3server import bench_server, client, s3_env

WORKERS = 2
THREADS = 32  # GETs in flight per worker for the concurrent per-object baseline
BATCH = 64  # both batched: the shards by the reader in its workers (the documented way), the objects by the DataLoader
TARGET = 10.0


def small_photos(root: Path, count: int) -> Path:
    """``count`` ~10 KB JPEG photos (crops of the sample photos, 150-210 px) in 10 classes."""
    from tests.tools.photos import load_photos, render

    src = root / f"small-{count}"
    if (src / ".complete").exists():
        return src
    shutil.rmtree(src, ignore_errors=True)
    rng = random.Random(11)
    photos = [p.convert("RGB") for p in load_photos().values()]
    for i in range(count):
        path = src / f"class{i % 10}" / f"img{i:05d}.jpg"
        path.parent.mkdir(parents=True, exist_ok=True)
        buf = io.BytesIO()
        render(photos[i % len(photos)], rng, 150, 210).save(buf, "JPEG", quality=90)
        path.write_bytes(buf.getvalue())
    (src / ".complete").write_text("ok\n")
    return src


class ObjectPerImage:
    """The baseline: a map-style Dataset with one GET per image, as a folder of objects is read."""

    def __init__(self, bucket: str, keys: list[str]) -> None:
        self.bucket, self.keys = bucket, keys
        names = sorted({k.rsplit("/", 2)[-2] for k in keys})
        self.labels = [names.index(k.rsplit("/", 2)[-2]) for k in keys]

    def __len__(self) -> int:
        return len(self.keys)

    def __getitem__(self, i: int):
        from pipelines.object_store import read_bytes

        return read_bytes(f"s3://{self.bucket}/{self.keys[i]}"), self.labels[i]


class ObjectPerImageThreads(ObjectPerImage):
    """The per-object baseline with concurrent GETs: the DataLoader hands each worker a batch's indices
    (``__getitems__``) and the worker gets them on its own thread pool of ``threads`` (made after the
    fork, one per worker), ``threads`` requests in flight."""

    def __init__(self, bucket: str, keys: list[str], threads: int = THREADS) -> None:
        super().__init__(bucket, keys)
        self.threads = threads
        self._pool = None

    def __getitems__(self, indices: list[int]) -> list:
        if self._pool is None:
            from concurrent.futures import ThreadPoolExecutor

            self._pool = ThreadPoolExecutor(self.threads)
        return list(self._pool.map(self.__getitem__, indices))


def _rate(dataset, batch_size: int | None = None, **loader) -> tuple[float, int, float]:
    """(samples/s of one epoch, samples, seconds to the first batch) through a fresh DataLoader: batches
    of ``batch_size`` collated by it, or made by the dataset itself (``yields_batches``)."""
    from torch.utils.data import DataLoader

    batched = batch_size is not None or getattr(dataset, "yields_batches", False)
    started = time.perf_counter()
    first, count = None, 0
    for item in DataLoader(dataset, batch_size=batch_size, num_workers=WORKERS, **loader):
        count += len(item[1]) if batched else 1
        if first is None:
            first = time.perf_counter() - started
    return count / (time.perf_counter() - started), count, first or 0.0


def _publish(s3, server, src: Path, work: Path, bucket: str) -> list[str]:
    """Pack ``src`` with repack, put the shards and one object per image into ``bucket``; the image keys.
    On a server over a folder (rclone: ``server.root``) the files are linked into the bucket's folder
    (the same objects, seconds sooner than 8,000 PUTs); on moto they are uploaded."""
    from boto3.s3.transfer import TransferConfig, create_transfer_manager

    s3.create_bucket(Bucket=bucket)
    packed = work / bucket
    subprocess.run([sys.executable, "-m", "repack", "images", str(src), str(packed), "--overwrite", "--quiet",
                    "--shard-bytes", "32MB"], check=True, capture_output=True)
    images = sorted(p for p in src.rglob("*") if p.is_file() and not p.name.startswith("."))
    uploads = [(p, f"shards/{p.name}") for p in sorted(packed.iterdir()) if p.is_file()]
    uploads += [(p, f"objects/{p.relative_to(src).as_posix()}") for p in images]
    root = getattr(server, "root", None)
    if root is not None:
        for p, key in uploads:
            target = Path(root, bucket, key)
            target.parent.mkdir(parents=True, exist_ok=True)
            try:
                os.link(p, target)
            except OSError:
                shutil.copyfile(p, target)
    else:
        with create_transfer_manager(s3, TransferConfig(max_concurrency=8)) as manager:
            for future in [manager.upload(str(p), bucket, key) for p, key in uploads]:
                future.result()
    return [key for p, key in uploads if key.startswith("objects/")]


def main(out_dir: str | os.PathLike = "bench-out") -> dict:
    from pipelines.torch_webdataset import ImageShardDataset
    from tests.benchmarks.bench_images import make_dataset

    out_dir = Path(out_dir).absolute()
    count = int(os.environ.get("REPACK_BENCH_NET_IMAGES") or 4000)
    latency_ms = float(os.environ.get("REPACK_BENCH_LATENCY_MS") or 10)
    repeats = int(os.environ.get("REPACK_BENCH_REPEATS") or 3)
    threads = int(os.environ.get("REPACK_BENCH_NET_THREADS") or THREADS)
    work = out_dir / "network"
    work.mkdir(parents=True, exist_ok=True)
    sets = {"~100 KB photos": make_dataset(out_dir / "images-data", count),
            "~10 KB images": small_photos(out_dir / "images-data", count)}
    server = bench_server()
    saved = {k: os.environ.get(k) for k in s3_env(server.endpoint)}
    rows = []
    try:
        s3 = client(server.endpoint)
        keys = {name: _publish(s3, server, src, work, f"bench{i}") for i, (name, src) in enumerate(sets.items())}
        # room for every worker's pool of connections and the parent's (a connection over the cap
        # waits in the listen queue until another closes: with keep-alive, until a read timeout)
        with LatencyProxy(server.port, delay_s=latency_ms / 1000, max_connections=4 * WORKERS * threads + 64) as proxy:
            os.environ.update(s3_env(proxy.endpoint))  # the readers' boto3 clients go through the proxy
            for i, (name, src) in enumerate(sets.items()):
                mean_kb = statistics.mean(p.stat().st_size for p in src.rglob("*.jpg")) / 1e3
                runs: dict[str, list[tuple[float, int, float]]] = {"shards": [], "objects": [], "threads": []}
                for _ in range(repeats):  # alternated
                    runs["shards"].append(_rate(ImageShardDataset(f"s3://bench{i}/shards", decode=False,
                                                                  shuffle=True, batch_size=BATCH)))
                    got = runs["shards"][-1][1]
                    assert got == len(keys[name]), f"shards delivered {got} of {len(keys[name])}"
                    runs["objects"].append(_rate(ObjectPerImage(f"bench{i}", keys[name]), batch_size=BATCH,
                                                 shuffle=True))
                    assert runs["objects"][-1][1] == len(keys[name])
                    runs["threads"].append(_rate(ObjectPerImageThreads(f"bench{i}", keys[name], threads),
                                                 batch_size=BATCH, shuffle=True))
                    assert runs["threads"][-1][1] == len(keys[name])
                shards, objects, pooled = (statistics.median(r[0] for r in runs[k]) for k in ("shards", "objects", "threads"))
                first = statistics.median(r[2] for r in runs["shards"])
                # after the first sample: the epoch's rate without the workers' start (fork, client,
                # manifest-driven index GETs, the first 16 MiB block)
                after = statistics.median((n - 1) / (n / rate - f) for rate, n, f in runs["shards"])
                rows.append({"set": name, "images": len(keys[name]), "mean_kb": round(mean_kb, 1),
                             "shards_per_s": round(shards, 1), "objects_per_s": round(objects, 1),
                             "objects_threads_per_s": round(pooled, 1), "ratio": round(shards / objects, 2),
                             "ratio_vs_threads": round(shards / pooled, 2), "target": TARGET if "100" in name else None,
                             "shards_first_sample_ms": round(first * 1e3), "shards_after_first_per_s": round(after, 1)})
            requests = proxy.requests
    finally:
        for key, value in saved.items():
            if value is None:
                os.environ.pop(key, None)
            else:
                os.environ[key] = value
        server.stop()
    lines = [f"network storage: {server.name} on loopback behind a {latency_ms:.0f} ms/request proxy, DataLoader "
             f"{WORKERS} workers, raw bytes, batches of {BATCH}, medians of {repeats} alternated runs ({requests} proxied requests); "
             f"objects: one GET per image, 1 in flight per worker; threads: {threads} in flight per worker",
             f"{'images':<16} {'n':>5} {'KB':>6} {'shards img/s':>13} {'objects img/s':>14} {'ratio':>7} "
             f"{'threads img/s':>14} {'ratio':>7}  {'shards: 1st sample':>18} {'img/s after':>11}  target"]
    for r in rows:
        lines.append(f"{r['set']:<16} {r['images']:>5} {r['mean_kb']:>6.1f} {r['shards_per_s']:>13.1f} "
                     f"{r['objects_per_s']:>14.1f} {r['ratio']:>6.2f}x {r['objects_threads_per_s']:>14.1f} "
                     f"{r['ratio_vs_threads']:>6.2f}x  {r['shards_first_sample_ms']:>15} ms "
                     f"{r['shards_after_first_per_s']:>11.1f}  {verdict(r['ratio'], r['target'])}")
    table = "\n".join(lines)
    print(table)
    return {"server": server.name, "latency_ms": latency_ms, "workers": WORKERS, "threads": threads, "rows": rows,
            "table": table}


if __name__ == "__main__":
    main(sys.argv[1] if len(sys.argv) > 1 else "bench-out")
