"""Changes cost what changed: `--append` of 1% new files and `repack remove` of 1,000 samples against a
full pack of the same tiny files (same run, same machine), and the job state's bytes per input.

    python -m tests.benchmarks.bench_changes [--files 100000] [--work DIR]
    python -m tests.benchmarks.bench_changes --select 1000000   # the --append comparison alone, in memory
    python -m tests.benchmarks.bench_changes --record OUT SOURCE  # reading OUT's record, comparing a scan

N tiny JPEGs (32x32, ~1.1 KB, 100 class folders) are generated under a temporary folder (deleted at the
end). Each step runs ``python -m repack`` as a user would; wall and CPU seconds (user + sys of the
process tree: the ratio that holds on a shared machine) are printed with the ratios to the full pack;
beside remove, its floor: the shards it rewrote copied whole in parallel (``copy_file_range`` + fsync).
"""

from __future__ import annotations

import argparse
import io
import json
import os
import resource
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def tiny_jpegs(root: Path, start: int, count: int) -> None:
    """``count`` distinct small JPEGs (64 base images, each made unique by a COM segment)."""
    import numpy as np
    from PIL import Image

    rng = np.random.default_rng(0)
    base = []
    for _ in range(64):
        buffer = io.BytesIO()
        Image.fromarray(rng.integers(0, 255, (32, 32, 3), dtype=np.uint8)).save(buffer, "JPEG", quality=60)
        base.append(buffer.getvalue())
    for i in range(start, start + count):
        folder = root / f"c{i % 100:03d}"
        folder.mkdir(parents=True, exist_ok=True)
        data = base[i % 64]
        (folder / f"img{i:07d}.jpg").write_bytes(data[:2] + b"\xff\xfe\x00\x0a" + i.to_bytes(8, "big") + data[2:])


def timed(*args: str) -> tuple[float, float]:
    """(wall, CPU seconds of the process tree) of ``python -m repack ARGS``."""
    before = resource.getrusage(resource.RUSAGE_CHILDREN)
    started = time.perf_counter()
    subprocess.run([sys.executable, "-m", "repack", *args], check=True, cwd=ROOT, stdout=subprocess.DEVNULL)
    wall = time.perf_counter() - started
    after = resource.getrusage(resource.RUSAGE_CHILDREN)
    return wall, (after.ru_utime - before.ru_utime) + (after.ru_stime - before.ru_stime)


