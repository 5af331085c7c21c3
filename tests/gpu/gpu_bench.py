"""`repack bench` on the GPU machine; prints one JSON line per measured setting.

    python -m tests.gpu.gpu_bench --out DIR [--images 4000] [--batch 128] [--steps 20] [--compute-ms 0]

Generates real-photo JPEGs and packs them (tests.gpu.gpu_images helpers, real CLI), then runs
the real CLI twice on the WebDataset: ``repack bench OUT --device gpu`` (DALI mixed decode on
device 0 and the DataLoader, batches copied to cuda:0) and ``--device cpu`` (DALI CPU backend and
the DataLoader on the machine's CPUs), workers and threads swept up to the usable CPUs, with the
original files as ``--source``. Full reports go to OUT/bench_{gpu,cpu}.json.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

from tests.gpu.gpu_images import ROOT, make_photos, pack


def sweep(cpus: int) -> str:
    """Half and all usable CPUs: workers=0 at full-size photos takes minutes per row on a GPU box."""
    values = sorted({max(2, cpus // 2), cpus} if cpus > 1 else {0})
    return ",".join(str(v) for v in values)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", required=True)
    parser.add_argument("--data", default=None, help="where the photos and the dataset live (default: temp)")
    parser.add_argument("--images", type=int, default=4000)
    parser.add_argument("--batch", type=int, default=128)
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("--compute-ms", default="0")
    args = parser.parse_args(argv)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    data = Path(args.data) if args.data else Path(tempfile.mkdtemp(prefix="repack-gpu-bench-"))
    cpus = len(os.sched_getaffinity(0))
    src = data / "photos"
    make_photos(src, args.images, cpus)
    packed = data / "packed"
    pack(src, packed, 1000)
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")]))}
    for device in ("gpu", "cpu"):
        cmd = [sys.executable, "-m", "repack", "bench", str(packed), "--device", device, "--json",
               "--batch-size", str(args.batch), "--steps", str(args.steps), "--warmup", str(args.warmup),
               "--workers", sweep(cpus), "--threads", str(max(2, cpus // 2)),
               "--compute-ms", args.compute_ms, "--source", str(src)]
        proc = subprocess.run(cmd, capture_output=True, text=True, env=env, cwd=ROOT)
        if proc.returncode != 0:
            print(json.dumps({"device": device, "error": proc.stderr[-3000:]}), flush=True)
            continue
        report = json.loads(proc.stdout)
        (out / f"bench_{device}.json").write_text(json.dumps(report, indent=1, sort_keys=True))
        for row in report["results"]:
            print(json.dumps({"device": device, "cpus": report["usable_cpus"], **row}, sort_keys=True), flush=True)
        print(json.dumps({"device": device, "recommendation": report["recommendation"]}), flush=True)


if __name__ == "__main__":
    main()
