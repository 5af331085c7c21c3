"""NVIDIA DALI reader for image WebDatasets written by ``repack images``.

``build_image_pipeline`` reads the manifest's shards with ``fn.readers.webdataset`` and their
DALI index files, with ``missing_component_behavior="error"`` (DALI's default would silently
yield empty samples), decodes on the GPU (``device="mixed"``) when a ``device_id`` is given and
on the CPU backend otherwise, and optionally resizes, crops and normalizes.

The label is computed inside DALI from the ``.cls`` member: zero-padded ASCII digits of one
fixed width per dataset (repack guarantees it). The bytes are cast to int32, 48 (``'0'``) is
subtracted, each digit is weighted by its power of ten and the row is summed (the sum comes out
int64: the labels are int64).

``dali_image_loader`` wraps the pipeline in a ``DALIGenericIterator`` (torch tensors) that
knows the reader's epoch size through ``reader_name``, and resumes exactly: its ``state_dict()``
holds DALI's own checkpoint (reader position, shuffle buffer, random generators; the pipeline
is built with ``enable_checkpointing``), see pipelines.dali_resume.
"""

from __future__ import annotations

import os
from typing import Sequence

import numpy as np

from pipelines.dali_resume import OpenedVersion, ResumableDALILoader, builder_args, restore_bytes, shard_range
from pipelines.dataset_identity import identity
from repack.manifest.versions import number_of
from pipelines.manifest_access import (dali_misread_refusal, image_extensions, is_labeled, open_webdataset, read_index,
                                       read_index_columns, shard_files)
from repack.manifest import ManifestError

READER = "Reader"
KIND = "dali_webdataset"
DALI_UNDECODABLE = frozenset({"gif"})  # fn.decoders.image: JPEG, PNG, BMP, TIFF, PNM, JPEG 2000, WebP

IMAGENET_MEAN = (0.485 * 255, 0.456 * 255, 0.406 * 255)
IMAGENET_STD = (0.229 * 255, 0.224 * 255, 0.225 * 255)


def cls_width(manifest) -> int:
    """Width in bytes of the dataset's ``.cls`` members (checked on the first sample)."""
    for shard, entry in enumerate(manifest.shards):
        if entry.samples:
            for ext, _, size in read_index(manifest, shard, 0, 1)[0].members:
                if ext == "cls":
                    return size
            raise ManifestError(f"{manifest.root}: the manifest has a cls field, the first sample has no .cls")
    raise ManifestError(f"{manifest.root}: no samples")


def output_names(root: str | os.PathLike, with_meta: bool = False, version: int | None = None) -> list[str]:
    """Names of the pipeline's outputs, in order: images[, labels][, meta]."""
    names = ["images"]
    if is_labeled(open_webdataset(root, "images", version)):
        names.append("labels")
    if with_meta:
        names.append("meta")
    return names


def check_shard_files(manifest) -> None:
    """Each shard's tar of the size its manifest entry records (``bytes``: a stat, or a HEAD on s3://) and its
    index file as recorded (``index_bytes``, ``index_sha256``); else a ManifestError naming the file. DALI takes an
    index's offsets and sizes as they are: a line repeated, moved or edited would give it another sample's image
    or label, or one sample fewer, without an error, and a tar cut short crashed its reader (SIGSEGV) or was
    named as a "malformed index"."""
    import hashlib

    from pipelines import object_store
    from pipelines.manifest_access import index_bytes
    from repack.manifest import ManifestError

    entries = [e for e in manifest.data["shards"] if e.get("bytes") is not None]
    tars = [str(manifest.path(e["path"])) for e in entries]
    for tar, entry, found in zip(tars, entries, object_store.sizes(tars)):
        if found is None:
            raise ManifestError(f"{tar}: the shard is missing (repack verify names what else is)")
        if found != entry["bytes"]:
            raise ManifestError(f"{tar}: {found} bytes, the manifest says {entry['bytes']}: the shard changed "
                                "since packing (repack verify names what else did)")
    for entry in manifest.data["shards"]:
        want_sha, want_size = entry.get("index_sha256"), entry.get("index_bytes")
        if not entry.get("index") or (want_sha is None and want_size is None):
            continue
        location = manifest.path(entry["index"])
        raw = index_bytes(location)  # mapped: hashed without a copy
        if want_size is not None and len(raw) != want_size:
            raise ManifestError(f"{location}: {len(raw)} bytes, the manifest says {want_size}: the index changed "
                                "since packing (repack verify names what else did)")
        if want_sha is not None and hashlib.sha256(raw).hexdigest() != want_sha:
            raise ManifestError(f"{location}: its sha256 is not the manifest's: the index changed since packing "
                                "(repack verify names what else did)")


