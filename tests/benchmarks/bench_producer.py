"""Benchmark of issue 10: the producer at disk speed, with default options, against baselines
measured in the same run (paired: each baseline and repack alternate, best of
REPACK_BENCH_REPEATS, default 3). Every command runs as its own process; CPU seconds are its
whole process tree's user+sys (``wait4``: the process and the children it waited for), peak RSS
its largest process's.

Rows (ratio = repack / baseline; rates in images/s):

  pack    `repack images --verify none`  vs `tar cf OUT.tar -C SRC . && sync OUT.tar` (both durable:
          repack fsyncs its shards; `sync FILE` fsyncs that file only, not the whole machine's
          dirty pages), wall and CPU; target wall >= 0.8x, CPU <= 2x
  check   `repack images --verify decode` (all usable CPUs) vs one process: webdataset
          ShardWriter + full PIL decode; target >= 1.8x on 2 cores
  sweep   `--verify decode` at 1, 2, 4, 8, 16, ... workers up to the usable CPUs: images/s and
          scaling efficiency rate(W) / (W x rate(1)); target >= 0.8 at 16. Beside it, the machine's
          own efficiency at W (``hardware``: W processes doing only the decode check, no repack) and
          repack's share of it (``of_hardware`` = efficiency / hardware)
  dispatch `--verify none` with the engine's dispatch order (the chunks of ceil(workers/4) shards
          take turns) vs plain plan order (``dispatch_order`` replaced in the driver), alternated,
          median of REPACK_BENCH_REPEATS + 1: CPU seconds and wall; the same order below 5 CPUs
  lmdb    `--to lmdb --verify none` vs plain LMDB puts of the same files (one process, one
          transaction per 1000 puts): CPU seconds and peak RSS of the largest process; target
          CPU <= 2x, memory that does not grow with the dataset
  growth  `--verify none` images/s at 1k, 10k and 100k tiny generated JPEGs (REPACK_BENCH_GROWTH,
          comma-separated counts): flat, not falling
  scan    scan + plan of REPACK_BENCH_SCAN_ENTRIES (default 1,000,000) empty files in 1000 folders:
          seconds and peak RSS (of a process that only plans)

The photos are bench_images' (REPACK_BENCH_IMAGES, default 4000, ~100 KB mean), generated once.
REPACK_BENCH_MAX_WORKERS caps the sweep; REPACK_BENCH_PARTS=pack,check,... runs a subset.
"""

from __future__ import annotations

import io
import json
import os
import random
import shutil
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

from tests.benchmarks.bench_images import image_files, make_dataset, run_shardwriter_pil, warm
from tests.benchmarks.bench_text import tree_sample
from tests.tools.bytecode import compile_package

ROOT = Path(__file__).resolve().parents[2]
PARTS = ("pack", "check", "sweep", "dispatch", "lmdb", "growth", "scan")
TARGETS = {"pack_wall": 0.8, "pack_cpu": 2.0, "check": 1.8, "efficiency": 0.8, "lmdb_cpu": 2.0}


def usable_cpus() -> int:
    return len(os.sched_getaffinity(0))


def worker_sweep(cpus: int) -> list[int]:
    """1, 2, 4, 8, ... up to ``cpus`` (and ``cpus`` itself)."""
    counts, w = [], 1
    while w < cpus:
        counts.append(w)
        w *= 2
    return counts + [cpus]


