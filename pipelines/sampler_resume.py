"""Exact and elastic resume for map-style readers: a global epoch order and the rule that splits
what remains of it among ranks.

An epoch's *global order* is a list of ``size`` positions (sample indices, or batch numbers for a
batch sampler) that depends only on (seed, epoch): never on the world size or the worker count.
A world of W ranks hands rank r the positions ``C[r::W]`` of the current list C (the whole order
at the start of an epoch), C first padded to a multiple of W with its own first positions (repeats:
every rank the same count, so DDP the same steps; ``equal`` cuts C to a multiple of W instead). A rank's state records how many of its positions it delivered; the
states of the N ranks of a checkpoint together say exactly which positions were consumed, and
``elastic_state`` folds them into a *stage* ``{"world_size": N, "yielded": [k_0, ..., k_N-1]}``.
A rank of any new world M then takes ``R[r::M]`` of the remaining list R (the order minus the
consumed positions, order kept): together the M ranks deliver every remaining position exactly
once. Stages chain (N -> M -> K within one epoch); the next epoch is a plain M-rank epoch.

States are plain JSON (``json.dumps`` round-trips them): ``{"kind", "version": 1, "dataset",
"epoch", "seed", "size", "rank", "world_size", "history": [stage, ...], "yielded"}``;
``dataset`` is the identity (``pipelines.dataset_identity``) of the dataset the sampler was given
(``dataset=``), else None. A loader state taken between snapshots (``snapshot_every_n_steps`` > 1)
is advanced by its steps since the snapshot (``loader_sampler_state``).
"""

from __future__ import annotations

from typing import Callable, Iterator, Sequence

import numpy as np
from torch.utils.data import Sampler

from pipelines.dataset_identity import follow_version, on_version, resolve
from pipelines.sample_order import checked_count, continued_epoch

STATE_VERSION = 1
ITERATE_BLOCK = 4096  # positions turned into Python ints at a time while a sampler hands them out


def global_order(size: int, seed: int, epoch: int, shuffle: bool = True) -> np.ndarray:
    """The epoch's order of ``range(size)``: a permutation seeded by (seed, epoch), or ``arange``."""
    return np.random.default_rng([seed, epoch]).permutation(size) if shuffle else np.arange(size)


