"""s3:// on the GPU machine, against moto's S3 server on loopback; one JSON line per measurement.

    python -m tests.gpu.gpu_s3 --out DIR [--images 6000] [--cpu-only]

Packs the same photos (tests.gpu.gpu_images) to a local folder and to s3:// (wall seconds of
each job), then reads both with DALI (device="mixed" decode, s3:// read by DALI's own client)
and with the PyTorch reader (streamed ranged GETs), in images/s; ``ratio`` = s3 / local.
moto is a Python server: the ratios bound what the readers lose to it, not to S3.
Results also go to OUT/gpu_s3.jsonl.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from tests.gpu.gpu_images import ROOT, dali_rate, make_photos, torch_rate
from tests.tools.s3server import MotoServer, client, s3_env


def _pack(src: Path, out: str, shard_size: int) -> float:
    started = time.perf_counter()
    subprocess.run([sys.executable, "-m", "repack", "images", str(src), out, "--shard-size", str(shard_size),
                    "--quiet"], check=True, cwd=ROOT, env={**os.environ, "PYTHONPATH": str(ROOT)})
    return round(time.perf_counter() - started, 3)


def main(argv: list[str] | None = None) -> None:
    cpus = len(os.sched_getaffinity(0))
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", required=True, help="folder for gpu_s3.jsonl")
    parser.add_argument("--data", default=None, help="folder for the photos and shards (default: a temp folder)")
    parser.add_argument("--images", type=int, default=6000)
    parser.add_argument("--batch", type=int, default=256)
    parser.add_argument("--epochs", type=int, default=2, help="timed epochs, after one warm-up epoch")
    parser.add_argument("--gpu-threads", type=int, default=min(8, cpus))
    parser.add_argument("--cpu-threads", type=int, default=cpus)
    parser.add_argument("--workers", type=int, default=cpus, help="DataLoader workers")
    parser.add_argument("--cpu-only", action="store_true", help="DALI on its CPU backend instead of the GPU")
    args = parser.parse_args(argv)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    data = Path(args.data or tempfile.mkdtemp(prefix="gpu-s3-"))
    src = data / f"photos-{args.images}"
    make_photos(src, args.images, cpus)
    server = MotoServer()
    results = []
    try:
        os.environ.update({**s3_env(server.endpoint), "REPACK_SCRATCH": str(data / "scratch")})
        client(server.endpoint).create_bucket(Bucket="gpu")
        local, remote = str(data / "packed"), "s3://gpu/packed"
        results.append({"what": "pack", "local_s": _pack(src, local, 500), "s3_s": _pack(src, remote, 500)})
        device = None if args.cpu_only else 0
        for name, measure in (("dali", lambda root: dali_rate(root, args, device)),
                              ("torch_reader", lambda root: torch_rate(root, src, args, "reader"))):
            rates = {}
            for where, root in (("local", local), ("s3", remote)):
                seconds, images = measure(root)
                rates[where] = round(images / seconds, 1)
            results.append({"what": name, **rates, "ratio": round(rates["s3"] / rates["local"], 3)})
            print(json.dumps(results[-1]), flush=True)
    finally:
        server.stop()
    with open(out / "gpu_s3.jsonl", "a") as fh:
        for row in results:
            fh.write(json.dumps({**row, "images": args.images, "cpus": cpus}) + "\n")
    print(json.dumps(results[0]))


if __name__ == "__main__":
    main()
