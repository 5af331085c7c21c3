"""A reader over N synthetic samples: the memory of a whole epoch of raw batches through a DataLoader.

``python -m tests.benchmarks.reader_scale DIR [N] [WORKERS] [PER_SHARD]`` (defaults: 10,000,000
samples, 16 workers, 40,000 samples per shard) writes under DIR an image WebDataset of N samples
(``tests.tools.synthetic_shards``: one real shard of PER_SHARD samples, a 1-byte ``.jpg`` and a
``.cls`` each, listed N / PER_SHARD times through hard links: the disk of one shard), then reads one
epoch of ``ImageShardDataset(DIR, decode=False, batch_size=256)`` through
``DataLoader(batch_size=None, num_workers=WORKERS)`` in a fresh process (the scale bench's reader
script) while sampling its process tree every 50 ms. It prints one JSON line: samples read, wall
seconds, open + first batch seconds, the tree's peak summed RSS and summed PSS (a shared page counted
once, split among its sharers), the largest worker's peak RSS, each per sample, against the budget of
8 GB at 10M samples (800 B per sample).
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

from tests.benchmarks.bench_scale import READER_SCRIPT, run_tree
from tests.tools.synthetic_shards import synthetic_dataset

BUDGET_PER_SAMPLE = 8e9 / 10_000_000  # the 8 GB for 10M samples read by 16 workers


def main(out_dir: str, samples: int = 10_000_000, workers: int = 16, per_shard: int = 40_000) -> dict:
    root = Path(out_dir) / f"synthetic-{samples}-{per_shard}"
    if not (root / "manifest.json").exists():
        synthetic_dataset(root, samples, per_shard)
    run = run_tree([sys.executable, "-c", READER_SCRIPT, "repack", str(root), str(workers), "256"])
    got = json.loads(run.stdout.strip().splitlines()[-1])
    if got["samples"] != samples or got["workers_seen"] != workers:
        raise RuntimeError(f"read {got['samples']} of {samples} samples with {got['workers_seen']} of {workers} workers")
    result = {"samples": samples, "workers": workers, "per_shard": per_shard, "seconds": round(got["seconds"], 1),
              "first_batch_s": round(got["first_batch_s"], 2),
              "peak_summed_rss_mb": round(run.peak_rss / 1e6), "peak_summed_pss_mb": round(run.peak_pss / 1e6),
              "largest_worker_peak_mb": round(got["worker_hwm_max"] / 1e6),
              "rss_b_per_sample": round(run.peak_rss / samples, 1), "pss_b_per_sample": round(run.peak_pss / samples, 1),
              "budget_mb": round(BUDGET_PER_SAMPLE * samples / 1e6),
              "rss_over_budget": round(run.peak_rss / (BUDGET_PER_SAMPLE * samples), 3)}
    print(json.dumps(result), flush=True)
    return result


if __name__ == "__main__":
    args = sys.argv[1:]
    if not args:
        raise SystemExit(__doc__)
    main(args[0], *(int(a) for a in args[1:4]))
