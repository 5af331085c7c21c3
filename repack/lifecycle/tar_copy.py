"""A tar shard without some of its samples, as bytes allow: `repack remove`'s copy of one shard.

The kept samples' byte ranges (headers and data, untouched and in order) are copied from the old tar
into ``<stem>.tar`` in the kernel (``os.copy_file_range``: no copy through this process; a reflink where
the filesystem shares blocks), runs of adjacent samples one call each (per 64 MB), on a helper thread. The
old tar is mapped once: the new sha256 is computed over the mapped ranges on a second helper thread,
started first (each byte read once by this process), while each kept member's header is checked to name
its member before a byte is written, then while the ranges are copied and the new index is laid out.
The new DALI index is the old index's kept lines with their offsets moved (``ShardIndex.shifted_text``:
copied in runs, only the offset digits written anew), the new ``.crc`` the old one's kept rows (else
computed from the new tar); nothing is decoded or re-encoded. Where the caller knows the shard holds a
sample to drop, the old tar's first bytes are copied into the temp file and hashed while it parses the
index (``CopiedPrefix``): a copy refused by the header check then removes a temp file already written to.
"""

from __future__ import annotations

import hashlib
import mmap
import os
import threading
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import numpy as np

from repack.errors import UsageError
from repack.lifecycle.shard_index import ShardIndex
from repack.sinks.sample_checksums import HEADER, MAGIC
from repack.sinks.tar_format import BLOCK, end_of_archive
from repack.sinks.webdataset import SYNC_EVERY, publish_shard

HASH_PIECE = 16 << 20  # bytes hashed between looks at whether the copy was refused
CHECK_ROWS = 1 << 16  # member headers compared at a time (a (rows, 101) byte matrix)


def temp_path(out: Path, stem: str) -> Path:
    """The temp file ``copy_kept`` writes shard ``stem`` into (renamed whole when done)."""
    return out / f".{stem}.tar.tmp-{os.getpid()}"


class CopiedPrefix:
    """A shard's first bytes copied into the new shard's temp file and hashed, from byte 0, on two threads,
    while the caller parses the shard's index and finds the samples to drop: the new shard starts with the
    old one's bytes up to its first dropped sample, so ``copy_kept`` goes on from where each thread got to
    before that cut (``take``) instead of copying and hashing that prefix after the parse. Both stop at
    ``limit`` bytes (the caller's guess of the cut; default: the whole tar). Bytes copied past the cut are
    written over (and the file cut to its length) by ``copy_kept``; a temp file ``copy_kept`` does not take
    is removed by ``close``."""

    def __init__(self, tar_fd: int, tmp: Path, limit: int | None = None) -> None:
        self.tmp, self._src, self._stop, self._taken = tmp, tar_fd, threading.Event(), False
        self.fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_NOFOLLOW | os.O_TRUNC, 0o644)
        self._states: list[tuple[int, object]] = [(0, hashlib.sha256())]  # (bytes hashed, the state there)
        self._copied = 0
        try:
            size = os.fstat(tar_fd).st_size
            self._limit = size if limit is None else max(0, min(size, limit))  # where both threads stop
            self._mapped = mmap.mmap(tar_fd, size, flags=mmap.MAP_SHARED, prot=mmap.PROT_READ) if size else None
        except BaseException:  # no prefix then: its temp file goes
            os.close(self.fd)
            tmp.unlink(missing_ok=True)
            raise
        self._threads = [threading.Thread(target=work, name=f"repack-prefix-{n}", daemon=True)
                         for n, work in enumerate((self._hash, self._copy))]
        for thread in self._threads:
            thread.start()

    def _hash(self) -> None:
        at, sha = 0, hashlib.sha256()
        if not self._limit:
            return
        view = memoryview(self._mapped)
        try:
            while at < self._limit and not self._stop.is_set():
                piece = min(self._limit, at + HASH_PIECE)
                sha.update(view[at:piece])  # the GIL released as it hashes
                at = piece
                self._states.append((at, sha.copy()))
        finally:
            view.release()  # before ``close`` unmaps

    def _copy(self) -> None:
        try:
            while self._copied < self._limit and not self._stop.is_set():
                piece = min(self._limit, self._copied + SYNC_EVERY)
                _copy_range(self._src, self.fd, None, self._copied, piece, self._copied)
                os.fdatasync(self.fd)  # the disk's write-back started, as _copy_ranges does
                self._copied = piece
        except (OSError, UsageError):  # a full disk, say: copy_kept copies the rest and raises what it meets
            return

    def take(self, cut: int) -> tuple[int, int, object]:
        """Stop both threads; hand the temp file over to the caller: (bytes copied, bytes hashed, a sha256 of
        the bytes hashed), each as far as it got but at most ``cut``."""
        self._halt()
        self._taken = True
        hashed, sha = max((state for state in self._states if state[0] <= cut), key=lambda state: state[0])
        return min(self._copied, cut), hashed, sha

    def _halt(self) -> None:
        self._stop.set()
        for thread in self._threads:
            thread.join()
        if self._mapped is not None:
            self._mapped.close()
            self._mapped = None

    def close(self) -> None:
        """Stop both threads and unmap; the temp file closed and removed unless ``take`` handed it over."""
        self._halt()
        if not self._taken and self.fd >= 0:
            os.close(self.fd)
            self.fd = -1
            self.tmp.unlink(missing_ok=True)


