"""The CPUs this process may really use, for the readers' own thread pools and the bench's sweeps.

Duplicated from ``repack/exec/cpus.py`` on purpose: ``pipelines`` may import ``repack.manifest`` only.
"""

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


def usable_cpus() -> int:
    """CPUs this process may really use: min(affinity mask, ceil(cgroup quota)), at least 1."""
    try:
        count = len(os.sched_getaffinity(0))
    except AttributeError:
        count = os.cpu_count() or 1
    quota = _cgroup_quota()
    if quota is not None:
        count = min(count, max(1, math.ceil(quota)))
    return max(1, count)
