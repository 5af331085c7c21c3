"""DALI video pipeline over a `repack video` output: DALI's video reader on the GPU (NVDEC).

``build_video_pipeline`` reads the manifest's usable videos (files under OUT/videos, paths
confined to the root) with their class indices and returns a pipeline whose outputs are
``frames`` (N, F, H, W, 3) uint8 and ``labels`` (N, 1) int32 (``DALIVideoLoader`` yields them
as int64 (N,)). Sampling: ``sequence_length``
frames ``stride`` apart, clip starts ``step`` apart (``-1``: ``sequence_length``), exactly as
pipelines.torch_video. ``resize=(h, w)`` makes a batch uniform when videos differ in size.

``reader="legacy"`` is ``fn.readers.video`` (GPU only: DALI's PyPI FFmpeg has no software
H.264/HEVC decoder), which reads one codec per reader and is the fast one (random 16-frame
clips ran 4-12x faster than the experimental reader's on the H200, tests/gpu/gpu_video.py);
``reader="experimental"`` is ``fn.experimental.readers.video``, which reads a dataset of mixed
codecs and also runs on the CPU for VP8/VP9/MJPEG (used by the CI tests). The default
(``reader=None``) is the reader the dataset was judged for: the manifest's ``dali_reader``
(`repack video --dali-reader`, ``legacy`` unless chosen otherwise, and for manifests written
before the field existed), so every video the rule passed as is is one this reader decodes, in
one pass over the whole dataset (every codec but H.264 is transcoded for the legacy reader;
MJPEG for the experimental one).

Labels: the class index, ``-1`` (``UNLABELED``) for a video without a class, as in
pipelines.torch_video (DALI accepts negative values in ``labels=``; only its ``file_list``
rejects them, which is why OUT/file_list.txt writes 0 there). Files are passed as absolute
paths from the manifest, confined to OUT (``safe_join``), not through OUT/file_list.txt: DALI
forbids ``file_root`` with ``file_list`` and resolves file_list paths against the working
directory.

Resume: pipelines are built with ``enable_checkpointing`` and ``DALIVideoLoader.state_dict()``
holds DALI's own checkpoint (both readers support it: reader position, shuffle buffer), see
pipelines.dali_resume; ``build_video_pipeline(..., checkpoint=...)`` restores a raw pipeline.
"""

from __future__ import annotations

from pipelines.dali_resume import OpenedVersion, ResumableDALILoader, builder_args, restore_bytes
from pipelines.dataset_identity import identity
from repack.manifest.versions import number_of
from pipelines.torch_video import UNLABELED, manifest_videos

READER_NAME = "VideoReader"
KIND = "dali_video"
READERS = ("legacy", "experimental")  # the keys of repack's DALI_READERS (the manifest's dali_reader)


def dataset_reader(root, version: int | None = None) -> str:
    """The DALI reader the dataset in ``root`` was judged for (``legacy`` for manifests without
    ``dali_reader``: those were judged for it)."""
    _, manifest = manifest_videos(root, version)
    return manifest.data.get("dali_reader") or "legacy"


def video_inputs(root, version: int | None = None) -> tuple[list[str], list[int]]:
    """(absolute file paths, class indices) of the manifest's videos, in manifest order."""
    entries, manifest = manifest_videos(root, version)
    return ([str(manifest.path(e["path"])) for e in entries],
            [int(e["cls"]) if e.get("cls") is not None else UNLABELED for e in entries])


def build_video_pipeline(root, *, sequence_length: int, batch_size: int, reader: str | None = None,
                         version: int | None = None, **options):
    """A built DALI Pipeline over the videos of the dataset in ``root`` (the latest version, or
    ``version``), read with ``reader`` (default: the reader the dataset was judged for); ``options``
    as ``build_files_pipeline``."""
    files, labels = video_inputs(root, version)
    if not files:
        raise ValueError(f"{root}: the manifest lists no videos")
    _, manifest = manifest_videos(root, version)
    return build_files_pipeline(files, labels, sequence_length=sequence_length, batch_size=batch_size,
                                reader=reader or dataset_reader(root, version), dataset=identity(manifest), **options)


SHAPING = ("stride", "step", "shard_id", "num_shards", "random_shuffle", "seed", "initial_fill", "pad_last_batch")


def order_options(files: list[str], batch_size: int, sequence_length: int, reader: str, options: dict) -> dict:
    """The options that shape the clip order (``SHAPING`` of ``options``), as a loader state records them."""
    return {"videos": len(files), "batch_size": batch_size, "sequence_length": sequence_length, "reader": reader,
            **{name: options[name] for name in SHAPING}}


