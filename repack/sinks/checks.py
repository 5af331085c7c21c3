"""Checks shared by every sink's ``verify_shard``: a file's presence, size and sha256."""

from __future__ import annotations

import hashlib
from pathlib import Path
from typing import Callable

Check = Callable[[bool, str], None]


def sha256_file(path: str | Path) -> str:
    """sha256 of a file (``hashlib.file_digest``: read into one reused buffer, the GIL released while
    hashing)."""
    with open(path, "rb") as fh:
        return hashlib.file_digest(fh, "sha256").hexdigest()


def check_file(root: Path, rel: str, size: int | None, sha256: str | None, check: Check,
               digest: Callable[[Path], str] | None = None) -> bool:
    """Report a missing file, a size or a sha256 mismatch (None: not recorded, not checked); False when the file
    is missing. ``digest``: how the file's sha256 is had (default ``sha256_file``; e.g. a hash already under way)."""
    path = Path(root) / rel
    try:
        actual = path.stat().st_size
    except OSError as exc:
        check(False, f"{rel}: missing ({exc.strerror})")
        return False
    if size is not None:
        check(actual == size, f"{rel}: {actual} bytes, manifest says {size}")
    if sha256 is not None:
        check((digest or sha256_file)(path) == sha256, f"{rel}: sha256 mismatch")
    return True


def bytes_digest(data: bytes) -> dict:
    """``{"bytes", "sha256"}`` of a side file's content, as the manifest's ``file_digests`` records it."""
    return {"bytes": len(data), "sha256": hashlib.sha256(data).hexdigest()}


def file_and_index_outputs(shard: dict) -> list[dict]:
    """[{path, bytes}] of a shard entry with a side index (tar + .idx, .bin + .idx) and, where it has
    them, per-sample checksums (tar: .crc) and document sources (token prefix: .sources)."""
    outputs = [{"path": shard["path"], "bytes": shard["bytes"]},
               {"path": shard["index"], "bytes": shard["index_bytes"]}]
    if shard.get("checksums"):
        outputs.append({"path": shard["checksums"], "bytes": shard["checksums_bytes"]})
    if shard.get("source_runs"):
        outputs.append({"path": shard["source_runs"], "bytes": shard["source_runs_bytes"]})
    return outputs
