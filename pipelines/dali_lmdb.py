"""NVIDIA DALI reader for ``repack images --to lmdb`` datasets.

DALI has no LMDB reader for this layout, so ``fn.external_source`` is fed from the database
(read-only, ``lock=False``; raw bytes and ASCII labels, never pickle) and the images are
decoded by ``fn.decoders.image``: on the GPU (``device="mixed"``, nvJPEG, the hardware decoder
for baseline JPEGs, which ``--normalize`` guarantees) when ``device_id`` is given, else on the
CPU backend.

Each pipeline (``shard_id`` of ``num_shards``) reads a contiguous, balanced range of the
samples; with ``random_shuffle`` the range is read in a fresh permutation every epoch (seed +
epoch). Every rank reads as many samples per epoch, so every rank yields as many batches (DDP never
waits on a rank with one step more), as the PyTorch readers do: a range one sample short of
``ceil(samples / num_shards)`` ends with one repeat of its epoch's first sample (``padding``); with
``drop_last`` every range is cut to ``samples // num_shards`` (its epoch's last sample is left out).
An epoch ends with the range: the source raises StopIteration and ``pipe.reset()``
(or the DALI iterator) starts the next one. The last batch is partial unless ``pad_last_batch``
(it repeats the range's last sample) or ``drop_last`` (the epoch ends before a short batch: every
batch holds exactly ``batch_size`` samples; a range smaller than one batch yields none).

Resume: the source's position is (epoch, batch), its order a function of the seed and the epoch,
so ``LmdbBatchSource(..., epoch=e, batch=b)`` starts at batch ``b`` of epoch ``e`` without reading
a record before it. ``dali_lmdb_loader`` counts the batches its caller took and saves that
position in ``state_dict()`` (pipelines.dali_resume); prefetched batches do not count.
"""

from __future__ import annotations

import os
import random

import numpy as np

from pipelines.dali_resume import OpenedVersion, ResumableDALILoader, builder_args, check_state, shard_range
from pipelines.dataset_identity import identity
from repack.manifest.versions import number_of
from pipelines.manifest_access import dali_misread_refusal
from pipelines.sample_errors import decode_error
from pipelines.torch_lmdb import LmdbReader, checked_label, class_indices, open_lmdb_dataset, sample_key

KIND = "dali_lmdb"

IMAGENET_MEAN = (0.485 * 255, 0.456 * 255, 0.406 * 255)
IMAGENET_STD = (0.229 * 255, 0.224 * 255, 0.225 * 255)


def epoch_batches(samples: int, batch_size: int, drop_last: bool) -> int:
    """Batches in one epoch over ``samples`` samples."""
    return samples // batch_size if drop_last else -(-samples // batch_size)


def rank_samples(count: int, num_shards: int, drop_last: bool) -> int:
    """Samples every rank reads per epoch (equal steps): ``ceil(count / num_shards)``, a short range padded;
    ``drop_last``: ``count // num_shards``, a long range cut."""
    return count // num_shards if drop_last else -(-count // num_shards)


