"""Benchmark of issue 2: reading `repack images` shards against the original files, in one run.

Dataset: REPACK_BENCH_IMAGES (default 4000) real-photo JPEGs of mixed sizes (~100 KB mean),
generated once into OUT/images-data and reused, packed with `--verify decode` into shards of
REPACK_BENCH_SHARD_SIZE (several shards, so DataLoader workers split them). Packing speed is
bench_producer's. Rows (images/s; ratio = repack / baseline):

  decode the per-image `--verify decode` check alone, one process (strict full libjpeg-turbo decode,
         ``inspect_image``) vs the check it replaced (PIL 1/8-scale draft decode, which misses
         corrupt data that libjpeg only warns about) and vs a plain PIL full-decode loop
  read   PyTorch reader over the shards vs a folder-of-files Dataset (same PIL decode, resize 224,
         same num_workers, both shuffled), warm and cold page cache; then the same without
         decoding (raw bytes: the I/O path alone)
  raw    issue 19.1: raw bytes, DataLoader with 2 workers, all shuffled: ImageShardDataset vs the
         folder Dataset and vs plain ``wds.WebDataset`` over the same shards; medians of
         REPACK_BENCH_REPEATS (default 3) alternated rounds, the baselines measured in the same run
  verify the cost of ``verify_samples=True`` (a crc32 of every payload byte read, issue 27): raw bytes
         in batches of 64, 2 workers, warm cache, check on vs off in alternated rounds (medians)
  resume the cost of a checkpoint: the JSON size of a StatefulDataLoader's state mid-epoch, and
         the time to the first batch after load_state_dict vs a fresh start (medians)

REPACK_BENCH_IMAGES_PARTS (default all: decode,read,raw,verify,resume) picks parts; the read part runs
REPACK_BENCH_REPEATS alternated rounds per row (medians; also the workers' CPU ms per image) for the
caches in REPACK_BENCH_READ_CACHES (default warm,cold); REPACK_BENCH_REUSE_PACKED=1 reads the shards
already in OUT/images-work/decode instead of packing them again.

Cold cache: every file involved is fsynced and dropped with posix_fadvise(DONTNEED) (or, with
REPACK_BENCH_DROP_CACHES=1, the whole page cache through /proc/sys/vm/drop_caches). Other knobs:
REPACK_BENCH_READ_WORKERS (default: the usable CPUs), REPACK_BENCH_SHARD_SIZE.
"""

from __future__ import annotations

import io
import json
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[2]


def usable_cpus() -> int:
    return len(os.sched_getaffinity(0))


def env_int(name: str, default: int) -> int:
    return int(os.environ.get(name) or default)


# ---- data -------------------------------------------------------------------------------

