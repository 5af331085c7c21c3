"""Weighted mixtures of readers: ``Mixture([(dataset, weight), ...], seed=...)``, an IterableDataset.

A seeded generator draws the source of each sample, then that source yields its next sample.
Draws come in blocks of ``BLOCK``: block ``b`` holds each source ``i`` as many times as keeps its
running count within one draw of ``weight_i * BLOCK * (b + 1)`` (largest remainder, with the
fractions carried from block to block), in an order shuffled by (seed, epoch, rank, worker, b).
So the proportions after any number of samples are within about ``BLOCK / 2`` draws of the
weights (0.5% over 10,000), on every rank and in every worker alike, while the order within a
block stays random.

Sources compose by the readers' shared protocol, not by format:

- a map-style source (``LmdbImageDataset``, ``DocumentDataset``, ``PackedTokenDataset``,
  ``VideoClipDataset``) is read in a seeded order per (epoch, pass), every (rank, worker) taking
  its own ``slot::slots`` share: disjoint across ranks and workers;
- an iterable source (``ImageShardDataset``) splits itself across ranks and workers (give it the
  same rank and world size); the mixture calls its ``set_epoch``, ``state_dict`` and
  ``load_state_dict``, and, for a source it has not drawn from yet in this pass, ``start_state`` where
  the source has it (a reader's ``state_dict`` is its last iterator's place, also once that ended).

When a source runs out (``exhausted``): ``"stop"`` (the default) ends the epoch at the first draw
of an exhausted source, so the proportions hold to the end; ``"repeat"`` starts that source over
(its next pass: a new seeded order for map-style sources, a new iteration of an iterable one) and
needs ``samples`` (the epoch's length across all ranks and workers). ``samples`` also caps a
``"stop"`` epoch.

Equal steps: every (rank, worker) draws as many samples as worker ``worker`` of every other rank.
With ``samples``, each draws ``ceil(samples / (ranks * workers))``. With ``"stop"``, the draws
(a pure function of seed, epoch, rank, worker) and the sources' lengths per (rank, worker) say in
advance where each rank's worker would first draw an exhausted source; all ranks stop at the
earliest of these points (``stop_point``). So every rank yields as many batches and DDP never waits
on a rank with one step more. (An iterable source needs ``worker_length(rank, worker, workers)``
for this, as ``ImageShardDataset`` has; without it a rank stops at its own first exhausted draw.)

State (``state_dict``; inside a DataLoader worker, that worker's): the epoch of the iterator it
describes, how many draws this
iterator made, and each source's state (pass and
position and dataset identity, or the iterable source's own state). ``load_state_dict`` makes the
next ``__iter__`` continue exactly there, re-reading nothing, on the versions the sources' states
were taken on (re-opened while kept, else refused). ``set_epoch`` before or after the load:
``sample_order.continued_epoch``.
"""

from __future__ import annotations

import math
from typing import Any, Iterator, Sequence

import numpy as np
import torch
from torch.utils.data import IterableDataset, get_worker_info

from pipelines.dataset_identity import follow_version, resolve
from pipelines.sample_order import checked_count, continued_epoch
from pipelines.sampler_resume import STATE_VERSION, check_state

BLOCK = 100
EXHAUSTED_RULES = ("stop", "repeat")


def _round9(value: float) -> float:
    """``np.round(value, 9)`` of one float, bit for bit (numpy scales, rounds half to even, scales back)."""
    return round(value * 1e9) / 1e9


