"""Benchmark of issue 26: repack at many tiny files, against baselines measured in the same run.

Data: N = REPACK_BENCH_SCALE_FILES (default 200,000) tiny JPEGs (32x32, ~700 B, 1,000 class folders)
and N/2 text files of ~770 B (REPACK_BENCH_SCALE_TEXT_FILES sizes them apart; tests/benchmarks/tiny_files.py),
generated once into OUT/scale-data and reused; page cache warm. W = the usable CPUs (sched_getaffinity).
Every command runs as users run it (`python -m repack ...`, default options), in its own process, once (the pack part's two scripts and two
repack packs, and the text part's script and `repack text`: REPACK_BENCH_REPEATS rounds, default 2,
alternated, best wall); wall seconds; the peak memory of a
process tree is the largest sum of its processes' PSS (proportional set size: a page shared by forked
processes counted once, split among them), sampled from /proc every 50 ms (the summed RSS, which counts a
shared page in every process, and the largest process are reported beside it).

Rows (ratio: for a time, baseline seconds / repack seconds, > 1 = repack faster; for a size or a
change, repack's figure / the budget or the full pack, <= 1 / <= 0.15 meets the issue's target):

  pack      `repack images SRC OUT --verify none` vs `find SRC -type f`, `tar cf` + `sync`, and a
            hand-written webdataset ShardWriter script (one process per core, each a contiguous slice
            of the sorted file list, its own shards of 1,000 samples of jpg + cls); the default
            `repack images SRC OUT` (decode check) vs the same script with a PIL decode check
  memory    peak summed PSS of the repack process tree (the larger of both packs) vs 120 MB + 0.5 KB per input;
            the same for `repack images LIST OUT --list --verify none` of the same files (a CSV beside SRC)
  state     bytes under OUT that no manifest names and are no manifest (the job state), per input, vs 64 B
  verify    `repack verify OUT` vs `sha256sum` of the same files (the manifests name) with `xargs -P W -n 4`
  change    `repack images SRC OUT --append` after adding N/100 new files, and `repack remove OUT --sources`
            of 1,000 names (N/10 when N < 10,000), each vs the full default pack
  readers   ImageShardDataset(OUT, decode=False, batch_size=256) through a DataLoader of W workers vs a
            folder-of-files Dataset (bytes + label from the folder name, DataLoader batch_size=256, W
            workers), each in a fresh process: samples/s over the epoch from opening the dataset; the
            workers' peak RSS (VmHWM, largest worker) growth per sample, against the same reader over
            min(1,000, N/10) samples; open + first batch seconds
  text      `repack text SRC OUT --doc-per file --tokenizer GPT-2` on N/2 (or REPACK_BENCH_SCALE_TEXT_FILES)
            .txt files vs a bare script,
            one process per core, each reading a contiguous slice of the sorted files and calling
            tokenizers' encode_batch_fast; its manifest bytes (vs the same on min(1,000, N/20) files), its
            state and RSS as for images

Run: ``python -m tests.benchmarks.run_all bench-out --only scale`` (REPACK_BENCH_SCALE_FILES=N to size it).
"""

from __future__ import annotations

import json
import math
import os
import random
import resource
import shutil
import subprocess
import sys
import tempfile
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

from tests.benchmarks.bench_changes import copy_floor
from tests.benchmarks.tiny_files import CLASSES, file_path, tiny_jpegs, tiny_texts

ROOT = Path(__file__).resolve().parents[2]
SAMPLE_EVERY_S = 0.05
PARTS = ("pack", "verify", "change", "readers", "text")
SMALL = 1000  # at most this many files in the small datasets the growth and manifest rows compare with


