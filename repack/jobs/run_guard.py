"""No write of an earlier run lands after a later run took OUT's lock.

Three guards, each for a way a killed driver's workers could outlive it:

- The run id. A run that took the lock writes a fresh id to ``.repack/run`` (a static partition:
  ``.repack/run-<part>``, its id also naming the full run's id it saw) through the job's store,
  so for ``s3://`` OUT it is an object beside the lock object. Every worker (and the driver's
  group assembler) reads it back before it publishes a unit's outputs and saves its record
  (``check_run``, in ``engine._run_and_record``): a different id means a later run owns OUT, and
  the stale writer stops with ``StaleRunError``, publishing nothing.
- The workers lock (local scratch, every store). A pool worker holds ``.repack/workers.lock``
  (a partition's: ``workers-<part>.lock``) shared for its life (``hold_workers_lock``); a new
  run, once it holds the job lock, takes it exclusively before any work
  (``wait_for_old_workers``; a full run every partition's too, a partition the full run's too):
  while a worker of an earlier run is alive (it could still rename a shard into OUT), the new
  run waits for it to die (a few seconds at most: see below), else refuses with JobLockedError.
  Partitions running side by side never wait for each other.
- Workers die with their driver: ``repack.exec.local`` (PR_SET_PDEATHSIG, and a pidfd watch of
  the driver when the pool's start method makes the worker a child of a fork server).
"""

from __future__ import annotations

import errno
import fcntl
import os
import secrets
import time
from pathlib import Path

from repack.errors import JobLockedError, UsageError
from repack.jobs.base import STATE_DIR

WORKERS_LOCK = "workers.lock"  # a partition's: workers-<part>.lock
OLD_WORKERS_WAIT_S = 10.0  # how long a new run waits for the dying workers of a killed run
_held: dict[str, int] = {}  # workers lock path -> fd, per worker process
_pool_worker = False  # set by the local pool's worker initializer (mark_pool_worker)
driver_lock_fds: set[int] = set()  # the job lock's fds: a forked worker closes its copies (close_inherited)


class StaleRunError(RuntimeError):
    """A writer of an earlier run found that a later run took OUT's lock: it publishes nothing."""


def run_file(part: str = "") -> str:
    """The store-relative name of the run id of a full run (``part`` empty) or a static partition."""
    return f"{STATE_DIR}/run-{part}" if part else f"{STATE_DIR}/run"


def _read(store, rel: str) -> str:
    raw = store.read_bytes(rel)
    return raw.decode("ascii", errors="replace").strip() if raw else ""


def _current(store, part: str) -> str:
    return f"{_read(store, run_file())}/{_read(store, run_file(part))}" if part else _read(store, run_file())


def claim_run(store, part: str = "") -> str:
    """Write a fresh run id for this run (the caller holds the job lock); returns the token writers
    check: ``<part>#<id>``, where a partition's id is ``<full run id seen>/<own id>`` (a later full
    run changes the first half)."""
    store.put_bytes(run_file(part), secrets.token_hex(16).encode("ascii") + b"\n")
    return f"{part}#{_current(store, part)}"


def check_run(store, run: str) -> None:
    """StaleRunError unless ``run`` (a token from ``claim_run``) is still the run that owns OUT."""
    if not run:
        return  # a call without a run id (a direct API use): nothing to compare with
    part, _, run_id = run.partition("#")
    current = _current(store, part)
    if current != run_id:
        raise StaleRunError(f"a later repack run took the lock on {store.url} (run {current or '?'} is not "
                            f"this writer's run {run_id}): this writer of an earlier run publishes nothing")


def in_pool_worker() -> bool:
    """Whether this process is a local pool's worker (``mark_pool_worker``): SIGINT ignored, SIGTERM ends it at
    once, its tasks never stopped half-way by an exception."""
    return _pool_worker


def mark_pool_worker() -> None:
    """In a local pool worker, at start: close the job lock's fds inherited through fork (so the
    lock dies with the driver, not with the last worker) and make ``hold_workers_lock`` effective."""
    global _pool_worker
    _pool_worker = True
    for fd in list(driver_lock_fds):
        try:
            os.close(fd)
        except OSError:
            pass
    driver_lock_fds.clear()


def open_lock_file(path, cloexec: bool = True) -> int:
    """A lock file of the job state opened for read and write (created when missing), never through a symbolic
    link (UsageError): a lock file linked elsewhere would have a pid written over what it points to."""
    try:
        return os.open(path, os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW | (os.O_CLOEXEC if cloexec else 0), 0o644)
    except OSError as exc:
        if exc.errno == errno.ELOOP:
            raise UsageError(f"{str(path)!r} is a symbolic link: refused (repack's lock files stay inside OUT); "
                             "remove the link") from None
        raise


def workers_lock(part: str = "") -> str:
    """The workers lock's file name for a full run (``part`` empty) or a static partition."""
    return f"workers-{part}.lock" if part else WORKERS_LOCK


def run_part(run: str) -> str:
    """The partition a run token (``claim_run``) belongs to; empty for a full run."""
    return run.partition("#")[0]


def hold_workers_lock(state: Path, part: str = "") -> None:
    """In a pool worker: hold the run's workers lock shared until the process ends (once per process)."""
    if not _pool_worker:
        return  # the driver itself (inline tasks) or a Ray worker
    path = str(state / workers_lock(part))
    if path in _held:
        return
    fd = open_lock_file(path)
    fcntl.flock(fd, fcntl.LOCK_SH)  # blocks only while a new run checks for old workers (an instant)
    _held[path] = fd


def wait_for_old_workers(state: Path, part: str = "", timeout: float = OLD_WORKERS_WAIT_S) -> None:
    """In the driver, holding the job lock: return once no worker of an earlier run that could
    write this run's outputs holds a workers lock (a full run: every one; a partition: its own and
    the full run's), waiting up to ``timeout`` s for killed workers to die; else JobLockedError."""
    names = {workers_lock(part), WORKERS_LOCK} if part else {WORKERS_LOCK} | {
        p.name for p in state.glob("workers-*.lock")}
    deadline = time.monotonic() + timeout
    for name in sorted(names):
        _wait_free(state / name, deadline, timeout)


def _wait_free(path: Path, deadline: float, timeout: float) -> None:
    fd = open_lock_file(path)
    try:
        while True:
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
                fcntl.flock(fd, fcntl.LOCK_UN)
                return
            except BlockingIOError:
                if time.monotonic() > deadline:
                    raise JobLockedError(f"worker processes of an earlier repack run still hold {path} after "
                                         f"{timeout:.0f} s; stop them first (see `fuser -v` on that file)") from None
                time.sleep(0.05)
    finally:
        os.close(fd)
