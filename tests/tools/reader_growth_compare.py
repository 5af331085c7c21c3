"""The scale bench's reader rows for two code trees and the folder Dataset, in one run.

    python -m tests.tools.reader_growth_compare BIG SMALL BIG_SRC SMALL_SRC WORKERS TREE [TREE ...]

BIG and SMALL are datasets packed by ``repack images`` from the folders BIG_SRC and SMALL_SRC (the
bench's N and min(1,000, N/10) tiny files). For each TREE (a checkout whose ``pipelines`` is imported)
and for the folder-of-files Dataset, the bench's reader script (``bench_scale.READER_SCRIPT``) reads
BIG and SMALL through a DataLoader of WORKERS workers in a fresh process; one JSON line per reader:
the largest worker's peak RSS growth per sample from SMALL to BIG (the bench's "reader memory" row),
open + first batch seconds and samples/s on BIG, and the CPU seconds of opening BIG in the training
process and its reaped children (``ImageShardDataset(BIG, decode=False, batch_size=256)`` alone, also in
a fresh process; an index helper process counted).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys

from tests.benchmarks.bench_scale import READER_SCRIPT

OPEN_SCRIPT = r"""
import json, resource, sys
import torch  # noqa: F401  (imported before the clock, as a training script has it)
from pipelines.torch_webdataset import ImageShardDataset

def cpu():  # this process and its reaped children (an index helper process)
    return sum(getattr(resource.getrusage(who), f) for who in (resource.RUSAGE_SELF, resource.RUSAGE_CHILDREN)
               for f in ("ru_utime", "ru_stime"))

started = cpu()
dataset = ImageShardDataset(sys.argv[1], decode=False, batch_size=256)
dataset.index  # an index helper process is not waited for by the constructor: its parse is part of opening
del dataset  # reaps the helper (it exits right after answering)
print(json.dumps({"open_cpu_s": cpu() - started}))
"""


def _run(script: str, args: list[str], tree: str) -> dict:
    env = dict(os.environ, PYTHONPATH=tree)
    done = subprocess.run([sys.executable, "-c", script, *args], env=env, cwd=tree, capture_output=True, text=True,
                          check=True)
    return json.loads(done.stdout.strip().splitlines()[-1])


def measure(kind: str, big: str, small: str, workers: str, tree: str) -> dict:
    """One reader's row: growth per sample, first batch, rate (and for repack, open CPU seconds)."""
    got = {name: _run(READER_SCRIPT, [kind, root, workers, "256"], tree) for name, root in (("big", big),
                                                                                          ("small", small))}
    growth = ((got["big"]["worker_hwm_max"] - got["small"]["worker_hwm_max"])
              / (got["big"]["samples"] - got["small"]["samples"]))
    row = {"reader": kind if kind == "folder" else f"repack@{tree}", "samples": got["big"]["samples"],
           "workers": int(workers), "growth_b_per_sample": round(growth, 1),
           "worker_peak_mb": round(got["big"]["worker_hwm_max"] / 1e6, 1),
           "first_batch_s": round(got["big"]["first_batch_s"], 2),
           "samples_per_s": round(got["big"]["samples"] / got["big"]["seconds"])}
    if kind == "repack":
        row["open_cpu_s"] = round(_run(OPEN_SCRIPT, [big], tree)["open_cpu_s"], 3)
    return row


def main(argv: list[str]) -> None:
    if len(argv) < 6:
        raise SystemExit(__doc__)
    big, small, big_src, small_src, workers, *trees = argv
    for tree in trees:
        print(json.dumps(measure("repack", big, small, workers, os.path.abspath(tree))), flush=True)
    print(json.dumps(measure("folder", big_src, small_src, workers, os.path.abspath(trees[0]))), flush=True)


if __name__ == "__main__":
    main(sys.argv[1:])