def run_measured(cmd: list[str], env: dict | None = None) -> dict:
    """Wall seconds, CPU seconds (user+sys of the process and the children it waited for, from
    ``wait4``) and peak RSS (the largest process of its tree, sampled from /proc every 20 ms: a
    child's own ``ru_maxrss`` would include the forking parent's) of one command."""
    os.sync()  # earlier runs' dirty pages must not land on this one's writeback
    with tempfile.TemporaryFile() as out, tempfile.TemporaryFile() as err:
        started = time.perf_counter()
        proc = subprocess.Popen(cmd, stdout=out, stderr=err, cwd=ROOT, env={**os.environ, **(env or {})})
        peak = [0]
        done = threading.Event()

        def sample() -> None:
            while not done.wait(0.02):
                tree = tree_sample(proc.pid)
                peak[0] = max([peak[0], *(rss for rss, _ in tree.values())])

        sampler = threading.Thread(target=sample, daemon=True)
        sampler.start()
        _, status, usage = os.wait4(proc.pid, 0)
        wall = time.perf_counter() - started
        done.set()
        sampler.join()
        proc.returncode = os.waitstatus_to_exitcode(status)
        out.seek(0)
        err.seek(0)
        stdout, stderr = out.read().decode(), err.read().decode()
    if proc.returncode != 0:
        raise RuntimeError(f"{' '.join(map(str, cmd[:6]))} ... exited {proc.returncode}: {stderr[-2000:]}")
    return {"wall": wall, "cpu": usage.ru_utime + usage.ru_stime, "rss_mb": peak[0] / 1e6, "stdout": stdout}


def repack_cmd(src: Path, out: Path, *options: str) -> list[str]:
    return [sys.executable, "-m", "repack", "images", str(src), str(out), "--quiet", "--json", *options]


def best(runs: list[dict]) -> dict:
    return min(runs, key=lambda r: r["wall"])


def fresh(src: Path, out: Path, *options: str) -> dict:
    """One measured run of `repack images` into an empty OUT."""
    remove(out)
    return run_measured(repack_cmd(src, out, *options))


def remove(path: Path) -> None:
    if path.is_dir():
        shutil.rmtree(path)
    else:
        path.unlink(missing_ok=True)


def paired(commands: dict[str, tuple[list[str], Path | None]], repeats: int) -> dict[str, dict]:
    """Run each command ``repeats`` times, interleaved; best (lowest wall) of each, its CPU with it."""
    runs: dict[str, list[dict]] = {name: [] for name in commands}
    for _ in range(repeats):
        for name, (cmd, clear) in commands.items():
            if clear is not None:
                remove(clear)
            runs[name].append(run_measured(cmd))
    return {name: best(r) for name, r in runs.items()}


# ---- parts ------------------------------------------------------------------------------

def part_pack(src: Path, n: int, work: Path, repeats: int) -> list[dict]:
    tar = work / "tar" / "images.tar"
    tar.parent.mkdir(parents=True, exist_ok=True)
    out = work / "none"
    r = paired({"tar": (["sh", "-c", 'tar cf "$0" -C "$1" . && sync "$0"', str(tar), str(src)], tar),
                "repack": (repack_cmd(src, out, "--verify", "none"), out)}, repeats)
    tar.unlink(missing_ok=True)
    return [row("pack: --verify none vs tar cf && sync FILE (wall)", n / r["repack"]["wall"], n / r["tar"]["wall"],
                TARGETS["pack_wall"], seconds=r["repack"]["wall"], baseline_seconds=r["tar"]["wall"]),
            row("pack: CPU seconds (lower is better)", r["repack"]["cpu"], r["tar"]["cpu"], TARGETS["pack_cpu"],
                lower=True)]


def part_check(src: Path, files: list[Path], n: int, work: Path, repeats: int) -> list[dict]:
    out = work / "decode"
    sw = min(run_shardwriter_pil(src, files, work, 1000) for _ in range(max(1, repeats - 1)))
    rp = best([fresh(src, out, "--verify", "decode") for _ in range(repeats)])
    return [row(f"check: --verify decode, {usable_cpus()} workers vs ShardWriter+PIL 1 proc", n / rp["wall"], n / sw,
                TARGETS["check"], seconds=rp["wall"], baseline_seconds=sw)]


BARE_DECODE = r"""
import json, multiprocessing, os, sys, time
from repack.transforms.image_check import inspect_image
src, workers = sys.argv[1], int(sys.argv[2])
files = sorted(os.path.join(d, f) for d, _, fs in os.walk(src) for f in fs if not f.startswith("."))

def share(i):
    for path in files[i::workers]:
        with open(path, "rb") as fh:
            inspect_image(fh.read(), "decode")
    return i

with multiprocessing.get_context("fork").Pool(workers) as pool:
    pool.map(abs, range(workers))  # every worker started
    started = time.perf_counter()
    pool.map(share, range(workers), chunksize=1)
    print(json.dumps({"seconds": time.perf_counter() - started}))
"""


