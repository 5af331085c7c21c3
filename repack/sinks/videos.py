"""``--to videos`` (`repack video`): every usable video is a plain file under ``OUT/videos/``.

Each manifest ``shards`` entry is one video (``samples`` 1) with its size and sha256; this
plugin only verifies them (the job writes the files itself, atomically).
"""

from __future__ import annotations

from pathlib import Path

from repack.manifest.video_entries import video_entries
from repack.sinks.checks import check_file


def dali_file_list(videos: list[dict]) -> bytes:
    """DALI's ``file_list`` of a video dataset's entries: "<path> <class index>" per video, in manifest order
    (UTF-8; an unlabeled video gets 0, as DALI's file_list rejects negative labels)."""
    return "".join(f"{v['path']} {v['cls'] if v.get('cls') is not None else 0}\n" for v in videos).encode("utf-8")


def file_list_problem(data: dict, listing: bytes) -> str | None:
    """What is wrong with ``listing`` (the bytes of the file_list a video manifest ``data`` names) against
    the manifest's video entries: the readers take a clip's label from one and its frames from the other."""
    videos = data.get("videos") if data.get("format") == "webdataset" else data.get("shards")
    if not isinstance(videos, list) or video_entries(data) != videos:
        return None  # the manifest's own checks name it
    if listing == dali_file_list(videos):
        return None
    expected = dali_file_list(videos).decode("utf-8", "replace").splitlines()
    found = listing.decode("utf-8", "replace").splitlines()
    first = next((i for i, (a, b) in enumerate(zip(expected, found)) if a != b), min(len(expected), len(found)))
    return (f"line {first + 1} is {found[first] if first < len(found) else 'missing'!r}, the manifest's entries "
            f"give {expected[first] if first < len(expected) else 'no such line'!r} ({len(found)} lines for "
            f"{len(expected)} videos)")


class VideosSink:
    """The ``videos`` format: one file per sample."""

    name = "videos"

    @staticmethod
    def outputs(entry: dict) -> list[dict]:
        return [{"path": entry["path"], "bytes": entry["bytes"]}]

    @staticmethod
    def verify_shard(root: Path, shard: dict, check) -> None:
        """Check one video file against its manifest entry (size, sha256, and the frames of one that matches)."""
        matched: list[bool] = []
        if check_file(root, shard["path"], shard["bytes"], shard["sha256"],
                      lambda ok, problem: matched.append(bool(ok)) or check(ok, problem)) and all(matched):
            check_frames(Path(root) / shard["path"], shard, check)


def check_frames(path: Path, entry: dict, check) -> None:
    """The video's frame count (its video packets, as ``repack video`` counted them) is its entry's ``frames``:
    the readers cut clips by it (fewer: clips silently lost; more: a decode error mid-epoch)."""
    from repack.transforms.probe import probe_file
    from repack.transforms.probe_pyav import count_frames

    counted = count_frames(str(path))
    if counted is None:  # a container the probe reads with ffprobe
        counted = probe_file(str(path)).get("frames")
    check(counted == entry.get("frames"), f"{entry['path']}: {counted} frames, manifest says {entry.get('frames')}")