class CountsTable:
    """``block_counts``'s rows, grown as blocks are reached: each new row goes on from the carried remainders
    (the table was computed again from its first row at every doubling, 1.3 s of a 1M-sample mixture's start),
    row by row in plain floats with numpy's rounding (a row of numpy calls cost ~9 us for two sources)."""

    def __init__(self, weights: Sequence[float], block: int = BLOCK) -> None:
        self._share = [float(x) for x in np.round(np.asarray(weights, dtype=np.float64) / float(sum(weights)) * block, 9)]
        self._carried = [0.0] * len(self._share)
        self._block = block
        self._rows: list[list[int]] = []
        self.table = np.zeros((0, len(self._share)), dtype=np.int64)

    def grow(self, blocks: int) -> np.ndarray:
        """The table with at least ``blocks`` rows."""
        if blocks <= len(self._rows):
            return self.table
        share, carried, block, order = self._share, self._carried, self._block, range(len(self._share))
        for _ in range(blocks - len(self._rows)):
            targets = [_round9(s + c) for s, c in zip(share, carried)]
            counts = [math.floor(t) for t in targets]
            left = block - sum(counts)
            if left:  # the largest remainders, ties in source order (numpy's stable argsort of -remainder)
                for i in sorted(order, key=lambda i: counts[i] - targets[i])[:left]:
                    counts[i] += 1
            carried = [_round9(c + s - n) for c, s, n in zip(carried, share, counts)]
            self._rows.append(counts)
        self._carried = carried
        self.table = np.array(self._rows, dtype=np.int64)
        return self.table


def block_counts(weights: Sequence[float], blocks: int, block: int = BLOCK) -> np.ndarray:
    """Draws of each source in each of the first ``blocks`` blocks (shape [blocks, sources]): the
    running counts track ``weight * block * (b + 1)`` within one draw. Shares are rounded to 1e-9 draws, so
    that weights normalized another way (or summed in another order) give the same table: a tie of
    remainders is a tie, broken by source order, not by the last bit of a float."""
    return CountsTable(weights, block).grow(blocks)[:blocks]


def _slot() -> tuple[int, int]:
    info = get_worker_info()
    return (info.id, info.num_workers) if info is not None else (0, 1)


def _resolve_rank(rank: int | None, world_size: int | None) -> tuple[int, int]:
    from pipelines.torch_webdataset import resolve_rank

    return resolve_rank(rank, world_size)


def _is_iterable(source) -> bool:
    return isinstance(source, IterableDataset)


def _meaning(source) -> tuple[str, object] | None:
    """What a source's labels or ids mean: ("classes", its class map), ("tokenizer", its sha256), or None
    (a source that is no repack reader, or an unlabeled one)."""
    classes = getattr(source, "classes", None)
    if isinstance(classes, dict) and classes:
        return "classes", classes
    tokenizer = getattr(getattr(source, "data", None), "tokenizer_sha256", None)
    return ("tokenizer", tokenizer) if isinstance(tokenizer, str) else None


def refuse_disagreeing(sources: Sequence, rank: int, world_size: int, per_source_labels: bool) -> None:
    """Refuse sources that would mix silently wrong: an iterable source split for another rank or world size
    than the mixture's (its samples read on every rank), and, unless each source's labels are its own
    (``per_source_labels``), class maps that give one class two indices or one index two classes, or token
    ids of other tokenizers."""
    for i, source in enumerate(sources):
        split = (getattr(source, "rank", None), getattr(source, "world_size", None))
        if not _is_iterable(source) and isinstance(split[1], int) and split[1] > 1:
            raise ValueError(f"Mixture source {i} ({type(source).__name__}) splits itself into {split[1]} parts: the "
                             "mixture splits a map-style source by rank and worker itself (each rank would draw from a "
                             "fraction of its share); build it with rank=0, world_size=1 (shard_id=0, num_shards=1)")
        if _is_iterable(source) and None not in split and split != (rank, world_size):
            raise ValueError(f"Mixture source {i} ({type(source).__name__}) reads rank {split[0]} of {split[1]}, the "
                             f"mixture rank {rank} of {world_size}: build it with rank={rank}, "
                             f"world_size={world_size} (an iterable source splits itself)")
    if per_source_labels:
        return
    meanings = [(i, _meaning(source)) for i, source in enumerate(sources)]
    meanings = [(i, m) for i, m in meanings if m is not None]
    names: dict[str, tuple[int, int]] = {}
    indices: dict[int, tuple[int, str]] = {}
    for i, (kind, meaning) in meanings:
        if kind == "tokenizer":
            first = next(((j, m) for j, (k, m) in meanings if k == "tokenizer"), None)
            if first is not None and first[1] != meaning:
                raise ValueError(f"Mixture sources {first[0]} and {i} were tokenized with other tokenizers (sha256 "
                                 f"{first[1][:12]}... and {meaning[:12]}...): one id would mean two tokens; "
                                 "pass per_source_labels=True and tag_source=True to map them per source")
            continue
        for name, index in meaning.items():
            held_index, held_name = names.setdefault(name, (index, i)), indices.setdefault(index, (i, name))
            if held_index[0] != index or held_name[1] != name:
                j = held_index[1] if held_index[0] != index else held_name[0]
                raise ValueError(f"Mixture sources {j} and {i} label otherwise: class {name!r} is {index} in "
                                 f"source {i}, and in source {j} " + (f"is {held_index[0]}" if held_index[0] != index
                                                                      else f"{index} is {held_name[1]!r}") +
                                 "; pass per_source_labels=True and tag_source=True to map each source's labels "
                                 "yourself")


