"""PyTorch clip dataset over a `repack video` output, decoding on the CPU with PyAV.

Sampling follows DALI's ``fn.readers.video``: a clip is ``sequence_length`` frames taken
``stride`` frames apart; clip starts are ``step`` frames apart (``step <= 0`` means
``sequence_length``, DALI's default) and a clip never runs past the last frame. Frame numbers
count decoded frames from 0, located through the constant frame rate repack guarantees.

DataLoader-worker safe: the dataset holds only paths and integers; each ``__getitem__`` opens
its own container. A root may be ``s3://bucket/prefix``: each clip then reads its video through
``pipelines.ranged_file`` (1 MiB ranged GETs of the blocks the decoder touches, never the whole
object unless the clip needs it). Order and resume come from the sampler: pass
``pipelines.sampler_resume.ResumableSampler`` to a ``StatefulDataLoader``. A missing video
raises RuntimeError naming the dataset, the clip and the file. Items: ``(frames uint8 tensor (F, H, W, 3), label int)``; the label is
``-1`` (``UNLABELED``) for a video without a class, as in pipelines.dali_video. A clip whose
frames are missing raises RuntimeError naming the file; one whose decode or transform fails,
``pipelines.sample_errors.SampleDecodeError`` naming the file and the clip (``"clip <i>"``).
"""

from __future__ import annotations

import io
import operator
import os
from collections.abc import Sequence
from fractions import Fraction

import numpy as np

from pipelines import object_store
from pipelines.manifest_access import open_manifest
from repack.manifest import ManifestError
from repack.manifest.containers import SAFE_INPUT_OPTIONS
from repack.manifest.video_entries import entry_problem
from pipelines.sample_errors import decode_error
from pipelines.dataset_identity import identity
from pipelines.sampler_resume import MapDatasetState

UNLABELED = -1  # the label of a video without a class (both readers)


def manifest_videos(root, version: int | None = None) -> tuple[list[dict], object]:
    """The per-video entries of a `repack video` manifest (either format) and the Manifest; the latest
    version, or ``version`` (``manifest.vN.json``)."""
    manifest = open_manifest(root, version)
    if manifest.modality != "video":
        raise ValueError(f"{manifest.root}: a {manifest.modality!r} dataset, not video")
    entries = manifest.data["videos"] if manifest.format == "webdataset" else manifest.data["shards"]
    check_video_entries(manifest, entries)
    return list(entries), manifest


def check_video_entries(manifest, entries: list[dict]) -> None:
    """ManifestError naming the entry of a received manifest a reader would read wrong: a video listed twice
    (in any spelling, or through a link: its clips read twice), a WebDataset's videos not one per sample, a
    frame count that is not a count or that no file of its size holds, a class index that is not one of the
    class map's or not its own label's."""
    import posixpath

    classes = manifest.classes or {}
    seen: dict[str, str] = {}
    for entry in entries:
        where = f"{manifest.root}: video {entry['path']!r}"
        same = posixpath.normpath(entry["path"])
        if not object_store.is_remote(manifest.root):
            same = os.path.realpath(manifest.path(entry["path"]))
        if same in seen:
            raise ManifestError(f"{where} is listed twice (as {seen[same]!r}): its clips would be read twice")
        seen[same] = entry["path"]
        problem = entry_problem(classes, entry)
        if problem:
            raise ManifestError(f"{where}: {problem}")
    if manifest.format == "webdataset":
        samples = manifest.data["totals"].get("samples")
        if samples is not None and samples != len(entries):
            raise ManifestError(f"{manifest.root}: {len(entries)} videos listed for {samples} samples in the shards")


def clip_starts(frames: int, sequence_length: int, stride: int = 1, step: int = -1) -> list[int]:
    """First-frame indices of every clip of a ``frames``-long video (DALI's sampling)."""
    step = sequence_length if step is None or step <= 0 else step
    span = (sequence_length - 1) * stride + 1
    return list(range(0, frames - span + 1, step)) if frames >= span else []


