"""PyTorch reader for image WebDatasets written by ``repack images``.

``ImageShardDataset`` is an ``IterableDataset``. The dataset's samples, in manifest order
(shards concatenated), are split into contiguous, balanced ranges: first across distributed
ranks, then across the DataLoader workers of a rank. Every sample goes to exactly one
(rank, worker): no duplicates, no gaps. A worker reads its samples' bytes with ``pread`` at the
offsets of the shards' DALI index files (one read per run of adjacent samples, up to
``read_bytes``), decodes images with PIL and applies the optional transform.

With ``shuffle=True`` each epoch (``set_epoch``) first permutes the shard order (seed + epoch,
the same on every rank), then cuts the ranges. A worker cuts its range into blocks of adjacent
samples (one ``pread`` of at most ``read_bytes`` each), reads the blocks in a random order and
yields the samples of ``shuffle_blocks`` blocks at a time in a random order (seeded by seed,
epoch, rank, worker): large sequential reads, a few shards per worker, memory bounded by
``shuffle_blocks * read_bytes``.

Labels come from the ``.cls`` member (zero-padded ASCII digits); metadata from ``.json`` (parsed
with ``json``). Nothing is ever unpickled.
"""

from __future__ import annotations

import json
import os
import random
from typing import Any, Callable, Iterator

import torch
from torch.utils.data import IterableDataset, get_worker_info

from pipelines.manifest_access import (Sample, image_extensions, is_labeled, open_webdataset, parse_label,
                                       read_index, segments, split_range)
from pipelines.pil_images import decode_image

UNLABELED = -1


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


