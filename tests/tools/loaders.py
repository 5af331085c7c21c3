"""A DataLoader iterator that a test expects to raise, its workers shut down when the test is done with it."""

from __future__ import annotations

import contextlib
import gc
from typing import Iterator


@contextlib.contextmanager
def failing_loader(loader) -> Iterator:
    """``iter(loader)``, its workers shut down on leaving the block (also when it raised), then the garbage
    collected, before the next loader forks. Left to the garbage collector (the raised error's traceback holds
    the iterator in a cycle), the workers missed the end and were joined only after torch's 5 s poll timed
    out: ~10 s a test."""
    iterator = iter(loader)
    try:
        yield iterator
    finally:
        iterator._shutdown_workers()
        del iterator
        gc.collect()
