"""PyTorch reader for image WebDatasets written by ``repack images``, built on the ``webdataset``
library's pipeline (``wds.DataPipeline``), from a folder or from ``s3://bucket/prefix``.

The pipeline, one epoch (``image_pipeline`` hands it to users, who can ``append`` stages)::

  pieces            the manifest's shard list, in the epoch's order (wds.detshuffle with
                    seed + epoch, the same on every rank, when shuffling), cut into one piece of
                    contiguous samples per (rank, DataLoader worker): balanced ranges, exact
  split_by_node     piece ``rank`` ...
  wds.split_by_worker                    ... of worker ``worker``
  open_pieces       each shard segment of the piece as a stream: a file window, or one ranged
                    GET of the object (streamed as read, never downloaded first)
  wds.tariterators.tar_file_expander + group_by_keys      tar members -> samples
  follow_index      each sample checked against its DALI index line (same key, in order) and
                    cut to the members the index lists: the index is the contract of both readers
  wds.shuffle       with shuffle: a buffer of ``shuffle_buffer`` samples, seeded by
                    (seed, epoch, rank, worker)
  wds.decode        our handlers only: images with PIL, ``.cls`` as ASCII digits, ``.json`` with
                    json (nothing is ever unpickled)
  to_output         (image, label) or {"key", "image", "label", "meta"}, after ``transform``

Every sample goes to exactly one (rank, worker) per epoch: no duplicates, no gaps; ``drop_last``
gives every rank ``len // world_size`` samples (DDP). ``set_epoch`` reaches persistent workers.
"""

from __future__ import annotations

import json
import os
import random
from itertools import islice
from typing import Any, Callable, Iterator

import torch
import webdataset as wds
from torch.utils.data import IterableDataset, get_worker_info

from pipelines import object_store
from pipelines.manifest_access import (Sample, image_extensions, is_labeled, open_webdataset, parse_label,
                                       read_index, segments, split_range)
from pipelines.pil_images import decode_image