def copy_kept(tar_fd: int, index: ShardIndex, keep: np.ndarray, out: Path, stem: str, shard: str,
              checksums: np.ndarray | None, prefix: CopiedPrefix | None = None) -> dict | None:
    """Write the samples ``keep`` marks (bool per sample) of the tar open at ``tar_fd`` as shard ``stem``
    under ``out`` (temp file, renamed whole: ``repack.sinks.webdataset.publish_shard``); its entry, None
    when nothing is kept. ``checksums``: the old per-sample ``.crc`` values, when trusted. ``prefix``: the
    tar's first bytes copied into the temp file and hashed already (``CopiedPrefix``), taken up to the
    first dropped sample.

    One helper thread hashes the kept ranges from the mapping from the start (it only reads: the sha256 of
    the kept bytes is the longest step, so it starts first); once the headers check out, another copies
    the runs (``copy_file_range``, with a write-back every SYNC_EVERY bytes, as the pack's assembler does,
    so the final fsync stays short) and this thread lays out the new index: the hashing, the header check,
    the kernel's copy, the disk's write-back and the index overlap instead of following each other."""
    kept = np.flatnonzero(keep)
    if not len(kept):
        return None
    starts, ends = index.spans()
    size = os.fstat(tar_fd).st_size
    if int(ends[kept].max()) > size:
        raise UsageError(f"{shard}: ends at byte {size}, inside its samples (run repack verify)")
    firsts, lasts, run_of = _runs(kept, starts, ends)
    run_start, run_end = starts[firsts], ends[lasts]
    run_at = np.concatenate([[0], np.cumsum(run_end - run_start)[:-1]]).astype(np.int64)
    written = int((run_end - run_start).sum())
    shift = np.zeros(index.samples, np.int64)  # new offset - old offset, per kept sample
    shift[kept] = (run_at - run_start)[run_of]
    ranges = list(zip(run_start.tolist(), run_end.tolist(), run_at.tolist()))
    if prefix is None:
        tmp, copied, hashed, sha = temp_path(out, stem), 0, 0, hashlib.sha256()
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_NOFOLLOW | os.O_TRUNC, 0o644)
    else:  # the first run is the prefix when the tar's first sample is kept
        tmp, fd = prefix.tmp, prefix.fd
        copied, hashed, sha = prefix.take(ranges[0][1] if ranges[0][0] == 0 else 0)
    try:
        with mmap.mmap(tar_fd, size, flags=mmap.MAP_SHARED | getattr(mmap, "MAP_POPULATE", 0),
                       prot=mmap.PROT_READ) as mapped:
            view = memoryview(mapped)
            try:
                with ThreadPoolExecutor(2, thread_name_prefix="repack-copy") as helpers:
                    stop = threading.Event()
                    hashing = helpers.submit(_hash_ranges, sha, view, _after(ranges, hashed), stop)  # reads only
                    try:
                        problem = _header_problem(np.frombuffer(mapped, np.uint8), index, kept, shard)
                        if problem is not None:
                            raise UsageError(problem)
                        copying = helpers.submit(_copy_ranges, tar_fd, fd, view, _after(ranges, copied))
                        try:
                            text = index.shifted_text(kept, shift)
                        finally:
                            copying.result()  # waited for (and its error raised) before the mapping closes
                    except BaseException:
                        stop.set()
                        raise
                    finally:
                        hashing.result()  # likewise
            finally:
                view.release()
        tail = end_of_archive(written)
        os.pwrite(fd, tail, written)
        os.ftruncate(fd, written + len(tail))  # a prefix copied past the first cut may have made it longer
        sha.update(tail)
    except BaseException:
        os.close(fd)
        tmp.unlink(missing_ok=True)
        raise
    sums = None if checksums is None else HEADER.pack(MAGIC, len(kept)) + checksums[kept].astype("<u4").tobytes()
    return publish_shard(out, stem, fd, tmp, written + len(tail), sha, text, len(kept), checksums=sums)


