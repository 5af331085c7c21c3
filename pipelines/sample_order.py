"""An epoch's sample order as data: which global positions a (rank, worker) reads, in what order.

The epoch's *global* list is the dataset's samples with the shards in the epoch's order (the
manifest's, or a seeded permutation); a position is an index into that list, the same for every
world size and worker count. A rank's *share* is a list of runs ``[[start, stop], ...]`` of
positions (normally one run: its balanced range; after an elastic resume, what remains). Its
DataLoader workers are dealt the share's positions in balanced pieces of about 64, in turn, and each
worker delivers its positions window by window (``window`` consecutive positions), each window in a seeded
permutation when shuffling. So how far a worker got is one number, and everything it consumed
follows from (share, worker, workers, seed, epoch, window, count): no bytes, no buffer contents.

Everything here is pure (stdlib and numpy, no torch), shared by the readers and ``pipelines.resume``.
The ``*_array`` forms give the same positions as numpy arrays (a worker's list of a 10M-sample
dataset as Python ints would cost 36 bytes each).
"""

from __future__ import annotations

import functools
import random
from typing import Iterable, Iterator, Sequence

import numpy as np

Runs = list  # [[start, stop], ...] of global positions, ascending, disjoint


def balanced(n: int, parts: int, index: int) -> tuple[int, int]:
    """The ``index``-th of ``parts`` contiguous, balanced pieces of ``range(n)``: (start, stop)."""
    if parts < 1 or not 0 <= index < parts:
        raise ValueError(f"part {index} of {parts} is not a valid split")
    return n * index // parts, n * (index + 1) // parts


def rank_runs(total: int, world_size: int, rank: int, drop_last: bool) -> Runs:
    """A rank's normal share of ``total`` positions: ``total // world_size`` positions each with
    ``drop_last`` (the remainder is skipped that epoch); else its balanced range, padded to
    ``ceil(total / world_size)`` positions with one repeat when it is short (``padding_runs``), so
    every rank has as many positions and DDP as many steps."""
    if drop_last:
        per = total // world_size
        return [[rank * per, (rank + 1) * per]]
    start, stop = balanced(total, world_size, rank)
    return ([[start, stop]] if stop > start else []) + padding_runs(total, world_size, rank)


