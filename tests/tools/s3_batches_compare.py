"""Raw batches over s3:// against the same shards on local disk, one tree or several side by side (a
tool, not a `make bench` part: it compares checkouts).

``python -m tests.tools.s3_batches_compare OUT BATCH WORKERS ROUNDS TREE [TREE ...]``: OUT is a
packed image dataset; it is served by ``rclone serve s3`` on loopback (hard links of its files), and
each round runs, per TREE (a checkout of this repository, e.g. one commit before a change and one
after, put first on PYTHONPATH) and per root (OUT, then s3://bench/ds), one epoch of
``ImageShardDataset(root, decode=False, batch_size=BATCH)`` through ``DataLoader(batch_size=None,
num_workers=WORKERS)`` in a fresh process: samples/s, and the CPU-seconds of that process and its
workers per GB of shard bytes (from the epoch's start: the imports before it are not counted). PIN=1 pins
the server to CPU 0 and the loaders to CPU 1. WARM=N reads N epochs first in the same process, not counted
(what a training process pays per epoch once boto3 is loaded and the bucket's route known).
"""

from __future__ import annotations

import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

from tests.tools.s3server import RcloneServer, s3_env

EPOCH = r"""
import json, resource, sys, time
from torch.utils.data import DataLoader
from pipelines.torch_webdataset import ImageShardDataset
root, batch, workers = sys.argv[1], int(sys.argv[2]), int(sys.argv[3])
def cpu():
    return sum(getattr(resource.getrusage(who), f) for who in (resource.RUSAGE_SELF, resource.RUSAGE_CHILDREN)
               for f in ("ru_utime", "ru_stime"))
for _ in range(int(sys.argv[4])):  # warm epochs, not counted (a training process reads many)
    for _ in DataLoader(ImageShardDataset(root, decode=False, batch_size=batch), batch_size=None, num_workers=workers):
        pass
before = cpu()  # the imports (and warm epochs) are not the read's
started = time.perf_counter()
samples = 0
for _, labels in DataLoader(ImageShardDataset(root, decode=False, batch_size=batch), batch_size=None,
                            num_workers=workers):
    samples += len(labels)
wall = time.perf_counter() - started
print(json.dumps({"samples": samples, "wall": wall, "cpu": cpu() - before}))
"""


def main(data: Path, batch: int, workers: int, rounds: int, trees: list[str]) -> dict:
    served = Path(tempfile.mkdtemp(prefix="bench-s3-batches-"))
    (served / "bench").mkdir()
    subprocess.run(["cp", "-al", str(data), str(served / "bench" / "ds")], check=True)
    server = RcloneServer(served)
    pin = os.environ.get("PIN") == "1"
    if pin:
        os.sched_setaffinity(server.proc.pid, {0})
    env = {**os.environ, **s3_env(server.endpoint)}
    gigabytes = sum(p.stat().st_size for p in data.glob("*.tar")) / 1e9
    runs: dict[tuple[str, str], list[dict]] = {}
    try:
        for _ in range(rounds):
            for tree in trees:
                for where, root in (("local", str(data)), ("s3", "s3://bench/ds")):
                    command = [*(["taskset", "-c", "1"] if pin else []), sys.executable, "-c", EPOCH, root,
                               str(batch), str(workers), os.environ.get("WARM", "0")]
                    out = subprocess.run(command, env={**env, "PYTHONPATH": tree}, capture_output=True, text=True,
                                         check=True)
                    runs.setdefault((tree, where), []).append(json.loads(out.stdout.strip().splitlines()[-1]))
    finally:
        server.stop()
        shutil.rmtree(served, ignore_errors=True)
    result = {}
    for tree in trees:
        rate = {w: statistics.median(r["samples"] / r["wall"] for r in runs[(tree, w)]) for w in ("local", "s3")}
        cpu = {w: statistics.median(r["cpu"] for r in runs[(tree, w)]) / gigabytes for w in ("local", "s3")}
        result[tree] = {"local_per_s": round(rate["local"]), "s3_per_s": round(rate["s3"]),
                        "s3_vs_local": round(rate["s3"] / rate["local"], 3),
                        "cpu_s_per_gb_local": round(cpu["local"], 2), "cpu_s_per_gb_s3": round(cpu["s3"], 2)}
        print(tree, json.dumps(result[tree]))
    return result


if __name__ == "__main__":
    main(Path(sys.argv[1]), int(sys.argv[2]), int(sys.argv[3]), int(sys.argv[4]), sys.argv[5:])
