"""Changes cost what changed: `--append` of 1% new files and `repack remove` of 1,000 samples against a
full pack of the same tiny files (same run, same machine), and the job state's bytes per input.

    python -m tests.benchmarks.bench_changes [--files 100000] [--work DIR]

N tiny JPEGs (32x32, ~1.1 KB, 100 class folders) are generated under a temporary folder (deleted at the
end). Each step runs ``python -m repack`` as a user would; wall and CPU seconds (user + sys of the
process tree: the ratio that holds on a shared machine) are printed with the ratios to the full pack.
"""

from __future__ import annotations

import argparse
import io
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


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--files", type=int, default=100_000)
    parser.add_argument("--work", default=None, help="folder for the generated files (default: a temp folder)")
    args = parser.parse_args()
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
        tiny_jpegs(src, args.files + new, new)
        again = timed("images", str(src), str(out), "--verify", "none", "--append", "-q")
        record = out / ".repack" / "inputs-v4.npz"
        print(f"{args.files} tiny files; full pack: {full[0]:.1f} s wall, {full[1]:.1f} CPU-s")
        for name, (wall, cpu) in (("--append of 1% (from version 1)", append), ("remove of 1,000 sources", remove),
                                  ("--append of 1% (from the record)", again)):
            print(f"{name}: {wall:.1f} s ({wall / full[0]:.3f}x), {cpu:.1f} CPU-s ({cpu / full[1]:.3f}x)")
        print(f"state: {record.stat().st_size / (args.files + 2 * new):.1f} bytes per input in {record.name}")
    finally:
        shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    os.environ.setdefault("PYTHONPATH", str(ROOT))
    main()