def build_image_pipeline(root: str | os.PathLike, batch_size: int, num_threads: int = 4,
                         device_id: int | None = None, shard_id: int = 0, num_shards: int = 1,
                         size: int | None = 224, random_shuffle: bool = False, seed: int = 0,
                         train: bool = False, mean: Sequence[float] = IMAGENET_MEAN,
                         std: Sequence[float] = IMAGENET_STD, with_meta: bool = False,
                         initial_fill: int = 1024, pad_last_batch: bool = True, prefetch_queue_depth: int = 2,
                         hw_decoder_load: float | None = None, enable_checkpointing: bool = True,
                         checkpoint: dict | bytes | None = None, version: int | None = None):
    """A built DALI pipeline over the dataset in ``root``.

    Outputs (see ``output_names``): ``images`` (``size`` given: float CHW normalized
    ``size`` x ``size``; else decoded uint8 HWC RGB), ``labels`` (int64 scalars, when the dataset
    is labeled: DALI's sum of the int32 digits widens to int64) and, with ``with_meta``, ``meta``
    (the ``.json`` member's bytes, zero-padded to the longest in the batch). ``train`` uses a random resized crop and a random mirror
    instead of resize-shorter + center crop. ``device_id=None`` runs on the CPU backend.

    ``checkpoint``: continue where a pipeline with the same options stopped, from its
    ``pipe.checkpoint()`` bytes or a ``dali_image_loader`` state (``state_dict()``).
    ``version``: the dataset version to read (``manifest.vN.json``); None: the latest.
    """
    from nvidia.dali import fn, types
    from nvidia.dali.pipeline import Pipeline

    manifest = open_webdataset(root, "images", version)
    samples = int(manifest.data["totals"]["samples"])
    if num_shards < 1 or not 0 <= shard_id < num_shards or num_shards > samples:
        raise ValueError(f"{manifest.root}: part {shard_id} of {num_shards} of {samples} sample(s): DALI's reader "
                         "needs 0 <= shard_id < num_shards <= samples (each part one sample at least)")
    paths, index_paths = shard_files(manifest)
    if not all(path.isascii() or _utf8(path) for path in paths + index_paths):  # DALI takes its paths as UTF-8
        raise ValueError(f"{str(manifest.root)!r}: a shard's path is not UTF-8 (a folder named in another encoding); "
                         "DALI cannot open it: read it with the PyTorch reader, or move the dataset to a UTF-8 path")
    check_shard_files(manifest)
    read_index_columns(manifest)  # every index laid out as its tar (the parser's checks): DALI trusts it blindly
    labeled = is_labeled(manifest)
    image_exts = image_extensions(manifest)
    if set(image_exts) & DALI_UNDECODABLE:
        raise ValueError(f"{manifest.root}: DALI's image decoder cannot read {sorted(set(image_exts) & DALI_UNDECODABLE)} "
                         "members; repack with --normalize (every image becomes a baseline JPEG) or use the "
                         "PyTorch reader")
    misread = dali_misread_refusal(manifest)
    if misread is not None:
        raise ValueError(misread)
    exts = [";".join(image_exts)]
    if labeled:
        exts.append("cls")
        width = cls_width(manifest)
    if with_meta:
        if "json" not in manifest.fields:
            raise ValueError(f"{manifest.root}: with_meta=True reads the .json member, and this dataset has none "
                             "(packed with --no-sample-json); read it with with_meta=False")
        exts.append("json")
    gpu = device_id is not None
    options = order_options(manifest, batch_size, shard_id, num_shards, random_shuffle, seed, initial_fill,
                            pad_last_batch)
    checkpoint = restore_bytes(checkpoint, KIND, options, enable_checkpointing, identity(manifest))
    pipe = Pipeline(batch_size=batch_size, num_threads=num_threads, device_id=device_id, seed=seed,
                    prefetch_queue_depth=prefetch_queue_depth, enable_checkpointing=enable_checkpointing,
                    checkpoint=checkpoint)
    with pipe:
        outputs = fn.readers.webdataset(
            paths=paths, index_paths=index_paths, ext=exts, missing_component_behavior="error", name=READER,
            shard_id=shard_id, num_shards=num_shards, random_shuffle=random_shuffle, initial_fill=initial_fill,
            pad_last_batch=pad_last_batch, seed=seed)
        outputs = list(outputs) if isinstance(outputs, (list, tuple)) else [outputs]
        encoded = outputs.pop(0)
        # the stored pixels, as the PyTorch readers decode them (EXIF orientation is --normalize's to apply)
        decoder_args = {"device": "mixed" if gpu else "cpu", "output_type": types.RGB, "adjust_orientation": False}
        if gpu and hw_decoder_load is not None:
            decoder_args["hw_decoder_load"] = hw_decoder_load
        if size is not None and train:
            images = fn.decoders.image_random_crop(encoded, **decoder_args, seed=seed)
            images = fn.resize(images, resize_x=size, resize_y=size)
            mirror = fn.random.coin_flip(probability=0.5, seed=seed)
        else:
            images = fn.decoders.image(encoded, **decoder_args)
            if size is not None:
                images = fn.resize(images, resize_shorter=size)
            mirror = 0
        if size is not None:
            images = fn.crop_mirror_normalize(images, crop=(size, size), mean=list(mean), std=list(std),
                                              mirror=mirror, dtype=types.FLOAT, output_layout="CHW")
        results = [images]
        if labeled:
            digits = fn.cast(outputs.pop(0), dtype=types.INT32) - 48
            powers = types.Constant(np.array([10 ** (width - 1 - i) for i in range(width)], dtype=np.int32))
            results.append(fn.reductions.sum(digits * powers, axes=0))
        if with_meta:
            results.append(fn.pad(outputs.pop(0), fill_value=0))
        pipe.set_outputs(*results)
    pipe.build()
    return pipe


