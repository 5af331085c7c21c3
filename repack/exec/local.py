"""The default executor: a local process pool sized to the usable CPUs.

Only JSON strings cross the process boundary (the pool's own transport aside, no object
of the data path is pickled). A single task, or ``workers=1``, runs in-process.
"""

from __future__ import annotations

import contextlib
import gc
import itertools
import json
import multiprocessing
import os
import queue
import signal
import threading
import time
import traceback
from concurrent.futures import ProcessPoolExecutor
from concurrent.futures.process import BrokenProcessPool
from typing import Iterator

from repack.exec.base import TaskFailure
from repack.exec.cpus import available_cpus, cpu_share, set_worker_cpus
from repack.exec.reap import only_thread


def _call(call: tuple[str, str, str, str, bool]) -> str:
    from repack.jobs.engine import execute_task

    return execute_task(*call)


PAIR_FROM = 32  # calls per worker from which the local pool sends them in pairs (see LocalExecutor._run_pool)
FAILED = " failed"  # the key of a call's failure in ``_call_pair``'s list (no record has it)


def _call_pair(calls: tuple) -> str:
    """Run consecutive calls in one turn of a worker: a JSON list of each one's record, or of
    ``{FAILED: "<error type>: <message>"}`` where it raised (what the driver would have read from its future)."""
    texts = []
    for call in calls:
        try:
            texts.append(_call(call))
        except Exception as exc:  # noqa: BLE001 - the driver retries it on its own
            texts.append(json.dumps({FAILED: f"{type(exc).__name__}: {exc}"}))
    return "[" + ",".join(text.rstrip() for text in texts) + "]"


def submit_calls(pool: ProcessPoolExecutor, calls: list[tuple]):
    """Submit one call, or consecutive calls that run in one turn of a worker (``_call_pair``); a broken pool's
    BrokenProcessPool is raised."""
    return pool.submit(_call, calls[0]) if len(calls) == 1 else pool.submit(_call_pair, tuple(calls))


def call_outcomes(future, count: int) -> list[dict]:
    """Each call's outcome from a finished ``submit_calls`` future of ``count`` calls: its record, or
    ``{FAILED: "<error type>: <message>"}``. A broken pool's BrokenProcessPool is raised."""
    try:
        text = future.result()
        return [json.loads(text)] if count == 1 else json.loads(text)
    except BrokenProcessPool:
        raise
    except Exception as exc:  # noqa: BLE001 - a task failure is a value
        return [{FAILED: f"{type(exc).__name__}: {exc}"}] * count


def _start_worker(driver_pid: int, cpus: int) -> None:
    """Pool initializer: record the worker's share of the pool's CPUs (``repack.exec.cpus.worker_cpus``: a
    tokenizer sizes its threads by it) and tie the worker's life to the driver's (``_die_with_parent``). A
    forked worker never collects what it inherited (``gc.freeze``: a finalizer of the driver's objects, a DALI
    pipeline's say, may need threads the fork did not copy), as the walk's workers (``scan_pool``)."""
    if os.getppid() == driver_pid:  # forked from the driver (a fork server's children inherit nothing of it)
        gc.freeze()
    set_worker_cpus(cpus)
    _die_with_parent(driver_pid)


def _die_with_parent(driver_pid: int) -> None:
    """Pool initializer: a worker must not outlive a killed driver (it would keep writing into
    OUT). Linux: PR_SET_PDEATHSIG = SIGKILL, which fires when the worker's parent dies: the driver
    under fork; under forkserver the parent is the fork server, which outlives a SIGKILLed driver,
    so a daemon thread also watches the driver itself (a pidfd, else polling) and SIGKILLs this
    worker the moment it is gone (its ffmpeg children die with it: PR_SET_PDEATHSIG). Signals are
    the driver's business: a worker ignores SIGINT (Ctrl-C reaches the whole process group) and
    dies on SIGTERM, which the driver sends when it is interrupted (it then removes the temp
    files). See repack.jobs.run_guard for the other guards (run id, workers lock)."""
    from repack.jobs import run_guard

    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(signal.SIGTERM, signal.SIG_DFL)
    run_guard.mark_pool_worker()
    try:
        import ctypes

        ctypes.CDLL(None, use_errno=True).prctl(1, int(signal.SIGKILL))  # 1 = PR_SET_PDEATHSIG
    except (OSError, AttributeError):
        pass
    if not driver_pid:
        return
    if os.getppid() == driver_pid:
        return  # forked by the driver: PR_SET_PDEATHSIG covers it
    watch = _pidfd(driver_pid)
    if watch is None and not _alive(driver_pid):
        os._exit(1)  # the driver died before this worker started
    threading.Thread(target=_watch_driver, args=(driver_pid, watch), daemon=True, name="repack-driver-watch").start()


