"""How many files a reader may hold open at once: its own bound, or an eighth of what this process
may open (``ulimit -n``: 1,024 by default on Linux) where that is fewer. A reader of a dataset of many
shards (index files mapped while they parse, shard files kept open between reads) stays under the
limit whatever the shard count, beside the DataLoader's own pipes and shared memory."""

from __future__ import annotations


def files_allowed(most: int) -> int:
    """``most``, or an eighth of the process's soft ``RLIMIT_NOFILE`` where that is fewer (at least 8)."""
    try:
        import resource

        soft = resource.getrlimit(resource.RLIMIT_NOFILE)[0]
    except (ImportError, OSError, ValueError):  # not a Unix
        return most
    if soft == resource.RLIM_INFINITY:
        return most
    return max(8, min(most, soft // 8))