ORDER_OPTIONS = ("shuffle", "exhausted", "samples", "weights")  # what shapes the draws: a state of others is refused


class _Cursor:
    """One source's place inside one (rank, worker) iterator."""

    def __init__(self, mixture: "Mixture", index: int, state: dict | None) -> None:
        self.mixture, self.index, self.source = mixture, index, mixture.sources[index]
        self.pass_ = int(state["pass"]) if state else 0
        self.position = int(state.get("position", 0)) if state else 0
        self.iterable = _is_iterable(self.source)
        self.restored = state.get("state") if state else None
        self._iter: Iterator | None = None
        self._order: np.ndarray | None = None  # this worker's share of the pass, a column

    def _start(self) -> None:
        if self.iterable:
            if self.restored is not None:
                self.source.load_state_dict(self.restored)
                self.restored = None
            self._iter = iter(self.source)
        else:
            m = self.mixture
            n = len(self.source)
            order = (np.random.default_rng([m.seed, m.epoch, self.index, self.pass_]).permutation(n)
                     if m.shuffle else np.arange(n))
            self._order = order[m.slot_id::m.slots].copy()  # the share alone: the whole order is freed

    def next(self) -> tuple[bool, Any]:
        """(True, sample), or (False, None) when this pass is over."""
        order = self._order
        if order is not None:
            if self.position < len(order):
                self.position += 1
                return True, self.source[int(order[self.position - 1])]
            return False, None
        if self._iter is None:
            self._start()
            return self.next()
        try:
            sample = next(self._iter)
        except StopIteration:
            return False, None
        self.position += 1
        return True, sample

    def restart(self) -> None:
        self.pass_, self.position, self._iter, self._order = self.pass_ + 1, 0, None, None

    def settle(self) -> None:
        """At the end of the pass (or its iterator's close): an iterable source's state that
        ``Mixture.load_state_dict`` loaded and this pass never drew from is taken off the source (its next
        iterator would have continued from it); this cursor still reports it (``state``)."""
        if self.iterable and self.restored is not None and self._iter is None:
            self.source.load_state_dict(self.restored)
            iter(self.source)  # an iterator takes the loaded state when it is made (reads nothing yet)

    def state(self) -> dict:
        out = {"kind": type(self.source).__name__, "pass": self.pass_, "position": self.position}
        if not self.iterable:
            out.update(_map_identity(self.source))
        if self.iterable:  # a source not drawn yet in this pass: its fresh state, which names its dataset version
            if self._iter is None:
                out["state"] = self.restored if self.restored is not None else _fresh_state(self.source)
            else:
                out["state"] = self.source.state_dict()
        return out


