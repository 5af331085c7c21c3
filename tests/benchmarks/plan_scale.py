"""The image plan of N synthetic inputs: seconds and peak RSS of the driver's planning, no files.

``python -m tests.benchmarks.plan_scale N [OUT]`` builds an ``InputTable`` of N inputs (what a folder
scan of N files in 1,000 class folders returns: ``c{i % 1000:03d}/{i:08d}.jpg``, ~700 B each, distinct
fingerprints), then plans it as ``repack images SRC OUT`` does after its scan: ``ImagesJob.plan_scan``
(with the cyclic GC paused, as ``build_plan``), the plan's digest, and ``save_plan`` into OUT/.repack
(a temporary folder when OUT is not given). It prints one JSON line: inputs, tasks, wall seconds of the
table and of each planning step, CPU seconds of the table and of the planning (what a shared machine
does not inflate), plan.json.gz bytes per input, the process's RSS after the table, and its peak RSS
(``ru_maxrss``), against the budget of 120 MB + 0.5 KB per input.
"""

from __future__ import annotations

import gc
import json
import resource
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

CLASSES = 1000


def synthetic_table(n: int, root: str = "/synthetic/src"):
    """An ``InputTable`` of ``n`` inputs in plan order (by path), built a class folder at a time."""
    from repack.sources.columns import InputTable, name_ends

    blobs, rows = [], []
    for c in range(min(n, CLASSES)):
        numbers = range(c, n, CLASSES)
        blobs.append("".join(f"c{c:03d}/{i:08d}.jpg\0" for i in numbers).encode())
        rows.append(np.arange(c, n, CLASSES, dtype=np.int64))
    names = b"".join(blobs)
    del blobs
    index = np.concatenate(rows) if rows else np.zeros(0, dtype=np.int64)
    counts = np.array([len(r) for r in rows], dtype=np.int64)
    label_ids = np.repeat(np.arange(len(rows), dtype=np.int32), counts)
    sizes = 600 + (index * 7919) % 200
    mtimes = 1_764_000_000_000_000_000 + index * 1_000_003
    return InputTable(root, names, name_ends(names), label_ids, tuple(f"c{c:03d}" for c in range(len(rows))),
                      sizes, mtimes, 1_000_000 + index, {})


def rss_mb() -> float:
    with open("/proc/self/status") as fh:
        return next(int(line.split()[1]) for line in fh if line.startswith("VmRSS:")) / 1024


def plan_synthetic(n: int, out: Path) -> dict:
    """Plan ``n`` synthetic inputs into ``out`` (see the module docstring); the figures."""
    from repack.config import ImagesSpec
    from repack.jobs.base import PLAN_NAME, STATE_DIR, save_plan
    from repack.jobs.images import ImagesJob
    from repack.sources.base import Scan
    from repack.store import open_store

    began = time.perf_counter()
    cpu_began = time.process_time()
    table = synthetic_table(n)
    scan = Scan(table, (), labeled=True, skipped=0)
    del table
    made = time.perf_counter()
    cpu_made = time.process_time()
    table_rss = rss_mb()
    job = ImagesJob(ImagesSpec(source="/synthetic/src", out=str(out), verify="none"))
    gc.disable()
    try:
        plan = job.plan_scan(scan)
    finally:
        gc.enable()
    del scan
    planned = time.perf_counter()
    digest = plan.digest
    hashed = time.perf_counter()
    (out / STATE_DIR).mkdir(parents=True, exist_ok=True)
    save_plan(open_store(str(out)), plan)
    saved = time.perf_counter()
    cpu_saved = time.process_time()
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
    budget = 120 + 0.5e3 * n / 1e6
    return {"inputs": n, "tasks": len(plan.tasks), "digest": digest[:16],
            "table_s": round(made - began, 2), "plan_s": round(planned - made, 2), "digest_s": round(hashed - planned, 2),
            "save_s": round(saved - hashed, 2), "planning_s": round(saved - made, 2),
            "table_cpu_s": round(cpu_made - cpu_began, 2), "planning_cpu_s": round(cpu_saved - cpu_made, 2),
            "plan_gz_bytes_per_input": round((out / STATE_DIR / PLAN_NAME).stat().st_size / max(n, 1), 1),
            "rss_after_table_mb": round(table_rss), "peak_rss_mb": round(peak),
            "budget_mb": round(budget), "peak_over_budget": round(peak / budget, 3)}


def main(argv: list[str]) -> dict:
    n = int(argv[0]) if argv else 10_000_000
    if len(argv) > 1:
        result = plan_synthetic(n, Path(argv[1]))
    else:
        with tempfile.TemporaryDirectory(prefix="repack-plan-scale-") as tmp:
            result = plan_synthetic(n, Path(tmp))
    print(json.dumps(result), flush=True)
    return result


if __name__ == "__main__":
    main(sys.argv[1:])
