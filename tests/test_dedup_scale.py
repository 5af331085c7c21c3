"""--dedup at many inputs of one size (tiny files): the hashing holds a few futures at a time, not one per
input (``ThreadPoolExecutor.map`` submitted every candidate up front: ~1.6 KB each until the map ended)."""

from __future__ import annotations

import threading
import time
import tracemalloc

from repack.exec.ahead import read_ahead
from repack.jobs.images import find_duplicates
from repack.sources.columns import InputTable


def test_read_ahead_keeps_at_most_depth_items_ahead_in_order():
    started: list[int] = []
    lock = threading.Lock()

    def work(item: int) -> int:
        with lock:
            started.append(item)
        return item * 2

    got = []
    for n, value in enumerate(read_ahead(range(2000), work, 4, 16)):
        if n % 200 == 0:
            time.sleep(0.01)  # the threads run ahead as far as they may
            with lock:
                assert len(started) <= n + 1 + 16 + 1, (n, len(started))
        got.append(value)
    assert got == [2 * i for i in range(2000)]


def test_find_duplicates_memory_does_not_grow_a_future_per_input(tmp_path):
    count = 6000
    root = tmp_path / "src"
    root.mkdir()
    rels = [f"{i:05d}.bin" for i in range(count)]
    for i, rel in enumerate(rels):  # one size; every 1000th file a copy of file 0
        (root / rel).write_bytes((0 if i % 1000 == 0 else i).to_bytes(4, "big") * 64)
    table = InputTable.of_rels(str(root), rels, [-1] * count, (), [256] * count, [0] * count, range(count))
    tracemalloc.start()
    try:
        groups = find_duplicates(table)
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert [positions for _, positions in groups] == [list(range(0, count, 1000))]
    assert peak < 800 * count, peak  # a digest and a group entry per input (~0.5 KB); with a future each: ~2 KB