def _map_identity(source) -> dict:
    """What a map-style source's saved position means: its length (its order is a permutation of it) and, for a
    repack reader, its dataset's identity and version and what decides the item an index names
    (``order_options()``: a token reader's ``seq_len``, a clip reader's clip length and step)."""
    options = _order_options(source)
    return {"length": len(source), **({"dataset": dict(source.dataset)} if hasattr(source, "dataset") else {}),
            **({"options": options} if options is not None else {})}


def _order_options(source) -> dict | None:
    """A map-style source's ``order_options()`` (what decides the item index i names), None without one."""
    options = getattr(source, "order_options", None)
    return options() if options is not None else None


def _fresh_state(source) -> dict | None:
    """The state of an iterable source not drawn from yet in this pass: its ``start_state()`` where it has one (a
    reader's ``state_dict()`` is its last iterator's place, also once that ended), else its ``state_dict()``
    (None without either)."""
    saver = getattr(source, "start_state", None) or getattr(source, "state_dict", None)
    return saver() if saver is not None else None


class Mixture(IterableDataset):
    """Samples of several readers mixed by weight (see the module docstring for the rules).

    Args:
        sources: ``[(dataset, weight), ...]``; weights positive (normalized here).
        seed: seeds the draws and the map-style sources' orders (with the epoch).
        exhausted: ``"stop"`` (default) or ``"repeat"`` (needs ``samples``).
        samples: samples per epoch across all ranks and workers (None: until a source runs out).
        tag_source: yield ``(source index, sample)`` instead of the sample.
        shuffle: False reads map-style sources in index order (the draws stay seeded).
        rank, world_size: this process's share; default: torch.distributed, else 0 of 1.
        per_source_labels: sources whose class maps or tokenizers disagree are mixed (each sample's label
            or ids mean what its own dataset says; needs ``tag_source``); default: refused.
    """

    def __init__(self, sources: Sequence[tuple[Any, float]], *, seed: int = 0, exhausted: str = "stop",
                 samples: int | None = None, tag_source: bool = False, shuffle: bool = True,
                 rank: int | None = None, world_size: int | None = None, per_source_labels: bool = False) -> None:
        if not sources:
            raise ValueError("a Mixture needs at least one (dataset, weight) source")
        weights = [float(w) for _, w in sources]
        if any(not math.isfinite(w) or w <= 0 for w in weights):
            raise ValueError(f"mixture weights must be positive and finite, got {weights}")
        if exhausted not in EXHAUSTED_RULES:
            raise ValueError(f"exhausted must be one of {EXHAUSTED_RULES}, not {exhausted!r}")
        if exhausted == "repeat" and samples is None:
            raise ValueError("exhausted='repeat' needs samples= (the epoch's length): repeating sources never end")
        batching = [type(s).__name__ for s, _ in sources if getattr(s, "yields_batches", False)]
        if batching:
            raise ValueError(f"a Mixture draws one sample at a time: build {', '.join(batching)} without "
                             "batch_size= and batch the mixture (DataLoader(mixture, batch_size=B))")
        self.sources = [s for s, _ in sources]
        self.rank, self.world_size = _resolve_rank(rank, world_size)
        if per_source_labels and not tag_source:
            raise ValueError("per_source_labels=True needs tag_source=True: a label means its source's class")
        refuse_disagreeing(self.sources, self.rank, self.world_size, per_source_labels)
        self.weights = [w / sum(weights) for w in weights]
        self._counts = CountsTable(self.weights)  # grown as blocks are reached: one table whatever the history
        self.seed, self.exhausted, self.samples, self.tag_source, self.shuffle = \
            seed, exhausted, samples, tag_source, shuffle
        self._epoch = torch.zeros((), dtype=torch.int64).share_memory_()  # reaches persistent workers
        self._epoch_chosen = torch.zeros((), dtype=torch.bool).share_memory_()
        self._pending: dict | None = None
        self._live: list | None = None  # [draws made, cursors, epoch] of the iterator running in this process

    # -- epoch, slots, draws ----------------------------------------------------------------------
    @property
    def epoch(self) -> int:
        return int(self._epoch.item())

    def set_epoch(self, epoch: int) -> None:
        """Select the draws and orders of ``epoch``; iterable sources get it too."""
        self._epoch.fill_(int(epoch))
        self._epoch_chosen.fill_(True)
        for source in self.sources:
            if _is_iterable(source) and hasattr(source, "set_epoch"):
                source.set_epoch(epoch)

    @property
    def chosen_epoch(self) -> int | None:
        """The epoch ``set_epoch`` chose (None: none yet)."""
        return self.epoch if bool(self._epoch_chosen) else None

    @property
    def slots(self) -> int:
        return self.world_size * _slot()[1]

    @property
    def slot_id(self) -> int:
        worker, _ = _slot()
        return self.rank + self.world_size * worker

    def counts(self, block: int) -> np.ndarray:
        """Draws of each source in block ``block`` (the table grows as blocks are reached)."""
        table = self._counts.table
        if block >= len(table):
            table = self._counts.grow(max(block + 1, 2 * len(table)))
        return table[block]

    def draws(self, block: int) -> np.ndarray:
        """The source of each draw of block ``block`` of this (rank, worker) in this epoch."""
        return self._draws(self.rank, _slot()[0], block)

    def _draws(self, rank: int, worker: int, block: int) -> np.ndarray:
        picks = np.repeat(np.arange(len(self.sources)), self.counts(block))
        return np.random.default_rng([self.seed, self.epoch, rank, worker, block]).permutation(picks)

    def slot_samples(self) -> int | None:
        """How many samples this (rank, worker) yields this epoch at most (None: until exhausted):
        the same for worker ``w`` of every rank (equal steps)."""
        worker, workers = _slot()
        limits = [limit for limit in (self._samples_limit(workers), self._stop_limit(worker, workers))
                  if limit is not None]
        return min(limits) if limits else None

    def _samples_limit(self, workers: int) -> int | None:
        return None if self.samples is None else -(-self.samples // (self.world_size * workers))

    def _source_length(self, source, rank: int, worker: int, workers: int) -> int | None:
        """Samples ``source`` holds for (rank, worker) in one pass (None: unknown)."""
        if _is_iterable(source):
            length = getattr(source, "worker_length", None)
            return None if length is None else int(length(rank, worker, workers))
        slots, slot = self.world_size * workers, rank + self.world_size * worker
        return len(range(slot, len(source), slots))

    def stop_point(self, rank: int, worker: int, workers: int) -> int | None:
        """With ``exhausted="stop"``: how many draws (rank, worker) makes before its first draw of an
        exhausted source this epoch (None: a source's length is unknown)."""
        lengths = [self._source_length(s, rank, worker, workers) for s in self.sources]
        if None in lengths:
            return None
        lengths = np.asarray(lengths)
        # the first block in which some source runs out: its running count passes its length (a source's count after
        # block b is within one draw of weight * BLOCK * (b + 1): the first guess is at most a block short)
        blocks = max(1, len(self._counts.table), int(np.min((lengths + 1) / (np.asarray(self.weights) * BLOCK))) + 2)
        while True:
            table = self._counts.grow(blocks)
            over = np.flatnonzero((np.cumsum(table, axis=0) > lengths).any(axis=1))
            if len(over):
                break
            blocks *= 2
        block = int(over[0])
        seen = table[:block].sum(axis=0)
        for i, pick in enumerate(self._draws(rank, worker, block).tolist()):  # the draw that finds it empty
            if seen[pick] == lengths[pick]:
                return block * BLOCK + i
            seen[pick] += 1
        raise AssertionError("a block whose counts pass a length draws that source empty")

    def _stop_limit(self, worker: int, workers: int) -> int | None:
        if self.exhausted != "stop":
            return None
        points = [self.stop_point(rank, worker, workers) for rank in range(self.world_size)]
        return None if None in points else min(points)

    # -- the protocol --------------------------------------------------------------------------------
    def state_dict(self) -> dict:
        """How far the iterator running in this process got (epoch, draws, each source's state)."""
        worker, workers = _slot()
        epoch = self.epoch
        if self._live is not None:  # its own epoch: a persistent worker's new epoch may not have started yet
            drawn, cursors, epoch = self._live
            sources = [c.state() for c in cursors]
        elif self._pending is not None:
            return dict(self._pending)
        else:
            drawn, sources = 0, [{"kind": type(s).__name__, "pass": 0, "position": 0, **(
                {"state": _fresh_state(s)} if _is_iterable(s) else _map_identity(s))} for s in self.sources]
        return {"kind": "Mixture", "version": STATE_VERSION, "epoch": epoch, "seed": self.seed,
                "slot": [self.rank, self.world_size, worker, workers], "drawn": drawn, "sources": sources,
                **{name: getattr(self, name) for name in ORDER_OPTIONS}}

    def load_state_dict(self, state: dict) -> None:
        """Make the next ``__iter__`` in this process continue from ``state``."""
        check_state(state, "Mixture")
        if state["seed"] != self.seed or len(state["sources"]) != len(self.sources):
            raise ValueError(f"Mixture state of seed {state['seed']} with {len(state['sources'])} sources loaded "
                             f"into a mixture of seed {self.seed} with {len(self.sources)}")
        differs = [f"{name}: saved {state[name]!r}, now {getattr(self, name)!r}" for name in ORDER_OPTIONS
                   if name in state and state[name] != getattr(self, name)]  # states of older readers lack them
        if differs:
            raise ValueError("Mixture state of another order loaded (" + "; ".join(differs) + "): it would read "
                             "some samples twice and others never")
        checked_count(state.get("drawn"), "Mixture state's drawn")
        checked_count(state.get("epoch"), "Mixture state's epoch")
        for i, (saved, source) in enumerate(zip(state["sources"], self.sources)):  # checks that change nothing
            checked_count(saved.get("pass"), f"Mixture source {i}'s pass")
            checked_count(saved.get("position"), f"Mixture source {i}'s position")  # bounded on the state's version
            if saved["kind"] != type(source).__name__:
                raise ValueError(f"Mixture source {i} was a {saved['kind']}, is a {type(source).__name__}")
            if _is_iterable(source) and saved["position"] and saved.get("state") is None:
                raise ValueError(f"Mixture source {i} ({saved['kind']}) has no state_dict(): it cannot resume exactly")
            options = None if _is_iterable(source) else _order_options(source)
            if isinstance(saved.get("options"), dict) and options is not None:  # a state of an older reader names
                options = {key: options.get(key) for key in saved["options"]}  # fewer: those are compared
            if saved.get("options") is not None and options is not None and saved["options"] != options:
                raise ValueError(f"Mixture source {i} ({saved['kind']}) was read with {saved['options']}, is built "
                                 f"with {options}: index i names another item, so resuming would read some "
                                 "samples twice and others never")
        undo: list = []  # a refused state leaves every source as it was (a caller that starts fresh reads that)
        try:
            for i, (saved, source) in enumerate(zip(state["sources"], self.sources)):
                self._load_source(i, saved, source, undo)
        except ValueError:
            for step in reversed(undo):
                step()
            raise
        if not bool(self._epoch_chosen):
            self._epoch.fill_(int(state["epoch"]))
            for source in self.sources:  # one not drawn yet when the state was taken reads the state's epoch too,
                if _is_iterable(source) and hasattr(source, "set_epoch"):  # as ``set_epoch`` had given it then
                    source.set_epoch(int(state["epoch"]))
        self._pending, self._live = dict(state), None

    def follow_state(self, state: dict):
        """Open each source's dataset version its part of ``state`` was taken on, as the DataLoader's workers do when
        they load it: the workers the next epoch starts (without persistent workers) are copies of this process's
        sources, which would read the latest versions (``pipelines.stateful_loader`` calls this). Returns what
        re-opens the versions they were on (a source refusing its version puts the others back first)."""
        undo: list = []

        def restore() -> None:
            for step in reversed(undo):
                step()

        try:
            for i, (saved, source) in enumerate(zip(state.get("sources") or [], self.sources)):
                if not isinstance(saved, dict):
                    continue
                step = None
                if not _is_iterable(source):
                    if hasattr(source, "dataset") and hasattr(source, "use_version"):
                        step = follow_version(saved.get("dataset"), source.dataset, str(source.root),
                                              f"Mixture source {i}", source.use_version)
                elif isinstance(saved.get("state"), dict) and hasattr(source, "follow_state"):
                    step = source.follow_state(saved["state"])
                if callable(step):
                    undo.append(step)
        except ValueError:
            restore()
            raise
        return restore if undo else None

    @staticmethod
    def _load_source(i: int, saved: dict, source, undo: list) -> None:
        """Source ``i`` put where ``saved`` (its part of a Mixture state) says, and how to put it back on ``undo``:
        a map-style one re-opened on the state's dataset version (its length checked there), an iterable one
        given its state now, not when first drawn: that re-opens the state's version, whose lengths the epoch's
        stop point (``slot_samples``) is computed from before any draw."""
        if not _is_iterable(source):
            if hasattr(source, "dataset"):
                version = resolve(saved.get("dataset"), source.dataset, str(source.root), f"Mixture source {i}")
                if version is not None:
                    built = source.dataset.get("version")
                    source.use_version(version)
                    undo.append(lambda: source.use_version(built))
            if saved.get("length") is not None and saved["length"] != len(source):  # states of older readers
                raise ValueError(f"Mixture source {i} ({saved['kind']}) had {saved['length']} samples when the "
                                 f"state was saved and has {len(source)} now (built with other options, e.g. "
                                 "seq_len, or another dataset): its order differs, so resuming would read some "
                                 "samples twice and others never")
            checked_count(saved["position"], f"Mixture source {i}'s position", len(source))
        elif saved.get("state") is not None:
            restorer = getattr(source, "restorer", None)  # a repack reader puts itself back exactly
            if restorer is not None:
                restore = restorer()
            else:  # another iterable: its fresh state loaded again
                fresh = _fresh_state(source)
                restore = (lambda: source.load_state_dict(fresh)) if fresh is not None else (lambda: None)
            source.load_state_dict(saved["state"])
            undo.append(restore)

    def __iter__(self) -> Iterator[Any]:
        state, self._pending = self._pending, None
        worker, workers = _slot()
        if state is not None and state["slot"] != [self.rank, self.world_size, worker, workers]:
            raise ValueError(f"Mixture state of (rank, world, worker, workers) {state['slot']} loaded into "
                             f"{[self.rank, self.world_size, worker, workers]}")
        if state is not None:
            _, keep = continued_epoch(int(state["epoch"]), self.chosen_epoch)
            state = state if keep else None  # the next epoch, from its start
        cursors = [_Cursor(self, i, state["sources"][i] if state else None) for i in range(len(self.sources))]
        drawn = int(state["drawn"]) if state else 0
        limit = self.slot_samples()
        limit = 1 << 62 if limit is None else limit
        self._live = [drawn, cursors, self.epoch]
        live, tag, stop = self._live, self.tag_source, self.exhausted == "stop"
        try:
            while drawn < limit:
                block_no, offset = divmod(drawn, BLOCK)
                picks = self.draws(block_no)[offset:offset + min(BLOCK, limit - drawn)].tolist()
                for pick in picks:
                    cursor = cursors[pick]
                    ok, sample = cursor.next()
                    if not ok:
                        if stop:
                            return
                        cursor.restart()
                        ok, sample = cursor.next()
                        if not ok:
                            raise ValueError(f"Mixture source {cursor.index} ({type(cursor.source).__name__}) has "
                                             f"no samples for rank {self.rank} worker {worker}: it cannot repeat")
                    drawn += 1
                    live[0] = drawn
                    yield (pick, sample) if tag else sample
        finally:
            for cursor in cursors:
                cursor.settle()