class LmdbBatchSource:
    """A batch callable for ``fn.external_source``: ([encoded images], [labels]) per call, and
    [record indices] with ``with_index``.

    It starts at batch ``batch`` of epoch ``epoch`` (a batch past the epoch's last: the next
    epoch's start).
    """

    def __init__(self, path: str, count: int, batch_size: int, shard_id: int = 0, num_shards: int = 1,
                 random_shuffle: bool = False, seed: int = 0, pad_last_batch: bool = False,
                 drop_last: bool = False, epoch: int = 0, batch: int = 0, with_index: bool = False,
                 class_indices: frozenset | None = None) -> None:
        if num_shards < 1 or not 0 <= shard_id < num_shards:
            raise ValueError(f"shard {shard_id} of {num_shards} is not valid")
        if pad_last_batch and drop_last:
            raise ValueError("pad_last_batch and drop_last exclude each other")
        self.reader = LmdbReader(path, count)
        self.count = count
        self.start, self.stop = shard_range(count, shard_id, num_shards)
        self.samples = rank_samples(count, num_shards, drop_last)  # per epoch: the range padded or cut to it
        self.padding = max(0, self.samples - (self.stop - self.start))  # repeats of the epoch's first sample
        self.batch_size, self.random_shuffle, self.seed, self.pad = batch_size, random_shuffle, seed, pad_last_batch
        self.drop_last, self.with_index = drop_last, with_index
        self.class_indices = class_indices  # a labeled dataset's class map's indices (``torch_lmdb.checked_label``)
        if epoch < 0 or batch < 0:
            raise ValueError(f"epoch {epoch} and batch {batch} must not be negative")
        self.epoch = epoch - 1
        self._order: list[int] = []
        self._pos = 0
        self._new_epoch()
        if batch > 0 and batch >= epoch_batches(len(self), batch_size, drop_last):
            self._new_epoch()
        else:
            self._pos = batch * batch_size

    def __len__(self) -> int:
        """Samples per epoch (the same on every rank)."""
        return self.samples

    def _new_epoch(self) -> None:
        self.epoch += 1
        self._order = list(range(self.start, self.stop))
        if self.random_shuffle:
            random.Random(self.seed * 1_000_003 + self.epoch).shuffle(self._order)
        # an empty share (more ranks than samples) repeats a sample of the dataset, as the PyTorch readers pad
        repeated = self._order or ([self.start % self.count] if self.count else [])
        self._order = (self._order + repeated * self.padding)[:self.samples]
        self._pos = 0

    def _label(self, index: int, cls: bytes | None) -> int:
        """A record's label (-1 without one); a bad value is a SampleDecodeError naming database and key."""
        try:
            return checked_label(cls, self.class_indices)
        except ValueError as exc:
            raise decode_error(self.reader.path, sample_key(index), "label", exc) from exc

    def __call__(self):
        left = len(self._order) - self._pos
        if left <= 0 or (self.drop_last and left < self.batch_size):
            self._new_epoch()
            raise StopIteration
        indices = self._order[self._pos:self._pos + self.batch_size]
        self._pos += len(indices)
        if self.pad and indices and len(indices) < self.batch_size:
            indices += [indices[-1]] * (self.batch_size - len(indices))
        images, labels = [], []
        for index in indices:
            raw = self.reader.get(index)
            images.append(np.frombuffer(raw["img"], dtype=np.uint8))
            labels.append(np.array([self._label(index, raw["cls"])], dtype=np.int32))
        if self.with_index:
            return images, labels, [np.array(index, dtype=np.int64) for index in indices]
        return images, labels


def build_lmdb_pipeline(root: str | os.PathLike, batch_size: int, num_threads: int = 4,
                        device_id: int | None = None, shard_id: int = 0, num_shards: int = 1,
                        size: int | None = 224, random_shuffle: bool = False, seed: int = 0,
                        normalize: bool = True, pad_last_batch: bool = False, prefetch_queue_depth: int = 2,
                        drop_last: bool = False, with_index: bool = False, checkpoint: dict | None = None,
                        version: int | None = None):
    """A built DALI pipeline with outputs ``images`` and ``labels`` (int32, -1 when unlabeled), and
    with ``with_index`` ``index`` (int64, the record's position in the dataset: a sample's key).

    ``drop_last``: an epoch ends before a short last batch (every batch is full); ``pad_last_batch``:
    the short last batch is filled with the range's last sample; neither: it is short.

    ``size`` given: resize the shorter side to ``size`` and center-crop ``size`` x ``size``, then
    (``normalize``) float CHW with ImageNet mean/std, else uint8 HWC; ``size=None``: decoded
    uint8 HWC RGB. ``device_id=None`` runs on the CPU backend. ``checkpoint``: a
    ``dali_lmdb_loader`` state (``state_dict()``) of a loader with the same options to start at.
    ``version``: the dataset version to read (default: the latest).
    """
    from nvidia.dali import fn, types
    from nvidia.dali.pipeline import Pipeline

    manifest, path, count = open_lmdb_dataset(root, version)
    misread = dali_misread_refusal(manifest)
    if misread is not None:
        raise ValueError(misread)
    epoch = batch = 0
    if checkpoint is not None:
        options = order_options(count, batch_size, shard_id, num_shards, random_shuffle, seed, pad_last_batch,
                                drop_last)
        state = check_state(checkpoint, KIND, options, identity(manifest))
        epoch, batch = state["epoch"], state["batch"]
    source = LmdbBatchSource(path, count, batch_size, shard_id, num_shards, random_shuffle, seed, pad_last_batch,
                             drop_last, epoch, batch, with_index, class_indices(manifest))
    gpu = device_id is not None
    pipe = Pipeline(batch_size=batch_size, num_threads=num_threads, device_id=device_id, seed=seed,
                    prefetch_queue_depth=prefetch_queue_depth, exec_dynamic=True)
    with pipe:
        inputs = fn.external_source(source=source, num_outputs=3 if with_index else 2, batch=True, parallel=False,
                                    dtype=[types.UINT8, types.INT32, types.INT64][:3 if with_index else 2])
        jpegs, labels = inputs[:2]
        images = fn.decoders.image(jpegs, device="mixed" if gpu else "cpu", output_type=types.RGB,
                                   adjust_orientation=False)  # the stored pixels, as the PyTorch readers decode
        if size is not None:
            images = fn.resize(images, resize_shorter=size)
            if normalize:
                images = fn.crop_mirror_normalize(images, crop=(size, size), mean=list(IMAGENET_MEAN),
                                                  std=list(IMAGENET_STD), dtype=types.FLOAT,
                                                  output_layout="CHW")
            else:
                images = fn.crop(images, crop=(size, size))
        labels = fn.reshape(labels, shape=[])
        pipe.set_outputs(images, *[data.gpu() if gpu else data for data in [labels, *inputs[2:]]])
    pipe.build()
    return pipe