def _pidfd(pid: int) -> int | None:
    try:
        return os.pidfd_open(pid)
    except (AttributeError, OSError):  # not Linux >= 5.3, or already gone
        return None


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def _watch_driver(driver_pid: int, pidfd: int | None) -> None:
    """SIGKILL this worker as soon as the driver exits (a pidfd turns readable then)."""
    import select

    if pidfd is not None:
        select.select([pidfd], [], [])
    else:
        while _alive(driver_pid):
            time.sleep(0.2)
    os.kill(os.getpid(), signal.SIGKILL)


def _pool_context():
    """fork where the platform has it and the driver runs no other thread: workers start ~0.2 s
    sooner than with forkserver and inherit the imported job modules (the engine turns tqdm's
    monitor thread off). With threads alive (a pool rebuilt while groups are assembled, an s3
    lock's heartbeat, upload threads) a fork could copy a lock held mid-operation: forkserver then."""
    methods = multiprocessing.get_all_start_methods()
    if "fork" in methods and only_thread():
        return multiprocessing.get_context("fork")
    if "forkserver" in methods:
        return multiprocessing.get_context("forkserver")
    ctx = multiprocessing.get_context("spawn")
    return ctx


def kill_pool(pool: ProcessPoolExecutor) -> None:
    """Cancel what has not started and kill the workers now, instead of waiting for their tasks (the
    engine then removes their temp files)."""
    pool.shutdown(wait=False, cancel_futures=True)
    for worker in multiprocessing.active_children():
        worker.terminate()
    for worker in multiprocessing.active_children():
        worker.join(5)
        if worker.is_alive():  # forked before its initializer set SIGTERM's default (the driver's handler ran in it,
            worker.kill()      # and its raise was lost): never left for the interpreter's exit to join forever
            worker.join(5)


@contextlib.contextmanager
def _stop_on_exit(pool: ProcessPoolExecutor):
    """Interrupted (or any error) while the pool runs: ``kill_pool``."""
    try:
        yield
    except BaseException:
        kill_pool(pool)
        raise


def new_pool(workers: int) -> ProcessPoolExecutor:
    """A pool of ``workers`` processes started as the engine's are (fork where safe, each dies with the
    driver, each told its share of the usable CPUs: ``cpu_share``). Pass JSON strings in and out."""
    return ProcessPoolExecutor(max_workers=workers, mp_context=_pool_context(), initializer=_start_worker,
                               initargs=(os.getpid(), cpu_share(available_cpus(), workers)))


@contextlib.contextmanager
def process_pool(workers: int) -> Iterator[ProcessPoolExecutor]:
    """``new_pool``, all its workers killed at once when the driver is interrupted or fails; for work outside
    a job's plan (`repack remove`'s shard rewrites) too."""
    with new_pool(workers) as pool, _stop_on_exit(pool):
        yield pool