DECODER_FAILURE = ("decoders", "nvImageCodec", "nvjpeg", "decode")  # words of a DALI decoder's error
NOT_THE_DATA = ("out of memory", "allocation failed", "cuda error", "cudaerror", "cuda_error")  # the device's


def failure_named(manifest, exc: BaseException, shard_id: int = 0, num_shards: int = 1,
                  epoch: int = 0) -> BaseException | None:
    """The error to raise for a DALI decoder's failure ``exc`` over ``manifest``'s dataset (read as part
    ``shard_id`` of ``num_shards`` in ``epoch``): the first sample of the shards that part reads whose bytes are
    not the ones packed (``shard_damage``: the shard and the key), else a ``RuntimeError`` saying that they are
    intact; both keep DALI's message. None for any other failure (out of memory, a CUDA error): re-raised as it
    is. DALI's reader moves a pipeline to part ``(shard_id + epoch) % num_shards`` each epoch, and prefetches
    into the next: the parts of ``epoch`` and ``epoch + 1`` are checked."""
    from pipelines.sample_errors import ShardIntegrityError
    from pipelines.shard_damage import damaged_samples

    text = str(exc)
    if not any(word in text for word in DECODER_FAILURE) or any(word in text.lower() for word in NOT_THE_DATA):
        return None
    said = " ".join(dict.fromkeys(line.strip() for line in text.splitlines()
                                  if line.strip() and "no longer valid" not in line))[:1000]
    parts = [(shard_id + e) % num_shards for e in (epoch, epoch + 1)]
    found = damaged_samples(manifest, sorted({n for part in dict.fromkeys(parts)
                                              for n in part_shards(manifest, part, num_shards)}))
    if found:
        path, key, problem = found[0]
        more = f"; {len(found) - 1} more damaged" if len(found) > 1 else ""
        return ShardIntegrityError(path, key, f"{problem} (`repack verify` names every damaged file{more}); "
                                              f"DALI said: {said}")
    return RuntimeError(f"{manifest.root}: DALI's decoder failed, and the samples of the shards this reader reads "
                        "are the bytes packed (crc32 per sample, where the shard has a .crc file): an image DALI's "
                        f"decoder rejects as packed (pipelines.torch_webdataset.ImageShardDataset names it); "
                        f"DALI said: {said}")


