"""CPU seconds of each of `repack verify`'s pool tasks for a local dataset, run one after another in
this process (best of R rounds), and their sums per kind: the work that verify spreads over cores.

    PYTHONPATH=. python -m tests.tools.verify_task_cpu OUT [R]
"""

from __future__ import annotations

import json
import sys
import time
from pathlib import Path

from repack.lifecycle.verify_shards import plan_tasks, run_task
from repack.sinks import get_sink


def main(out: Path, rounds: int = 3) -> dict[str, float]:
    """{task kind: CPU seconds summed over its tasks} (each task's best of ``rounds``)."""
    manifest = json.loads((out / "manifest.json").read_text())
    shards, fmt = manifest["shards"], manifest["format"]
    get_sink(fmt)
    totals: dict[str, float] = {}
    for task in plan_tasks(fmt, shards):
        order = json.dumps({"kind": task.kind, "root": str(out), "format": fmt, "shard": shards[task.shard],
                            "part": task.part, "parts": task.parts})
        best = float("inf")
        for _ in range(rounds):
            started = time.process_time()
            run_task(order)
            best = min(best, time.process_time() - started)
        totals[task.kind] = totals.get(task.kind, 0.0) + best
    return totals


if __name__ == "__main__":
    found = main(Path(sys.argv[1]), int(sys.argv[2]) if len(sys.argv) > 2 else 3)
    print(json.dumps({kind: round(seconds, 3) for kind, seconds in found.items()}
                     | {"sum": round(sum(found.values()), 3)}))