class LocalExecutor:
    """Process-pool executor with per-task retries."""

    same_host = True  # workers share the driver's disk and page cache

    def __init__(self, workers: int | None = None, retries: int = 2, **_ignored) -> None:
        self.workers = workers or available_cpus()
        self.retries = retries

    def close(self) -> None:
        """Nothing to release: each ``run`` starts and stops its own pool."""

    def run(self, calls: list[tuple[str, str, str, str, bool]], task_ids: list[str]) -> Iterator[dict | TaskFailure]:
        if not calls:
            return
        if self.workers == 1 or len(calls) == 1:
            for call, task_id in zip(calls, task_ids):
                yield self._run_inline(call, task_id)
            return
        attempts = [0] * len(calls)
        remaining = set(range(len(calls)))
        while remaining:  # a new pool after a worker died (segfault, OOM kill): BrokenProcessPool
            yield from self._run_pool(calls, task_ids, remaining, attempts)

    def _run_pool(self, calls, task_ids, remaining: set[int], attempts: list[int]) -> Iterator[dict | TaskFailure]:
        """Run ``remaining`` on one pool; returns early (leaving work in ``remaining``) if it breaks.

        A finished future puts itself on a queue (``add_done_callback``, run by the pool's manager
        thread), which this loop takes from: O(1) per result. (A ``wait`` over the oldest 2W+2 futures
        installed and removed a waiter on each of them per result: at 16 workers and ~8,000 chunk tasks
        of tiny files that was a large part of the driver's GIL time, which also paces the dispatch.)
        With at least ``PAIR_FROM`` calls per worker, consecutive calls travel in pairs (``_call_pair``):
        half the pool's per-call work in the driver (pickling, its manager thread, futures); a call that
        failed is retried on its own."""
        with process_pool(min(self.workers, len(remaining))) as pool:
            finished: queue.SimpleQueue = queue.SimpleQueue()
            pending: dict = {}  # future -> (its submission number, the indices of the calls it runs)
            in_flight = 2 * self.workers + 2  # futures that may be at the workers (the rest wait in the driver)
            seq = itertools.count()  # submission order

            def submit(indices: list[int]) -> bool:
                """Submit; False when the pool broke meanwhile (a worker died)."""
                try:
                    future = submit_calls(pool, [calls[i] for i in indices])
                except BrokenProcessPool:
                    return False
                pending[future] = (next(seq), indices)
                future.add_done_callback(finished.put)
                return True

            def charge(i: int, error: str) -> TaskFailure | None:
                """One failed attempt of call ``i``; its TaskFailure once past the retries."""
                attempts[i] += 1
                if attempts[i] <= self.retries:
                    return None
                remaining.discard(i)
                return TaskFailure(task_ids[i], error)

            order = sorted(remaining)
            step = 2 if len(order) >= PAIR_FROM * self.workers else 1
            for at in range(0, len(order), step):
                submit(order[at:at + step])
            broken = False
            while pending and not broken:
                done = [finished.get()]
                with contextlib.suppress(queue.Empty):
                    while True:
                        done.append(finished.get_nowait())
                lost: list[tuple[int, list[int], str]] = []  # (submission, calls, error) of the broken pool's futures
                for future in done:
                    seq_and_calls = pending.pop(future)
                    try:
                        outcomes = call_outcomes(future, len(seq_and_calls[1]))
                    except BrokenProcessPool as exc:
                        broken = True
                        lost.append((*seq_and_calls, f"{type(exc).__name__}: {exc}"))
                        continue
                    for i, outcome in zip(seq_and_calls[1], outcomes):
                        if FAILED not in outcome:
                            remaining.discard(i)
                            yield outcome
                        elif (failure := charge(i, outcome[FAILED])) is not None:
                            yield failure
                        elif not broken:
                            broken = not submit([i])  # else it stays in ``remaining``: the next pool runs it
            if broken:
                # a broken pool fails every future, also those still waiting in the driver: only the oldest,
                # those a worker could have been running, count an attempt; the rest run again uncharged
                for future, seq_and_calls in pending.items():
                    future.cancel()
                    lost.append((*seq_and_calls, "BrokenProcessPool"))
                for _, indices, error in sorted(lost)[:in_flight]:
                    for i in indices:
                        if (failure := charge(i, error)) is not None:
                            yield failure

    def _run_inline(self, call, task_id) -> dict | TaskFailure:
        error = ""
        for _ in range(self.retries + 1):
            try:
                return json.loads(_call(call))
            except Exception as exc:  # noqa: BLE001
                error = f"{type(exc).__name__}: {exc}\n{traceback.format_exc(limit=3)}"
        return TaskFailure(task_id, error)
