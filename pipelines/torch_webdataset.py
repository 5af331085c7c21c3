"""PyTorch reader for image WebDatasets written by ``repack images``, from a folder or from
``s3://bucket/prefix``: exact, checked, resumable.

One epoch, per (rank, DataLoader worker) (``pipelines.sample_order`` defines the order as data)::

  global list      the manifest's samples, shards in the epoch's order (wds.detshuffle with
                   seed + epoch when shuffling: the same for every rank and world size)
  share            this rank's runs of positions: a balanced range (``drop_last``: equal ones),
                   or what ``pipelines.resume`` handed it after an elastic restart
  worker part      pieces of ~64 consecutive positions of the share, dealt to the workers in turn
  windows          the piece cut into ``shuffle_buffer`` consecutive samples, each delivered in a
                   seeded permutation (seed, epoch, rank, worker, window) when shuffling
  blocks           each window's samples read in blocks of up to ``read_bytes`` (one ranged GET; on
                   local files one pread per large member, straight into its bytes, and one per run
                   of headers and small members), ``prefetch`` blocks ahead in threads, members at
                   the DALI index's offsets; every member's tar header checked (``pipelines.tar_blocks``)
  to_output        decode (PIL; ``.cls`` as ASCII digits, ``.json`` with json, nothing unpickled),
                   ``transform``, then (image, label) or {"key", "image", "label", "meta"}

Every sample goes to exactly one (rank, worker) per epoch: no duplicates, no gaps, and every sample
the index lists is delivered, in order, or an error says which one is not. ``pipeline()`` hands the
same as a ``wds.DataPipeline`` that takes more stages (``image_pipeline``).

Memory per worker: ``(prefetch + 1) * read_bytes`` of blocks, plus, when shuffling, the window being
delivered (up to ``shuffle_buffer`` samples), and with ``batch_size`` up to ``batches.RING`` batch
buffers in shared memory, reused once the training process dropped them.
"""

from __future__ import annotations

import json
import os
import warnings
import zlib
from dataclasses import dataclass
from itertools import accumulate, islice
from typing import TYPE_CHECKING, Any, Callable, Iterator

import numpy as np
import torch
from torch.utils.data import IterableDataset, get_worker_info

from pipelines import dataset_identity, object_store, sample_order
from pipelines.batch_read import BatchRules, read_batch
from pipelines.batches import BufferRing, OneBuffer, PackedBytes, collate_column, new_board
from pipelines.manifest_access import (Sample, checked_pixels, image_extensions, is_labeled, missing_checksums,
                                       open_webdataset, parse_label, read_checksums, sample_at, SharedIndex)
from pipelines.index_process import drop_resident, shared_maps
from pipelines.sample_errors import SampleDecodeError, decode_error
from pipelines.tar_blocks import (Pieces, ShardFiles, ShardIntegrityError, cut_block, cut_blocks, fetch_blocks,
                                 plan_blocks, read_ahead, split_out)
from repack.manifest import ManifestError
from repack.manifest.shard_index import IndexColumns

if TYPE_CHECKING:
    import webdataset as wds

UNLABELED = -1
STATE_VERSION = 3  # 3: the dataset version and digest, padding repeats (2: worker pieces; 1: contiguous parts)
WHOLE_RUNS = 1 << 62  # a batch's block size limit: every run of adjacent samples is one read (pread, ranged GET)
_STAT_SLOTS = 256  # per-worker counters in shared memory: [worker % slots] -> (skipped, bytes read)
INDEX_DROP_SAMPLES = 8192  # a worker unmaps the shared index's pages after every this many samples it delivered


def resolve_rank(rank: int | None, world_size: int | None) -> tuple[int, int]:
    """(rank, world size): the explicit values, else torch.distributed's when initialized, else (0, 1)."""
    if rank is None or world_size is None:
        dist = torch.distributed
        if dist.is_available() and dist.is_initialized():
            rank = dist.get_rank() if rank is None else rank
            world_size = dist.get_world_size() if world_size is None else world_size
        else:
            rank = 0 if rank is None else rank
            world_size = 1 if world_size is None else world_size
    if world_size < 1 or not 0 <= rank < world_size:
        raise ValueError(f"rank {rank} is not in a world of {world_size}")
    return rank, world_size


def _worker() -> tuple[int, int]:
    info = get_worker_info()
    return (info.id, info.num_workers) if info is not None else (0, 1)


@dataclass
class _Cursor:
    """Where the iterator running in this process is: worker ``worker`` of ``workers`` of share ``runs``
    of rank ``rank`` in ``epoch``, ``position`` samples of its delivery order consumed."""

    epoch: int
    rank: int
    world_size: int
    worker: int
    workers: int
    runs: list
    position: int = 0
    skipped: int = 0