def order_options(count: int, batch_size: int, shard_id: int, num_shards: int, random_shuffle: bool, seed: int,
                  pad_last_batch: bool, drop_last: bool) -> dict:
    """The options that shape the sample order, as a loader state records them."""
    return {"samples": count, "batch_size": batch_size, "shard_id": shard_id, "num_shards": num_shards,
            "random_shuffle": random_shuffle, "seed": seed, "pad_last_batch": pad_last_batch, "drop_last": drop_last}


def dali_lmdb_loader(root: str | os.PathLike, batch_size: int, num_threads: int = 4, device_id: int | None = None,
                     shard_id: int = 0, num_shards: int = 1, auto_reset: bool = True, state: dict | None = None,
                     **pipeline_args) -> ResumableDALILoader:
    """A ``DALIGenericIterator`` over ``build_lmdb_pipeline`` that resumes (``state_dict()``,
    ``load_state_dict()``, or ``state=`` here); yields ``[{"images": ..., "labels": ...}]`` (and
    ``"index"`` with ``with_index=True``). A state of another dataset version continues on that
    version while it is kept."""
    args = builder_args(build_lmdb_pipeline, pipeline_args)

    def open_version(version: int | None) -> OpenedVersion:
        version = args["version"] if version is None else version
        manifest, _, count = open_lmdb_dataset(root, version)
        version = number_of(manifest.data)  # pinned: a build (a state loaded later) reads this version, not the latest
        options = order_options(count, batch_size, shard_id, num_shards, args["random_shuffle"], args["seed"],
                                args["pad_last_batch"], args["drop_last"])

        def build(saved: dict | None):
            return build_lmdb_pipeline(root, batch_size, num_threads, device_id, shard_id, num_shards,
                                       checkpoint=saved, **{**pipeline_args, "version": version})

        samples = rank_samples(count, num_shards, args["drop_last"])
        if not epoch_batches(samples, batch_size, args["drop_last"]):
            raise ValueError(f"{manifest.root}: batch_size {batch_size} is more than a rank's {samples} sample(s) "
                             f"({count} over {num_shards} rank(s)) with drop_last: every epoch would be empty")
        start, stop = shard_range(count, shard_id, num_shards)
        return OpenedVersion(identity(manifest), options, build, epoch_batches(samples, batch_size, args["drop_last"]),
                             padding=max(0, samples - (stop - start)))

    names = ["images", "labels", "index"] if args["with_index"] else ["images", "labels"]
    return ResumableDALILoader(KIND, open_version, names, root=str(root), reader_name=None, auto_reset=auto_reset,
                               resume="source", state=state)


def read_epoch(pipe) -> list:
    """Run ``pipe`` until its source ends one epoch; the list of (images, labels) batches (then reset)."""
    batches = []
    while True:
        try:
            batches.append(pipe.run())
        except StopIteration:
            pipe.reset()
            return batches
