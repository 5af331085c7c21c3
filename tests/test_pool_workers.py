"""A forked pool worker never collects what it inherited from the driver (``gc.freeze`` in the pool's
initializer): a finalizer of an inherited object (a DALI pipeline's) may need the driver's threads, which the
fork did not copy, and hung a worker (stop 50 saw it in the walk's workers; the rewrite pool forks the same way)."""

from __future__ import annotations

import gc

import pytest

from repack.exec.local import _pool_context, process_pool


def frozen(_: int) -> int:
    return gc.get_freeze_count()


def test_forked_pool_workers_freeze_what_they_inherited():
    if _pool_context().get_start_method() != "fork":
        pytest.skip("the pool starts through a fork server here: its workers inherit nothing of the driver")
    with process_pool(2) as pool:
        assert all(count > 0 for count in pool.map(frozen, range(4)))