def small_count(n: int) -> int:
    return min(SMALL, max(1, n // 10))


SHARDWRITER_SCRIPT = r"""
import io, json, os, sys
from multiprocessing import Pool

import webdataset as wds
from PIL import Image


def pack(job):
    rank, files, labels, out, check = job
    written = 0
    with wds.ShardWriter(os.path.join(out, f"shard-{rank:03d}-%06d.tar"), maxcount=1000, verbose=0) as sink:
        for path, label in zip(files, labels):
            with open(path, "rb") as fh:
                data = fh.read()
            if check:
                try:
                    Image.open(io.BytesIO(data)).load()
                except Exception:
                    continue
            sink.write({"__key__": os.path.splitext(os.path.basename(path))[0], "jpg": data,
                        "cls": str(label).encode()})
            written += 1
    return written


if __name__ == "__main__":
    src, out, workers, check = sys.argv[1], sys.argv[2], int(sys.argv[3]), sys.argv[4] == "1"
    os.makedirs(out, exist_ok=True)
    classes = sorted(entry.name for entry in os.scandir(src) if entry.is_dir())
    files, labels = [], []
    for label, name in enumerate(classes):
        for file in sorted(os.listdir(os.path.join(src, name))):
            files.append(os.path.join(src, name, file))
            labels.append(label)
    per = -(-len(files) // workers)
    jobs = [(r, files[r * per:(r + 1) * per], labels[r * per:(r + 1) * per], out, check) for r in range(workers)]
    with Pool(workers) as pool:
        print(json.dumps({"samples": sum(pool.map(pack, jobs))}))
"""

TOKENIZE_SCRIPT = r"""
import json, os, sys
from multiprocessing import Pool
os.environ["TOKENIZERS_PARALLELISM"] = "false"


def count(job):
    tokenizer, files = job
    from tokenizers import Tokenizer
    tok = Tokenizer.from_file(tokenizer)
    tokens = 0
    for i in range(0, len(files), 1024):
        docs = []
        for path in files[i:i + 1024]:
            with open(path, encoding="utf-8") as fh:
                docs.append(fh.read())
        tokens += sum(len(e.ids) + 1 for e in tok.encode_batch_fast(docs))
    return tokens


if __name__ == "__main__":
    tokenizer, src, workers = sys.argv[1], sys.argv[2], int(sys.argv[3])
    files = sorted(os.path.join(d, f) for d, _, names in os.walk(src) for f in names if f.endswith(".txt"))
    per = -(-len(files) // workers)
    with Pool(workers) as pool:
        print(json.dumps({"tokens": sum(pool.map(count, [(tokenizer, files[r * per:(r + 1) * per])
                                                          for r in range(workers)]))}))
"""

READER_SCRIPT = r"""
import json, os, sys, time
kind, root, workers, batch = sys.argv[1], sys.argv[2], int(sys.argv[3]), int(sys.argv[4])
import torch
from torch.utils.data import DataLoader, Dataset


class FolderBytes(Dataset):
    # ImageFolder's listing (sorted classes, sorted files), raw bytes + the folder's label
    def __init__(self, root):
        classes = sorted(entry.name for entry in os.scandir(root) if entry.is_dir())
        self.files, self.labels = [], []
        for label, name in enumerate(classes):
            for file in sorted(os.listdir(os.path.join(root, name))):
                self.files.append(os.path.join(root, name, file))
                self.labels.append(label)

    def __len__(self):
        return len(self.files)

    def __getitem__(self, i):
        with open(self.files[i], "rb") as fh:
            return fh.read(), self.labels[i]


def worker_peaks():
    # VmHWM (peak RSS) of this process's children: the DataLoader workers, kept alive (persistent)
    me, peaks = str(os.getpid()), []
    for pid in filter(str.isdigit, os.listdir("/proc")):
        try:
            with open(f"/proc/{pid}/stat") as fh:
                if fh.read().rsplit(")", 1)[1].split()[1] != me:
                    continue
            with open(f"/proc/{pid}/status") as fh:
                peaks += [int(line.split()[1]) * 1024 for line in fh if line.startswith("VmHWM:")]
        except (OSError, IndexError):
            pass
    return peaks


started = time.perf_counter()
if kind == "repack":
    from pipelines.torch_webdataset import ImageShardDataset
    dataset = ImageShardDataset(root, decode=False, batch_size=batch)
    shared = getattr(dataset, "_shared_index", None)  # parsed by pipelines.index_process (not waited for here)
    in_helper = shared.in_helper if shared is not None else getattr(dataset, "_index_mapping", None) is not None
    loader = DataLoader(dataset, batch_size=None, num_workers=workers, persistent_workers=True)
else:
    in_helper = False
    loader = DataLoader(FolderBytes(root), batch_size=batch, num_workers=workers, persistent_workers=True)
with open("/proc/self/status") as fh:  # the training process's RSS when the workers fork from it
    opened_rss = [int(line.split()[1]) * 1024 for line in fh if line.startswith("VmRSS:")][0]
samples, first = 0, None
for _, labels in loader:
    samples += len(labels)
    if first is None:
        first = time.perf_counter() - started
seconds = time.perf_counter() - started
peaks = worker_peaks()
print(json.dumps({"samples": samples, "seconds": seconds, "first_batch_s": first, "worker_hwm_max": max(peaks),
                  "workers_seen": len(peaks), "index_in_helper": in_helper, "opened_rss": opened_rss}))
"""


@dataclass(frozen=True)
class Run:
    """One measured command: wall seconds; CPU seconds (user + system) of its reaped process tree; the
    peaks (bytes) over its run of the tree's summed RSS, summed PSS (a shared page counted once, split
    among its sharers) and largest process's RSS; what it printed."""

    wall: float
    cpu: float
    peak_rss: int
    peak_pss: int
    peak_largest: int
    stdout: str
    stderr: str


PAGE = os.sysconf("SC_PAGE_SIZE")


def tree_pids(root: int) -> list[int]:
    """``root`` and its descendants, from every process's parent in /proc/PID/stat."""
    children: dict[int, list[int]] = {}
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                with open(f"/proc/{entry}/stat") as fh:
                    parent = int(fh.read().rsplit(")", 1)[1].split()[1])
            except (OSError, ValueError, IndexError):
                continue
            children.setdefault(parent, []).append(int(entry))
    tree, todo = [], [root]
    while todo:
        pid = todo.pop()
        tree.append(pid)
        todo += children.get(pid, [])
    return tree


def memory(pid: int) -> tuple[int, int]:
    """(RSS, PSS) of one process in bytes; (0, 0) once it is gone."""
    try:
        with open(f"/proc/{pid}/statm") as fh:
            rss = int(fh.read().split()[1]) * PAGE
        with open(f"/proc/{pid}/smaps_rollup") as fh:
            pss = next((int(line.split()[1]) * 1024 for line in fh if line.startswith("Pss:")), rss)
    except (OSError, ValueError, IndexError):
        return 0, 0
    return rss, pss


def usable_cpus() -> int:
    return len(os.sched_getaffinity(0))


def run_tree(cmd: list[str], quiet_stdout: bool = False, cwd: str | Path = ROOT, env: dict | None = None) -> Run:
    """Run ``cmd`` from ``cwd`` (default: the repository root) with ``env`` added to this process's
    environment, earlier runs' dirty pages flushed first: its wall and CPU seconds (``RUSAGE_CHILDREN``:
    run one command at a time), its process tree's memory peaks (see Run), sampled every 50 ms, and its
    output. Raises with the command's stderr on a non-zero exit."""
    os.sync()
    with tempfile.TemporaryFile() as out, tempfile.TemporaryFile() as err:
        before = resource.getrusage(resource.RUSAGE_CHILDREN)
        started = time.perf_counter()
        proc = subprocess.Popen(cmd, cwd=cwd, stdout=subprocess.DEVNULL if quiet_stdout else out, stderr=err,
                                env={**os.environ, **env} if env else None)
        peak = [0, 0, 0]
        done = threading.Event()

        def sample() -> None:
            while not done.wait(SAMPLE_EVERY_S):
                sizes = [memory(pid) for pid in tree_pids(proc.pid)]
                peak[0] = max(peak[0], sum(rss for rss, _ in sizes))
                peak[1] = max(peak[1], sum(pss for _, pss in sizes))
                peak[2] = max([peak[2], *(rss for rss, _ in sizes)])

        sampler = threading.Thread(target=sample, daemon=True)
        sampler.start()
        proc.wait()
        wall = time.perf_counter() - started
        done.set()
        sampler.join()
        after = resource.getrusage(resource.RUSAGE_CHILDREN)
        out.seek(0)
        err.seek(0)
        stdout, stderr = out.read().decode(), err.read().decode(errors="replace")
    if proc.returncode != 0:
        raise RuntimeError(f"{' '.join(map(str, cmd[:6]))} ... exited {proc.returncode}: {stderr[-3000:]}")
    cpu = after.ru_utime + after.ru_stime - before.ru_utime - before.ru_stime
    return Run(wall, cpu, *peak, stdout, stderr)


def repack(*args: str | Path) -> list[str]:
    return [sys.executable, "-m", "repack", *map(str, args)]


def last_json(run: Run) -> dict:
    return json.loads(run.stdout.strip().splitlines()[-1])


# ---- data -------------------------------------------------------------------------------

def dataset(data: Path, kind: str, count: int) -> Path:
    """``count`` tiny files of ``kind`` ("jpg"/"txt") under data/{kind}-{count}, made once (a marker
    beside the tree says it is complete)."""
    src = data / f"{kind}-{count}"
    marker = data / f"{kind}-{count}.complete"
    if not marker.exists():
        shutil.rmtree(src, ignore_errors=True)
        started = time.perf_counter()
        (tiny_jpegs if kind == "jpg" else tiny_texts)(src, 0, count)
        print(f"[scale] generated {count} .{kind} files in {time.perf_counter() - started:.1f} s", file=sys.stderr)
        marker.write_text("ok\n")
    return src


def warm(src: Path) -> int:
    """Read every file under ``src`` once (warm page cache); returns their total bytes."""
    total = 0
    for folder, _, names in os.walk(src):
        for name in names:
            with open(os.path.join(folder, name), "rb") as fh:
                total += len(fh.read())
    return total


# ---- what a dataset folder holds ----------------------------------------------------------

def manifest_files(out: Path) -> tuple[set[Path], set[Path]]:
    """(the manifest files of OUT, every file of OUT that one of them names)."""
    manifests = {p for p in out.glob("manifest*.json") if p.is_file()}
    named: set[Path] = set()

    def walk(value) -> None:
        if isinstance(value, dict):
            for item in value.values():
                walk(item)
        elif isinstance(value, list):
            for item in value:
                walk(item)
        elif isinstance(value, str) and 0 < len(value) < 4096 and not value.startswith("/"):
            candidate = out / value
            if ".." not in candidate.relative_to(out).parts and candidate.is_file():
                named.add(candidate)

    for manifest in manifests:
        walk(json.loads(manifest.read_text()))
    return manifests, named - manifests


def state_bytes(out: Path) -> int:
    """Bytes of every file under OUT that is neither a manifest nor named by one (the job state)."""
    manifests, named = manifest_files(out)
    keep = manifests | named
    return sum(p.stat().st_size for p in out.rglob("*") if p.is_file() and p not in keep)


# ---- rows ---------------------------------------------------------------------------------

def row(measure: str, value: float, unit: str, baseline: str, baseline_value: float, ratio: float,
        target: str | None = None, **extra) -> dict:
    """One table row; ``target`` is ``'>= 2'`` or ``'<= 0.15'`` (on the ratio)."""
    return {"measure": measure, "value": value, "unit": unit, "baseline": baseline, "baseline_value": baseline_value,
            "ratio": ratio, "target": target, **extra}


def verdict(ratio: float, target: str | None) -> str:
    if not target:
        return ""
    op, bound = target.split()
    met = ratio >= float(bound) if op == ">=" else ratio <= float(bound)
    return f"{target}x " + ("ok" if met else "MISSED")


def table(rows: list[dict], header: str) -> str:
    lines = [header, f"{'measure':<50} {'value':>11}  {'baseline':<44} {'value':>11} {'ratio':>7}  target"]
    for r in rows:
        lines.append(f"{r['measure']:<50} {r['value']:>8.4g} {r['unit']:<2} {r['baseline']:<44} "
                     f"{r['baseline_value']:>8.4g} {r['unit']:<2} {r['ratio']:>6.3g}x  "
                     f"{verdict(r['ratio'], r['target'])}")
    lines += [f"  {r['measure']}: {r['note']}" for r in rows if r.get("note")]
    return "\n".join(lines)


def memory_row(what: str, runs: tuple[Run, ...], inputs: int) -> dict:
    """The peak memory of the process tree of ``runs`` (the largest) against 120 MB + 0.5 KB per input,
    as summed PSS: a page the forked workers share with the driver (the interpreter, numpy, a tokenizer)
    counted once, split among its sharers, so the sum is what the tree holds; summed RSS, which counts
    such a page once per process that maps it, and the largest process are in the note."""
    budget = 120e6 + 500 * inputs
    rss, pss, largest = (max(getattr(r, f) for r in runs) for f in ("peak_rss", "peak_pss", "peak_largest"))
    return row(f"{what}: peak memory of the process tree (summed PSS)", pss / 1e6, "MB",
               "budget: 120 MB + 0.5 KB/input", budget / 1e6, pss / budget, "<= 1",
               note=f"120 MB + {(pss - 120e6) / inputs / 1e3:.2f} KB per input; summed RSS {rss / 1e6:.0f} MB "
                    f"(a shared page counted in every process); largest process {largest / 1e6:.0f} MB",
               peak_rss_mb=round(rss / 1e6, 1), peak_largest_mb=round(largest / 1e6, 1))


def list_memory_row(src: Path, work: Path, n: int) -> dict:
    """``repack images LIST OUT --list`` of the same files (a CSV of path,label beside SRC, in the order
    ``tiny_jpegs`` made them: not sorted): the peak memory of its process tree, as ``memory_row``."""
    listing = src.parent / f"{src.name}.csv"
    if not listing.exists():
        part = listing.with_suffix(".part")
        with open(part, "w") as fh:
            fh.write("path,label\n")
            for index in range(n):
                rel = file_path(Path(src.name), index, ".jpg")
                fh.write(f"{rel},{rel.parent.name}\n")
        part.rename(listing)
    out = work / "out-list"
    shutil.rmtree(out, ignore_errors=True)
    listed = run_tree(repack("images", listing, out, "--list", "--verify", "none"))
    shutil.rmtree(out, ignore_errors=True)
    return memory_row(f"repack images --list --verify none ({listed.wall:.2f} s)", (listed,), n)


PACK_REPEATS = 2  # rounds of the pack and the text commands (REPACK_BENCH_REPEATS), alternated; the best wall of each


def alternated_runs(commands: dict[str, list[str]], before: Callable[[str], object] = lambda name: None,
                    after: Callable[[str], object] = lambda name: None) -> dict[str, list[Run]]:
    """Each command's Runs over REPACK_BENCH_REPEATS (default 2) rounds, in the given order, then the reverse,
    and so on: every command gets an early and a late turn. ``before``/``after(name)`` around each run."""
    runs: dict[str, list[Run]] = {name: [] for name in commands}
    repeats = max(1, int(os.environ.get("REPACK_BENCH_REPEATS") or PACK_REPEATS))
    for round_ in range(repeats):
        for name in (list(commands) if round_ % 2 == 0 else list(commands)[::-1]):
            before(name)
            runs[name].append(run_tree(commands[name]))
            after(name)
    return runs


def part_pack(src: Path, work: Path, n: int, cpus: int) -> tuple[list[dict], dict]:
    """The pack rows; returns (rows, {"full": the default pack's Run, "out": its OUT, "none": --verify none's OUT}).

    The two scripts and the two repack packs run in REPACK_BENCH_REPEATS (default 2) rounds, in the order
    script, --verify none, script+PIL, default, then the reverse, and so on: every command has an early and a
    late turn (the first repack run of a bench paid something the second did not: 12.9 s for --verify none
    against 11.69 s for the default pack, which does more, in one 16-core run); each row takes the best
    wall, its note lists them all. Same commands, sources, options and cores as before."""
    script = work / "shardwriter"
    tar = work / "src.tar"
    found = run_tree(["find", str(src), "-type", "f"], quiet_stdout=True)
    tarred = run_tree(["sh", "-c", f'tar cf "{tar}" -C "{src}" . && sync "{tar}"'])
    tar.unlink()
    out_none, out_full = work / "out-none", work / "out"
    commands = {"plain": [sys.executable, "-c", SHARDWRITER_SCRIPT, str(src), str(script), str(cpus), "0"],
                "none": repack("images", src, out_none, "--verify", "none"),
                "checked": [sys.executable, "-c", SHARDWRITER_SCRIPT, str(src), str(script), str(cpus), "1"],
                "full": repack("images", src, out_full)}
    # a fresh OUT each time; a script's shards go after it ran
    runs = alternated_runs(commands, before=lambda name: shutil.rmtree({"none": out_none, "full": out_full}.get(
        name, script), ignore_errors=True), after=lambda name: shutil.rmtree(script, ignore_errors=True))
    repeats = len(runs["none"])
    plain, none, checked, full = (min(runs[name], key=lambda r: r.wall) for name in commands)
    walls = {name: ", ".join(f"{r.wall:.2f}" for r in got) for name, got in runs.items()}
    imported = run_tree([sys.executable, "-c", "import webdataset"])  # the scripts' fixed cost (it imports torch)
    for what, got in (("script", last_json(plain)["samples"]), ("script+PIL", last_json(checked)["samples"]),
                      ("repack", json.loads((out_full / "manifest.json").read_text())["totals"]["samples"])):
        if got != n:
            raise RuntimeError(f"{what} packed {got} of {n} samples")
    script_name = f"ShardWriter script, {cpus} processes"
    rows = [
        row("repack images --verify none", none.wall, "s", "find SRC -type f", found.wall, found.wall / none.wall),
        row("repack images --verify none", none.wall, "s", "tar cf + sync", tarred.wall, tarred.wall / none.wall),
        row("repack images --verify none", none.wall, "s", f"{script_name}, no check", plain.wall,
            plain.wall / none.wall, ">= 2", note=f"best of {repeats} alternated rounds (walls: repack {walls['none']}; "
                                                 f"script {walls['plain']}); the script's `import webdataset` (torch "
                                                 f"with it) alone: {imported.wall:.2f} s",
            import_webdataset_s=imported.wall, walls_repack=[r.wall for r in runs["none"]],
            walls_script=[r.wall for r in runs["plain"]]),
        row("repack images (default: decode check)", full.wall, "s", f"{script_name} + PIL check", checked.wall,
            checked.wall / full.wall, ">= 1.5", note=f"best of {repeats} alternated rounds (walls: repack "
                                                      f"{walls['full']}; script+PIL {walls['checked']})",
            walls_repack=[r.wall for r in runs["full"]], walls_script=[r.wall for r in runs["checked"]]),
    ]
    rows.append(memory_row("repack images", (*runs["none"], *runs["full"]), n))
    rows.append(list_memory_row(src, work, n))
    state = state_bytes(out_full)
    rows.append(row("job state under OUT, per input", state / n, "B", "budget: 64 B/input", 64, state / n / 64,
                    "<= 1", state_bytes=state))
    return rows, {"full": full, "out": out_full, "none": out_none}


def part_verify(out: Path, work: Path, cpus: int) -> list[dict]:
    _, named = manifest_files(out)
    listing = work / "verify-files.txt"
    listing.write_bytes(b"\0".join(str(p).encode() for p in sorted(named)) + b"\0")
    hashed = run_tree(["sh", "-c", f'xargs -0 -P {cpus} -n 4 sha256sum < "{listing}"'], quiet_stdout=True)
    verified = run_tree(repack("verify", out))
    size = sum(p.stat().st_size for p in named)
    return [row(f"repack verify OUT ({size / 1e6:.0f} MB, {len(named)} files)", verified.wall, "s",
                f"sha256sum, same files, xargs -P {cpus} -n 4", hashed.wall, hashed.wall / verified.wall, ">= 0.8")]


def part_change(src: Path, out: Path, work: Path, n: int, full_wall: float, marker: Path) -> list[dict]:
    """--append of N/100 new files (added to SRC, removed again afterwards), then remove --sources."""
    added = max(1, n // 100)
    marker.unlink()  # SRC differs from its recipe until the added files are gone again
    try:
        tiny_jpegs(src, n, added)
        appended = run_tree(repack("images", src, out, "--append"))
    finally:
        for index in range(n, n + added):
            file_path(src, index, ".jpg").unlink(missing_ok=True)
    marker.write_text("ok\n")
    count = min(1000, max(1, n // 10))
    names = work / "remove-sources.txt"
    chosen = sorted(random.Random(0).sample(range(n), count))
    names.write_text("".join(f"{file_path(Path(''), i, '.jpg').as_posix()}\n" for i in chosen))
    removed = run_tree(repack("remove", out, "--sources", names))
    manifest = json.loads((out / "manifest.json").read_text())
    samples = manifest["totals"]["samples"]
    if samples != n + added - count:
        raise RuntimeError(f"after --append of {added} and remove of {count}: {samples} samples, "
                           f"not {n + added - count}")
    rewritten = list(manifest["dataset_version"]["change"]["rewritten"])
    os.sync()  # as run_tree: earlier runs' dirty pages are not this copy's to write
    floor_wall, floor_cpu = copy_floor(out, rewritten, work / "remove-copy-floor")
    folder = CLASSES // 2 if n >= CLASSES else 0  # one class folder: its files lie together in the shards
    taken = set(chosen)
    in_folder = [i for i in range(folder, n, CLASSES) if i not in taken]
    names.write_text("".join(f"{file_path(Path(''), i, '.jpg').as_posix()}\n" for i in in_folder))
    removed_folder = run_tree(repack("remove", out, "--sources", names))
    manifest = json.loads((out / "manifest.json").read_text())
    if manifest["totals"]["samples"] != samples - len(in_folder):
        raise RuntimeError(f"remove of folder c{folder:03d}'s {len(in_folder)} files left "
                           f"{manifest['totals']['samples']} samples, not {samples - len(in_folder)}")
    folder_rewritten = len(manifest["dataset_version"]["change"]["rewritten"])
    return [row(f"repack images --append, {added} new files (1%)", appended.wall, "s", "the full default pack",
                full_wall, appended.wall / full_wall, "<= 0.15"),
            row(f"repack remove --sources, {count} names", removed.wall, "s", "the full default pack",
                full_wall, removed.wall / full_wall, "<= 0.15", floor_s=round(floor_wall, 3),
                note=f"its floor, the {len(rewritten)} shard(s) it rewrote copied whole in parallel "
                     f"(copy_file_range + fsync, as remove and the pack write): {floor_wall:.2f} s "
                     f"({floor_wall / full_wall:.3f}x), {floor_cpu:.1f} CPU-s; remove {removed.cpu:.1f} CPU-s"),
            row(f"repack remove --sources, the {len(in_folder)} files of one class folder", removed_folder.wall, "s",
                "the full default pack", full_wall, removed_folder.wall / full_wall, "<= 0.15",
                note=f"{folder_rewritten} shard(s) rewritten; remove {removed_folder.cpu:.1f} CPU-s")]


def read(kind: str, root: Path, workers: int) -> dict:
    got = json.loads(run_tree([sys.executable, "-c", READER_SCRIPT, kind, str(root), str(workers), "256"])
                     .stdout.strip().splitlines()[-1])
    if got["workers_seen"] != workers:
        raise RuntimeError(f"{kind} reader: saw {got['workers_seen']} DataLoader workers, not {workers}")
    return got


def part_readers(src: Path, packed: Path, data: Path, work: Path, n: int, workers: int) -> list[dict]:
    small = small_count(n)
    small_src = dataset(data, "jpg", small)
    small_out = work / "out-small"
    shutil.rmtree(small_out, ignore_errors=True)
    run_tree(repack("images", small_src, small_out, "--verify", "none"))
    warm(small_src)
    result = {}
    for kind, big_root, small_root in (("repack", packed, small_out), ("folder", src, small_src)):
        result[kind] = read(kind, big_root, workers)
        result[kind + "-small"] = read(kind, small_root, workers)
        if result[kind]["samples"] != n:
            raise RuntimeError(f"{kind} reader yielded {result[kind]['samples']} of {n} samples")
    rate = {kind: n / result[kind]["seconds"] for kind in ("repack", "folder")}
    peak = {kind: result[kind]["worker_hwm_max"] for kind in ("repack", "folder")}
    growth = {kind: (peak[kind] - result[kind + "-small"]["worker_hwm_max"]) / (n - small) for kind in peak}
    allowed = result["repack-small"]["worker_hwm_max"] + 100 * (n - small)  # the 100 B per sample
    what = f"raw, {workers} workers"
    first = result["repack"]["first_batch_s"]
    return [
        row(f"ImageShardDataset(batch_size=256), {what}", rate["repack"], "/s",
            "folder-of-files Dataset, same", rate["folder"], rate["repack"] / rate["folder"], ">= 1.5"),
        row(f"reader worker peak RSS, +{growth['repack']:.0f} B/sample", peak["repack"] / 1e6, "MB",
            f"budget: {small} samples' peak + 100 B/sample", allowed / 1e6, peak["repack"] / allowed, "<= 1",
            note=f"folder Dataset workers: {peak['folder'] / 1e6:.0f} MB, +{growth['folder']:.0f} B/sample; "
                 f"index parsed in a helper process: {'yes' if result['repack']['index_in_helper'] else 'no'}; "
                 f"training process at the workers' fork: {result['repack']['opened_rss'] / 1e6:.0f} MB "
                 f"({result['repack-small']['opened_rss'] / 1e6:.0f} MB for {small} samples)",
            growth_per_sample=round(growth["repack"], 1), folder_growth_per_sample=round(growth["folder"], 1)),
        row("reader open + first batch", first, "s", "budget: 1 s", 1.0, first / 1.0, "<= 1",
            note=f"folder Dataset: {result['folder']['first_batch_s']:.2f} s"),
        many_shards_row(work, n, workers, first),
    ]


MANY_SHARDS_SAMPLES = 100  # samples per shard of the many-shards row's dataset
DEFAULT_OPEN_FILES = 1024  # Linux's default soft `ulimit -n`, which the many-shards row runs under


def many_shards_row(work: Path, n: int, workers: int, packed_first: float) -> dict:
    """Open + first batch of ``n`` samples (rounded down to whole shards) in shards of 100 (synthetic, shaped as
    repack packs tiny JPEGs: ``tests.tools.synthetic_shards``), under the default limit of 1,024 open files,
    against the packed dataset's figure of the same run (few large shards)."""
    from tests.tools.synthetic_shards import synthetic_dataset

    samples = max(MANY_SHARDS_SAMPLES, n - n % MANY_SHARDS_SAMPLES)
    root = work / "many-shards"
    shutil.rmtree(root, ignore_errors=True)
    synthetic_dataset(root, samples, MANY_SHARDS_SAMPLES, meta=True)

    def limited() -> None:
        hard = resource.getrlimit(resource.RLIMIT_NOFILE)[1]
        soft = DEFAULT_OPEN_FILES if hard == resource.RLIM_INFINITY else min(DEFAULT_OPEN_FILES, hard)
        resource.setrlimit(resource.RLIMIT_NOFILE, (soft, hard))

    done = subprocess.run([sys.executable, "-m", "tests.tools.reader_open_parts", str(root), str(workers)], cwd=ROOT,
                          capture_output=True, text=True, preexec_fn=limited, check=True)
    got = json.loads(done.stdout.strip().splitlines()[-1])
    shards = samples // MANY_SHARDS_SAMPLES
    first = got["open_and_first_batch_s"]
    return row(f"reader open + first batch, {shards} shards of {MANY_SHARDS_SAMPLES} (synthetic), ulimit -n "
               f"{DEFAULT_OPEN_FILES}", first, "s", "the packed dataset's, same run", packed_first, first / packed_first,
               note=f"open {got['open_s']:.2f} s, first batch {got['first_batch_s']:.2f} s; {samples} samples")


def text_files(n: int) -> int:
    """The text part's file count: REPACK_BENCH_SCALE_TEXT_FILES, else N/2 (issue 26 item 7 names 1M files:
    ``REPACK_BENCH_SCALE_PARTS=text REPACK_BENCH_SCALE_TEXT_FILES=1000000``)."""
    count = int(os.environ.get("REPACK_BENCH_SCALE_TEXT_FILES") or max(1, n // 2))
    if count < 1:
        raise ValueError(f"REPACK_BENCH_SCALE_TEXT_FILES={count}: at least 1 file")
    return count


def part_text(data: Path, work: Path, n: int, cpus: int) -> list[dict]:
    from tests.tools.text import gpt2_tokenizer, write_tokenizer

    count = text_files(n)
    src = dataset(data, "txt", count)
    small_src = dataset(data, "txt", small_count(count))
    warm(src)
    tokenizer = write_tokenizer(gpt2_tokenizer(), work / "gpt2")
    out, small_out = work / "text-out", work / "text-out-small"
    shutil.rmtree(small_out, ignore_errors=True)
    commands = {"script": [sys.executable, "-c", TOKENIZE_SCRIPT, str(tokenizer), str(src), str(cpus)],
                "repack": repack("text", src, out, "--doc-per", "file", "--tokenizer", tokenizer)}
    def fresh_out(name: str) -> None:  # repack packs into an empty OUT each round
        if name == "repack":
            shutil.rmtree(out, ignore_errors=True)

    runs = alternated_runs(commands, before=fresh_out)
    bare, packed = (min(runs[name], key=lambda r: r.wall) for name in commands)
    walls = {name: ", ".join(f"{r.wall:.2f}" for r in got) for name, got in runs.items()}
    run_tree(repack("text", small_src, small_out, "--doc-per", "file", "--tokenizer", tokenizer))
    manifest = json.loads((out / "manifest.json").read_text())
    tokens = last_json(bare)["tokens"]
    if manifest["totals"]["tokens"] != tokens:
        raise RuntimeError(f"repack text: {manifest['totals']['tokens']} tokens, the bare script {tokens}")
    size, small_size = ((folder / "manifest.json").stat().st_size for folder in (out, small_out))
    state = state_bytes(out)
    return [
        row(f"repack text --doc-per file, {count} files", packed.wall, "s",
            f"encode_batch_fast script, {cpus} processes", bare.wall, bare.wall / packed.wall, ">= 0.9",
            note=f"best of {len(runs['repack'])} alternated rounds (walls: repack {walls['repack']}; script "
                 f"{walls['script']})", walls_repack=[r.wall for r in runs["repack"]],
            walls_script=[r.wall for r in runs["script"]]),
        row("text manifest.json", size / 1e3, "KB", f"the same on {small_count(count)} files", small_size / 1e3,
            size / small_size, note=f"{size / count:.1f} B per input file; {tokens / 1e6:.1f}M tokens"),
        row("text job state under OUT, per input", state / count, "B", "budget: 64 B/input",
            64, state / count / 64, "<= 1", state_bytes=state),
        memory_row("repack text", tuple(runs["repack"]), count),
    ]


def main(out_dir: str | os.PathLike = "bench-out") -> dict:
    out_dir = Path(out_dir).absolute()
    data, work = out_dir / "scale-data", out_dir / "scale-work"
    work.mkdir(parents=True, exist_ok=True)
    n = int(os.environ.get("REPACK_BENCH_SCALE_FILES") or 200_000)
    if n < 20:
        raise ValueError(f"REPACK_BENCH_SCALE_FILES={n}: at least 20 files")
    parts = (os.environ.get("REPACK_BENCH_SCALE_PARTS") or ",".join(PARTS)).split(",")
    unknown = sorted(set(parts) - set(PARTS))
    if unknown:
        raise ValueError(f"REPACK_BENCH_SCALE_PARTS: unknown part(s) {unknown}; known: {', '.join(PARTS)}")
    cpus = usable_cpus()
    rows: list[dict] = []
    seconds: dict[str, float] = {}
    payload = 0
    images = bool(set(parts) & {"pack", "verify", "change", "readers"})  # each needs the packs
    if images:
        src = dataset(data, "jpg", n)
        payload = warm(src)
        print(f"[scale] {n} JPEGs ({payload / n:.0f} B mean) in {min(n, CLASSES)} folders, {cpus} usable CPUs",
              file=sys.stderr, flush=True)
    steps = {"pack": lambda: part_pack(src, work, n, cpus),
             "verify": lambda: part_verify(packed["out"], work, cpus),
             "change": lambda: part_change(src, packed["out"], work, n, packed["full"].wall,
                                           data / f"jpg-{n}.complete"),
             "readers": lambda: part_readers(src, packed["none"], data, work, n, cpus),
             "text": lambda: part_text(data, work, n, cpus)}
    for name in PARTS:
        if not (name in parts or (name == "pack" and images)):
            continue
        began = time.perf_counter()
        got = steps[name]()
        if name == "pack":
            got, packed = got
        seconds[name] = time.perf_counter() - began
        print(table(got, f"[scale] {name}: {seconds[name]:.0f} s"), file=sys.stderr, flush=True)
        rows += got
    inputs = [f"{n} tiny JPEGs ({payload / n:.0f} B mean, {min(n, CLASSES)} folders)"] if images else []
    inputs += [f"{text_files(n)} .txt files"] if "text" in parts else []
    header = (f"scale: {' and '.join(inputs)}, {cpus} usable CPUs, warm page cache, load average "
              f"{os.getloadavg()[0]:.1f}; seconds per part: " + ", ".join(f"{k} {v:.0f}" for k, v in seconds.items()))
    text = table(rows, header)
    print(text, flush=True)
    broken = [r["measure"] for r in rows if not (math.isfinite(r["ratio"]) and r["ratio"] > 0)]
    if broken:
        raise RuntimeError(f"rows without a positive finite ratio: {broken}")
    shutil.rmtree(work, ignore_errors=True)  # outputs are large; the generated data is kept for the next run
    return {"name": "scale", "files": n, "cpus": cpus, "mean_bytes": round(payload / n), "rows": rows,
            "part_seconds": {k: round(v, 1) for k, v in seconds.items()}, "table": text}


if __name__ == "__main__":
    sys.path.insert(0, str(ROOT))
    main(sys.argv[1] if len(sys.argv) > 1 else "bench-out")
