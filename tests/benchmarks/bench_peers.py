"""Side by side with the peers (issue 19.5): the same photos read through repack's
ImageShardDataset, litdata's StreamingDataset (after ``litdata.optimize``) and MosaicML
streaming's StreamingDataset (after its ``MDSWriter``), local disk, DataLoader with the same 2
workers, shuffled, raw bytes and decoded (PIL decode + resize 224, the same function for all);
each epoch in a fresh process, so no reader's process-wide state (shared memory, caches) meets
another's.

Dataset: REPACK_BENCH_PEER_IMAGES (default 1000) real-photo JPEGs of ~100 KB (bench_images'
generator), each peer's format written with its own writer at 32 MB chunks/shards. One untimed
epoch per reader first, then alternated repeats (REPACK_BENCH_REPEATS, default 3), medians; the table gives repack's ratio to each peer.
A peer that is not installed or cannot be imported is skipped with the reason.

Installing the peers beside torch 2.13.0+cpu: both pull a CUDA build of torch through their
``torchvision`` requirement (``pip install .[bench]`` would replace torch), and PyPI's x86_64
torchvision wheels link ``libc10_cuda.so``/``libtorch_cuda.so`` (0.17 and newer then fail at import:
"operator torchvision::nms does not exist"). mosaic's ``streaming/__init__.py`` imports
``streaming.vision`` (torchvision's ``VisionDataset`` and ``to_tensor``: pure Python) and
``streaming.base.dataloader`` imports ``transformers``. So the peers go into a folder of their
own, without dependencies, at pinned versions (``PEER_SITE``: torchvision 0.16.2 is the newest that
imports without its C++ ops, which nothing here uses; transformers 4.57 wants tokenizers 0.22 and
huggingface_hub < 1, which the folder shadows only in the peers' processes)::

    python -m tests.benchmarks.bench_peers --install-site DIR     # pip install --no-deps --target DIR
    REPACK_BENCH_PEERS_SITE=DIR python -m tests.benchmarks.run_all OUT --only peers

With REPACK_BENCH_PEERS_SITE set, DIR goes first on sys.path of the processes that write or read a
peer's format (never of repack's own epochs); without it the peers are imported from the
environment, if they are there.
"""

from __future__ import annotations

import json
import os
import shutil
import statistics
import subprocess
import sys
import time
from pathlib import Path

from torch.utils.data import IterableDataset

ROOT = Path(__file__).resolve().parents[2]
BATCH = 64
WORKERS = 2
CHUNK_BYTES = 32 << 20
PEERS = ("litdata", "mosaic streaming")
# pip install --no-deps --target DIR: the peers and what they import, at versions seen to import and
# run beside torch 2.13.0+cpu, numpy 2.4 and Pillow 13 (2026-12-01); nothing here replaces torch
PEER_SITE = ("mosaicml-streaming==0.13.0", "torchvision==0.16.2", "transformers==4.57.6", "tokenizers==0.22.2",
             "huggingface_hub==0.36.2", "safetensors==0.8.0", "catalogue==2.0.10", "python-snappy==0.7.3",
             "cramjam==2.14.0", "brotli==1.2.1", "zstd==1.5.7.2",
             "litdata==0.2.76", "lightning-utilities==0.15.3", "obstore==0.12.1")


def use_peer_site() -> None:
    """Put REPACK_BENCH_PEERS_SITE first on sys.path (this process only), when set."""
    site = os.environ.get("REPACK_BENCH_PEERS_SITE")
    if site and site not in sys.path:
        if not Path(site).is_dir():
            raise RuntimeError(f"REPACK_BENCH_PEERS_SITE={site} is not a folder: "
                               "python -m tests.benchmarks.bench_peers --install-site DIR")
        sys.path.insert(0, site)


def install_site(target: str) -> None:
    subprocess.run([sys.executable, "-m", "pip", "install", "-q", "--disable-pip-version-check", "--no-deps",
                    "--target", target, *PEER_SITE], check=True)


def _sample(path: str) -> dict:
    """litdata's per-input function: the file's bytes and its class (module level: it is pickled
    to litdata's worker processes)."""
    return {"image": Path(path).read_bytes(), "label": int(Path(path).parent.name.split("_")[-1])}