def _copy_one(job: tuple[str, str]) -> int:
    """``os.copy_file_range`` of one whole file, then fsync (``copy_floor``'s work per shard)."""
    src, dst = job
    fin, fout = os.open(src, os.O_RDONLY), os.open(dst, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
    try:
        size, at = os.fstat(fin).st_size, 0
        while at < size:
            at += os.copy_file_range(fin, fout, size - at, at, at)
        os.fsync(fout)
        return size
    finally:
        os.close(fin)
        os.close(fout)


def copy_floor(out: Path, shards: list[str], scratch: Path) -> tuple[float, float]:
    """(wall, CPU seconds) of copying ``shards`` of ``out`` whole, in parallel (a process per usable CPU), as
    `repack remove` copies them (``copy_file_range`` + fsync): the floor of a remove that rewrites them."""
    from concurrent.futures import ProcessPoolExecutor

    scratch.mkdir(parents=True, exist_ok=True)
    before = resource.getrusage(resource.RUSAGE_CHILDREN)
    started = time.perf_counter()
    with ProcessPoolExecutor(min(len(shards), len(os.sched_getaffinity(0)))) as pool:
        list(pool.map(_copy_one, [(str(out / rel), str(scratch / Path(rel).name)) for rel in shards]))
    wall = time.perf_counter() - started
    after = resource.getrusage(resource.RUSAGE_CHILDREN)
    shutil.rmtree(scratch)
    return wall, (after.ru_utime - before.ru_utime) + (after.ru_stime - before.ru_stime)


def select_at(count: int) -> None:
    """Time the record's build, write and read, and ``select_new`` of ``count`` + 1% scanned inputs
    (``InputItem``s, as a folder scan gives them) against a record of ``count``."""
    import hashlib

    import numpy as np

    from repack.lifecycle.input_columns import build_columns, from_bytes, to_bytes
    from repack.lifecycle.input_record import select_new
    from repack.sources.base import InputItem

    new = count // 100
    names = [f"n{i % 1000:08d}/n{i % 1000:08d}_{i:07d}.JPEG" for i in range(count + new)]
    rng = np.random.default_rng(0)
    sizes = rng.integers(500, 200_000, count + new)
    mtimes = 1_700_000_000_000_000_000 + rng.integers(0, 10**12, count + new)
    digests = {name: hashlib.sha256(name.encode()).hexdigest() for name in names[:count]}
    started = time.perf_counter()
    record = build_columns(names[:count], sizes[:count], mtimes[:count], np.arange(count), digests, count)
    built = time.perf_counter()
    raw = to_bytes(record)
    written = time.perf_counter()
    record = from_bytes(raw, "record")
    read = time.perf_counter()
    items = [InputItem("/src/" + n, n, n.split("/")[0], int(s), int(m)) for n, s, m in zip(names, sizes, mtimes)]
    begun = time.perf_counter()
    picked = select_new(items, record, lambda item: item.rel, lambda item: item.fingerprint, lambda item: None)
    done = time.perf_counter()
    assert len(picked.new) == new
    print(f"record of {count}: {len(raw) / count:.1f} bytes per input; build {built - started:.2f} s, write "
          f"{written - built:.2f} s, read {read - written:.2f} s; select_new of {count + new} scanned: "
          f"{done - begun:.2f} s")


def record_parts(out: str, source: str) -> None:
    """Driver CPU seconds (best of 3, in this process) of what an append and a remove of OUT do in proportion
    to the dataset: read the published version's record, and compare SOURCE's scan with it."""
    import numpy as np

    from repack.lifecycle.input_record import dataset_record, select_new_rows
    from repack.lifecycle.publish import current_version
    from repack.sources import scan_source
    from repack.store import open_store

    def best(call):
        times = []
        for _ in range(3):
            started = time.process_time()
            result = call()
            times.append(time.process_time() - started)
        return min(times), result

    store = open_store(out)
    current, _ = current_version(store)
    took, known = best(lambda: dataset_record(store, current))
    items = scan_source(source, list_file=False).items
    compared, chosen = best(lambda: select_new_rows(items.rels, np.asarray(items.sizes), np.asarray(items.mtimes),
                                                   known, lambda row: None))
    number = current.get("dataset_version", {}).get("number", 1)
    print(f"record of version {number} ({len(known)} inputs): {took:.3f} CPU-s; select_new_rows of {len(items)} "
          f"scanned: {compared:.3f} CPU-s ({len(chosen.new)} new)")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--files", type=int, default=100_000)
    parser.add_argument("--work", default=None, help="folder for the generated files (default: a temp folder)")
    parser.add_argument("--select", type=int, default=0, help="only time select_new against a record of N inputs")
    parser.add_argument("--record", nargs=2, metavar=("OUT", "SOURCE"),
                        help="only time reading OUT's record and comparing SOURCE's scan with it (driver CPU)")
    args = parser.parse_args()
    if args.record:
        record_parts(*args.record)
        return
    if args.select:
        select_at(args.select)
        return
    work = Path(tempfile.mkdtemp(prefix="bench-changes-", dir=args.work))
    try:
        src, out, new = work / "src", work / "out", args.files // 100
        tiny_jpegs(src, 0, args.files)
        full = timed("images", str(src), str(out), "--verify", "none", "-q")
        tiny_jpegs(src, args.files, new)
        append = timed("images", str(src), str(out), "--verify", "none", "--append", "-q")
        names = sorted(str(p.relative_to(src)) for p in src.rglob("*.jpg"))[::101][:1000]
        (work / "names.txt").write_text("\n".join(names) + "\n")
        remove = timed("remove", str(out), "--sources", str(work / "names.txt"), "-q")
        rewritten = list(json.loads((out / "manifest.json").read_text())["dataset_version"]["change"]["rewritten"])
        floor = copy_floor(out, rewritten, work / "copy-floor")
        tiny_jpegs(src, args.files + new, new)
        again = timed("images", str(src), str(out), "--verify", "none", "--append", "-q")
        record = out / ".repack" / "inputs-v4.npz"
        print(f"{args.files} tiny files; full pack: {full[0]:.1f} s wall, {full[1]:.1f} CPU-s")
        for name, (wall, cpu) in (("--append of 1% (from version 1)", append), ("remove of 1,000 sources", remove),
                                  (f"  its floor: copy_file_range + fsync of the {len(rewritten)} shard(s) it "
                                   "rewrote, in parallel", floor),
                                  ("--append of 1% (from the record)", again)):
            print(f"{name}: {wall:.1f} s ({wall / full[0]:.3f}x), {cpu:.1f} CPU-s ({cpu / full[1]:.3f}x)")
        print(f"state: {record.stat().st_size / (args.files + 2 * new):.1f} bytes per input in {record.name}")
    finally:
        shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    os.environ.setdefault("PYTHONPATH", str(ROOT))
    main()