def bare_decode_rate(src: Path, n: int, workers: int, repeats: int) -> float:
    """Images/s of ``workers`` processes doing only repack's decode check on their share of the
    files, nothing else (no plan, no writes): what the machine gives that work at that width."""
    runs = [run_measured([sys.executable, "-c", BARE_DECODE, str(src), str(workers)]) for _ in range(repeats)]
    return n / min(float(json.loads(r["stdout"].strip().splitlines()[-1])["seconds"]) for r in runs)


def part_sweep(src: Path, n: int, work: Path, repeats: int, cpus: int) -> list[dict]:
    """Scaling efficiency rate(W) / (W x rate(1)), and beside it the machine's own: the same for bare
    decode processes (``hardware``; on a VM of hyperthreads it is well below 1), and their ratio."""
    rows, rate1, bare1 = [], None, None
    for workers in worker_sweep(cpus):
        out = work / f"sweep-{workers}"
        r = best([fresh(src, out, "--verify", "decode", "--workers", str(workers)) for _ in range(repeats)])
        engine = float(json.loads(r["stdout"].strip().splitlines()[-1])["seconds"])
        rate = n / engine
        bare = bare_decode_rate(src, n, workers, repeats)
        rate1, bare1 = rate1 or rate, bare1 or bare
        efficiency, hardware = rate / (workers * rate1), bare / (workers * bare1)
        rows.append(row(f"sweep: --verify decode, {workers} worker(s) (engine time)", rate, rate1 * workers,
                        TARGETS["efficiency"] if workers == cpus and workers > 1 else None,
                        workers=workers, efficiency=round(efficiency, 3), hardware=round(hardware, 3),
                        of_hardware=round(efficiency / hardware, 3), bare_rate=round(bare, 1), wall=round(r["wall"], 3)))
    return rows


DISPATCH = r"""
import sys
import repack.jobs.engine as engine
if sys.argv[1] == "plan-order":
    engine.dispatch_order = lambda tasks, lanes: list(tasks)
sys.argv = ["repack", "images", *sys.argv[2:]]
from repack.cli import main
main()
"""