class ImageShardDataset(IterableDataset):
    """Images (and labels) of a repack WebDataset, split across ranks and DataLoader workers.

    Args:
        root: the dataset folder (holds ``manifest.json``).
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
        read_bytes: upper bound of one read of adjacent samples.
        shuffle_blocks: with shuffle, how many blocks are read and mixed together.
    """

    def __init__(self, root: str | os.PathLike, transform: Callable | None = None, output: str = "tuple",
                 shuffle: bool = False, seed: int = 0, rank: int | None = None, world_size: int | None = None,
                 drop_last: bool = False, mode: str | None = "RGB", decode: bool = True,
                 read_bytes: int = 4 << 20, shuffle_blocks: int = 8) -> None:
        if output not in ("tuple", "dict"):
            raise ValueError(f"output must be 'tuple' or 'dict', not {output!r}")
        self.manifest = open_webdataset(root, "images")
        self.image_exts = set(image_extensions(self.manifest))
        self.labeled = is_labeled(self.manifest)
        self.transform = transform
        self.output = output
        self.shuffle = shuffle
        self.seed = seed
        self.rank, self.world_size = resolve_rank(rank, world_size)
        self.drop_last = drop_last
        self.mode = mode
        self.decode = decode
        self.read_bytes = read_bytes
        self.shuffle_blocks = max(1, shuffle_blocks)
        self.counts = [s.samples for s in self.manifest.shards]
        self.paths = [str(self.manifest.path(s.path)) for s in self.manifest.shards]
        # Shared memory, so set_epoch reaches persistent DataLoader workers too.
        self._epoch = torch.zeros((), dtype=torch.int64).share_memory_()

    @property
    def classes(self) -> dict[str, int]:
        return self.manifest.classes

    @property
    def total_samples(self) -> int:
        return sum(self.counts)

    def set_epoch(self, epoch: int) -> None:
        """Select the shuffle of ``epoch`` (affects iterators created afterwards)."""
        self._epoch.fill_(int(epoch))

    def rank_range(self) -> tuple[int, int]:
        """This rank's [start, stop) among the epoch's ordered samples."""
        total = self.total_samples
        if self.drop_last:
            per = total // self.world_size
            return self.rank * per, (self.rank + 1) * per
        return split_range(total, self.world_size, self.rank)

    def __len__(self) -> int:
        start, stop = self.rank_range()
        return stop - start

    def worker_samples(self, worker: int = 0, workers: int = 1, epoch: int | None = None) -> list[Sample]:
        """The samples worker ``worker`` of ``workers`` of this rank yields in ``epoch``, in order."""
        return [s for _, order in self.worker_plan(worker, workers, epoch) for s in order]

    def worker_plan(self, worker: int = 0, workers: int = 1,
                    epoch: int | None = None) -> list[tuple[list[list[Sample]], list[Sample]]]:
        """[(blocks to read, their samples in yielding order), ...] of one worker in ``epoch``."""
        epoch = int(self._epoch) if epoch is None else epoch
        order = list(range(len(self.counts)))
        if self.shuffle:
            random.Random(f"{self.seed}:{epoch}").shuffle(order)
        r0, r1 = self.rank_range()
        w0, w1 = split_range(r1 - r0, workers, worker)
        samples: list[Sample] = []
        for shard, lo, hi in segments(self.counts, order, r0 + w0, r0 + w1):
            samples += read_index(self.manifest, shard, lo, hi)
        blocks = self._blocks(samples)
        if not self.shuffle:
            return [([block], block) for block in blocks]
        rng = random.Random(f"{self.seed}:{epoch}:{self.rank}:{worker}")
        rng.shuffle(blocks)
        plan = []
        for i in range(0, len(blocks), self.shuffle_blocks):
            group = blocks[i:i + self.shuffle_blocks]
            mixed = [s for block in group for s in block]
            rng.shuffle(mixed)
            plan.append((group, mixed))
        return plan

    def _blocks(self, samples: list[Sample]) -> list[list[Sample]]:
        """Runs of adjacent samples of one shard spanning at most ``read_bytes`` (one pread each)."""
        blocks: list[list[Sample]] = []
        for sample in samples:
            if blocks:
                block = blocks[-1]
                first, last = block[0], block[-1]
                if (sample.shard == first.shard and 0 <= sample.start - last.end < 1024
                        and sample.end - first.start <= self.read_bytes):
                    block.append(sample)
                    continue
            blocks.append([sample])
        return blocks

    def __iter__(self) -> Iterator[Any]:
        info = get_worker_info()
        worker, workers = (info.id, info.num_workers) if info is not None else (0, 1)
        fds: dict[int, int] = {}
        buffers: list[bytearray] = []  # reused: no page faults on fresh memory per read
        try:
            for blocks, order in self.worker_plan(worker, workers):
                where = {}
                for slot, block in enumerate(blocks):
                    shard, start = block[0].shard, block[0].start
                    fd = fds.get(shard)
                    if fd is None:
                        fd = fds[shard] = os.open(self.paths[shard], os.O_RDONLY)
                    size = block[-1].end - start
                    if slot == len(buffers):
                        buffers.append(bytearray(max(size, self.read_bytes)))
                    elif len(buffers[slot]) < size:
                        buffers[slot] = bytearray(size)
                    blob = _pread_exact(fd, memoryview(buffers[slot])[:size], start, self.paths[shard])
                    for sample in block:
                        where[id(sample)] = blob, start
                for sample in order:
                    yield self._make(sample, *where[id(sample)])
        finally:
            for fd in fds.values():
                os.close(fd)

    def _make(self, sample: Sample, blob: memoryview, base: int):
        image = label = meta = None
        for ext, off, size in sample.members:
            data = blob[off - base:off - base + size]
            if ext in self.image_exts and image is None:
                image = self._decode(bytes(data), sample)
            elif ext == "cls":
                label = parse_label(bytes(data))
            elif ext == "json" and self.output == "dict":
                meta = json.loads(bytes(data))
        if image is None:
            raise ValueError(f"{self.paths[sample.shard]}: sample {sample.key} has no image member")
        if label is None:
            if self.labeled:
                raise ValueError(f"{self.paths[sample.shard]}: sample {sample.key} has no .cls member")
            label = UNLABELED
        if self.transform is not None:
            image = self.transform(image)
        if self.output == "tuple":
            return image, label
        return {"key": sample.key, "image": image, "label": label, "meta": meta}

    def _decode(self, data: bytes, sample: Sample):
        if not self.decode:
            return data
        return decode_image(data, self.mode)


def _pread_exact(fd: int, view: memoryview, offset: int, where: str) -> memoryview:
    """Fill ``view`` from ``fd`` at ``offset``; a short file is an error. Members are copied out of
    ``view`` (``bytes(...)``) before the buffer is reused."""
    size = len(view)
    got = 0
    while got < size:
        n = os.preadv(fd, [view[got:]], offset + got)
        if n == 0:
            raise ValueError(f"{where}: ends at byte {offset + got}, the index expects {offset + size}")
        got += n
    return view
