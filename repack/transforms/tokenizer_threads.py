"""How many Rust threads a tokenizer's ``encode_batch`` runs in one worker process.

The rule: a worker's share of the CPUs its pool may use (``repack.exec.cpus.worker_cpus``: usable CPUs //
pool processes, at least 1; a Ray task: 1; a task run in the driver: every usable CPU), so that processes
x threads <= cores. Even one thread runs in tokenizers' Rust pool (the worker's own thread waits): the
same ``encode_batch`` on the process's main thread (``TOKENIZERS_PARALLELISM=false``) cost 1.2-1.3x the
CPU per document on the 2-core VM (batches interleaved in one process; the 100k-file job: 44.9 CPU-s off,
34.8 with one pool thread, 37.8 with two).

Settings, first match wins:

- a process forked from one where tokenizers' Rust thread pool may have started runs no pool: the
  pool's threads do not survive a fork, and with ``TOKENIZERS_PARALLELISM`` set tokenizers does not turn
  parallelism off in the child by itself, so its first ``encode_batch`` would wait forever;
- ``REPACK_TOKENIZER_THREADS=N``: N pool threads in every worker (0: no pool, on the worker's own thread), whatever the pool (``--workers P``
  with it runs P x N; ``tests/tools/text_shapes.py`` compares shapes);
- ``TOKENIZERS_PARALLELISM`` or ``RAYON_NUM_THREADS`` set by the user: tokenizers' own settings, left as
  they are;
- else the rule above.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import MutableMapping

from repack.errors import UsageError

ENV_THREADS = "REPACK_TOKENIZER_THREADS"
_OFF = ("", "off", "false", "f", "no", "n", "0")  # TOKENIZERS_PARALLELISM values tokenizers reads as off
_applied: str | None = None  # what ``apply`` last put into the environment (not a user's setting)
_pool_pid: int | None = None  # the process in which ``apply`` let tokenizers start its Rust thread pool


@dataclass(frozen=True)
class TokenizerThreads:
    """Rust pool threads per worker process (``threads``; 0: no pool, on the worker's own thread; None:
    tokenizers' own settings decide) and what chose them (``reason``)."""

    threads: int | None
    reason: str

    @classmethod
    def choose(cls, environ: MutableMapping[str, str], worker_cpus: int) -> "TokenizerThreads":
        """The setting that applies in a process with ``environ`` whose share of the pool is ``worker_cpus``."""
        raw = environ.get(ENV_THREADS, "").strip()
        threads = -1
        if raw:
            try:
                threads = int(raw)
            except ValueError:
                pass
            if threads < 0:
                raise UsageError(f"{ENV_THREADS}={raw!r}: must be a whole number of threads (0: none, on the "
                                 "worker's own thread)")
        if _pool_pid is not None and _pool_pid != os.getpid():
            return cls(0, "forked after the Rust thread pool started")
        if threads >= 0:
            return cls(threads, ENV_THREADS)
        for name in ("TOKENIZERS_PARALLELISM", "RAYON_NUM_THREADS"):
            if name in environ and _mark(environ) != _applied:
                return cls(None, name)
        return cls(max(1, int(worker_cpus)), "pool share")

    def apply(self, environ: MutableMapping[str, str]) -> None:
        """Put the setting into ``environ`` (the process's own, before its first ``encode_batch``: the Rust
        thread pool reads ``RAYON_NUM_THREADS`` once, when it starts)."""
        global _applied, _pool_pid
        if self.threads is not None:
            environ["TOKENIZERS_PARALLELISM"] = "true" if self.threads > 0 else "false"
            if self.threads > 0:
                environ["RAYON_NUM_THREADS"] = str(self.threads)
            _applied = _mark(environ)
        if environ.get("TOKENIZERS_PARALLELISM", "true").strip().lower() not in _OFF and _pool_pid is None:
            _pool_pid = os.getpid()


def _mark(environ: MutableMapping[str, str]) -> str:
    return f"{environ.get('TOKENIZERS_PARALLELISM', '')}/{environ.get('RAYON_NUM_THREADS', '')}"


def use_tokenizer_threads(worker_cpus: int, environ: MutableMapping[str, str] | None = None) -> TokenizerThreads:
    """Choose (``TokenizerThreads.choose``) and apply the setting for this process, before it encodes;
    returns it."""
    environ = os.environ if environ is None else environ
    setting = TokenizerThreads.choose(environ, worker_cpus)
    setting.apply(environ)
    return setting