class Decoded(IterableDataset):
    """A peer's samples ({"image": bytes, "label": int}) decoded like repack's: PIL + resize 224."""

    def __init__(self, inner, decode: bool) -> None:
        self.inner, self.decode = inner, decode

    def __iter__(self):
        from pipelines.pil_images import decode_image
        from tests.benchmarks.bench_images import to_224

        for sample in self.inner:
            # litdata hands out a memoryview into its mmapped chunk: bytes, as repack's reader yields
            # (a view does not cross the DataLoader's worker queue: ~10 images/s when passed as is)
            data = bytes(sample["image"])
            yield (to_224(decode_image(data, "RGB")) if self.decode else data), int(sample["label"])


def _classed_copy(src: Path, dst: Path) -> list[Path]:
    """Hard links of ``src``'s photos under ``dst/class_N/`` (a label parsable from the path)."""
    if not (dst / ".complete").exists():
        shutil.rmtree(dst, ignore_errors=True)
        for n, folder in enumerate(sorted(p for p in src.iterdir() if p.is_dir())):
            (dst / f"class_{n}").mkdir(parents=True)
            for f in sorted(folder.iterdir()):
                os.link(f, dst / f"class_{n}" / f.name)
        (dst / ".complete").write_text("ok\n")
    return sorted(p for p in dst.rglob("*.jpg"))


def write_litdata(files: list[Path], out: Path) -> None:
    from litdata import optimize

    if not (out / "index.json").exists():
        shutil.rmtree(out, ignore_errors=True)
        optimize(fn=_sample, inputs=[str(f) for f in files], output_dir=str(out), chunk_bytes=CHUNK_BYTES,
                 num_workers=WORKERS)


def write_mds(files: list[Path], out: Path) -> None:
    from streaming import MDSWriter

    if not (out / "index.json").exists():
        shutil.rmtree(out, ignore_errors=True)
        with MDSWriter(out=str(out), columns={"image": "bytes", "label": "int"}, size_limit=CHUNK_BYTES) as writer:
            for f in files:
                writer.write(_sample(str(f)))


def _readers(work: Path, packed: Path, only: str | None = None) -> dict:
    """{name: factory(decode) -> dataset}, and {name: why skipped} for missing peers (``only``: just
    that reader, and no peer imported in this process unless it is that peer)."""
    from pipelines.torch_webdataset import ImageShardDataset
    from tests.benchmarks.bench_images import to_224

    readers = {"repack": lambda decode: ImageShardDataset(packed, decode=decode, shuffle=True, batch_size=BATCH,
                                                          transform=to_224 if decode else None)}
    skipped = {}
    if only is not None and only not in PEERS:
        return readers, skipped
    use_peer_site()
    try:
        if only not in (None, "litdata"):
            raise LookupError("not asked for")
        import litdata

        def lit(decode: bool):
            return Decoded(litdata.StreamingDataset(str(work / "litdata"), shuffle=True), decode)

        readers["litdata"] = lit
    except Exception as exc:  # noqa: BLE001 - any import failure means "not usable here"
        skipped["litdata"] = f"{type(exc).__name__}: {exc}"
    try:
        if only not in (None, "mosaic streaming"):
            raise LookupError("not asked for")
        import streaming

        from streaming.base.util import clean_stale_shared_memory

        def mds(decode: bool):
            clean_stale_shared_memory()  # one StreamingDataset per local folder at a time
            return Decoded(streaming.StreamingDataset(local=str(work / "mds"), shuffle=True, batch_size=BATCH), decode)

        readers["mosaic streaming"] = mds
    except Exception as exc:  # noqa: BLE001
        skipped["mosaic streaming"] = f"{type(exc).__name__}: {exc}"
    return readers, skipped


def _epoch(dataset) -> tuple[float, int]:
    from torch.utils.data import DataLoader

    # batches of BATCH for every reader: repack's made in its workers (its documented way), the peers'
    # collated by the DataLoader (theirs)
    own = getattr(dataset, "yields_batches", False)
    started = time.perf_counter()
    count = sum(len(labels) for _, labels in DataLoader(dataset, batch_size=None if own else BATCH,
                                                         num_workers=WORKERS))
    return time.perf_counter() - started, count