def _after(ranges: list[tuple[int, int, int]], done: int) -> list[tuple[int, int, int]]:
    """``ranges`` less the new tar's first ``done`` bytes (copied or hashed by ``CopiedPrefix``: at most the
    first range, which starts the new tar)."""
    return [(max(start, done), end, max(start, done) - start) if at == 0 else (start, end, at)
            for start, end, at in ranges]


def _runs(kept: np.ndarray, starts: np.ndarray, ends: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """(first sample, last sample) of each run of kept samples whose byte ranges follow each other, and
    the run of each kept sample."""
    opens = np.ones(len(kept), bool)
    opens[1:] = starts[kept[1:]] != ends[kept[:-1]]
    closes = np.ones(len(kept), bool)
    closes[:-1] = opens[1:]
    return kept[opens], kept[closes], np.cumsum(opens) - 1


def _hash_ranges(sha, view: memoryview, ranges: list[tuple[int, int, int]], stop: threading.Event) -> None:
    """``sha`` updated with each (start, end) range of ``view``, in order, HASH_PIECE bytes at a time (the
    GIL released as it hashes); it gives up when ``stop`` is set (the copy was refused)."""
    for start, end, _ in ranges:
        while start < end and not stop.is_set():
            piece = min(end, start + HASH_PIECE)
            sha.update(view[start:piece])
            start = piece


def _copy_ranges(src: int, dst: int, view: memoryview, ranges: list[tuple[int, int, int]]) -> None:
    """Each (start, end, at) of ``ranges``: bytes ``start..end`` of ``src`` to ``dst`` at ``at``, in pieces
    of at most SYNC_EVERY bytes; an ``fdatasync`` of ``dst`` after every SYNC_EVERY bytes starts the disk's
    write-back early (also inside one long run)."""
    unsynced = 0
    for start, end, at in ranges:
        while start < end:
            piece = min(end - start, SYNC_EVERY - unsynced)
            _copy_range(src, dst, view, start, start + piece, at)
            start, at, unsynced = start + piece, at + piece, unsynced + piece
            if unsynced >= SYNC_EVERY:
                os.fdatasync(dst)
                unsynced = 0


def _copy_range(src: int, dst: int, view: memoryview | None, start: int, end: int, at: int) -> None:
    """Bytes ``start..end`` of ``src`` to ``dst`` at ``at``: in the kernel, else written from ``view`` (None:
    read with ``pread``)."""
    while start < end:
        try:
            done = os.copy_file_range(src, dst, end - start, start, at)
        except OSError:  # no copy_file_range between these files (another filesystem, an old kernel)
            done = os.pwrite(dst, view[start:end] if view is not None else os.pread(src, end - start, start), at)
        if done <= 0:
            raise UsageError(f"cannot copy bytes {start}..{end} of a shard: the copy made no progress")
        start, at = start + done, at + done


def _header_problem(data: np.ndarray, index: ShardIndex, kept: np.ndarray, shard: str) -> str | None:
    """Why the kept members' headers in ``data`` (the old tar) are not the ones the index gives (None when
    each names its member): the headers' name fields taken as rows of the tar's 512-byte blocks (a
    header starts on a block), compared with the names the index gives. Said, not raised: an exception
    raised here would keep ``data``, a view of the shard's mapping, alive in its traceback, and the
    mapping could not close (``BufferError`` in place of the message)."""
    counts = np.diff(index.first)[kept]
    rows = np.repeat(index.first[kept] - np.cumsum(counts) + counts, counts) + np.arange(int(counts.sum()))
    headers = index.offset[rows] - BLOCK
    if np.any(headers % BLOCK):
        return f"{shard}: its index puts a member off a tar block (run repack verify)"
    blocks = data[:len(data) // BLOCK * BLOCK].reshape(-1, BLOCK)[:, :100]
    for lo in range(0, len(rows), CHECK_ROWS):
        part = rows[lo:lo + CHECK_ROWS]
        fields = index.name_fields(part, 101)  # a byte in column 100: a name longer than a header holds
        if fields[:, 100].any():
            return f"{shard}: a member name is longer than a ustar header holds (run repack verify)"
        if not np.array_equal(blocks[headers[lo:lo + CHECK_ROWS] // BLOCK], fields[:, :100]):
            return f"{shard}: a header does not name the member its index says (run repack verify)"
    return None