class ImageShardDataset(IterableDataset):
    """Images (and labels) of a repack WebDataset, split across ranks and DataLoader workers.

    Args:
        root: the dataset folder (holds ``manifest.json``), or ``s3://bucket/prefix``.
        transform: applied to each decoded PIL image (e.g. torchvision transforms).
        output: ``"tuple"`` yields ``(image, label)``; ``"dict"`` yields
            ``{"key", "image", "label", "meta"}`` (meta: the parsed ``.json`` member, or None).
            ``label`` is ``-1`` for unlabeled datasets.
        shuffle, seed: per-epoch shuffling (call ``set_epoch`` every epoch).
        rank, world_size: this process's share; default: torch.distributed, else 0 of 1.
        drop_last: give every rank exactly ``len(dataset) // world_size`` samples (DDP needs equal
            counts); the remainder (at most world_size - 1 samples) is skipped that epoch.
        mode: PIL mode to convert to (``"RGB"``); None keeps the stored mode.
        decode: False yields the raw image bytes instead of a PIL image.
        read_bytes: the largest block read at once (one ranged GET, or the preads of one block of a
            local file); default 4 MiB on local files, 16 MiB on s3:// (fewer requests). Raw batches
            (``batch_size=``, no decode, no transform) read each run of adjacent samples whole instead.
        prefetch: blocks (raw batches: batches) read ahead by as many threads (0: none); default: 4 on s3:// (concurrent
            ranged GETs: network latency overlaps with consumption; measured 1,963 against 1,455
            images/s with 2), 0 on local files (measured: on a CPU-bound worker, threads only
            compete for it).
        shuffle_buffer: with shuffle, how many consecutive samples are mixed at a time (per worker).
        version: the dataset version to read (``manifest.vN.json``); None: the latest.
        verify_samples: check each sample's payload as it is read against the crc32 the producer
            recorded beside the index (``<shard>.crc``, see docs/formats.md): a flipped byte anywhere
            in a member's data is a ``ShardIntegrityError`` naming shard and key (skipped and counted
            with ``on_error="skip"``). Costs one crc32 pass over the bytes read (``make bench``). A
            dataset written before repack recorded them is refused: pack it again (``--overwrite``,
            or into a new folder) to add them.
        on_error: ``"raise"`` (default): a damaged header, a truncated shard, a missing member raise
            ``ShardIntegrityError`` naming the shard and the sample key; an image that does not decode,
            a bad ``.cls``/``.json`` member or a failing ``transform`` raise ``SampleDecodeError`` (a
            kind of it, chained from the original error). ``"skip"``: such a sample is skipped with a
            warning and counted; ``dataset.skipped`` reads the count (all workers of this process's
            loaders, since construction).
        draft_size: (width, height) to decode JPEGs at a reduced DCT scale no smaller than this
            (PIL draft, through ``pil_images.decode_image(..., draft=)``); None: full decode.
        batch_size: yield batches of this many samples made in the worker (``pipelines.batches``),
            for ``DataLoader(dataset, batch_size=None)``: raw bytes as one ``PackedBytes`` in shared
            memory, tensors and labels stacked (``default_collate``), other fields as lists. The
            fast way to read: no per-sample pickling through the DataLoader's pipe. Each worker's
            last batch may be smaller, so how many batches an epoch has depends on the number of
            workers: ``steps(num_workers)``. Memory: each worker keeps up to ``batches.RING`` (8)
            batch buffers in shared memory for reuse. None (default): one sample at a time.
        num_workers: with ``batch_size``, the ``num_workers`` of the DataLoader that reads this
            dataset: ``len(dataset)`` (hence ``len(loader)``) is then the number of batches an epoch
            yields, and a loader with another worker count is refused. Without it, ``len()`` in batch
            mode raises TypeError (it would be a guess); ``steps(n)`` answers for any count.

    Resume: ``state_dict()`` / ``load_state_dict()`` follow torchdata's ``StatefulDataLoader``
    protocol (plain JSON; position = epoch + samples consumed, replayed without reading bytes);
    ``pipelines.resume`` turns the states of N ranks into the shares of M ranks (elastic).
    ``bytes_read`` counts the shard bytes read (all workers of this process's loaders).
    """

    def __init__(self, root: str | os.PathLike, transform: Callable | None = None, output: str = "tuple",
                 shuffle: bool = False, seed: int = 0, rank: int | None = None, world_size: int | None = None,
                 drop_last: bool = False, mode: str | None = "RGB", decode: bool = True,
                 read_bytes: int | None = None, shuffle_buffer: int = 1000, prefetch: int | None = None,
                 on_error: str = "raise", draft_size: tuple[int, int] | None = None,
                 version: int | None = None, batch_size: int | None = None,
                 num_workers: int | None = None, verify_samples: bool = False) -> None:
        if output not in ("tuple", "dict"):
            raise ValueError(f"output must be 'tuple' or 'dict', not {output!r}")
        if on_error not in ("raise", "skip"):
            raise ValueError(f"on_error must be 'raise' or 'skip', not {on_error!r}")
        self.root = str(root)
        self._open(version)
        self.transform = transform
        self.output = output
        self.shuffle = shuffle
        self.seed = seed
        self.rank, self.world_size = resolve_rank(rank, world_size)
        self.drop_last = drop_last
        self.mode = mode
        self.decode = decode
        remote = object_store.is_remote(root)
        self.read_bytes = max(1, read_bytes or (16 << 20 if remote else 4 << 20))
        self.prefetch = max(0, prefetch if prefetch is not None else (4 if remote else 0))
        self.shuffle_buffer = max(1, shuffle_buffer)
        self.on_error = on_error
        self.draft_size = tuple(draft_size) if draft_size else None
        if batch_size is not None and (isinstance(batch_size, bool) or int(batch_size) != batch_size or batch_size < 1):
            raise ValueError(f"batch_size must be a positive int or None, not {batch_size!r}")
        self.batch_size = batch_size
        if num_workers is not None and (batch_size is None or num_workers < 0):
            raise ValueError(f"num_workers={num_workers!r} is for batch mode (batch_size=), a count >= 0")
        self.num_workers = num_workers
        self.verify_samples = bool(verify_samples)
        if self.verify_samples and missing_checksums(self.manifest):
            missing = missing_checksums(self.manifest)
            raise ManifestError(f"{self.root}: verify_samples=True needs the per-sample checksums repack records "
                                f"beside each index; {len(missing)} shard(s) have none ({missing[0]}, ...: written by "
                                "an older repack). Pack it again to add them (`repack images SRC OUT --overwrite`, "
                                "or into a new folder), "
                                "or read without verify_samples (`repack verify OUT` checks whole shards)")
        # Shared memory, so set_epoch reaches persistent DataLoader workers and counts come back.
        self._epoch = torch.zeros((), dtype=torch.int64).share_memory_()
        self._epoch_chosen = torch.zeros((), dtype=torch.bool).share_memory_()  # set_epoch was called
        self._stats = torch.zeros((_STAT_SLOTS, 2), dtype=torch.int64).share_memory_()
        self._board_id, self._board = new_board(_STAT_SLOTS)  # batch buffers the training process released
        self._ring: BufferRing | None = None
        self._cursor: _Cursor | None = None
        self._pending: dict | None = None

    def _open(self, version: int | None) -> None:
        """Read version ``version`` of the dataset (None: the latest): its shards and their order."""
        self.manifest = open_webdataset(self.root, "images", version)
        if checked_pixels(self.manifest) is not None:  # over Pillow's own limit: the check's
            from pipelines.pil_images import allow_pixels

            allow_pixels(checked_pixels(self.manifest))
        self.dataset = dataset_identity.identity(self.manifest)
        self.image_exts = set(image_extensions(self.manifest))
        self._image_order = sorted(self.image_exts)
        self.labeled = is_labeled(self.manifest)
        shards = self.manifest.shards
        self.counts = [s.samples for s in shards]
        self.paths = [str(self.manifest.path(s.path)) for s in shards]
        # every index as numpy columns, shared by the DataLoader's workers (at scale parsed by a helper
        # process into one shared mapping, while this process goes on and the workers start; a worker
        # unmaps its pages again as it goes: ``_IndexPages``); a spawned worker gets them by value
        self._shared_index = SharedIndex(self.manifest)
        self._checksum_cache: dict[int, Any] = {}

    @property
    def index(self) -> IndexColumns:
        """The dataset's index columns (waiting for the helper process that parses them, if it still does)."""
        return self._shared_index.get()[0]

    @property
    def _index_mapping(self):
        return self._shared_index.get()[1]

    @property
    def classes(self) -> dict[str, int]:
        return self.manifest.classes

    @property
    def yields_batches(self) -> bool:
        """True with ``batch_size=``: each item is a batch (``Mixture`` refuses such a source)."""
        return self.batch_size is not None

    @property
    def total_samples(self) -> int:
        return sum(self.counts)

    @property
    def skipped(self) -> int:
        """Samples skipped as damaged (``on_error="skip"``), all workers, since construction."""
        return int(self._stats[:, 0].sum())

    @property
    def bytes_read(self) -> int:
        """Shard bytes read, all workers, since construction."""
        return int(self._stats[:, 1].sum())

    def set_epoch(self, epoch: int) -> None:
        """Select the shuffle of ``epoch`` (affects iterators created afterwards). Before or after
        ``load_state_dict`` (``sample_order.continued_epoch``): the state's epoch keeps the state's
        position; another epoch starts from its beginning."""
        self._epoch.fill_(int(epoch))
        self._epoch_chosen.fill_(True)

    @property
    def chosen_epoch(self) -> int | None:
        """The epoch ``set_epoch`` chose (None: none yet)."""
        return int(self._epoch) if bool(self._epoch_chosen) else None

    def rank_range(self, rank: int | None = None) -> tuple[int, int]:
        """A rank's [start, stop) among the epoch's ordered samples (default: this rank's), padding
        repeats not included."""
        rank = self.rank if rank is None else rank
        if self.drop_last:
            per = self.total_samples // self.world_size
            return rank * per, (rank + 1) * per
        return sample_order.balanced(self.total_samples, self.world_size, rank)

    def _rank_runs(self, rank: int) -> list:
        return sample_order.rank_runs(self.total_samples, self.world_size, rank, self.drop_last)

    @property
    def padding(self) -> int:
        """How many of this rank's samples each epoch are repeats that even out the ranks' counts (0 or 1;
        0 with ``drop_last``): the same number of steps on every rank."""
        return sum(stop - start for start, stop in self._rank_runs(self.rank) if start >= self.total_samples)

    def __len__(self) -> int:
        """This rank's items per epoch (padding repeats included: the same on every rank): samples, or in
        batch mode the batches (``num_workers`` given)."""
        if self.batch_size is None:
            return sample_order.runs_length(self._rank_runs(self.rank))
        if self.num_workers is None:
            raise TypeError(f"{self.root}: in batch mode the number of batches depends on the DataLoader's "
                            "workers: build the dataset with num_workers= (the DataLoader's), or call "
                            "dataset.steps(num_workers)")
        return self.steps(self.num_workers)

    def steps(self, num_workers: int = 0) -> int:
        """The items one epoch of this rank yields through a DataLoader with ``num_workers`` workers:
        its samples, or in batch mode the batches (each worker cuts its own part into batches, so a
        worker's last batch may be short)."""
        runs = self._rank_runs(self.rank)
        if self.batch_size is None:
            return sample_order.runs_length(runs)
        return sum(-(-count // self.batch_size) for count in sample_order.worker_sizes(runs, max(1, num_workers)))

    def worker_length(self, rank: int, worker: int, workers: int) -> int:
        """Samples worker ``worker`` of ``workers`` of rank ``rank`` delivers per epoch (for ``Mixture``)."""
        return len(sample_order.WorkerPositions(self._rank_runs(rank), worker, workers))

    # -- the order -------------------------------------------------------------------------------
    def shard_order(self, epoch: int) -> list[int]:
        """The epoch's shard order: the manifest's, or wds.detshuffle's permutation for seed + epoch."""
        order = list(range(len(self.counts)))
        if not self.shuffle:
            return order
        import webdataset as wds  # here: PIL and webdataset stay out of opening a reader (~0.2 s of imports)

        return list(wds.detshuffle(len(order), len(order), seed=self.seed, epoch=epoch - 1).run(iter(order)))

    def _layout(self, epoch: int) -> tuple[list[int], list[int]]:
        """(shard order, first global position of each shard in that order) of ``epoch``."""
        order = self.shard_order(epoch)
        return order, [0, *accumulate(self.counts[s] for s in order)][:-1]

    def _samples(self, layout: tuple[list[int], list[int]], positions: np.ndarray) -> np.ndarray:
        """The index's sample numbers (shards in manifest order) at epoch ``positions`` (padding ones too)."""
        order, starts = (np.asarray(a, dtype=np.int64) for a in layout)
        total = self.total_samples
        real = np.where(positions < total, positions, (positions - total) % max(total, 1))
        i = np.searchsorted(starts, real, side="right") - 1
        return self.index.shard_starts[order[i]] + real - starts[i]

    def _checksums(self, shard: int):
        if shard not in self._checksum_cache:
            self._checksum_cache[shard] = read_checksums(self.manifest, shard)
        return self._checksum_cache[shard]

    def _sample_at(self, layout: tuple[list[int], list[int]], position: int) -> Sample:
        return sample_at(self.index, int(self._samples(layout, np.array([position]))[0]))

    def _shuffle_seed(self, cursor: _Cursor) -> str | None:
        if not self.shuffle:
            return None
        return f"{self.seed}:{cursor.epoch}:{cursor.rank}:{cursor.worker}"

    def _windows(self, cursor: _Cursor) -> Iterator[list[int]]:
        """The positions ``cursor``'s worker still delivers, a window at a time in delivery order (the first
        window from the cursor's position now on), each made when it is reached: no list of the worker's share."""
        positions = sample_order.WorkerPositions(cursor.runs, cursor.worker, cursor.workers)
        chunks = sample_order.delivery_chunks(positions, self.shuffle_buffer, self._shuffle_seed(cursor),
                                              cursor.position)  # bound now: the reads run ahead of delivery
        return (chunk.tolist() for chunk in chunks)

    def worker_samples(self, worker: int = 0, workers: int = 1, epoch: int | None = None) -> list[Sample]:
        """The samples (index lines) worker ``worker`` of ``workers`` of this rank yields in ``epoch``, in order."""
        epoch = int(self._epoch) if epoch is None else epoch
        cursor = self._fresh_cursor(epoch, worker, workers)
        layout = self._layout(epoch)
        return [self._sample_at(layout, p) for window in self._windows(cursor) for p in window]

    # -- state -----------------------------------------------------------------------------------
    def _fresh_cursor(self, epoch: int, worker: int, workers: int) -> _Cursor:
        return _Cursor(epoch, self.rank, self.world_size, worker, workers, self._rank_runs(self.rank))

    def _state_of(self, cursor: _Cursor) -> dict:
        return {"kind": type(self).__name__, "version": STATE_VERSION, "dataset": dict(self.dataset),
                "epoch": cursor.epoch,
                "seed": self.seed, "shuffle": self.shuffle, "window": self.shuffle_buffer,
                "samples": self.total_samples, "drop_last": self.drop_last,
                "rank": cursor.rank, "world_size": cursor.world_size, "worker": cursor.worker,
                "num_workers": cursor.workers, "runs": [list(r) for r in cursor.runs],
                "position": cursor.position, "skipped": cursor.skipped, "batch_size": self.batch_size}

    def state_dict(self) -> dict:
        """How far the iterator running in this process got (plain JSON): the epoch, this worker's
        share and how many samples of its delivery order it consumed. Before any iterator: the state
        loaded last, else the start of the current epoch."""
        return self._state_of(self._cursor) if self._cursor is not None else self.start_state()

    def start_state(self) -> dict:
        """The state of an iterator this process has not started yet: the state loaded last, else the start of
        the current epoch (``state_dict`` gives the last iterator's place, also once it ended: a ``Mixture``
        saving a source it has not drawn from in this pass asks for this one)."""
        if self._pending is not None:
            return dict(self._pending)
        worker, workers = _worker()
        return self._state_of(self._fresh_cursor(int(self._epoch), worker, workers))

    def load_state_dict(self, state: dict) -> None:
        """Make the next iterator continue exactly where ``state`` stopped (skipping by index: consumed
        samples are never read). Also accepts a rank state from ``pipelines.resume`` (no worker: the
        workers split its share). A state of another dataset version continues on that version (this
        reader re-opens it) while it is kept; else a ValueError names both. Sets the epoch to the
        state's unless ``set_epoch`` chose one (``sample_order.continued_epoch``)."""
        version = dataset_identity.resolve(state.get("dataset"), self.dataset, self.root, type(self).__name__)
        with dataset_identity.on_version(self._open, dict(self.dataset), version):
            self._check_loaded(state)
        self._pending = json.loads(json.dumps(state))
        self._cursor = None
        if not bool(self._epoch_chosen):
            self._epoch.fill_(int(state["epoch"]))

    def restorer(self) -> Callable[[], None]:
        """A function that puts this reader back as it is now (its dataset version, loaded state, cursor and
        epoch): what a caller loading several readers' states undoes when a later one is refused (``Mixture``)."""
        version, pending, cursor, epoch = self.dataset.get("version"), self._pending, self._cursor, int(self._epoch)

        def restore() -> None:
            if self.dataset.get("version") != version:
                self._open(version)
            self._pending, self._cursor = pending, cursor
            self._epoch.fill_(epoch)
        return restore

    def follow_state(self, state: dict):
        """Open the dataset version ``state`` was taken on, as the DataLoader's workers do when they load it: a
        loader with workers loads its readers' states in the workers only, so this process's ``len()`` and
        ``steps()`` counted the latest version's samples (``pipelines.stateful_loader`` calls this). A ValueError
        names a version that is no longer kept, as the workers would. Returns what re-opens the version it was
        on (None: it is on the state's already)."""
        return dataset_identity.follow_version(state.get("dataset"), self.dataset, self.root, type(self).__name__,
                                               self._open)

    def _check_loaded(self, state: dict) -> None:
        """ValueError unless ``state`` is of this reader's options, size, rank and world size."""
        expect = {"kind": type(self).__name__, "version": STATE_VERSION, "seed": self.seed,
                  "shuffle": self.shuffle, "window": self.shuffle_buffer, "samples": self.total_samples,
                  "rank": self.rank, "world_size": self.world_size}
        if "drop_last" in state:  # a rank's share depends on it (states of older readers lack it)
            expect["drop_last"] = self.drop_last
        wrong = {k: (state.get(k), v) for k, v in expect.items() if state.get(k) != v}
        if wrong:
            detail = ", ".join(f"{k}: state {got!r}, dataset {want!r}" for k, (got, want) in wrong.items())
            raise ValueError(f"{self.root}: this state is not one of this dataset's ({detail}); "
                             "for another world size use pipelines.resume")
        where = f"{self.root}: the state's"  # positions past the samples are an equal-count rank's repeats
        sample_order.checked_count(state.get("epoch"), f"{where} epoch")
        runs = sample_order.checked_runs(state.get("runs"), f"{where} runs", self.total_samples + self.world_size)
        if state.get("worker") is None:  # a rank's share from pipelines.resume: not started
            sample_order.checked_count(state.get("position"), f"{where} position", 0)
        else:
            workers = sample_order.checked_count(state.get("num_workers"), f"{where} num_workers")
            if workers < 1:
                raise ValueError(f"{where} num_workers 0 is no worker count (a loader without workers saves 1)")
            worker = sample_order.checked_count(state["worker"], f"{where} worker", workers - 1)
            sample_order.checked_count(state.get("position"), f"{where} position",
                                       len(sample_order.WorkerPositions(runs, worker, workers)))
        sample_order.checked_count(state.get("skipped", 0), f"{where} skipped")

    def _start(self) -> _Cursor:
        """The cursor of a new iterator: from the loaded state when it is of the current epoch."""
        epoch = int(self._epoch)
        worker, workers = _worker()
        state, self._pending = self._pending, None
        if state is None:
            return self._fresh_cursor(epoch, worker, workers)
        chosen = epoch if bool(self._epoch_chosen) else None
        epoch, keep = sample_order.continued_epoch(int(state["epoch"]), chosen)
        if not keep:
            return self._fresh_cursor(epoch, worker, workers)
        if state["worker"] is None:  # a rank share from pipelines.resume: split among these workers
            return _Cursor(epoch, self.rank, self.world_size, worker, workers, state["runs"])
        if (state["worker"], state["num_workers"]) != (worker, workers):
            raise ValueError(f"{self.root}: the state of worker {state['worker']} of {state['num_workers']} was "
                             f"loaded into worker {worker} of {workers}; resume with the same num_workers")
        return _Cursor(epoch, self.rank, self.world_size, worker, workers, state["runs"], state["position"],
                       state.get("skipped", 0))

    # -- reading ---------------------------------------------------------------------------------
    def _blocks(self, windows: Iterator[list[int]], layout) -> Iterator:
        """(window number, ReadBlock) for every sample still to deliver, window by window."""
        for w, todo in enumerate(windows):
            turn = {p: i for i, p in enumerate(todo)}  # when each position is handed out
            blocks = self._plan(layout, todo, self.read_bytes)
            # in the order their first sample is handed out: the consumer starts on the first block
            # read, not after most of a shuffled window (measured on s3://: 70-110 MB before the first sample)
            blocks.sort(key=lambda b: min(turn[p] for p in b.positions))
            if w == 0 and blocks and object_store.is_remote(self.root):  # the first GET: one sample
                blocks[:1] = split_out(blocks[0], todo[0])
            for block in blocks:
                yield w, block

    def _plan(self, layout, positions: list[int], max_bytes: int) -> list:
        """The ReadBlocks that hold ``positions``: runs of adjacent samples of at most ``max_bytes``,
        in byte order within each shard, the shards in the epoch's order."""
        order, _ = layout
        ordered = sorted(positions)
        by_shard: dict[int, list] = {}
        for p, number in zip(ordered, self._samples(layout, np.array(ordered, dtype=np.int64)).tolist()):
            sample = sample_at(self.index, number)
            by_shard.setdefault(sample.shard, []).append((p, sample))
        return [block for shard in sorted(by_shard, key=order.index)
                for block in plan_blocks(self.paths[shard], by_shard[shard], max_bytes)]

    def _read(self, cursor: _Cursor) -> Iterator[dict]:
        """The samples of ``cursor``'s worker from its position on, as {"__key__", "__url__", ext: bytes}."""
        self._cursor = cursor
        layout = self._layout(cursor.epoch)
        slot = self._stats[cursor.worker % _STAT_SLOTS]
        ready: dict[int, tuple] = {}
        pages = _IndexPages(shared_maps(self.index, self._index_mapping))  # the index waited for before any thread
        fetched = fetch_blocks(self._blocks(self._windows(cursor), layout), self.prefetch)
        try:
            for window in self._windows(cursor):
                for position in window:
                    pages.used(1)
                    while position not in ready:
                        _, block, data = next(fetched)
                        slot[1] += len(data)
                        for p, sample, got in zip(block.positions, block.samples, cut_block(block, data)):
                            ready[p] = (block.url, sample, got)
                    got = self._deliver(cursor, *ready.pop(position))
                    if got is not None:
                        yield got
        finally:
            fetched.close()

    def _deliver(self, cursor: _Cursor, url: str, sample: Sample, got) -> dict | None:
        """Consume one position: the sample as {"__key__", "__url__", ext: data}, or None when it is
        damaged and ``on_error="skip"`` (counted, with a warning); raises ShardIntegrityError otherwise."""
        if not isinstance(got, ShardIntegrityError):
            got = self._check_members(url, sample, got)
        cursor.position += 1
        if isinstance(got, ShardIntegrityError):
            self._damaged(cursor, got)
            return None
        got["__key__"], got["__url__"] = sample.key, url  # got is this sample's own dict
        return got

    def _damaged(self, cursor: _Cursor, error: ShardIntegrityError) -> None:
        """A damaged sample (already consumed by ``cursor``): raise ``error``, or with ``on_error="skip"``
        count it (``skipped``) and warn."""
        if self.on_error == "raise":
            raise error
        cursor.skipped += 1
        self._stats[cursor.worker % _STAT_SLOTS][0] += 1
        warnings.warn(f"skipped: {error}", stacklevel=4)

    def _outputs(self, samples: Iterator[dict]) -> Iterator[Any]:
        """Each sample through ``_to_output``; one whose decode, label or transform fails is damage like
        any other (``SampleDecodeError`` naming shard and key: raised, or skipped and counted)."""
        for sample in samples:
            try:
                out = self._to_output(sample)
            except SampleDecodeError as error:
                self._damaged(self._cursor, error)
                continue
            yield out

    def _read_direct(self, cursor: _Cursor, ring: BufferRing | None) -> Iterator[Any]:
        """Raw bytes: the batches of ``cursor``'s worker from its position on, each read with one read per
        run of adjacent samples (a ``preadv``, or on s3:// one ranged GET received into it) straight into
        one buffer (in a worker: shared memory from ``ring``), ``prefetch`` batches ahead in threads. A
        batch of ``(image, label)`` pairs is read and checked as arrays (``pipelines.batch_read``); a
        batch that path refuses, and every ``output="dict"`` batch, sample by sample (``_exact_batch``),
        which names what is wrong."""
        self._cursor = cursor
        layout = self._layout(cursor.epoch)
        positions = sample_order.WorkerPositions(cursor.runs, cursor.worker, cursor.workers)
        chunks = sample_order.delivery_chunks(positions, self.shuffle_buffer, self._shuffle_seed(cursor),
                                              cursor.position)
        slot = self._stats[cursor.worker % _STAT_SLOTS]
        pages = _IndexPages(shared_maps(self.index, self._index_mapping))  # the index waited for before any thread
        rules = None
        if self.output == "tuple":
            rules = BatchRules.of(self.index, self._image_order, self.labeled,
                                  self._checksums if self.verify_samples else None)
        files = ShardFiles()

        def take(size: int) -> tuple:
            return ring.take(size) if ring is not None else (torch.empty(size, dtype=torch.uint8), None)

        def attempt(chunk: np.ndarray) -> tuple:
            """(chunk, the RawBatch, or else the exact path's reads when made here, or else the buffer
            the refused batch took, for reading it again sample by sample)."""
            if rules is None:
                return chunk, None, self._read_runs(layout, chunk.tolist(), files, take), None
            taken: list[tuple] = []

            def take_once(size: int) -> tuple:
                taken.append(take(size))
                return taken[-1]

            batch = read_batch(self.index, self.paths, files, self._samples(layout, chunk), take_once, rules)
            return chunk, batch, None, (taken[0] if batch is None and taken else None)

        attempts = read_ahead(rebatch(chunks, self.batch_size), attempt, self.prefetch)
        try:
            for chunk, batch, reads, reserved in attempts:
                pages.used(len(chunk))
                if batch is not None:
                    cursor.position += len(chunk)
                    slot[1] += batch.nbytes
                    spans = tuple(zip(batch.starts.tolist(), batch.ends.tolist()))
                    images = PackedBytes(batch.buffer, spans, batch.claim)
                    yield OneBuffer((images, batch.labels), batch.buffer, batch.claim)
                    continue
                if reads is None:
                    reads = self._read_runs(layout, chunk.tolist(), files, take, reserved)
                buffer, claim, outputs = self._exact_batch(cursor, chunk.tolist(), slot, reads)
                if outputs:
                    yield self._collate(outputs, ring, buffer, claim)
        finally:
            attempts.close()
            files.close()

    def _read_runs(self, layout, chunk: list[int], files: ShardFiles, take: Callable[[int], tuple],
                   reserved: tuple | None = None) -> tuple[tuple, list]:
        """The samples at positions ``chunk`` read into one buffer, one read per run of adjacent samples:
        ((buffer, claim), [(ReadBlock, Pieces)]). ``reserved``: a buffer already taken for them, used
        again when it has the size."""
        blocks = self._plan(layout, chunk, WHOLE_RUNS)
        size = sum(b.end - b.start for b in blocks)
        buffer, claim = reserved if reserved is not None and reserved[0].numel() >= size else take(size)
        buffer = buffer[:size]
        view, at, reads = memoryview(buffer.numpy()), 0, []
        for block in blocks:
            piece = view[at:at + block.end - block.start]
            got = files.read_into(block.url, block.start, piece)
            reads.append((block, Pieces([(block.start, piece[:got])])))
            at += len(piece)
        return (buffer, claim), reads

    def _exact_batch(self, cursor: _Cursor, chunk: list[int], slot, read: tuple[tuple, list]
                     ) -> tuple[torch.Tensor, tuple | None, list]:
        """One batch, read by ``_read_runs``, cut and checked sample by sample (every damaged one raised,
        or skipped and counted): (buffer, its claim, the outputs)."""
        (buffer, claim), reads = read
        slot[1] += sum(len(pieces) for _, pieces in reads)
        ready = {}
        for (block, _), cut in zip(reads, cut_blocks(reads)):
            for p, sample, members in zip(block.positions, block.samples, cut):
                if not isinstance(members, ShardIntegrityError):
                    members = {ext: data if ext in self.image_exts else bytes(data)
                               for ext, data in members.items()}
                ready[p] = (block.url, sample, members)
        delivered = [self._deliver(cursor, *ready.pop(p)) for p in chunk]
        return buffer, claim, list(self._outputs(d for d in delivered if d is not None))

    def _check_members(self, url: str, sample: Sample, members: dict) -> dict | ShardIntegrityError:
        if self.verify_samples:
            crc = 0
            for ext, _, _ in sample.members:
                crc = zlib.crc32(members[ext], crc)
            want = int(self._checksums(sample.shard)[sample.number])
            if crc != want:
                return ShardIntegrityError(url, sample.key, f"payload checksum mismatch (crc32 {crc:08x}, recorded "
                                                            f"{want:08x}): the bytes changed since packing")
        for ext in self._image_order:
            if ext in members:
                break
        else:
            return ShardIntegrityError(url, sample.key, "no image member")
        if self.labeled and "cls" not in members:
            return ShardIntegrityError(url, sample.key, "no .cls member")
        return members

    # -- output ----------------------------------------------------------------------------------
    def _to_output(self, sample: dict):
        """(image, label) or the dict of one sample; any failure as a SampleDecodeError naming shard and key."""
        stage = "decode"
        try:
            for ext in self._image_order:
                if ext in sample:
                    image = self._decode(sample[ext])
                    break
            stage = "label"
            cls = sample.get("cls")
            label = parse_label(cls) if cls is not None else UNLABELED
            if self.transform is not None:
                stage = "transform"
                image = self.transform(image)
            if self.output == "tuple":
                return image, label
            stage = "meta"
            meta = sample.get("json")
            return {"key": sample["__key__"], "image": image, "label": label,
                    "meta": json.loads(meta) if meta is not None else None}
        except Exception as exc:
            raise decode_error(sample["__url__"], sample["__key__"], stage, exc) from exc

    def pipeline(self) -> wds.DataPipeline:
        """This dataset as a ``wds.DataPipeline`` (an IterableDataset): add stages with ``append``.
        Its state (``state_dict``) counts the samples the reader handed to the stages."""
        if self.batch_size is not None:
            raise ValueError("pipeline() hands samples one at a time: build the dataset without batch_size= "
                             "and append wds.batched(...) to the pipeline")
        return self._pipeline(lambda: self._read(self._start()))

    def __iter__(self) -> Iterator[Any]:
        cursor = self._start()  # now, not at the first next(): state_dict() describes this iterator
        self._cursor = cursor
        if self.batch_size is None:
            return self._outputs(self._read(cursor))  # pipeline()'s stages without its per-sample layers
        if self.num_workers is not None and max(1, self.num_workers) != cursor.workers:
            raise ValueError(f"{self.root}: built with num_workers={self.num_workers} (len() counts the batches "
                             f"of that many DataLoader workers), read by {cursor.workers}")
        ring = self._worker_ring()
        if not self.decode and self.transform is None:
            return self._read_direct(cursor, ring)
        samples = self._outputs(self._read(cursor))  # decoded or transformed: collate what was read
        return (self._collate(chunk, ring) for chunk in iter(lambda: list(islice(samples, self.batch_size)), []))

    def _worker_ring(self) -> BufferRing | None:
        """Inside a DataLoader worker, its reusable batch buffers; None in the training process."""
        info = get_worker_info()
        if info is None:
            return None
        if self._ring is None:
            self._ring = BufferRing(self._board_id, self._board, info.id)
        return self._ring

    def _collate(self, outputs: list, ring: BufferRing | None, buffer: torch.Tensor | None = None,
                 claim: tuple | None = None):
        """One batch, made here (in the worker): image bytes as ``PackedBytes`` (views of ``buffer``
        when given: no copy), tensors stacked (into ``ring``'s buffers), labels too, other fields as lists."""
        def column(values: list):
            if buffer is not None and values and isinstance(values[0], memoryview):
                return PackedBytes.of_views(buffer, values, claim)
            return collate_column(values, ring)

        if self.output == "tuple":
            images, labels = (list(v) for v in zip(*outputs))
            return column(images), column(labels)
        return {key: column([o[key] for o in outputs]) for key in ("key", "image", "label", "meta")}

    def _pipeline(self, source: Callable[[], Iterator[dict]]) -> wds.DataPipeline:
        import webdataset as wds

        return wds.DataPipeline(source, self._outputs)

    def _decode(self, data: bytes):
        if not self.decode:
            return data
        from pipelines.pil_images import decode_image
        if self.draft_size is None:
            return decode_image(data, self.mode)
        return decode_image(data, self.mode, draft=self.draft_size)


class _IndexPages:
    """Unmaps this process's pages of the shared maps that hold the index (``index_process.shared_maps``,
    ``drop_resident``) after every ``INDEX_DROP_SAMPLES`` samples: a worker's samples are dealt in pieces
    spread over the whole index, so without it each worker ends up mapping (and counting in its RSS)
    every page of it; with it, about the pages of the last stretch (measured: see docs/benchmarks.md,
    "Reader memory per sample")."""

    def __init__(self, maps: tuple) -> None:
        self.maps, self.count = maps, 0

    def used(self, samples: int) -> None:
        self.count += samples
        if self.maps and self.count >= INDEX_DROP_SAMPLES:
            for mapping in self.maps:
                drop_resident(mapping)
            self.count = 0


def rebatch(chunks: Iterator[np.ndarray], size: int) -> Iterator[np.ndarray]:
    """The arrays ``chunks`` as consecutive arrays of ``size`` items (the last one shorter)."""
    pending: list[np.ndarray] = []
    held = 0
    for chunk in chunks:
        pending.append(chunk)
        held += len(chunk)
        if held >= size:
            joined = np.concatenate(pending)
            cut = len(joined) - len(joined) % size
            yield from (joined[i:i + size] for i in range(0, cut, size))
            pending, held = [joined[cut:]], len(joined) - cut
    if held:
        yield np.concatenate(pending)


def image_pipeline(root: str | os.PathLike, **options) -> wds.DataPipeline:
    """The ``wds.DataPipeline`` of ``ImageShardDataset(root, **options)``; append your own stages,
    e.g. ``pipe.append(wds.batched(64))``, and iterate it or hand it to a DataLoader."""
    return ImageShardDataset(root, **options).pipeline()