def epoch_in_child(name: str, decode: bool, work: Path, packed: Path, timeout: float = 300.0) -> tuple[float, int]:
    """One epoch of reader ``name`` in a fresh process (a peer's process-wide state, its shared
    memory or caches, cannot leak into the next measurement; a hung reader is cut at ``timeout``)."""
    cmd = [sys.executable, "-m", "tests.benchmarks.bench_peers", "--epoch", name, str(int(decode)), str(work),
           str(packed)]
    try:
        proc = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, cwd=ROOT)
    except subprocess.TimeoutExpired:
        raise RuntimeError(f"{name} did not finish an epoch in {timeout:.0f} s") from None
    if proc.returncode != 0:
        raise RuntimeError(f"{name} epoch failed: {proc.stderr.strip().splitlines()[-1:]}")
    seconds, count = json.loads(proc.stdout.strip().splitlines()[-1])
    return seconds, count


def main(out_dir: str | os.PathLike = "bench-out") -> dict:
    from tests.benchmarks.bench_images import make_dataset

    out_dir = Path(out_dir).absolute()
    count = int(os.environ.get("REPACK_BENCH_PEER_IMAGES") or 1000)
    repeats = int(os.environ.get("REPACK_BENCH_REPEATS") or 3)
    work = out_dir / "peers"
    work.mkdir(parents=True, exist_ok=True)
    files = _classed_copy(make_dataset(out_dir / "images-data", count), work / f"photos-{count}")
    packed = work / "repack"
    subprocess.run([sys.executable, "-m", "repack", "images", str(work / f"photos-{count}"), str(packed),
                    "--overwrite", "--quiet", "--shard-bytes", "32MB"], check=True, capture_output=True)
    readers, skipped = _readers(work, packed)
    writers = {"litdata": write_litdata, "mosaic streaming": write_mds}
    for name in list(readers):
        if name in writers:
            try:
                writers[name](files, work / ("litdata" if name == "litdata" else "mds"))
            except Exception as exc:  # noqa: BLE001 - a peer that fails to write is reported, not fatal
                skipped[name] = f"writer failed: {type(exc).__name__}: {exc}"
                del readers[name]
    for name, why in skipped.items():
        print(f"[peers] {name}: skipped ({why}); see tests/benchmarks/bench_peers.py: --install-site",
              file=sys.stderr)
    for name in readers:  # one untimed epoch each: a peer's first read of new chunks (its cache) is not timed
        epoch_in_child(name, False, work, packed)
    rates: dict[tuple[str, bool], list[float]] = {}
    for _ in range(repeats):
        for decode in (False, True):
            for name, make in readers.items():  # alternated: every reader once per round
                seconds, got = epoch_in_child(name, decode, work, packed)
                if got != len(files):
                    raise RuntimeError(f"{name} delivered {got} of {len(files)} samples")
                rates.setdefault((name, decode), []).append(len(files) / seconds)
    median = {key: statistics.median(values) for key, values in rates.items()}
    rows = []
    for decode in (False, True):
        what = "decode+resize 224" if decode else "raw bytes"
        for name in readers:
            if name != "repack":
                rows.append({"measure": what, "peer": name, "repack": round(median[("repack", decode)], 1),
                             "peer_rate": round(median[(name, decode)], 1),
                             "ratio": round(median[("repack", decode)] / median[(name, decode)], 3)})
    mean_kb = statistics.mean(f.stat().st_size for f in files) / 1e3
    lines = [f"peers: {len(files)} JPEG photos, {mean_kb:.0f} KB mean, local disk (page cache warm), DataLoader "
             f"{WORKERS} workers, shuffled, medians of {repeats} alternated runs",
             f"{'measure':<20} {'peer':<18} {'repack img/s':>12} {'peer img/s':>11} {'repack/peer':>12}"]
    lines += [f"{r['measure']:<20} {r['peer']:<18} {r['repack']:>12.1f} {r['peer_rate']:>11.1f} {r['ratio']:>11.2f}x"
              for r in rows]
    lines += [f"{name}: skipped ({why})" for name, why in skipped.items()]
    table = "\n".join(lines)
    print(table)
    return {"images": len(files), "rows": rows, "skipped": skipped, "table": table}


if __name__ == "__main__":
    if sys.argv[1:2] == ["--epoch"]:  # a child of epoch_in_child: one epoch, its (seconds, count) as JSON
        reader, decode_flag, work_dir, packed_dir = sys.argv[2:6]
        factories, _ = _readers(Path(work_dir), Path(packed_dir), only=reader)
        print(json.dumps(_epoch(factories[reader](decode_flag == "1"))))
    elif sys.argv[1:2] == ["--install-site"]:
        install_site(sys.argv[2])
    else:
        main(sys.argv[1] if len(sys.argv) > 1 else "bench-out")