def rank_slots(n: int, rank: int, world_size: int, equal: bool = False) -> np.ndarray:
    """Indices into a list of ``n`` that rank ``rank`` takes: every ``world_size``-th of the list
    padded to a multiple of ``world_size`` (an index ``>= n`` is a repeat of index ``i - n``); ``equal``
    cuts the list to a multiple instead (at most world_size - 1 left out)."""
    if equal:
        return np.arange(rank, n, world_size)[:n // world_size]
    return np.arange(rank, -(-n // world_size) * world_size if n else 0, world_size)


def rank_share(current: np.ndarray, rank: int, world_size: int, equal: bool = False) -> np.ndarray:
    """Rank ``rank``'s positions of ``current`` (``rank_slots``): the same count on every rank."""
    slots = rank_slots(len(current), rank, world_size, equal)
    return current[slots % len(current)] if len(current) else current[:0]


def padding(n: int, rank: int, world_size: int, equal: bool = False) -> int:
    """How many of rank ``rank``'s positions of a list of ``n`` are repeats (at its share's end: 0 or 1)."""
    return int(np.sum(rank_slots(n, rank, world_size, equal) >= n))


def remaining(order: np.ndarray, history: Sequence[dict], equal: bool = False) -> np.ndarray:
    """What is left of ``order`` after the stages of ``history`` (each: world_size, yielded per rank);
    repeats a rank delivered are not counted as delivered samples."""
    current = order
    for stage in history:
        world, yielded = int(stage["world_size"]), [int(k) for k in stage["yielded"]]
        consumed = np.zeros(len(current), dtype=bool)
        for rank, count in enumerate(yielded):
            slots = rank_slots(len(current), rank, world, equal)
            if count > len(slots):
                raise ValueError(f"rank {rank} of {world} claims {count} samples of its {len(slots)}")
            taken = slots[:count]
            consumed[taken[taken < len(current)]] = True
        current = current[~consumed]
    return current


def check_state(state: dict, kind: str) -> dict:
    """``state`` if it is a version-1 state of ``kind``; else a ValueError naming what differs."""
    if not isinstance(state, dict) or state.get("kind") != kind or state.get("version") != STATE_VERSION:
        got = (state.get("kind"), state.get("version")) if isinstance(state, dict) else type(state).__name__
        raise ValueError(f"not a {kind} state of version {STATE_VERSION}: {got}")
    return state


def elastic_state(states: Sequence[dict]) -> dict:
    """Fold the states of all N ranks of a checkpoint (one per rank, any order) into the one state
    every rank of the new world loads: the remaining positions of the epoch, split by the new ranks."""
    if not states:
        raise ValueError("no states to resume from")
    first = states[0]
    world = int(first["world_size"])
    by_rank = {int(s["rank"]): s for s in states}
    if sorted(by_rank) != list(range(world)) or len(states) != world:
        raise ValueError(f"need one state per rank of {world}, got ranks {sorted(int(s['rank']) for s in states)}")
    for s in states:
        for key in ("kind", "version", "dataset", "epoch", "seed", "size", "order", "history", "world_size"):
            if s.get(key) != first.get(key):
                raise ValueError(f"rank {s['rank']}'s state differs from rank {first['rank']}'s in {key!r}")
    stage = {"world_size": world, "yielded": [int(by_rank[r]["yielded"]) for r in range(world)]}
    return {**first, "rank": None, "world_size": None, "history": [*first["history"], stage], "yielded": 0}


class OrderPosition:
    """Where a rank is in its share of an epoch's global order: the bookkeeping that
    ``ResumableSampler`` and ``LengthGroupedBatchSampler`` share. ``dataset``: the reader whose
    positions these are (None: unknown); a state of another version of it re-opens that version
    (``use_version``) or is refused. ``order()``: the sampler's options that make its order besides the
    seed and size (shuffle, drop_last, batch size...), saved in the state and compared when one is loaded."""

    def __init__(self, kind: str, size: int, seed: int, rank: int, world_size: int, equal: bool,
                 dataset=None, order: Callable[[], dict] = dict) -> None:
        if world_size < 1 or not 0 <= rank < world_size:
            raise ValueError(f"rank {rank} is not in a world of {world_size}")
        self.kind, self.size, self.seed, self.rank, self.world_size, self.equal = kind, size, seed, rank, world_size, equal
        self.dataset = dataset
        self._sized_on = self._identity()  # the dataset version ``size`` counts
        self.order = order
        self.epoch = 0
        self.chosen: int | None = None  # the epoch set_epoch chose, if any
        self.history: list[dict] = []
        self.yielded = 0
        self._resume_at = 0
        self._finished = False
        self._loaded = False  # a state is loaded and no pass has begun since

    def set_epoch(self, epoch: int) -> None:
        """Choose ``epoch``; after a load, ``sample_order.continued_epoch`` decides what is kept."""
        epoch = int(epoch)
        self.chosen = epoch
        if self._loaded and continued_epoch(self.epoch, epoch)[1]:
            return
        if epoch != self.epoch:
            self.epoch, self.history, self.yielded, self._resume_at, self._finished = epoch, [], 0, 0, False
            self._loaded = False

    def key(self) -> tuple:
        """What this rank's share depends on besides the order: (epoch, history)."""
        return self.epoch, tuple((int(s["world_size"]), tuple(s["yielded"])) for s in self.history)

    def share(self, order: np.ndarray) -> np.ndarray:
        """This rank's positions of ``order`` (the epoch's global order) after the history."""
        return rank_share(remaining(order, self.history, self.equal), self.rank, self.world_size, self.equal)

    def padding(self) -> int:
        """Repeats at the end of this rank's share (0 or 1)."""
        return padding(len(remaining(np.arange(self.size), self.history, self.equal)), self.rank, self.world_size,
                       self.equal)

    def begin(self) -> int:
        """Start a pass over this rank's share; returns where it starts. After a finished pass the
        history and the count are cleared first (the next pass is a plain epoch)."""
        if self._finished:
            self.history, self.yielded, self._resume_at, self._finished = [], 0, 0, False
        self._loaded = False
        start, self._resume_at = self._resume_at, 0
        self.yielded = start
        return start

    def iterate(self, share: np.ndarray, start: int) -> Iterator[int]:
        """The positions of ``share`` from ``start`` on, counting each one handed out. A finished pass
        keeps its count (a rank done before a checkpoint consumed its whole share)."""
        for block in range(start, len(share), ITERATE_BLOCK):  # a block of Python ints at a time, not the share
            for position in share[block:block + ITERATE_BLOCK].tolist():
                self.yielded += 1
                yield position
        self._finished = True

    def state_dict(self) -> dict:
        return {"kind": self.kind, "version": STATE_VERSION, "dataset": self._identity(), "epoch": self.epoch,
                "seed": self.seed, "size": self.size, "order": self.order(), "rank": self.rank,
                "world_size": self.world_size, "history": [dict(s, yielded=list(s["yielded"])) for s in self.history],
                "yielded": self.yielded}

    def _identity(self) -> dict | None:
        return dict(self.dataset.dataset) if self.dataset is not None else None

    def load_state_dict(self, state: dict, resize=None) -> None:
        """Continue from ``state``; ``resize()`` gives the size after the dataset re-opened another version."""
        check_state(state, self.kind)
        version, mine = None, {}
        if self.dataset is not None:
            mine = dict(self.dataset.dataset)
            version = resolve(state.get("dataset"), self.dataset.dataset, self.dataset.root, self.kind)
        elif state.get("dataset") is not None:
            raise ValueError(f"this {self.kind} state was taken on version {state['dataset']['version']} of its "
                             f"dataset; build the sampler with dataset= so it checks (and re-opens) that version")

        def resized() -> None:
            self.size = resize() if resize is not None else len(self.dataset)
            self._sized_on = self._identity()

        def reopen(number: int) -> None:
            self.dataset.use_version(number)
            resized()

        sized = self.size, self._sized_on
        if version is None and self.dataset is not None and mine != self._sized_on:
            resized()  # the reader is on the state's version already, moved there after this sampler counted it (a
            # loader with workers re-opens it in this process when it loads the state: ``follow_state``)
        try:
            with on_version(reopen, mine, version):
                self._check_loaded(state)
        except ValueError:
            self.size, self._sized_on = sized  # refused: the count of the version the loader puts the reader back on
            raise
        self.epoch = int(state["epoch"])
        self.history = [dict(s) for s in state["history"]]
        self.yielded = self._resume_at = int(state["yielded"])
        self._finished = False
        self._loaded = True
        if self.chosen is not None:  # set_epoch came first (a StatefulDataLoader loads when it starts)
            self.set_epoch(self.chosen)

    def _check_loaded(self, state: dict) -> None:
        """ValueError unless ``state`` is of this sampler's seed, size, ordering options, rank and world size."""
        for key, mine in (("seed", self.seed), ("size", self.size)):
            if int(state[key]) != mine:
                raise ValueError(f"{self.kind} state was saved with {key} {state[key]}, this one has {mine}")
        saved = state.get("order")  # (a state saved by an older repack has none: seed and size decide)
        if isinstance(saved, dict):
            for key, mine in self.order().items():
                if saved.get(key) != mine:
                    raise ValueError(f"{self.kind} state was saved with {key} {saved.get(key)!r}, this one has "
                                     f"{mine!r}: build it with the saved options to resume")
        if state["world_size"] is not None and (state["rank"], state["world_size"]) != (self.rank, self.world_size):
            raise ValueError(f"{self.kind} state of rank {state['rank']} of {state['world_size']} loaded into rank "
                             f"{self.rank} of {self.world_size}: fold the ranks' states with elastic_state() first")
        self._check_counts(state)

    def _check_counts(self, state: dict) -> None:
        """ValueError naming a count of ``state`` that no run of this sampler gives (a hand edit): the epoch, the
        history's stages (a world size, then what each rank took: at most its share) and what this rank took."""
        where = f"{self.kind} state's"
        checked_count(state.get("epoch"), f"{where} epoch")
        history = state.get("history")
        if not isinstance(history, list) or not all(isinstance(stage, dict) for stage in history):
            raise ValueError(f"{where} history {history!r} is not a list of stages")
        for stage in history:
            world = checked_count(stage.get("world_size"), f"{where} history world_size")
            taken = stage.get("yielded")
            if world < 1 or not isinstance(taken, list) or len(taken) != world:
                raise ValueError(f"{where} history stage {stage!r} is not a world size and one count per rank")
            for count in taken:
                checked_count(count, f"{where} history count")
        left = remaining(np.arange(self.size), history, self.equal)  # a rank claiming more than its share: refused
        mine = len(rank_share(left, self.rank, self.world_size, self.equal)) if state["world_size"] is not None else 0
        checked_count(state.get("yielded"), f"{where} yielded", mine)


class ResumableSampler(Sampler[int]):
    """The sampler to pass a map-style reader (``LmdbImageDataset``, ``DocumentDataset``,
    ``VideoClipDataset``, ``PackedTokenDataset(shuffle=False)``) for exact and elastic resume under
    ``torchdata.stateful_dataloader.StatefulDataLoader``: ``sampler=ResumableSampler(len(ds), ...)``.

    Rank ``rank`` of ``world_size`` reads every ``world_size``-th index of the epoch's global order
    (seeded by (seed, epoch), independent of the world size), padded with repeats of the order's
    first indices to ``ceil(size / world_size)`` on every rank (``padding`` of them: the last ones
    of the rank's share); ``drop_last`` gives every rank ``size // world_size`` indices instead. Call
    ``set_epoch`` every epoch, as with DistributedSampler. ``dataset``: the reader (its state
    identifies the dataset version; a state of another kept version re-opens it).
    """

    def __init__(self, size: int, *, shuffle: bool = True, seed: int = 0, rank: int = 0, world_size: int = 1,
                 drop_last: bool = False, dataset=None) -> None:
        if world_size > 1 and getattr(dataset, "world_size", 1) > 1:
            raise ValueError(f"ResumableSampler of rank {rank} of {world_size} over a dataset that splits by rank "
                             f"itself (world_size={dataset.world_size}): the split would apply twice and each rank "
                             "read a fraction of its share; build the dataset with rank=0, world_size=1")
        self.shuffle = shuffle
        self.position = OrderPosition(type(self).__name__, int(size), seed, rank, world_size, drop_last, dataset,
                                      lambda: {"shuffle": bool(shuffle), "drop_last": bool(drop_last)})
        self._cached: tuple[tuple, np.ndarray] | None = None

    @property
    def epoch(self) -> int:
        return self.position.epoch

    @property
    def padding(self) -> int:
        """How many of this rank's indices this epoch are repeats (the last ones; 0 or 1)."""
        return self.position.padding()

    def set_epoch(self, epoch: int) -> None:
        self.position.set_epoch(epoch)

    def indices(self) -> np.ndarray:
        """This rank's indices of the current epoch (after any resumed history), in order."""
        p = self.position
        key = (p.size, *p.key())
        if self._cached is None or self._cached[0] != key:  # len() and iter() of one epoch: one permutation
            self._cached = key, p.share(global_order(p.size, p.seed, p.epoch, self.shuffle))
        return self._cached[1]

    def __iter__(self) -> Iterator[int]:
        start = self.position.begin()
        return self.position.iterate(self.indices(), start)

    def __len__(self) -> int:
        return len(self.indices())

    def state_dict(self) -> dict:
        """Epoch, history and how many indices of this rank's share were handed out."""
        return self.position.state_dict()

    def load_state_dict(self, state: dict) -> None:
        """Continue from ``state``: this rank's own, or the fold of all ranks' (``elastic_state``)."""
        self.position.load_state_dict(state)


def loader_sampler_state(loader_state: dict, kind: str, batch_size: int | None = None) -> dict:
    """The ``kind`` sampler state in a StatefulDataLoader state, advanced by the loader's steps since
    its last snapshot (``snapshot_every_n_steps`` > 1): each step took ``batch_size`` indices (a batch
    sampler: one batch; needs ``batch_size`` for an index sampler when there were such steps)."""
    state = dict(find_state(loader_state, kind))
    steps = int(loader_state.get("_steps_since_snapshot") or 0) if isinstance(loader_state, dict) else 0
    if steps:
        per = 1 if kind == "LengthGroupedBatchSampler" else batch_size
        if not per:
            raise ValueError(f"this loader state was taken {steps} steps after its snapshot "
                             "(snapshot_every_n_steps > 1): pass batch_size= (the loader's) so they are counted")
        state["yielded"] = int(state["yielded"]) + steps * int(per)
    return state


def find_state(tree, kind: str) -> dict:
    """The first state of ``kind`` inside a loader's state (e.g. ``StatefulDataLoader.state_dict()``)."""
    if isinstance(tree, dict):
        if tree.get("kind") == kind and "version" in tree:
            return tree
        for value in tree.values():
            try:
                return find_state(value, kind)
            except LookupError:
                pass
    elif isinstance(tree, list):
        for value in tree:
            try:
                return find_state(value, kind)
            except LookupError:
                pass
    raise LookupError(f"no {kind} state in this loader state")


class MapDatasetState:
    """The state of a map-style reader: which dataset it reads (its kind, version identity and size)
    and the epoch (order comes from the sampler: ``ResumableSampler``). Readers mix this in and
    define ``root``, ``dataset`` (``dataset_identity.identity``) and ``use_version(n)``."""

    epoch: int = 0

    def set_epoch(self, epoch: int) -> None:
        self.epoch = int(epoch)

    def order_options(self) -> dict:
        """The reader's options that decide what index ``i`` is (a clip reader's length and stride): saved, and
        a state of other ones refused."""
        return {}

    def state_dict(self) -> dict:
        return {"kind": type(self).__name__, "version": STATE_VERSION, "dataset": dict(self.dataset),
                "epoch": self.epoch, "samples": len(self), **({"options": self.order_options()}
                                                             if self.order_options() else {})}

    def follow_state(self, state: dict):
        """Open the dataset version ``state`` was taken on, as the DataLoader's workers do when they load it: the
        workers that the next epoch starts (without persistent workers) are copies of this process's reader, which
        would read the latest version (``pipelines.stateful_loader`` calls this). Returns what re-opens the version
        it was on (None: it is on the state's already)."""
        return follow_version(state.get("dataset"), self.dataset, str(self.root), type(self).__name__, self.use_version)

    def load_state_dict(self, state: dict) -> None:
        """Continue on the state's dataset version: this one, or a kept older one (re-opened here)."""
        check_state(state, type(self).__name__)
        saved = state.get("options")  # states of older readers lack it
        if saved is not None and saved != self.order_options():
            differ = ", ".join(f"{k}: state {saved.get(k)!r}, reader {v!r}" for k, v in self.order_options().items()
                               if saved.get(k) != v)
            raise ValueError(f"{type(self).__name__} state of a reader with other options loaded ({differ})")
        version = resolve(state.get("dataset"), self.dataset, str(self.root), type(self).__name__)
        built, sized = self.dataset.get("version"), len(self)
        with on_version(self.use_version, dict(self.dataset), version):
            if int(state["samples"]) != len(self):
                raise ValueError(f"{type(self).__name__} state of a dataset of {state['samples']} samples loaded "
                                 f"into one of {len(self)}")
            if version is not None and len(self) != sized:  # re-opened here, under a sampler that counted the
                # version the reader was built on (a loader whose sampler re-counts it moves it before: no re-open)
                raise ValueError(f"{self.root}: this {type(self).__name__} state was taken on version {version} "
                                 f"({len(self)} samples), the reader was built on version {built} ({sized}), which "
                                 "the loader's sampler counted: build the reader with version="
                                 f"{version}, or order it with ResumableSampler(len(ds), dataset=ds) (its state, "
                                 "loaded first, re-opens the version), to continue")
        self.epoch = int(state["epoch"])
