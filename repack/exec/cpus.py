"""How many CPUs this process may really use: affinity mask and cgroup CPU quota."""

from __future__ import annotations

import math
import os
from pathlib import Path


def _cgroup_quota() -> float | None:
    try:  # cgroup v2
        quota, period = Path("/sys/fs/cgroup/cpu.max").read_text().split()[:2]
        if quota != "max":
            return int(quota) / int(period)
    except (OSError, ValueError):
        pass
    try:  # cgroup v1
        quota = int(Path("/sys/fs/cgroup/cpu/cpu.cfs_quota_us").read_text())
        period = int(Path("/sys/fs/cgroup/cpu/cpu.cfs_period_us").read_text())
        if quota > 0 and period > 0:
            return quota / period
    except (OSError, ValueError):
        pass
    return None


def available_cpus() -> int:
    """CPUs usable by this process: min(affinity mask, ceil(cgroup quota)), at least 1."""
    try:
        count = len(os.sched_getaffinity(0))
    except AttributeError:
        count = os.cpu_count() or 1
    quota = _cgroup_quota()
    if quota is not None:
        count = min(count, max(1, math.ceil(quota)))
    return max(1, count)


_worker_cpus: int | None = None  # this process's share of its pool's CPUs, once an executor set it


def cpu_share(cpus: int, processes: int) -> int:
    """The CPUs each of ``processes`` workers may keep busy so that together they use at most ``cpus``:
    ``cpus // processes``, at least 1."""
    return max(1, cpus // max(1, processes))


def set_worker_cpus(cpus: int) -> None:
    """Record this worker process's share of the pool's CPUs (the executor calls it as the worker starts)."""
    global _worker_cpus
    _worker_cpus = max(1, int(cpus))


def worker_cpus() -> int:
    """The CPUs this process may keep busy with threads of its own (a tokenizer's Rust threads): its share
    of the pool it works in, as its executor set it; else (a task run in the driver) every usable CPU."""
    return _worker_cpus if _worker_cpus is not None else available_cpus()
