"""Work on a few threads, its results in order and only a few ahead of the one consumed: no future (nor
result) per item of a long list held at once (``ThreadPoolExecutor.map`` submits every item up front: ~1.6 KB
per item until the map ends)."""

from __future__ import annotations

from collections import deque
from concurrent.futures import ThreadPoolExecutor
from typing import Any, Callable, Iterable, Iterator


def read_ahead(items: Iterable, work: Callable[[Any], Any], threads: int, depth: int | None = None) -> Iterator:
    """``work(item)`` for each of ``items``, in order, computed by ``threads`` threads up to ``depth``
    items (default: ``threads``) ahead of the one consumed (0 threads: in the caller's thread, nothing
    ahead). No thread outlives the iterator: closing it cancels what has not started and waits for the
    rest (a DataLoader forking workers next must not copy a thread's held locks)."""
    if threads <= 0:
        for item in items:
            yield work(item)
        return
    prefetch = max(threads, depth or 0)
    pool = ThreadPoolExecutor(threads, thread_name_prefix="repack-prefetch")
    ahead: deque = deque()
    try:
        for item in items:
            ahead.append(pool.submit(work, item))
            if len(ahead) > prefetch:
                yield ahead.popleft().result()
        while ahead:
            yield ahead.popleft().result()
    finally:
        # seen without it: a forked worker's import failed with KeyError in importlib
        for future in ahead:
            future.cancel()
        pool.shutdown(wait=True, cancel_futures=True)
