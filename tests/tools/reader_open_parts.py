"""Where a reader's open + first batch goes, in one fresh process (run it once per code tree to compare).

    python -m tests.tools.reader_open_parts DIR [WORKERS]

Times, after ``import torch`` (as a training script has it): importing ``pipelines.torch_webdataset``,
``ImageShardDataset(DIR, decode=False, batch_size=256)`` (manifest, index parse; a helper process
parses on while the workers start, its CPU counted as a reaped child), ``iter(DataLoader(..., num_workers=WORKERS))`` (the workers start)
and the first batch. Prints one JSON line: wall seconds per part, their sum (the scale bench's "open +
first batch"), and the CPU seconds of the process and its reaped children up to the first batch.
"""

from __future__ import annotations

import json
import resource
import sys
import time


def cpu() -> float:
    return sum(getattr(resource.getrusage(who), f) for who in (resource.RUSAGE_SELF, resource.RUSAGE_CHILDREN)
               for f in ("ru_utime", "ru_stime"))


def main(root: str, workers: int = 2) -> dict:
    import torch  # noqa: F401
    from torch.utils.data import DataLoader

    began, cpu0 = time.perf_counter(), cpu()
    from pipelines.torch_webdataset import ImageShardDataset
    imported = time.perf_counter()
    dataset = ImageShardDataset(root, decode=False, batch_size=256)
    opened = time.perf_counter()
    batches = iter(DataLoader(dataset, batch_size=None, num_workers=workers))
    started = time.perf_counter()
    next(batches)
    first = time.perf_counter()
    dataset.index  # noqa: B018  (reaps an index helper process, so that its CPU seconds count: it has answered)
    result = {"import_s": round(imported - began, 3), "open_s": round(opened - imported, 3),
              "workers_start_s": round(started - opened, 3), "first_batch_s": round(first - started, 3),
              "open_and_first_batch_s": round(first - began, 3), "cpu_s": round(cpu() - cpu0, 3)}
    print(json.dumps(result), flush=True)
    return result


if __name__ == "__main__":
    if len(sys.argv) < 2:
        raise SystemExit(__doc__)
    main(sys.argv[1], *(int(a) for a in sys.argv[2:3]))