UNLABELED = -1
TAR_HEADER = 512  # repack writes one ustar header per member, no long-name records (sinks/tar_format.py)


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
        read_bytes: buffer of each shard stream (one read of the file or the network).
        shuffle_buffer: with shuffle, how many samples are mixed at a time (per worker).
        version: the dataset version to read (``manifest.vN.json``); None: the latest.
    """

    def __init__(self, root: str | os.PathLike, transform: Callable | None = None, output: str = "tuple",
                 shuffle: bool = False, seed: int = 0, rank: int | None = None, world_size: int | None = None,
                 drop_last: bool = False, mode: str | None = "RGB", decode: bool = True,
                 read_bytes: int = 4 << 20, shuffle_buffer: int = 1000, version: int | None = None) -> None:
        if output not in ("tuple", "dict"):
            raise ValueError(f"output must be 'tuple' or 'dict', not {output!r}")
        self.manifest = open_webdataset(root, "images", version)
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
        self.shuffle_buffer = max(1, shuffle_buffer)
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

    def rank_range(self, rank: int | None = None) -> tuple[int, int]:
        """A rank's [start, stop) among the epoch's ordered samples (default: this rank's)."""
        rank = self.rank if rank is None else rank
        total = self.total_samples
        if self.drop_last:
            per = total // self.world_size
            return rank * per, (rank + 1) * per
        return split_range(total, self.world_size, rank)

    def __len__(self) -> int:
        start, stop = self.rank_range()
        return stop - start

    # -- the pipeline ----------------------------------------------------------------------------
    def shard_order(self, epoch: int) -> list[int]:
        """The epoch's shard order: the manifest's, or wds.detshuffle's permutation for seed + epoch."""
        order = list(range(len(self.counts)))
        if not self.shuffle:
            return order
        return list(wds.detshuffle(len(order), len(order), seed=self.seed, epoch=epoch - 1).run(iter(order)))

    def pieces(self, workers: int, epoch: int) -> list[list[tuple[int, int, int]]]:
        """The epoch's shard list cut into one piece per (rank, worker), placed so that
        split_by_node then wds.split_by_worker hand each its own: piece of (rank r, worker w)
        at position r + world_size * w. A piece: [(shard, first sample, stop sample), ...]."""
        order = self.shard_order(epoch)
        placed: list[list[tuple[int, int, int]]] = []
        for worker in range(workers):
            for rank in range(self.world_size):
                r0, r1 = self.rank_range(rank)
                w0, w1 = split_range(r1 - r0, workers, worker)
                placed.append(segments(self.counts, order, r0 + w0, r0 + w1))
        return placed

    def _source(self) -> Iterator[list[tuple[int, int, int]]]:
        return iter(self.pieces(_worker()[1], int(self._epoch)))

    def _split_by_node(self, src: Iterator) -> Iterator:
        """wds.split_by_node, with this dataset's (rank, world size) (explicit or torch.distributed)."""
        return islice(src, self.rank, None, self.world_size)

    def _open_pieces(self, src: Iterator) -> Iterator[dict]:
        """Each segment of a piece as {"url", "stream", "samples"} (its index lines)."""
        for piece in src:
            for shard, lo, hi in piece:
                samples = read_index(self.manifest, shard, lo, hi)
                start = min(m[1] for m in samples[0].members) - TAR_HEADER
                end = samples[-1].end + (-samples[-1].end % TAR_HEADER)
                stream = object_store.open_range(self.paths[shard], start, end, self.read_bytes)
                try:
                    yield {"url": self.paths[shard], "stream": stream, "samples": samples}
                finally:
                    stream.close()

    def _tar_samples(self, src: Iterator[dict]) -> Iterator[dict]:
        """wds's tar expansion and grouping of each opened segment; every sample then checked against
        its index line (same key, in order) and cut to the members the index lists."""
        expected: dict[str, Iterator[Sample]] = {}

        def streams():
            for source in src:
                expected[source["url"]] = iter(source["samples"])
                yield source

        for sample in wds.tariterators.group_by_keys(wds.tariterators.tar_file_expander(streams())):
            url = sample["__url__"]
            line = next(expected[url], None)
            if line is None or line.key != sample["__key__"]:
                raise ValueError(f"{url}: sample {sample['__key__']!r} where the index expects "
                                 f"{line.key if line else 'no more samples'!r}")
            listed = {ext for ext, _, _ in line.members}
            yield {"__key__": sample["__key__"], "__url__": url,
                   **{ext: data for ext, data in sample.items() if ext in listed}}

    def _shuffle_stage(self, src: Iterator) -> Iterator:
        """wds.shuffle seeded by (seed, epoch, rank, worker): the same order on every replay."""
        rng = random.Random(f"{self.seed}:{int(self._epoch)}:{self.rank}:{_worker()[0]}")
        return wds.shuffle(self.shuffle_buffer, self.shuffle_buffer, rng=rng)(src)

    def _decode_member(self, key: str, data: bytes):
        ext = key.rsplit(".", 1)[-1]
        if ext in self.image_exts:
            return self._decode(data)
        if ext == "cls":
            return parse_label(data)
        if ext == "json":
            return json.loads(data) if self.output == "dict" else None
        return None

    def _to_output(self, sample: dict):
        image = next((sample[ext] for ext in sorted(self.image_exts) if ext in sample), None)
        if image is None:
            raise ValueError(f"{sample['__url__']}: sample {sample['__key__']} has no image member")
        label = sample.get("cls")
        if label is None:
            if self.labeled:
                raise ValueError(f"{sample['__url__']}: sample {sample['__key__']} has no .cls member")
            label = UNLABELED
        if self.transform is not None:
            image = self.transform(image)
        if self.output == "tuple":
            return image, label
        return {"key": sample["__key__"], "image": image, "label": label, "meta": sample.get("json")}

    def pipeline(self) -> wds.DataPipeline:
        """This dataset as a ``wds.DataPipeline`` (an IterableDataset): add stages with ``append``."""
        stages: list = [self._source, self._split_by_node, wds.split_by_worker, self._open_pieces,
                        self._tar_samples]
        if self.shuffle:
            stages.append(self._shuffle_stage)
        stages += [wds.map(self._keep_known), wds.decode(self._decode_member, pre=[], post=[]),
                   wds.map(self._to_output)]
        return wds.DataPipeline(*stages)

    def _keep_known(self, sample: dict) -> dict:
        """Only the members this reader decodes reach the decoder (never a .pyd/.pickle one)."""
        return {k: v for k, v in sample.items() if k.startswith("__") or k in self.image_exts or k in ("cls", "json")}

    def worker_samples(self, worker: int = 0, workers: int = 1, epoch: int | None = None) -> list[Sample]:
        """The samples (index lines) worker ``worker`` of ``workers`` of this rank yields in ``epoch``, in order."""
        epoch = int(self._epoch) if epoch is None else epoch
        piece = self.pieces(workers, epoch)[self.rank + self.world_size * worker]
        samples = [s for shard, lo, hi in piece for s in read_index(self.manifest, shard, lo, hi)]
        if not self.shuffle:
            return samples
        rng = random.Random(f"{self.seed}:{epoch}:{self.rank}:{worker}")
        return list(wds.shuffle(self.shuffle_buffer, self.shuffle_buffer, rng=rng)(iter(samples)))

    def __iter__(self) -> Iterator[Any]:
        return iter(self.pipeline())

    def _decode(self, data: bytes):
        if not self.decode:
            return data
        return decode_image(data, self.mode)


def image_pipeline(root: str | os.PathLike, **options) -> wds.DataPipeline:
    """The ``wds.DataPipeline`` of ``ImageShardDataset(root, **options)``; append your own stages,
    e.g. ``pipe.append(wds.batched(64))``, and iterate it or hand it to a DataLoader."""
    return ImageShardDataset(root, **options).pipeline()
