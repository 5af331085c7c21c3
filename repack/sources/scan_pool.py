"""The process pool that a source scan fans its top-level folders out on.

fork while the driver runs no other thread: the workers start at once and inherit the imported
modules. With a thread alive (``--executor ray`` joins its cluster on one while the driver plans,
an object-store OUT's lock keeps a heartbeat) a fork could copy a lock held mid-operation, so the
scan runs on forkserver workers then: the server starts once (a fresh interpreter that imports the
scanning module) and forks each worker from itself. Such a scan ran on one process before: on 2
cores, 50,000 tiny files planned in ~10 s under Ray against ~3 s on the local pool.
"""

from __future__ import annotations

import gc
import multiprocessing
from concurrent.futures import ProcessPoolExecutor

from repack.exec.reap import only_thread


def start_method(workers: int, tasks: int, min_tasks: int) -> str | None:
    """How a scan of ``tasks`` folder walks starts its pool's processes ("fork", "forkserver"), or None when
    it stays in this process (one worker, fewer than ``min_tasks`` folders, no fork on this platform)."""
    methods = multiprocessing.get_all_start_methods()
    if workers <= 1 or tasks < min_tasks or "fork" not in methods:
        return None
    if only_thread():
        return "fork"
    return "forkserver" if "forkserver" in methods else None


_lent: ProcessPoolExecutor | None = None  # a pool forked before the driver's threads started, lent to scans


def lend(pool: ProcessPoolExecutor | None) -> None:
    """Let scans run on ``pool`` (None: no more): ``--executor ray`` forks the driver's pool before Ray's threads
    start (``repack.exec.driver_share``), so its scan needs no forkserver."""
    global _lent
    _lent = pool


def end_loan(pool: ProcessPoolExecutor) -> None:
    """Scans stop borrowing ``pool`` (if it is the one lent)."""
    if _lent is pool:
        lend(None)


class _Borrowed:
    """A lent pool as a scan uses its own: ``map``, and a ``shutdown``/``with`` that leave it running (a
    shutdown that cancels drops the walks not started yet; one that waits waits for them)."""

    def __init__(self, pool: ProcessPoolExecutor) -> None:
        self.pool = pool
        self.futures: list = []

    def map(self, fn, *iterables, chunksize: int = 1):
        futures = [self.pool.submit(fn, *args) for args in zip(*iterables)]
        self.futures += futures
        return (future.result() for future in futures)

    def shutdown(self, wait: bool = True, cancel_futures: bool = False) -> None:
        for future in self.futures:
            if cancel_futures:
                future.cancel()
            elif wait and not future.cancelled():
                future.exception()  # waits; an error is the map's to raise

    def __enter__(self) -> "_Borrowed":
        return self

    def __exit__(self, *exc) -> None:
        pass


def scan_pool(workers: int, tasks: int, min_tasks: int, module: str) -> ProcessPoolExecutor | None:
    """A pool of ``min(workers, tasks)`` processes for ``tasks`` folder walks, or None (``start_method``).
    ``module``: the module holding the pool's task function (a forkserver imports it once). A lent pool
    (``lend``) serves instead of starting one."""
    method = start_method(workers, tasks, min_tasks)
    if method is None:
        return None
    if _lent is not None:
        return _Borrowed(_lent)
    context = multiprocessing.get_context(method)
    if method == "forkserver":
        context.set_forkserver_preload([module])  # a no-op once this process's server runs
    # a forked worker never collects what it inherited: an object whose finalizer needs the parent's threads (a
    # DALI pipeline left for the garbage collector by the caller) would hang the walk there
    return ProcessPoolExecutor(min(workers, tasks), mp_context=context,
                               initializer=gc.freeze if method == "fork" else None)