def part_shards(manifest, shard_id: int, num_shards: int) -> list[int]:
    """The shard numbers holding the samples DALI's reader gives part ``shard_id`` of ``num_shards`` (its
    contiguous share of the dataset's samples)."""
    counts = [int(entry["samples"]) for entry in manifest.data["shards"]]
    first, last = shard_range(sum(counts), shard_id, num_shards)
    found, at = [], 0
    for number, count in enumerate(counts):
        if at < last and at + count > first:
            found.append(number)
        at += count
    return found


def order_options(manifest, batch_size: int, shard_id: int, num_shards: int, random_shuffle: bool, seed: int,
                  initial_fill: int, pad_last_batch: bool) -> dict:
    """The options that shape the sample order, as a loader state records them."""
    return {"samples": manifest.data["totals"]["samples"], "batch_size": batch_size, "shard_id": shard_id,
            "num_shards": num_shards, "random_shuffle": random_shuffle, "seed": seed,
            "initial_fill": initial_fill if random_shuffle else None, "pad_last_batch": pad_last_batch}


def _utf8(text: str) -> bool:
    try:
        text.encode("utf-8")
    except UnicodeEncodeError:
        return False
    return True


def dali_image_loader(root: str | os.PathLike, batch_size: int, num_threads: int = 4, device_id: int | None = None,
                      shard_id: int = 0, num_shards: int = 1, last_batch: str = "partial", auto_reset: bool = True,
                      state: dict | None = None, **pipeline_args) -> ResumableDALILoader:
    """A ``DALIGenericIterator`` over ``build_image_pipeline`` that resumes; yields dicts of torch tensors.

    ``last_batch``: ``"partial"`` (every sample of the shard once per epoch, the last batch
    smaller), ``"drop"`` or ``"fill"`` (DALI's LastBatchPolicy). ``state``: a ``state_dict()`` of
    a loader with the same options to continue from (or call ``load_state_dict`` later); a state
    of another dataset version continues on that version while it is kept.
    """
    args = builder_args(build_image_pipeline, pipeline_args)

    def open_version(version: int | None) -> OpenedVersion:
        version = args["version"] if version is None else version
        manifest = open_webdataset(root, "images", version)
        version = number_of(manifest.data)  # pinned: a build (a state loaded later) reads this version, not the latest
        options = order_options(manifest, batch_size, shard_id, num_shards, args["random_shuffle"], args["seed"],
                                args["initial_fill"], args["pad_last_batch"])

        def build(saved: dict | None):
            return build_image_pipeline(root, batch_size, num_threads, device_id, shard_id, num_shards,
                                        checkpoint=saved, **{**pipeline_args, "version": version})

        return OpenedVersion(identity(manifest), options, build,
                             diagnose=lambda exc, epoch: failure_named(manifest, exc, shard_id, num_shards, epoch))

    names = output_names(root, args["with_meta"], args["version"])
    return ResumableDALILoader(KIND, open_version, names, root=str(root), reader_name=READER, last_batch=last_batch,
                               auto_reset=auto_reset, resume="dali" if args["enable_checkpointing"] else "none",
                               state=state)