def padding_runs(total: int, world_size: int, rank: int) -> Runs:
    """The repeats that even out rank ``rank``'s share: a short rank (one position fewer than
    ``ceil(total / world_size)``) gets one *virtual* position ``total + k`` (k: how many short ranks
    come before it), which stands for the epoch's position ``k % total`` (``real_position``): a
    sample delivered twice that epoch, once as itself and once as padding."""
    if total == 0:
        return []
    per = -(-total // world_size)
    short = [r for r in range(world_size) if per - (balanced(total, world_size, r)[1] - balanced(total, world_size, r)[0])]
    if rank not in short:
        return []
    k = short.index(rank)
    return [[total + k, total + k + 1]]


def real_position(position: int, total: int) -> int:
    """The epoch's position a (possibly virtual, padding) position stands for."""
    return position if position < total else (position - total) % total


def continued_epoch(saved_epoch: int, chosen: int | None) -> tuple[int, bool]:
    """Where a loaded state continues, given the epoch chosen with ``set_epoch`` before or after the
    load (None: none chosen; a StatefulDataLoader applies a loaded state only when its next iteration
    starts, so the two orders are one case): (epoch, keep the state's position).

    No epoch chosen, or the state's: the state's epoch from the state's position (a state taken after
    the last step of epoch e ends epoch e: that pass yields nothing more). Another epoch: that epoch
    from its start, exactly as in an uninterrupted run that calls ``set_epoch`` with it (so a state
    taken at the end of epoch e, then ``set_epoch(e + 1)``, gives epoch e + 1's order); the state's
    position applies to its own epoch only."""
    if chosen is None or chosen == saved_epoch:
        return saved_epoch, True
    return chosen, False


def checked_count(value, what: str, high: int | None = None) -> int:
    """``value`` when it is an int from 0 to ``high`` (None: no bound); else a ValueError naming ``what``. A
    state's counts pass here: a hand-edited negative or oversized one skipped or repeated samples silently."""
    if not isinstance(value, int) or isinstance(value, bool) or value < 0 or (high is not None and value > high):
        raise ValueError(f"{what} {value!r} is not a count from 0 to {'any' if high is None else high}: the state "
                         "was edited, or is not this reader's")
    return value


def checked_runs(runs, what: str, high: int) -> Runs:
    """``runs`` when it is a list of [start, stop) position pairs, ascending and disjoint, within 0..``high``;
    else a ValueError naming ``what``."""
    if not isinstance(runs, list) or not all(isinstance(run, list) and len(run) == 2 for run in runs):
        raise ValueError(f"{what} {runs!r} is not a list of [start, stop] pairs")
    end = 0
    for start, stop in runs:
        if checked_count(start, f"{what} start", high) < end or checked_count(stop, f"{what} stop", high) <= start:
            raise ValueError(f"{what} {runs!r} are not ascending, disjoint and non-empty")
        end = stop
    return runs


def runs_length(runs: Runs) -> int:
    return sum(stop - start for start, stop in runs)


def runs_of(positions: Iterable[int]) -> Runs:
    """Sorted distinct positions -> the fewest runs that hold exactly them."""
    runs: Runs = []
    for p in positions:
        if runs and runs[-1][1] == p:
            runs[-1][1] = p + 1
        else:
            runs.append([p, p + 1])
    return runs


def take_runs(runs: Runs, start: int, stop: int) -> list[int]:
    """Positions ``start:stop`` of the concatenated runs."""
    out: list[int] = []
    base = 0
    for a, b in runs:
        n = b - a
        lo, hi = max(start, base), min(stop, base + n)
        if lo < hi:
            out.extend(range(a + lo - base, a + hi - base))
        base += n
        if base >= stop:
            break
    return out


WORKER_PIECE = 64  # positions per piece the workers are dealt, round robin


def piece_count(n: int, workers: int) -> int:
    """How many pieces a share of ``n`` positions is cut into for ``workers`` workers (a multiple of them)."""
    return max(1, n // (workers * WORKER_PIECE)) * workers


def worker_sizes(runs: Runs, workers: int) -> list[int]:
    """How many positions each of ``workers`` workers gets from ``worker_positions``, without listing them."""
    n = runs_length(runs)
    pieces = piece_count(n, workers)
    sizes = [hi - lo for lo, hi in (balanced(n, pieces, p) for p in range(pieces))]
    return [sum(sizes[w::workers]) for w in range(workers)]


def worker_positions(runs: Runs, worker: int, workers: int) -> list[int]:
    """The positions of worker ``worker`` of ``workers`` of a share, in global order: the share cut
    into balanced pieces of about ``WORKER_PIECE`` positions, dealt to the workers in turn. (One
    contiguous half each put the share's slow stretches, e.g. a class of large photos, on one
    worker: 2-7% more work, the other waiting at the end; pieces keep block reads contiguous.)"""
    n = runs_length(runs)
    pieces = piece_count(n, workers)
    if not 0 <= worker < workers:
        raise ValueError(f"part {worker} of {workers} is not a valid split")
    out: list[int] = []
    for piece in range(worker, pieces, workers):
        out.extend(take_runs(runs, *balanced(n, pieces, piece)))
    return out


def worker_position_array(runs: Runs, worker: int, workers: int) -> np.ndarray:
    """``worker_positions`` as an int64 array, built without a Python object per position."""
    positions = WorkerPositions(runs, worker, workers)
    return positions[0:len(positions)]


class WorkerPositions:
    """``worker_positions(runs, worker, workers)`` computed a slice at a time (``positions[a:b]``: an int64
    array): a worker holds a few numbers per piece of ~64 positions, not 8 bytes per position (with its
    working arrays, ~40 bytes per position of its share at once: 25 MB a worker at 10M samples and 16)."""

    def __init__(self, runs: Runs, worker: int, workers: int) -> None:
        n = runs_length(runs)
        pieces = piece_count(n, workers)
        if not 0 <= worker < workers:
            raise ValueError(f"part {worker} of {workers} is not a valid split")
        piece = np.arange(worker, pieces, workers, dtype=np.int64)
        self._piece_lo = n * piece // pieces  # each of this worker's pieces: its first index into the share
        counts = n * (piece + 1) // pieces - self._piece_lo
        self._piece_ends = np.cumsum(counts)
        self._piece_starts = self._piece_ends - counts
        self._total = int(self._piece_ends[-1]) if len(counts) else 0
        self._run_lo = np.array([a for a, _ in runs] or [0], dtype=np.int64)
        self._run_base = (np.concatenate([[0], np.cumsum([b - a for a, b in runs])[:-1]]).astype(np.int64)
                          if runs else self._run_lo)

    def __len__(self) -> int:
        return self._total

    def __getitem__(self, cut: slice) -> np.ndarray:
        if not isinstance(cut, slice) or cut.step not in (None, 1):
            raise TypeError("WorkerPositions takes a slice positions[a:b]")
        mine = np.arange(*cut.indices(self._total)[:2], dtype=np.int64)  # indexes into this worker's list
        piece = np.searchsorted(self._piece_ends, mine, side="right")
        share = self._piece_lo[piece] + mine - self._piece_starts[piece]  # indexes into the share
        run = np.searchsorted(self._run_base, share, side="right") - 1
        return self._run_lo[run] + share - self._run_base[run]


def delivery_chunks(positions: "np.ndarray | WorkerPositions", window: int, seed: str | None, start: int = 0) -> Iterator[np.ndarray]:
    """``delivery_order(positions, window, seed)[start:]`` as consecutive arrays (a window at a time:
    a window's permutation is made when it is reached)."""
    first = start // window
    for i, lo in enumerate(range(first * window, len(positions), window), first):
        chunk = positions[lo:lo + window]
        if seed is not None:
            chunk = chunk[window_permutation(len(chunk), f"{seed}:{i}")]
        yield chunk[start - lo:] if lo < start else chunk


@functools.lru_cache(maxsize=16)
def window_permutation(size: int, seed: str | None) -> np.ndarray:
    """The delivery order of a window of ``size`` positions: identity, or a seeded shuffle (read-only; kept for
    the few windows a reader's read-ahead and its delivery both walk, so each is shuffled once)."""
    order = list(range(size))
    if seed is not None:
        random.Random(seed).shuffle(order)
    permutation = np.array(order, dtype=np.int64)
    permutation.flags.writeable = False
    return permutation


def delivery_windows(positions: Sequence[int], window: int, seed: str | None) -> list[list[int]]:
    """``positions`` cut into windows of ``window``, each in delivery order (seed None: unshuffled).
    Window ``i``'s permutation is seeded by ``f"{seed}:{i}"``."""
    out = []
    for i, lo in enumerate(range(0, len(positions), window)):
        chunk = positions[lo:lo + window]
        perm = window_permutation(len(chunk), None if seed is None else f"{seed}:{i}")
        out.append([chunk[j] for j in perm])
    return out


def delivery_order(positions: Sequence[int], window: int, seed: str | None) -> list[int]:
    """All of ``positions`` in the order the worker delivers them."""
    return [p for chunk in delivery_windows(positions, window, seed) for p in chunk]
