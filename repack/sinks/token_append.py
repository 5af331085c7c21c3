"""A merged prefix's ``.bin`` grown part by part: the parts' token files appended in order into one temp file.

``BinAppender`` copies each part in the kernel (``copy_file``: ``copy_file_range``) and hashes it from the
part (just written: the page cache) on a helper thread beside the copy, so the sha256 of the whole ``.bin``
is known when the last part is in. ``merge_parts`` uses one for the whole merge; a text job's driver uses
one while its tasks still run (``repack.jobs.text_merge_ahead``), so that its finish step only appends the
last parts. ``write_back=True`` starts the disk's write-back every ``SYNC_EVERY`` bytes (``fdatasync``),
which keeps the final ``fsync`` short when the appends run ahead of it. The temp file lands under the
final name only through ``merge_parts`` (renamed whole); ``abort`` removes it.
"""

from __future__ import annotations

import hashlib
import os
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

SYNC_EVERY = 64 << 20  # bytes appended between write-backs (as a tar shard's copies: repack.sinks.webdataset)
BLOCK = 1 << 20  # bytes read at a time to hash (and to copy where the kernel cannot): allocated once


def temp_bin(out_bin: Path) -> Path:
    """The temp file an appender for ``out_bin`` writes (renamed whole by ``merge_parts``)."""
    return out_bin.parent / f".{out_bin.name}.tmp-{os.getpid()}"


class BinAppender:
    """Parts' ``.bin`` files appended in order to ``temp_bin(out_bin)``; ``sha256`` and ``bytes`` of what
    is in, and ``parts`` appended so far."""

    def __init__(self, out_bin: Path, write_back: bool = False) -> None:
        self.tmp = temp_bin(out_bin)
        self.fd = os.open(self.tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_NOFOLLOW, 0o644)
        self.sha = hashlib.sha256()
        self.bytes = 0
        self.parts = 0
        self._write_back = write_back
        self._unsynced = 0
        self._buffer = bytearray(BLOCK)  # the hash's
        self._copy_buffer = bytearray(BLOCK)  # used only without copy_file_range

    def extend(self, paths: list[Path]) -> None:
        """Append ``paths`` in order: the kernel's copies on this thread, their hashing on a helper thread
        (hashlib and the copies release the GIL: the two overlap)."""
        from repack.sinks.megatron import MegatronFormatError, copy_file

        if not paths:
            return
        with ThreadPoolExecutor(1, thread_name_prefix="repack-append-hash") as side:
            hashed = side.submit(self._hash, list(paths))
            copied = 0
            try:
                for path in paths:
                    size = copy_file(path, self.fd, self._copy_buffer)
                    copied += size
                    self._unsynced += size
                    if self._write_back and self._unsynced >= SYNC_EVERY:
                        os.fdatasync(self.fd)
                        self._unsynced = 0
            finally:
                read = hashed.result()  # waited for (its error raised) before the buffers go
        if read != copied:
            raise MegatronFormatError(f"{len(paths)} part(s) changed while they were appended ({copied} bytes "
                                      f"copied, {read} hashed)")
        self.bytes += copied
        self.parts += len(paths)

    def _hash(self, paths: list[Path]) -> int:
        view = memoryview(self._buffer)
        total = 0
        for path in paths:
            with open(path, "rb", buffering=0) as src:
                while n := src.readinto(self._buffer):
                    self.sha.update(view[:n])
                    total += n
        return total

    def sync(self) -> None:
        """Everything appended on disk (``fsync``)."""
        os.fsync(self.fd)

    def close(self) -> None:
        """Close the file (kept: ``merge_parts`` renames it)."""
        if self.fd >= 0:
            os.close(self.fd)
            self.fd = -1

    def abort(self) -> None:
        """Close and remove the temp file."""
        self.close()
        self.tmp.unlink(missing_ok=True)
