"""``--to videos`` (`repack video`): every usable video is a plain file under ``OUT/videos/``.

Each manifest ``shards`` entry is one video (``samples`` 1) with its size and sha256; this
plugin only verifies them (the job writes the files itself, atomically).
"""

from __future__ import annotations

import hashlib
from pathlib import Path


class VideosSink:
    """The ``videos`` format: one file per sample."""

    name = "videos"
    shard_level = False

    @staticmethod
    def outputs(entry: dict) -> list[dict]:
        return [{"path": entry["path"], "bytes": entry["bytes"]}]

    @staticmethod
    def verify_shard(root: Path, shard: dict, check) -> None:
        """Check one video file against its manifest entry (size, sha256)."""
        path = Path(root) / shard["path"]
        try:
            size = path.stat().st_size
        except OSError as exc:
            check(False, f"{shard['path']}: missing ({exc.strerror})")
            return
        check(size == shard["bytes"], f"{shard['path']}: {size} bytes, manifest says {shard['bytes']}")
        sha = hashlib.sha256()
        with open(path, "rb") as fh:
            for block in iter(lambda: fh.read(1 << 22), b""):
                sha.update(block)
        check(sha.hexdigest() == shard["sha256"], f"{shard['path']}: sha256 mismatch")