def clip_columns(frames: list[int], sequence_length: int, stride: int = 1, step: int = -1
                 ) -> tuple[np.ndarray, np.ndarray]:
    """Every clip of videos of ``frames`` frames each, as columns (video number, first frame; int64), in
    ``clip_starts``' order video after video: no Python object per clip."""
    step = sequence_length if step is None or step <= 0 else step
    span = (sequence_length - 1) * stride + 1
    frames_of = np.asarray(frames, dtype=np.int64).reshape(-1)
    counts = np.where(frames_of >= span, (frames_of - span) // step + 1, 0)
    videos = np.repeat(np.arange(len(frames_of), dtype=np.int64), counts)
    firsts = np.cumsum(counts) - counts  # each video's first row
    starts = (np.arange(len(videos), dtype=np.int64) - np.repeat(firsts, counts)) * step
    return videos, starts


class ClipIndex(Sequence):
    """The clips of a ``VideoClipDataset`` as two int64 columns; ``index[i]`` is (video, first frame), and it
    compares equal to the list of those pairs (what the index was before it was columns)."""

    def __init__(self, videos: np.ndarray, starts: np.ndarray) -> None:
        self.videos, self.starts = videos, starts

    def __len__(self) -> int:
        return len(self.videos)

    def __getitem__(self, i):
        if isinstance(i, slice):  # a slice of the index, as a list's
            return ClipIndex(self.videos[i], self.starts[i])
        i = operator.index(i)  # an int (a float is a TypeError, as for a list)
        if not -len(self.videos) <= i < len(self.videos):
            raise IndexError(f"clip {i} of {len(self.videos)}")
        return int(self.videos[i]), int(self.starts[i])

    def __add__(self, other) -> list:
        return list(self) + list(other)

    def __eq__(self, other) -> bool:
        if isinstance(other, ClipIndex):
            return np.array_equal(self.videos, other.videos) and np.array_equal(self.starts, other.starts)
        return isinstance(other, Sequence) and list(self) == list(other)

    __hash__ = None


class VideoClipDataset(MapDatasetState):
    """Map-style dataset of clips; ``shard_id``/``num_shards`` split the clips like DALI does;
    ``version`` pins a dataset version (default: the latest)."""

    def __init__(self, root, sequence_length: int, stride: int = 1, step: int = -1, shard_id: int = 0,
                 num_shards: int = 1, transform=None, version: int | None = None) -> None:
        if sequence_length < 1 or stride < 1:
            raise ValueError("sequence_length and stride must be >= 1")
        if num_shards < 1 or not 0 <= shard_id < num_shards:
            raise ValueError(f"shard_id must be in [0, num_shards) and num_shards >= 1, got {shard_id} of {num_shards}")
        self.root = str(root)
        self.sequence_length, self.stride, self.transform = sequence_length, stride, transform
        self._split = (step, shard_id, num_shards)
        self.use_version(version)

    def use_version(self, version: int | None) -> None:
        """Read version ``version`` of the dataset (None: the latest): its videos and clips."""
        entries, manifest = manifest_videos(self.root, version)
        self.dataset = identity(manifest)
        self._classes = dict(manifest.data.get("classes") or {})
        self.paths = [str(manifest.path(e["path"])) for e in entries]
        self.sizes = [int(e.get("bytes", 0)) for e in entries]
        self.labels = [int(e["cls"]) if e.get("cls") is not None else UNLABELED for e in entries]
        step, shard_id, num_shards = self._split
        videos, starts = clip_columns([int(e["frames"]) for e in entries], self.sequence_length, self.stride, step)
        cut = slice(len(videos) * shard_id // num_shards, len(videos) * (shard_id + 1) // num_shards)  # DALI's split
        self.index = ClipIndex(videos[cut].copy(), starts[cut].copy())

    @property
    def classes(self) -> dict[str, int]:
        """The dataset's class map (name -> label)."""
        return self._classes

    @property
    def world_size(self) -> int:
        """The parts the clips are split into (``num_shards``): a sampler that splits by rank too refuses it."""
        return self._split[2]

    def order_options(self) -> dict:
        """What decides which clips index ``i`` names: a state of other ones is refused."""
        step, shard_id, num_shards = self._split
        return {"sequence_length": self.sequence_length, "stride": self.stride, "step": step, "shard_id": shard_id,
                "num_shards": num_shards}

    def __len__(self) -> int:
        return len(self.index)

    def frame_indices(self, i: int) -> list[int]:
        start = self.index[i][1]
        return [start + k * self.stride for k in range(self.sequence_length)]

    def _open(self, video: int, clip: int):
        """The container of video ``video`` (local file or ranged s3:// reads); a missing one is an error
        naming the dataset and the clip, never a silently shorter epoch."""
        import av

        path = self.paths[video]
        try:
            if object_store.is_remote(path):
                from pipelines.ranged_file import RangedObjectFile

                return av.open(io.BufferedReader(RangedObjectFile(path, self.sizes[video]), 1 << 16),
                               options={"format_whitelist": SAFE_INPUT_OPTIONS["format_whitelist"]})
            # this one file, as one of the single-file containers: never a concat script or a playlist that
            # opens others (a symlink beside it, outside the root)
            return av.open("file:" + os.path.abspath(path), options=dict(SAFE_INPUT_OPTIONS))
        except (FileNotFoundError, av.error.FileNotFoundError) as exc:
            raise RuntimeError(f"{self.root}: clip {clip} needs {path}, which is missing ({exc})") from None

    def __getitem__(self, i: int):
        import torch

        video, _ = self.index[i]
        try:
            frames = self._frames(video, i)
        except RuntimeError:
            raise  # a missing video or frames: already named
        except Exception as exc:
            raise decode_error(self.paths[video], f"clip {i}", "decode", exc) from exc
        clip = torch.from_numpy(frames)
        if self.transform is not None:
            try:
                clip = self.transform(clip)
            except Exception as exc:
                raise decode_error(self.paths[video], f"clip {i}", "transform", exc) from exc
        return clip, self.labels[video]

    def _frames(self, video: int, i: int):
        """The frames of clip ``i`` (of video number ``video``), as one uint8 array (F, H, W, 3)."""
        import numpy as np

        wanted = self.frame_indices(i)
        got: dict[int, np.ndarray] = {}
        # a container whose seek lands past the wanted frame or on nothing (MPEG-TS, FLV: the keyframe after it;
        # MPEG-TS with B-frames even for a seek to its first timestamp) is opened again and decoded from its
        # start, with no seek
        for seek in (True, False):
            with self._open(video, i) as container:
                stream = container.streams.video[0]
                stream.thread_type = "AUTO"
                rate = Fraction(stream.average_rate or stream.guessed_rate)
                tb = Fraction(stream.time_base)
                origin = stream.start_time or 0
                if seek:
                    first_pts = origin + int(Fraction(wanted[0]) / rate / tb)
                    container.seek(first_pts, stream=stream, backward=True, any_frame=False)
                landed = None
                for frame in container.decode(stream):
                    number = round((Fraction(frame.pts - origin) * tb) * rate)
                    landed = number if landed is None else landed
                    if number in wanted:
                        got[number] = frame.to_ndarray(format="rgb24")
                    if number >= wanted[-1]:
                        break
            if landed is not None and landed <= wanted[0]:
                break
        missing = [n for n in wanted if n not in got]
        if missing:
            # not IndexError: that would silently end a plain ``for clip in dataset`` loop
            raise RuntimeError(f"{self.paths[video]}: frames {missing} could not be decoded")
        return np.stack([got[n] for n in wanted])
