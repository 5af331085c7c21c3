"""How many threads a tokenizer's ``encode_batch`` runs on in one worker process.

The rule: a worker's share of the CPUs its pool may use (``repack.exec.cpus.worker_cpus``: usable CPUs //
pool processes, at least 1; a Ray task: 1; a task run in the driver: every usable CPU), so that processes
x threads <= cores. In a local pool's worker a share of one thread is a thread of the task's own
(``run_on_own_thread``: the whole task, reading and writing too, runs there and encodes on it,
``TOKENIZERS_PARALLELISM=false``), neither the process's main thread nor one Rust pool thread. Elsewhere (the
driver, a Ray worker: an exception there may stop a task half-way, and the thread would go on) one Rust pool
thread. Measured at 1,000,000 tiny files on 16 cores (``bash tests/gpu/text_cpu.sh``, three rounds on one
device host): the task's own thread 0.4-6.4% less wall than one pool thread per worker, 1.2-4.6% less CPU,
and its threads waited runnable for a CPU 5-6 s in all instead of 46-52 s (each batch handed to the pool
thread and back); encoding on the main thread costs ~20% more CPU per document than on any other thread
(2-core VM, the same batches alternated in one process). More threads than one are tokenizers' Rust pool.

Settings, first match wins:

- a process forked from one where tokenizers' Rust thread pool may have started runs no pool: the
  pool's threads do not survive a fork, and with ``TOKENIZERS_PARALLELISM`` set tokenizers does not turn
  parallelism off in the child by itself, so its first ``encode_batch`` would wait forever;
- ``REPACK_TOKENIZER_THREADS=N``: N threads in every worker (0: on the worker's main thread; 1: on a thread of
  the task's own, as above; more: a Rust pool of N), whatever the pool (``--workers P`` with it runs P x N;
  ``tests/tools/text_shapes.py`` compares shapes);
- ``TOKENIZERS_PARALLELISM`` or ``RAYON_NUM_THREADS`` set by the user: tokenizers' own settings, left as
  they are;
- else the rule above.
"""

from __future__ import annotations

import os
import threading
from dataclasses import dataclass
from typing import Callable, MutableMapping, TypeVar

from repack.errors import UsageError

ENV_THREADS = "REPACK_TOKENIZER_THREADS"
T = TypeVar("T")
_OFF = ("", "off", "false", "f", "no", "n", "0")  # TOKENIZERS_PARALLELISM values tokenizers reads as off
_applied: str | None = None  # what ``apply`` last put into the environment (not a user's setting)
_pool_pid: int | None = None  # the process in which ``apply`` let tokenizers start its Rust thread pool


@dataclass(frozen=True)
class TokenizerThreads:
    """Threads encoding in one worker process (``threads``; 0: the worker's main thread; 1: a thread of the
    task's own where ``own_thread``, else one Rust pool thread; more: a Rust pool of that many; None: tokenizers'
    own settings decide) and what chose them (``reason``)."""

    threads: int | None
    reason: str
    own_thread: bool = False

    @classmethod
    def choose(cls, environ: MutableMapping[str, str], worker_cpus: int,
               own_thread_ok: bool = False) -> "TokenizerThreads":
        """The setting that applies in a process with ``environ`` whose share of the pool is ``worker_cpus``;
        ``own_thread_ok``: one thread may be a thread of the task's own (a local pool's worker)."""
        raw = environ.get(ENV_THREADS, "").strip()
        threads = -1
        if raw:
            try:
                threads = int(raw)
            except ValueError:
                pass
            if threads < 0:
                raise UsageError(f"{ENV_THREADS}={raw!r}: must be a whole number of threads (0: the worker's "
                                 "main thread)")
        if _pool_pid is not None and _pool_pid != os.getpid():
            return cls(0, "forked after the Rust thread pool started")
        if threads >= 0:
            return cls(threads, ENV_THREADS, own_thread_ok and threads == 1)
        for name in ("TOKENIZERS_PARALLELISM", "RAYON_NUM_THREADS"):
            if name in environ and _mark(environ) != _applied:
                return cls(None, name)
        share = max(1, int(worker_cpus))
        return cls(share, "pool share", own_thread_ok and share == 1)

    def apply(self, environ: MutableMapping[str, str]) -> None:
        """Put the setting into ``environ`` (the process's own, before its first ``encode_batch``: the Rust
        thread pool reads ``RAYON_NUM_THREADS`` once, when it starts)."""
        global _applied, _pool_pid
        if self.threads is not None:
            pool = self.threads > 0 and not self.own_thread
            environ["TOKENIZERS_PARALLELISM"] = "true" if pool else "false"
            if pool:
                environ["RAYON_NUM_THREADS"] = str(self.threads)
            _applied = _mark(environ)
        if environ.get("TOKENIZERS_PARALLELISM", "true").strip().lower() not in _OFF and _pool_pid is None:
            _pool_pid = os.getpid()


def _mark(environ: MutableMapping[str, str]) -> str:
    return f"{environ.get('TOKENIZERS_PARALLELISM', '')}/{environ.get('RAYON_NUM_THREADS', '')}"


def use_tokenizer_threads(worker_cpus: int, environ: MutableMapping[str, str] | None = None,
                          own_thread_ok: bool = False) -> TokenizerThreads:
    """Choose (``TokenizerThreads.choose``) and apply the setting for this process, before it encodes;
    returns it."""
    environ = os.environ if environ is None else environ
    setting = TokenizerThreads.choose(environ, worker_cpus, own_thread_ok)
    setting.apply(environ)
    return setting


def run_on_own_thread(work: Callable[[], T]) -> T:
    """``work()`` run on a new thread while this one waits: its result, or its exception raised here. Only
    where nothing raises in the waiting thread meanwhile (a local pool's worker: SIGINT ignored, SIGTERM ends
    the process): the thread would go on alone. A daemon thread, so that a worker ending never waits for it;
    what it leaves behind is a temp file, as after kill -9."""
    box: list = []

    def run() -> None:
        try:
            box.append((True, work()))
        except BaseException as exc:  # noqa: BLE001 - handed to the waiting thread, raised there
            box.append((False, exc))

    thread = threading.Thread(target=run, name="repack-task", daemon=True)
    thread.start()
    thread.join()
    if not box:
        raise RuntimeError("the task's thread ended without a result or an error")
    ok, value = box.pop()
    if ok:
        return value
    try:
        raise value
    finally:
        del value  # no cycle through this frame: a failed task's data is freed now, not at the next collection
