"""The driver's per-record folding helpers keep their results exactly (the fast paths change no output)."""

from __future__ import annotations

import random

import numpy as np
import pytest

from repack.jobs.record_columns import pack_times, unpack_times
from repack.jobs.stats import merge_slowest


def _full_sort(current: list[dict], new: list[dict], limit: int) -> list[dict]:
    return sorted(current + new, key=lambda e: (-e["us"], e.get("source", "")))[:limit]


def test_merge_slowest_equals_the_full_sort_with_ties_and_unsorted_input():
    rng = random.Random(7)
    for _ in range(3000):
        def entries(count: int) -> list[dict]:
            return [{"us": rng.randint(0, 12), "source": f"s{rng.randint(0, 30)}"} for _ in range(count)]

        current, new, limit = entries(rng.randint(0, 14)), entries(rng.randint(0, 14)), rng.randint(1, 12)
        assert merge_slowest(current, new, limit) == _full_sort(current, new, limit)


@pytest.mark.parametrize("count", [0, 1, 7, 128])
def test_unpack_times_equals_np_split(count: int):
    read, check = list(range(count)), [3 * v + 1 for v in range(count)]
    got = unpack_times(pack_times(read, check), 2)
    assert [g.dtype for g in got] == [np.int64, np.int64]
    assert [g.tolist() for g in got] == [read, check]


def test_unpack_times_refuses_uneven_columns():
    with pytest.raises(ValueError):
        unpack_times(pack_times([1, 2, 3]), 2)
