"""``--to videos`` (`repack video`): every usable video is a plain file under ``OUT/videos/``.

Each manifest ``shards`` entry is one video (``samples`` 1) with its size and sha256; this
plugin only verifies them (the job writes the files itself, atomically).
"""

from __future__ import annotations

from pathlib import Path

from repack.sinks.checks import check_file


class VideosSink:
    """The ``videos`` format: one file per sample."""

    name = "videos"

    @staticmethod
    def outputs(entry: dict) -> list[dict]:
        return [{"path": entry["path"], "bytes": entry["bytes"]}]

    @staticmethod
    def verify_shard(root: Path, shard: dict, check) -> None:
        """Check one video file against its manifest entry (size, sha256)."""
        check_file(root, shard["path"], shard["bytes"], shard["sha256"], check)
