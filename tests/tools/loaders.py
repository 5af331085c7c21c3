"""A DataLoader iterator that a test expects to raise, its workers shut down when the test is done with it."""

from __future__ import annotations

import contextlib
import gc
import traceback
from typing import Iterator


@contextlib.contextmanager
def failing_loader(loader) -> Iterator:
    """``iter(loader)``, its workers shut down on leaving the block (also when it raised), then the garbage
    collected, before the next loader forks. Left to the garbage collector (the raised error's traceback holds
    the iterator in a cycle), the workers missed the end and were joined only after torch's 5 s poll timed
    out: ~10 s a test. ``iter(loader)`` may raise itself (torchdata re-raises a worker's refusal of a loaded
    state in the iterator's ``__init__``): that half-built iterator's workers are shut down the same way. The
    error's finished frames are cleared (``traceback.clear_frames``): torch's ``reraise`` frame holds the error
    it raised, a cycle that kept every frame of its traceback, the test's own included, so the test's other
    loaders (a few batches taken) were also left to the garbage collector, and its 10 s."""
    try:
        iterator = iter(loader)
    except BaseException as exc:
        _shut_down_raising_iterator(exc.__traceback__.tb_next)  # not this frame: reading its locals keeps exc
        traceback.clear_frames(exc.__traceback__)
        raise
    try:
        yield iterator
    except BaseException as exc:
        traceback.clear_frames(exc.__traceback__)
        raise
    finally:
        shutdown = getattr(iterator, "_shutdown_workers", None)  # none without workers (num_workers=0)
        if shutdown is not None:
            shutdown()
        del iterator
        gc.collect()


def _shut_down_raising_iterator(tb) -> None:
    """Shut down the workers of the DataLoader iterator whose method is a frame of traceback ``tb`` (the
    one whose ``__init__`` raised); nothing if none is."""
    from torch.utils.data.dataloader import _BaseDataLoaderIter

    while tb is not None:
        owner = tb.tb_frame.f_locals.get("self")
        if isinstance(owner, _BaseDataLoaderIter) and hasattr(owner, "_shutdown_workers"):
            owner._shutdown_workers()
            return
        tb = tb.tb_next