def build_files_pipeline(files: list[str], labels: list[int], *, sequence_length: int, batch_size: int,
                         reader: str = "legacy", stride: int = 1, step: int = -1, shard_id: int = 0,
                         num_shards: int = 1, random_shuffle: bool = False, seed: int = 0, device: str = "gpu",
                         device_id: int | None = 0, num_threads: int = 4, initial_fill: int = 64,
                         resize: tuple[int, int] | None = None, prefetch_queue_depth: int = 2,
                         pad_last_batch: bool = True, enable_checkpointing: bool = True,
                         checkpoint: dict | bytes | None = None, dataset: dict | None = None):
    """A built DALI Pipeline reading ``files`` (with ``labels``) through ``reader`` (``READERS``) on
    ``device`` (``gpu``; ``cpu`` only with the experimental reader). ``checkpoint``: continue
    where a pipeline with the same options stopped (``pipe.checkpoint()`` bytes or a
    ``DALIVideoLoader`` state); ``dataset``: the identity of the dataset version ``files`` come
    from, checked against a state's."""
    from nvidia.dali import fn, pipeline_def, types

    if reader not in READERS:
        raise ValueError(f"reader must be one of {', '.join(READERS)}, got {reader!r}")
    if reader == "legacy" and device != "gpu":
        raise ValueError(f"the legacy reader (fn.readers.video) runs on the GPU only, got device={device!r}; "
                         "use reader='experimental' for the CPU")
    options = order_options(files, batch_size, sequence_length, reader, dict(
        stride=stride, step=step, shard_id=shard_id, num_shards=num_shards, random_shuffle=random_shuffle, seed=seed,
        initial_fill=initial_fill, pad_last_batch=pad_last_batch))
    checkpoint = restore_bytes(checkpoint, KIND, options, enable_checkpointing, dataset)

    @pipeline_def(batch_size=batch_size, num_threads=num_threads, device_id=device_id, seed=seed,
                  prefetch_queue_depth=prefetch_queue_depth, enable_checkpointing=enable_checkpointing,
                  checkpoint=checkpoint)
    def video_pipeline():
        common = dict(filenames=files, labels=labels, sequence_length=sequence_length, stride=stride, step=step,
                      shard_id=shard_id, num_shards=num_shards, random_shuffle=random_shuffle,
                      initial_fill=initial_fill, pad_last_batch=pad_last_batch, name=READER_NAME)
        if reader == "legacy":
            frames, label = fn.readers.video(device=device, dtype=types.UINT8, **common)
        else:
            frames, label = fn.experimental.readers.video(device=device, **common)
        if resize is not None:
            frames = fn.resize(frames, resize_y=resize[0], resize_x=resize[1])
        return frames, label

    pipe = video_pipeline()
    pipe.build()
    return pipe


class DALIVideoLoader:
    """A PyTorch-style iterator over a video pipeline: yields (frames, labels) torch tensors.

    ``state_dict()`` / ``load_state_dict()`` (or ``state=`` here) resume it exactly, mid-epoch.
    """

    def __init__(self, root, *, sequence_length: int, batch_size: int, auto_reset: bool = True,
                 state: dict | None = None, version: int | None = None, **kwargs) -> None:
        reader = kwargs.pop("reader", None) or dataset_reader(root, version)
        args = builder_args(build_files_pipeline, kwargs)

        def open_version(chosen: int | None) -> OpenedVersion:
            chosen = version if chosen is None else chosen
            _, manifest = manifest_videos(root, chosen)
            chosen = number_of(manifest.data)  # pinned: the files and every build (a state loaded later) read it
            files, _ = video_inputs(root, chosen)
            options = order_options(files, batch_size, sequence_length, reader, args)

            def build(saved: dict | None):
                return build_video_pipeline(root, sequence_length=sequence_length, batch_size=batch_size,
                                            reader=reader, version=chosen, checkpoint=saved, **kwargs)

            return OpenedVersion(identity(manifest), options, build)

        self._loader = ResumableDALILoader(KIND, open_version, ["frames", "labels"], root=str(root),
                                           reader_name=READER_NAME, auto_reset=auto_reset,
                                           resume="dali" if args["enable_checkpointing"] else "none", state=state)

    @property
    def pipe(self):
        """The DALI pipeline (rebuilt by ``load_state_dict``)."""
        return self._loader.pipe

    def __iter__(self):
        for batch in self._loader:
            yield batch[0]["frames"], batch[0]["labels"].view(-1).long()

    def __len__(self) -> int:
        return len(self._loader)

    @property
    def padding(self) -> int:
        """Repeated clips this rank yields in the current epoch (equal steps: ``ResumableDALILoader``)."""
        return self._loader.padding

    def state_dict(self) -> dict:
        """The loader's position after the last batch taken, as JSON-safe data."""
        return self._loader.state_dict()

    def load_state_dict(self, state: dict) -> None:
        """Continue from ``state`` (from ``state_dict``): rebuilds the pipeline there."""
        self._loader.load_state_dict(state)