def make_dataset(data_dir: Path, count: int) -> Path:
    """ImageFolder tree of ``count`` JPEG photos (10 classes), generated once and reused."""
    from tests.tools.photos import make_photo_tree

    src = data_dir / f"photos-{count}"
    marker = src / ".complete"
    if not marker.exists():
        shutil.rmtree(src, ignore_errors=True)
        started = time.perf_counter()
        make_photo_tree(src, per_class=max(1, count // 10), seed=7, min_side=400, max_side=2200, png_share=0.0)
        print(f"[images] generated {count} photos in {time.perf_counter() - started:.0f} s", file=sys.stderr)
        marker.write_text("ok\n")
    return src


def image_files(src: Path) -> list[Path]:
    return sorted(p for p in src.rglob("*") if p.is_file() and not p.name.startswith("."))


def warm(files: list[Path]) -> None:
    for path in files:
        with open(path, "rb") as fh:
            while fh.read(1 << 22):
                pass


def drop_cache(files: list[Path]) -> str:
    """Evict ``files`` from the page cache; returns the method used."""
    if os.environ.get("REPACK_BENCH_DROP_CACHES") == "1":
        os.sync()
        try:
            Path("/proc/sys/vm/drop_caches").write_text("3\n")
            return "drop_caches"
        except OSError:
            pass
    for path in files:
        fd = os.open(path, os.O_RDONLY)
        try:
            os.fdatasync(fd)
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        finally:
            os.close(fd)
    return "posix_fadvise"


# ---- writers ----------------------------------------------------------------------------

def timed(cmd: list[str]) -> tuple[float, subprocess.CompletedProcess]:
    # Flush earlier runs' dirty pages first: otherwise kernel writeback throttling lands on
    # whichever command happens to run next (seen here: the same write loop 0.14 s or 1.1 s).
    os.sync()
    started = time.perf_counter()
    proc = subprocess.run(cmd, capture_output=True, text=True, cwd=ROOT)
    seconds = time.perf_counter() - started
    if proc.returncode != 0:
        raise RuntimeError(f"{' '.join(cmd)} exited {proc.returncode}: {proc.stderr[-2000:]}")
    return seconds, proc


def run_repack(src: Path, out: Path, verify: str, shard_size: int, repeats: int = 1) -> tuple[float, float]:
    """Best (wall seconds, engine seconds) of ``repeats`` fresh runs of the real CLI."""
    results = []
    for _ in range(repeats):
        shutil.rmtree(out, ignore_errors=True)
        wall, proc = timed([sys.executable, "-m", "repack", "images", str(src), str(out), "--verify", verify,
                            "--shard-size", str(shard_size), "--quiet", "--json"])
        summary = json.loads(proc.stdout.strip().splitlines()[-1])
        results.append((wall, float(summary["seconds"])))
    return min(results)


def run_shardwriter_pil(src: Path, files: list[Path], work: Path, shard_size: int) -> float:
    """The baseline: one process, webdataset ShardWriter, full PIL decode of every image."""
    import webdataset as wds
    from PIL import Image

    out = work / "shardwriter"
    shutil.rmtree(out, ignore_errors=True)
    out.mkdir(parents=True)
    classes = {name: i for i, name in enumerate(sorted({p.parent.name for p in files}))}
    started = time.perf_counter()
    with wds.ShardWriter(str(out / "shard-%06d.tar"), maxcount=shard_size, verbose=0) as sink:
        for i, path in enumerate(files):
            data = path.read_bytes()
            image = Image.open(io.BytesIO(data))
            image.load()
            sink.write({"__key__": f"{i:08d}", "jpg": data, "cls": str(classes[path.parent.name]).encode(),
                        "json": json.dumps({"path": str(path.relative_to(src)), "width": image.width,
                                            "height": image.height}).encode()})
    seconds = time.perf_counter() - started
    shutil.rmtree(out)
    return seconds


def decode_check_seconds(datas: list[bytes]) -> dict[str, float]:
    """Best of 2 seconds, one process, for each way of checking that every image of ``datas`` decodes."""
    from PIL import Image

    from repack.transforms.image_check import inspect_image

    def draft(data: bytes) -> None:  # the pre-issue-11 `--verify decode`
        image = Image.open(io.BytesIO(data))
        image.draft(image.mode, (max(1, image.width // 8), max(1, image.height // 8)))
        image.load()

    def full_pil(data: bytes) -> None:
        Image.open(io.BytesIO(data)).load()

    ways = {"inspect": lambda data: inspect_image(data, "decode"), "draft": draft, "pil": full_pil}
    result = {}
    for name, check in ways.items():
        best = float("inf")
        for _ in range(2):
            started = time.perf_counter()
            for data in datas:
                check(data)
            best = min(best, time.perf_counter() - started)
        result[name] = best
    return result


# ---- readers ----------------------------------------------------------------------------

def to_224(image):
    """The per-image work both readers do after decoding: RGB, resize to 224x224, CHW uint8 tensor.

    ``convert`` only when the image is not RGB yet: on an RGB image it is a full-size copy, which
    charged the shard reader (it hands RGB already: ``mode="RGB"``) a second full-size copy of every
    grayscale photo that the folder (converting here, once) did not pay. Same pixels either way."""
    import torch
    from PIL import Image

    if image.mode != "RGB":
        image = image.convert("RGB")
    image = image.resize((224, 224), Image.BILINEAR)
    return torch.from_numpy(np.array(image)).permute(2, 0, 1)


class FolderDataset:
    """The baseline: a map-style Dataset over the original files (ImageFolder-like)."""

    def __init__(self, files: list[Path]) -> None:
        self.files = files
        names = sorted({p.parent.name for p in files})
        self.labels = [names.index(p.parent.name) for p in files]

    def __len__(self) -> int:
        return len(self.files)

    def __getitem__(self, i: int):
        from PIL import Image

        with Image.open(self.files[i]) as image:
            return to_224(image), self.labels[i]


class FolderBytes(FolderDataset):
    """The baseline without decoding: the raw bytes of each file."""

    def __getitem__(self, i: int):
        return self.files[i].read_bytes(), self.labels[i]


def read_rate(kind: str, packed: Path, files: list[Path], workers: int) -> tuple[float, int]:
    """(seconds, samples) of one shuffled epoch through a DataLoader, batches of 64. ``repack`` and
    ``folder`` are batched by the DataLoader; ``repack-batched`` is ImageShardDataset(batch_size=64),
    its batches made in the workers (the documented way); ``-bytes``: raw bytes, no decode."""
    from torch.utils.data import DataLoader

    from pipelines.torch_webdataset import ImageShardDataset

    decode = not kind.endswith("-bytes")
    if kind.startswith("repack"):
        batched = kind.startswith("repack-batched")
        dataset = ImageShardDataset(packed, transform=to_224 if decode else None, shuffle=True, seed=0, decode=decode,
                                    batch_size=64 if batched else None)
        loader = DataLoader(dataset, batch_size=None if batched else 64, num_workers=workers)
    else:
        dataset = FolderDataset(files) if decode else FolderBytes(files)
        loader = DataLoader(dataset, batch_size=64, num_workers=workers, shuffle=True)
    started = time.perf_counter()
    count = sum(len(labels) for _, labels in loader)
    return time.perf_counter() - started, count


def read_rates(packed: Path, files: list[Path], workers: int, cache: str, decode: bool,
               repeats: int) -> tuple[dict, dict]:
    """The read part's rows: ``repeats`` alternated rounds (folder, repack one at a time, repack in
    batches) of one shuffled epoch each, the page cache warmed or dropped before every epoch. Returns ({kind: median images/s, "_method":
    how the cache was dropped}, {kind: median CPU ms per image of the DataLoader workers}); the CPU
    figure (RUSAGE_CHILDREN of the joined workers) is what other load on the machine disturbs least."""
    import resource

    seconds: dict[str, list[float]] = {"folder": [], "repack": [], "repack-batched": []}
    cpu: dict[str, list[float]] = {kind: [] for kind in seconds}
    shards = sorted(packed.glob("*.tar"))
    method = None
    for _ in range(repeats):
        for kind in seconds:
            involved = files if kind == "folder" else shards
            if cache == "warm":
                warm(involved)
            else:
                method = drop_cache(involved)
            before = resource.getrusage(resource.RUSAGE_CHILDREN)
            took, got = read_rate(kind if decode else f"{kind}-bytes", packed, files, workers)
            after = resource.getrusage(resource.RUSAGE_CHILDREN)
            if got != len(files):
                raise RuntimeError(f"{kind} reader yielded {got} of {len(files)} samples")
            seconds[kind].append(took)
            used = after.ru_utime + after.ru_stime - before.ru_utime - before.ru_stime
            cpu[kind].append(used * 1e3 / got)
    rates = {kind: len(files) / float(np.median(s)) for kind, s in seconds.items()}
    rates["_method"] = method
    return rates, {kind: round(float(np.median(c)), 2) for kind, c in cpu.items()}


class WdsBytes:
    """The baseline of issue 19.1: plain ``wds.WebDataset`` over the same shards (shards shuffled,
    a 1000-sample shuffle buffer, split by DataLoader worker), raw bytes and label."""

    def __init__(self, shards: list[Path]) -> None:
        self.urls = [str(s) for s in shards]

    def dataset(self):
        import webdataset as wds

        return (wds.WebDataset(self.urls, shardshuffle=len(self.urls), seed=0, empty_check=False)
                .shuffle(1000).to_tuple("jpg", "cls"))


class TransportOnly:
    """The ceiling of any raw-bytes reader here: the DataLoader carrying distinct bytes objects of
    the photos' mean size from its workers (each made by one copy in the worker, nothing read)."""

    def __init__(self, count: int, size: int) -> None:
        self.count, self.size = count, size

    def dataset(self):
        from torch.utils.data import IterableDataset, get_worker_info

        count, size = self.count, self.size

        class Blobs(IterableDataset):
            def __iter__(self):
                info = get_worker_info()
                worker, workers = (info.id, info.num_workers) if info is not None else (0, 1)
                blob = os.urandom(size + 8)
                for i in range(worker, count, workers):
                    yield blob[i % 8:i % 8 + size], 0  # a new object each: pickle sends every one

        return Blobs()


def raw_epoch(kind: str, packed: Path, files: list[Path], workers: int) -> tuple[float, int]:
    """(seconds, samples) of one shuffled raw-bytes epoch through a DataLoader, batches of 64:
    ``repack`` is ImageShardDataset(batch_size=64) (batches made in the workers, the documented way),
    ``repack-1`` the same reader one sample at a time, batched by the DataLoader like the others."""
    from torch.utils.data import DataLoader

    if kind in ("wds", "transport"):
        shards = sorted(packed.glob("*.tar"))
        mean = sum(p.stat().st_size for p in files) // len(files)
        dataset = WdsBytes(shards).dataset() if kind == "wds" else TransportOnly(len(files), mean).dataset()
        loader = DataLoader(dataset, batch_size=64, num_workers=workers)
        started = time.perf_counter()
        count = sum(len(labels) for _, labels in loader)
        return time.perf_counter() - started, count
    return read_rate({"repack": "repack-batched-bytes", "repack-1": "repack-bytes"}.get(kind, "folder-bytes"),
                     packed, files, workers)


def raw_ratios(packed: Path, files: list[Path], workers: int, repeats: int) -> list[dict]:
    """Issue 19.1's rows: medians of ``repeats`` alternated rounds, warm cache. The transport rows say
    what a DataLoader carries when every sample crosses its pipe as ``bytes`` (the folder's and the
    one-at-a-time reader's ceiling; batches in shared memory do not cross that pipe)."""
    warm(files)
    warm(sorted(packed.glob("*.tar")))
    seconds: dict[str, list[float]] = {"repack": [], "folder": [], "wds": [], "repack-1": [], "transport": []}
    for _ in range(repeats):
        for kind in seconds:
            took, got = raw_epoch(kind, packed, files, workers)
            if got != len(files):
                raise RuntimeError(f"{kind} (raw bytes) yielded {got} of {len(files)} samples")
            seconds[kind].append(took)
    rate = {kind: len(files) / float(np.median(s)) for kind, s in seconds.items()}
    what = f"raw bytes, {workers} workers, batches of 64, median of {repeats}"
    return [row(f"ImageShardDataset(batch_size=64), {what}", rate["repack"], "folder Dataset, same", rate["folder"], 1.5),
            row(f"ImageShardDataset(batch_size=64), {what}", rate["repack"], "plain wds.WebDataset, same", rate["wds"], 1.2),
            row(f"ImageShardDataset one at a time, {what}", rate["repack-1"], "folder Dataset, same", rate["folder"]),
            row(f"folder Dataset, {what}", rate["folder"], "DataLoader transport alone (in-memory bytes), same",
                rate["transport"]),
            row(f"ImageShardDataset one at a time, {what}", rate["repack-1"],
                "DataLoader transport alone (in-memory bytes), same", rate["transport"])]


def checkpoint_cost(packed: Path, workers: int, repeats: int) -> dict:
    """State size (JSON bytes) of a StatefulDataLoader halfway through a shuffled epoch, and the
    seconds to its first batch after load_state_dict vs a fresh start (medians of ``repeats``)."""
    from torchdata.stateful_dataloader import StatefulDataLoader

    from pipelines.torch_webdataset import ImageShardDataset

    def loader():
        dataset = ImageShardDataset(packed, shuffle=True, seed=0, decode=False)
        return dataset, StatefulDataLoader(dataset, batch_size=64, num_workers=workers)

    dataset, first = loader()
    it = iter(first)
    for _ in range(len(dataset) // 64 // 2):
        next(it)
    state = json.loads(json.dumps(first.state_dict()))
    del it, first
    fresh, resumed = [], []
    for _ in range(repeats):
        for target in (fresh, resumed):
            _, again = loader()
            started = time.perf_counter()
            if target is resumed:
                again.load_state_dict(state)
            next(iter(again))
            target.append(time.perf_counter() - started)
            del again
    return {"state_bytes": len(json.dumps(state)), "first_batch_fresh_s": round(float(np.median(fresh)), 3),
            "first_batch_resumed_s": round(float(np.median(resumed)), 3)}


def verify_ratio(packed: Path, files: list[Path], workers: int, repeats: int) -> list[dict]:
    """The cost of ``verify_samples=True`` (a crc32 of every payload byte read): one shuffled epoch of raw
    bytes in batches of 64 (where the check's share of the work is largest: no decode), page cache warm,
    check on and off alternated ``repeats`` times in the same run; medians."""
    from torch.utils.data import DataLoader

    from pipelines.torch_webdataset import ImageShardDataset

    warm(sorted(packed.glob("*.tar")))
    seconds: dict[bool, list[float]] = {False: [], True: []}
    for _ in range(repeats):
        for verify in seconds:
            dataset = ImageShardDataset(packed, decode=False, shuffle=True, seed=0, batch_size=64,
                                        verify_samples=verify)
            started = time.perf_counter()
            count = sum(len(labels) for _, labels in DataLoader(dataset, batch_size=None, num_workers=workers))
            seconds[verify].append(time.perf_counter() - started)
            if count != len(files):
                raise RuntimeError(f"verify_samples={verify}: {count} of {len(files)} samples")
    on, off = (len(files) / float(np.median(seconds[v])) for v in (True, False))
    return [row("ImageShardDataset(verify_samples=True), raw, warm", on, "same, verify_samples off", off)]


# ---- report -----------------------------------------------------------------------------

def table(rows: list[dict], header: str) -> str:
    lines = [header, f"{'measure':<44} {'img/s':>8}  {'baseline':<36} {'img/s':>8} {'ratio':>6}  target"]
    for r in rows:
        target = r.get("target")
        verdict = "" if target is None else (f">= {target}x " + ("ok" if r["ratio"] >= target else "MISSED"))
        lines.append(f"{r['measure']:<44} {r['rate']:>8.0f}  {r['baseline']:<36} {r['baseline_rate']:>8.0f} "
                     f"{r['ratio']:>5.2f}x  {verdict}")
    return "\n".join(lines)


def row(measure: str, rate: float, baseline: str, baseline_rate: float, target: float | None = None, **extra) -> dict:
    return {"measure": measure, "rate": round(rate, 1), "baseline": baseline, "baseline_rate": round(baseline_rate, 1),
            "ratio": round(rate / baseline_rate, 3), "target": target, **extra}


def main(out_dir: str | os.PathLike = "bench-out") -> dict:
    out_dir = Path(out_dir).absolute()
    work = out_dir / "images-work"
    work.mkdir(parents=True, exist_ok=True)
    count = env_int("REPACK_BENCH_IMAGES", 4000)
    cpus = usable_cpus()
    read_workers = env_int("REPACK_BENCH_READ_WORKERS", cpus)
    shard_size = env_int("REPACK_BENCH_SHARD_SIZE", max(50, count // 16))
    src = make_dataset(out_dir / "images-data", count)
    files = image_files(src)
    n = len(files)
    total_bytes = sum(p.stat().st_size for p in files)
    print(f"[images] {n} JPEGs, {total_bytes / n / 1e3:.0f} KB mean, {cpus} usable CPUs", file=sys.stderr)
    warm(files)

    parts = set((os.environ.get("REPACK_BENCH_IMAGES_PARTS") or "decode,read,raw,verify,resume").split(","))
    repeats = env_int("REPACK_BENCH_REPEATS", 3)
    rows = []  # packing speed (vs tar, vs ShardWriter, worker sweep): bench_producer
    if not (os.environ.get("REPACK_BENCH_REUSE_PACKED") == "1" and (work / "decode" / "manifest.json").exists()):
        run_repack(src, work / "decode", "decode", shard_size)
    read_caches = (os.environ.get("REPACK_BENCH_READ_CACHES") or "warm,cold").split(",")

    if "decode" in parts:
        sample = [p.read_bytes() for p in files[: env_int("REPACK_BENCH_DECODE_IMAGES", 500)]]
        check_s = decode_check_seconds(sample)
        m = len(sample)
        rows.append(row("decode check: strict full decode (1 proc)", m / check_s["inspect"],
                        "old check: PIL 1/8 draft decode", m / check_s["draft"], seconds=round(check_s["inspect"], 3)))
        rows.append(row("decode check: strict full decode (1 proc)", m / check_s["inspect"],
                        "plain PIL full decode loop", m / check_s["pil"], seconds=round(check_s["inspect"], 3)))

    packed = work / "decode"
    method = None
    if "raw" in parts:
        rows += raw_ratios(packed, files, 2, repeats)
    if "verify" in parts:
        rows += verify_ratio(packed, files, 2, repeats)
    checkpoint = checkpoint_cost(packed, 2, repeats) if "resume" in parts else None
    for decode in ((True, False) if "read" in parts else ()):
        for cache in read_caches:
            got_rates, cpu_ms = read_rates(packed, files, read_workers, cache, decode, repeats)
            method = got_rates.pop("_method", method)
            what = "decode+resize 224" if decode else "bytes only"
            for kind, name in (("repack-batched", "ImageShardDataset(batch_size=64)"), ("repack", "one at a time")):
                rows.append(row(f"PyTorch reader {name}, {what}, {cache}", got_rates[kind],
                                f"folder Dataset, {what}, {cache}", got_rates["folder"],
                                1.0 if decode and cache == "warm" and kind == "repack-batched" else None,
                                worker_cpu_ms=cpu_ms[kind], baseline_worker_cpu_ms=cpu_ms["folder"]))

    header = (f"images: {n} JPEG photos, {total_bytes / n / 1e3:.0f} KB mean, {cpus} usable CPU cores, "
              f"shards of {shard_size}, {read_workers} DataLoader workers; cold cache via {method}; "
              f"load average {os.getloadavg()[0]:.1f}")
    text = table(rows, header)
    cpu_rows = [r for r in rows if "worker_cpu_ms" in r]
    if cpu_rows:
        text += "\n" + "\n".join(f"  {r['measure']}: DataLoader workers' CPU {r['worker_cpu_ms']:.2f} ms per image vs "
                                 f"{r['baseline_worker_cpu_ms']:.2f} for the folder (medians of {repeats})"
                                 for r in cpu_rows)
    if checkpoint is not None:
        text += (f"\ncheckpoint (StatefulDataLoader, 2 workers, mid-epoch): state {checkpoint['state_bytes']} bytes of "
                 f"JSON; first batch {checkpoint['first_batch_resumed_s']:.3f} s after load_state_dict vs "
                 f"{checkpoint['first_batch_fresh_s']:.3f} s fresh (medians of {repeats})")
    print(text)
    return {"name": "images", "cpus": cpus, "images": n, "mean_bytes": round(total_bytes / n),
            "shard_size": shard_size, "read_workers": read_workers, "cold_cache": method, "rows": rows,
            "checkpoint": checkpoint, "table": text}


if __name__ == "__main__":
    main(sys.argv[1] if len(sys.argv) > 1 else "bench-out")
