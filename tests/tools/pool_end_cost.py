"""What the end of a process pool costs the driver on this machine: N workers forked after numpy and
the sinks are imported (as verify's and remove's are), each given one task that touches MB of memory;
then the seconds of a whole round (fork, tasks, end) on a ``ProcessPoolExecutor`` (the jobs' and
remove's pools; its shutdown after the last result, sentinels and a join of every worker, beside it)
and on ``verify_pool.run_tasks`` (nothing joined: it returns with the last answer), best and median
of R rounds, alternated.

    PYTHONPATH=. python -m tests.tools.pool_end_cost [WORKERS] [ROUNDS] [MB]
"""

from __future__ import annotations

import json
import multiprocessing
import statistics
import sys
import time
from concurrent.futures import ProcessPoolExecutor

import numpy as np

from repack.lifecycle.verify_pool import run_tasks
from repack.sinks import get_sink


def touch(task: str) -> tuple[str, bytes]:
    """A task that fills ``task`` MB of fresh memory (a worker's working arrays) and answers."""
    block = np.ones(int(task) << 20, np.uint8)
    return json.dumps(int(block.sum())), b""


def executor_round(workers: int, mb: int) -> tuple[float, float]:
    """(seconds of a whole round: fork, tasks, shutdown; of it the shutdown after the last result)."""
    started = time.perf_counter()
    pool = ProcessPoolExecutor(workers, mp_context=multiprocessing.get_context("fork"))
    list(pool.map(touch, [str(mb)] * workers))
    ending = time.perf_counter()
    pool.shutdown(wait=True)
    ended = time.perf_counter()
    return ended - started, ended - ending


def forked_round(workers: int, mb: int) -> float:
    """Seconds of a whole round on ``run_tasks``: fork, tasks, return with the last answer."""
    started = time.perf_counter()
    run_tasks([str(mb)] * workers, touch, workers)
    return time.perf_counter() - started


def main(workers: int, rounds: int, mb: int) -> dict:
    get_sink("webdataset")  # the driver's imports, as verify's workers inherit them
    found: dict[str, list[float]] = {"executor round": [], "executor shutdown": [], "run_tasks round": []}
    for _ in range(rounds):
        whole, end = executor_round(workers, mb)
        found["executor round"].append(whole)
        found["executor shutdown"].append(end)
        found["run_tasks round"].append(forked_round(workers, mb))
    return {name: {"best_s": round(min(v), 4), "median_s": round(statistics.median(v), 4)} for name, v in found.items()}


if __name__ == "__main__":
    args = [int(a) for a in sys.argv[1:]]
    print(json.dumps({"workers": (args + [16])[0], **main(*(args + [16, 5, 64][len(args):]))}, indent=1))