def part_dispatch(src: Path, n: int, work: Path, repeats: int, cpus: int) -> list[dict]:
    out = work / "dispatch"
    runs: dict[str, list[dict]] = {"plan-order": [], "turns": []}
    for _ in range(repeats + 1):
        for mode, measured in runs.items():
            remove(out)
            measured.append(run_measured([sys.executable, "-c", DISPATCH, mode, str(src), str(out), "--verify", "none",
                                          "--quiet", "--workers", str(cpus)]))
    median = {mode: sorted(measured, key=lambda r: r["cpu"])[len(measured) // 2] for mode, measured in runs.items()}
    return [row(f"dispatch: --verify none CPU s, {cpus} workers, shards in turns vs plan order", median["turns"]["cpu"],
                median["plan-order"]["cpu"], None, lower=True, wall=round(median["turns"]["wall"], 3),
                baseline_wall=round(median["plan-order"]["wall"], 3))]


PLAIN_LMDB = r"""
import os, sys, lmdb
src, path = sys.argv[1], sys.argv[2]
files = sorted(os.path.join(d, f) for d, _, fs in os.walk(src) for f in fs if not f.startswith("."))
env = lmdb.open(path, subdir=False, lock=False, map_size=1 << 36, readahead=False)
for start in range(0, len(files), 1000):
    with env.begin(write=True) as txn:
        for i in range(start, min(start + 1000, len(files))):
            with open(files[i], "rb") as fh:
                txn.put(b"s/%010d/img" % i, fh.read())
env.sync(True)
env.close()
"""


def part_lmdb(src: Path, n: int, work: Path, repeats: int) -> list[dict]:
    out, plain = work / "lmdb", work / "plain.lmdb"
    r = paired({"plain": ([sys.executable, "-c", PLAIN_LMDB, str(src), str(plain)], plain),
                "repack": (repack_cmd(src, out, "--to", "lmdb", "--verify", "none"), out)}, repeats)
    plain.unlink(missing_ok=True)
    return [row("lmdb: --to lmdb --verify none vs plain puts (CPU s)", r["repack"]["cpu"], r["plain"]["cpu"],
                TARGETS["lmdb_cpu"], lower=True, wall=round(r["repack"]["wall"], 3),
                baseline_wall=round(r["plain"]["wall"], 3)),
            row("lmdb: peak RSS MB (largest process)", r["repack"]["rss_mb"], r["plain"]["rss_mb"], None, lower=True)]


def tiny_jpegs(root: Path, count: int) -> Path:
    """``count`` distinct tiny JPEGs (16..48 px, a comment segment makes each unique) in 10 classes."""
    from PIL import Image

    src = root / f"tiny-{count}"
    if (src / ".complete").exists():
        return src
    shutil.rmtree(src, ignore_errors=True)
    rng = random.Random(3)
    blobs = []
    for _ in range(64):
        buf = io.BytesIO()
        side = rng.randint(16, 48)
        Image.frombytes("RGB", (side, side), rng.randbytes(side * side * 3)).save(buf, "JPEG", quality=80)
        blobs.append(buf.getvalue())
    for c in range(10):
        (src / f"class{c}").mkdir(parents=True)
    for i in range(count):
        blob = blobs[i % len(blobs)]
        note = b"repack bench %d" % i
        data = blob[:2] + b"\xff\xfe" + (len(note) + 2).to_bytes(2, "big") + note + blob[2:]
        (src / f"class{i % 10}" / f"img{i:07d}.jpg").write_bytes(data)
    (src / ".complete").write_text("ok\n")
    return src


def part_growth(data: Path, work: Path, counts: list[int], repeats: int) -> list[dict]:
    rows, rate1 = [], None
    for count in counts:
        src = tiny_jpegs(data, count)
        warm(image_files(src))
        r = best([fresh(src, work / "growth", "--verify", "none") for _ in range(repeats)])
        rate = count / r["wall"]
        rate1 = rate1 or rate
        rows.append(row(f"growth: --verify none, {count} tiny JPEGs (wall)", rate, rate1, None, seconds=r["wall"],
                        cpu=round(r["cpu"], 3), us_cpu_per_image=round(r["cpu"] / count * 1e6, 1)))
    return rows


PLAN_ONLY = r"""
import json, resource, sys, time
t0 = time.perf_counter()
from repack.config import ImagesSpec
from repack.jobs.base import build_plan
from repack.jobs.images import ImagesJob
plan = build_plan(ImagesJob(ImagesSpec(source=sys.argv[1], out=sys.argv[2])))  # as the engine plans
print(json.dumps({"seconds": time.perf_counter() - t0, "tasks": len(plan.tasks),
                  "inputs": sum(len(t.payload["inputs"]) for t in plan.tasks),
                  "rss_mb": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024}))
"""


def tiny_tree(root: Path, entries: int) -> Path:
    """``entries`` empty .jpg files in 1000 folders (only scanned and planned, never read; empty
    files take inodes but no data blocks)."""
    src = root / f"scan-{entries}"
    if (src / ".complete").exists():
        return src
    shutil.rmtree(src, ignore_errors=True)
    per = -(-entries // 1000)
    for d in range(1000):
        folder = src / f"c{d:03d}"
        folder.mkdir(parents=True)
        for i in range(min(per, entries - d * per)):
            open(folder / f"{i:07d}.jpg", "wb").close()
    (src / ".complete").write_text("ok\n")
    return src


def part_scan(data: Path, work: Path, entries: int) -> list[dict]:
    src = tiny_tree(data, entries)
    r = run_measured([sys.executable, "-c", PLAN_ONLY, str(src), str(work / "scan-out")])
    result = json.loads(r["stdout"].strip().splitlines()[-1])
    return [row(f"scan+plan: {entries} entries (seconds, lower is better)", result["seconds"], result["seconds"], None,
                lower=True, tasks=result["tasks"], peak_rss_mb=round(result["rss_mb"], 1))]


# ---- report -----------------------------------------------------------------------------

def row(measure: str, value: float, baseline: float, target: float | None, lower: bool = False, **extra) -> dict:
    ratio = value / baseline if baseline else float("nan")
    ok = None if target is None else (ratio <= target if lower else ratio >= target)
    return {"measure": measure, "value": round(value, 3), "baseline": round(baseline, 3), "ratio": round(ratio, 3),
            "target": target, "lower_is_better": lower, "ok": ok,
            **{k: round(v, 3) if isinstance(v, float) else v for k, v in extra.items()}}


def table(rows: list[dict], header: str) -> str:
    lines = [header, f"{'measure':<62} {'repack':>10} {'baseline':>10} {'ratio':>7}  target / notes"]
    for r in rows:
        target = "" if r["target"] is None else \
            f"{'<=' if r['lower_is_better'] else '>='} {r['target']}x {'ok' if r['ok'] else 'MISSED'}"
        notes = ", ".join(f"{k}={r[k]}" for k in ("efficiency", "hardware", "of_hardware", "peak_rss_mb", "tasks",
                                                   "us_cpu_per_image") if k in r)
        lines.append(f"{r['measure']:<62} {r['value']:>10.1f} {r['baseline']:>10.1f} {r['ratio']:>6.2f}x  "
                     f"{target} {notes}".rstrip())
    return "\n".join(lines)


def main(out_dir: str | os.PathLike = "bench-out") -> dict:
    out_dir = Path(out_dir).absolute()
    compile_package()
    work = out_dir / "producer-work"
    work.mkdir(parents=True, exist_ok=True)
    parts = [p for p in (os.environ.get("REPACK_BENCH_PARTS") or ",".join(PARTS)).split(",") if p]
    repeats = int(os.environ.get("REPACK_BENCH_REPEATS") or 3)
    cpus = min(usable_cpus(), int(os.environ.get("REPACK_BENCH_MAX_WORKERS") or usable_cpus()))
    count = int(os.environ.get("REPACK_BENCH_IMAGES") or 4000)
    src = make_dataset(out_dir / "images-data", count)
    files = image_files(src)
    n = len(files)
    mean_kb = sum(p.stat().st_size for p in files) / n / 1e3
    warm(files)
    rows: list[dict] = []
    if "pack" in parts:
        rows += part_pack(src, n, work, repeats)
    if "check" in parts:
        rows += part_check(src, files, n, work, repeats)
    if "sweep" in parts:
        rows += part_sweep(src, n, work, max(1, repeats - 1), cpus)
    if "dispatch" in parts and cpus > 4:  # below 5 workers the two orders are the same
        rows += part_dispatch(src, n, work, repeats, cpus)
    if "lmdb" in parts:
        rows += part_lmdb(src, n, work, repeats)
    if "growth" in parts:
        counts = [int(c) for c in (os.environ.get("REPACK_BENCH_GROWTH") or "1000,10000,100000").split(",")]
        rows += part_growth(out_dir / "images-data", work, counts, max(1, repeats - 1))
    if "scan" in parts:
        rows += part_scan(out_dir / "images-data", work, int(os.environ.get("REPACK_BENCH_SCAN_ENTRIES") or 1_000_000))
    header = (f"producer: {n} JPEG photos, {mean_kb:.0f} KB mean, default options, {cpus} usable CPU cores, "
              f"best of {repeats} paired runs; load average {os.getloadavg()[0]:.1f}")
    text = table(rows, header)
    print(text)
    return {"name": "producer", "cpus": cpus, "images": n, "rows": rows, "table": text}


if __name__ == "__main__":
    main(sys.argv[1] if len(sys.argv) > 1 else "bench-out")
