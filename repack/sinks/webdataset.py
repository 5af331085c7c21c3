"""WebDataset tar shards with DALI index files (see tar_format for the byte layout).

A shard is written to a hidden temp name and renamed into place only when complete,
after its index; the sha256 is computed while writing. A shard is written either whole by one
task (``TarShardWriter``), or as segments by several chunk tasks (``TarSegmentWriter``: the same
members, no end-of-archive) that ``ShardAssembler`` concatenates in plan order: the bytes are
the same either way.

Each writer keeps its index as text (the DALI lines, one per sample) and its per-sample checksums as
a uint32 column while it writes, from the bytes in hand: no per-sample object survives the sample,
and the driver never reads a shard back to checksum it.

A segment is *placed* when its task is given the offset and size the plan predicts for it
(``place``): it is written straight into the shard's shared file at that offset, so the shard is
written once. The assembler then only hashes it, in plan order. Where a prediction fails (a
quarantined input, an unusual header) the piece is a file of its own or shorter than its slot, and
from there on the assembler copies, as for unplaced segments: same bytes, one more write.
"""

from __future__ import annotations

import base64
import errno
import hashlib
import os
import zlib
from array import array
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path

from repack.manifest.io import fsync_dir
from repack.sinks.checks import file_and_index_outputs
from repack.sinks.sample_checksums import checksums_column, checksums_header, sample_checksums
from repack.sinks.tar_format import BLOCK, INDEX_VERSION, PADDING, end_of_archive, ustar_header
from repack.sinks.tar_verify import TarShardParts, verify_tar_shard


class TarMemberWriter:
    """Appends samples (adjacent members sharing one key) as ustar members to a hidden temp file.

    Writes are batched (one ``writev`` per ~1 MiB); ``hashed`` keeps a running sha256 of it all. The
    DALI index lines (``_index``, ASCII) and each sample's crc32 (``_crcs``, see ``sample_checksums``)
    grow as samples are added."""

    def __init__(self, tmp: Path, hashed: bool, fd: int | None = None) -> None:
        self._tmp = tmp
        self._fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_NOFOLLOW | os.O_TRUNC, 0o644) if fd is None else fd
        self._sha = hashlib.sha256() if hashed else None
        self._offset = 0
        self._index_base = 0  # added to the offsets the index lines give (a placed segment: where it lies)
        self._index = bytearray()  # "ext offset size name ..." + "\n" per sample
        self._crcs = array("I")
        self._pending: list[bytes] = []
        self._pending_bytes = 0

    @property
    def samples(self) -> int:
        return len(self._crcs)

    def add_sample(self, key: str, members: list[tuple[str, bytes]]) -> None:
        """Write one sample: members [(extension, data)], in the given order; ValueError for two members of one
        extension (a reader would take one for the other: webdataset refuses the shard, DALI reads either)."""
        if len(members) > 1 and len({ext for ext, _ in members}) < len(members):
            raise ValueError(f"sample {key}: two members of one extension ({', '.join(e for e, _ in members)})")
        fields = []
        pending = self._pending
        offset = self._offset
        base = self._index_base + BLOCK
        crc = 0
        key_bytes = key.encode("ascii")
        key_sum = sum(key_bytes)
        for ext, data in members:
            suffix = _SUFFIXES.get(ext) or _suffix(ext)
            name = key_bytes + suffix
            size = len(data)
            pending.append(ustar_header(name, size, key_sum + _SUFFIX_SUMS[suffix]))
            pending.append(data)
            pad = -size % BLOCK
            if pad:
                pending.append(PADDING[pad])
            fields.append(b"%s %d %d %s" % (suffix[1:], base + offset, size, name))
            crc = zlib.crc32(data, crc)
            offset += BLOCK + size + pad
        self._index += b" ".join(fields) + b"\n"
        self._crcs.append(crc)
        self._pending_bytes += offset - self._offset
        self._offset = offset
        if self._pending_bytes >= WRITE_BATCH or len(pending) >= WRITE_BATCH_IOVECS:
            self._flush()

    def _flush(self) -> None:
        if self._pending:
            self._write_pending()
            if self._sha is not None:
                for chunk in self._pending:
                    self._sha.update(chunk)
            self._pending.clear()
            self._pending_bytes = 0

    def _write_pending(self) -> None:
        _write_all(self._fd, self._pending, self._pending_bytes)

    def abort(self) -> None:
        self._pending.clear()
        if self._fd >= 0:
            os.close(self._fd)
            self._fd = -1
        self._tmp.unlink(missing_ok=True)


_SUFFIXES: dict[str, bytes] = {}  # extension -> b".ext"
_SUFFIX_SUMS: dict[bytes, int] = {}  # b".ext" -> its byte sum (a header's checksum adds the name's)


def _suffix(ext: str) -> bytes:
    suffix = _SUFFIXES[ext] = f".{ext}".encode("ascii")
    _SUFFIX_SUMS[suffix] = sum(suffix)
    return suffix


WRITE_BATCH = 1 << 20
WRITE_BATCH_IOVECS = 900  # below IOV_MAX (1024)


def _write_all(fd: int, chunks: list, expected: int, at: int | None = None) -> None:
    """Write ``chunks`` (``expected`` bytes in all) at the file position, or at offset ``at``."""
    written = os.writev(fd, chunks) if at is None else os.pwritev(fd, chunks, at)
    if written < expected:  # short write: finish it
        rest = memoryview(b"".join(chunks))[written:]
        while rest:
            rest = rest[os.write(fd, rest) if at is None else os.pwrite(fd, rest, at + expected - len(rest)):]


class TarShardWriter(TarMemberWriter):
    """Writes one whole tar shard (``<stem>.tar`` + DALI ``<stem>.idx``), renamed into place on commit."""

    def __init__(self, out: Path, stem: str) -> None:
        self.out = Path(out)
        self.stem = stem
        super().__init__(self.out / f".{stem}.tar.tmp-{os.getpid()}", hashed=True)

    def commit(self) -> dict | None:
        """Finish the shard; rename tar and index into place. None (and nothing on disk) if empty."""
        if not self.samples:
            self.abort()
            return None
        self._flush()
        tail = end_of_archive(self._offset)
        os.write(self._fd, tail)
        self._sha.update(tail)
        fd, self._fd = self._fd, -1
        return publish_shard(self.out, self.stem, fd, self._tmp, self._offset + len(tail), self._sha,
                             index_bytes([bytes(self._index)], self.samples), self.samples,
                             checksums_header(self.samples) + checksums_column(self._crcs))


class TarSegmentWriter(TarMemberWriter):
    """A chunk's piece of a shard: complete ustar members, no end-of-archive, not hashed, not fsynced
    (``ShardAssembler`` hashes the pieces once, in order, and fsyncs the shard).

    Unplaced, the piece is the file ``<stem>.seg`` in ``folder``. Placed (``place`` = (the shard's
    shared file, offset, slot bytes)), it is written into the shared file at that offset; if its
    members outgrow the slot it spills into ``<stem>.seg`` after all, taking along what it placed."""

    def __init__(self, folder: Path, stem: str, place: tuple[Path, int, int] | None = None) -> None:
        self.folder = Path(folder)
        self.name = f"{stem}.seg"
        self.folder.mkdir(parents=True, exist_ok=True)
        self._place = place
        own = self.folder / f".{self.name}.tmp-{os.getpid()}"
        if place is None:
            super().__init__(own, hashed=False)
        else:
            fd = os.open(place[0], os.O_WRONLY | os.O_CREAT | os.O_NOFOLLOW | getattr(os, "O_CLOEXEC", 0), 0o644)
            super().__init__(own, hashed=False, fd=fd)
            self._index_base = place[1]
            self._placed = 0  # bytes written into the slot so far

    def _write_pending(self) -> None:
        if self._place is None:
            return super()._write_pending()
        _, at, slot = self._place
        if self._placed + self._pending_bytes <= slot:
            _write_all(self._fd, self._pending, self._pending_bytes, at + self._placed)
            self._placed += self._pending_bytes
            return None
        self._spill()
        return super()._write_pending()

    def _spill(self) -> None:
        """The members outgrew the slot: continue in a file of our own, starting with what was placed."""
        shared, at, _ = self._place
        fd = os.open(self._tmp, os.O_WRONLY | os.O_CREAT | os.O_NOFOLLOW | os.O_TRUNC, 0o644)
        try:
            with open(shared, "rb", buffering=0) as src:
                if _copy_by_blocks(src.fileno(), fd, at, self._placed, 0) != self._placed:
                    raise OSError(f"{shared} ended inside a placed segment")
            os.lseek(fd, self._placed, os.SEEK_SET)  # the next writes append
        except BaseException:
            os.close(fd)
            raise
        os.close(self._fd)
        self._fd, self._place = fd, None

    def commit(self) -> dict:
        """Finish the piece: {name, bytes, count, index, index_at, crc}, plus ``at`` and ``slot`` when it lies
        in the shared file (else it was renamed into place as ``name``). ``index``: its samples' DALI index
        lines (one string, no final newline) with offsets counted from ``index_at``: where a placed piece
        lies, so that the assembler takes them as they are while the pieces before it were placed too (0
        when unplaced; a piece that spilled keeps its slot's offset). ``crc``: base64 of the samples'
        checksums (``sample_checksums``' uint32 column, little-endian)."""
        self._flush()
        os.close(self._fd)
        self._fd = -1
        piece = {"name": self.name, "bytes": self._offset, "count": self.samples,
                 "index": self._index[:-1].decode("ascii"), "index_at": self._index_base,
                 "crc": base64.b64encode(checksums_column(self._crcs)).decode("ascii")}
        if self._place is not None:
            return {**piece, "at": self._place[1], "slot": self._place[2]}
        os.replace(self._tmp, self.folder / self.name)
        return piece

    def abort(self) -> None:
        if self._place is None:
            return super().abort()
        self._pending.clear()
        if self._fd >= 0:
            os.close(self._fd)
            self._fd = -1
        return None


def _rebased(text: str, shift: int) -> bytes:
    """DALI index lines ("ext offset size name" per member, a newline between samples) with every offset
    moved by ``shift``, as ASCII with a final newline."""
    if not shift:
        return text.encode("ascii") + b"\n"
    moved = []
    for line in text.split("\n"):
        fields = line.split(" ")
        fields[1::4] = [str(int(offset) + shift) for offset in fields[1::4]]
        moved.append(" ".join(fields))
    return ("\n".join(moved) + "\n").encode("ascii")


def index_bytes(parts: list[bytes], samples: int) -> bytes:
    """A DALI index file: its header line, then ``parts`` (lines, each ending in a newline)."""
    return b"".join([f"{INDEX_VERSION} {samples}\n".encode("ascii"), *parts])


class ShardAssembler:
    """Builds ``<stem>.tar`` (+ ``.idx``) from segments added in plan order, as they become available.

    While every segment so far was placed contiguously in the shared file ``shared`` (the common
    case), the shard *is* that file: a segment is only hashed. From the first segment that is not
    (a spilled or short one), the shard is a file of its own: what the shared file holds so far
    is copied into it, then each later segment, from its own file or its slot in the shared file.
    The sha256 runs in the caller's thread, in order; copies and periodic write-back run beside it on
    one helper thread (``copy_file_range``, inside the kernel), so the final fsync stays short."""

    def __init__(self, out: Path, stem: str, shared: Path | None = None) -> None:
        self.out = Path(out)
        self.stem = stem
        self._shared = shared
        self._shared_fd = -1  # the shared file while it is the shard
        self._tmp = self.out / f".{stem}.tar.tmp-{os.getpid()}"
        self._fd = -1  # the shard being written (the shared file, or a copy)
        self._sha = hashlib.sha256()
        self._offset = 0
        self._index: list[bytes] = []  # the DALI index lines of the segments so far
        self._samples = 0
        self._crcs: list[bytes] | None = []  # their checksum columns (None once a piece came without one)
        self._helper: ThreadPoolExecutor | None = None
        self._jobs: list[Future] = []
        self._unsynced = 0  # the helper's alone
        self._placed_unsynced = 0  # bytes of placed pieces since the last write-back (the caller's)
        self._buffer = memoryview(bytearray(ASSEMBLY_BLOCK))

    def add_segment(self, path: Path, piece: dict) -> None:
        """Append one segment: ``piece`` as ``TarSegmentWriter.commit`` described it, its bytes in
        ``path`` (its own file), or at ``piece["at"]`` of the shared file when it was placed."""
        if not piece["count"]:
            return
        size, at = piece["bytes"], piece.get("at")
        base = self._offset
        if at is not None and at == base and self._fd == self._shared_fd:
            if self._fd < 0:
                self._fd = self._shared_fd = os.open(self._shared,
                                                     os.O_RDWR | os.O_NOFOLLOW | getattr(os, "O_CLOEXEC", 0))
            self._hash(self._fd, at, size, self._shared)
            self._placed_unsynced += size  # a write-back on the helper every SYNC_EVERY bytes, not a job per piece
            if self._placed_unsynced >= SYNC_EVERY:
                self._placed_unsynced = 0
                self._jobs.append(self._start_helper().submit(os.fdatasync, self._fd))
        else:
            self._start_helper()
            if self._fd < 0 or self._fd == self._shared_fd:
                self._leave_shared()
            with open(self._shared if at is not None else path, "rb", buffering=0) as src:
                if at is None and os.fstat(src.fileno()).st_size != size:
                    raise OSError(f"segment {path} is not the {size} bytes its record says")
                self._hash(src.fileno(), at or 0, size, path)
            self._jobs.append(self._helper.submit(self._copy, self._shared if at is not None else path, at or 0,
                                                  size, base))
        self._settle()
        self._index.append(_rebased(piece["index"], base - piece["index_at"]))
        self._samples += piece["count"]
        if self._crcs is not None and "crc" in piece:
            self._crcs.append(base64.b64decode(piece["crc"]))
        else:
            self._crcs = None  # a record of an older repack: read back at commit
        self._offset += size

    def _start_helper(self) -> ThreadPoolExecutor:
        if self._helper is None:
            self._helper = ThreadPoolExecutor(1, thread_name_prefix="repack-copy")
        return self._helper

    def _hash(self, fd: int, start: int, size: int, path: Path) -> None:
        buffer, done = self._buffer, 0
        while done < size:
            n = os.preadv(fd, [buffer[:min(ASSEMBLY_BLOCK, size - done)]], start + done)
            if n == 0:
                raise OSError(f"{path} ended after {done} of the {size} bytes of a segment")
            self._sha.update(buffer[:n])
            done += n

    def _leave_shared(self) -> None:
        """From here on the shard is a file of its own: it starts as a copy of the shared file so far."""
        self._fd = os.open(self._tmp, os.O_WRONLY | os.O_CREAT | os.O_NOFOLLOW | os.O_TRUNC, 0o644)
        if self._shared_fd >= 0:
            self._jobs.append(self._helper.submit(self._copy, self._shared, 0, self._offset, 0))

    def _copy(self, path: Path, start: int, size: int, base: int) -> None:
        with open(path, "rb", buffering=0) as src:
            done = 0
            while done < size:
                try:
                    n = os.copy_file_range(src.fileno(), self._fd, size - done, start + done, base + done)
                except OSError as exc:
                    if exc.errno not in NO_COPY_FILE_RANGE or done:
                        raise
                    n = _copy_by_blocks(src.fileno(), self._fd, start, size, base)
                if n == 0:
                    raise OSError(f"{path} ended after {done} of {size} bytes")
                done += n
        self._written(size)

    def _written(self, size: int) -> None:
        self._unsynced += size
        if self._unsynced >= SYNC_EVERY:
            os.fdatasync(self._fd)
            self._unsynced = 0

    def _settle(self) -> None:
        """Forget the copies done so far (re-raising the first that failed): a shard of thousands of
        segments keeps no finished future."""
        while self._jobs and self._jobs[0].done():
            self._jobs.pop(0).result()

    def _drain(self) -> None:
        """Wait for every copy; re-raise the first that failed."""
        if self._helper is not None:
            self._helper.shutdown(wait=True)
            self._helper = None
        jobs, self._jobs = self._jobs, []
        for job in jobs:
            job.result()

    def commit(self) -> dict | None:
        """Finish and rename into place; the shard entry. None (and nothing on disk) if no samples."""
        if self._fd < 0:
            self._drop_shared()
            return None
        self._drain()
        tail = end_of_archive(self._offset)
        if os.pwrite(self._fd, tail, self._offset) != len(tail):
            raise OSError(f"short write at the end of {self._tmp}")
        self._sha.update(tail)
        fd, self._fd = self._fd, -1
        tmp = self._tmp
        if fd == self._shared_fd:  # the shared file is the shard (cut after its end: slots left unused)
            os.ftruncate(fd, self._offset + len(tail))
            self._shared_fd, tmp = -1, self._shared
        else:
            self._drop_shared()
        checksums = None if self._crcs is None else \
            b"".join([checksums_header(self._samples), *self._crcs])
        return publish_shard(self.out, self.stem, fd, tmp, self._offset + len(tail), self._sha,
                             index_bytes(self._index, self._samples), self._samples, checksums)

    def _drop_shared(self) -> None:
        if self._shared_fd >= 0:
            os.close(self._shared_fd)
            self._shared_fd = -1
        if self._shared is not None:
            self._shared.unlink(missing_ok=True)

    def abort(self) -> None:
        try:
            self._drain()
        except OSError:
            pass  # the shard is dropped anyway
        if self._fd >= 0 and self._fd != self._shared_fd:
            os.close(self._fd)
        self._fd = -1
        self._tmp.unlink(missing_ok=True)
        self._drop_shared()


SYNC_EVERY = 64 << 20  # bytes copied into a shard between write-backs
ASSEMBLY_BLOCK = 1 << 20
NO_COPY_FILE_RANGE = {errno.EXDEV, errno.ENOSYS, errno.EOPNOTSUPP, errno.EINVAL}  # e.g. older kernels, FUSE


def _copy_by_blocks(src: int, dst: int, start: int, size: int, base: int) -> int:
    """The fallback of ``copy_file_range``: ``size`` bytes of ``src`` from ``start`` to ``dst`` at ``base``."""
    done = 0
    while done < size:
        block = os.pread(src, min(ASSEMBLY_BLOCK, size - done), start + done)
        if not block:
            break
        written = 0
        while written < len(block):
            written += os.pwrite(dst, block[written:], base + done + written)
        done += len(block)
    return done


def publish_shard(out: Path, stem: str, fd: int, tmp: Path, size: int, sha, index: str | bytes, samples: int,
                  checksums: bytes | None = None) -> dict:
    """fsync and close a finished tar temp file, write its index and per-sample checksums (``checksums``,
    or ``sample_checksums`` of the file), rename them into place, the tar last; the shard entry."""
    text = index.encode() if isinstance(index, str) else index
    try:
        if checksums is None:
            checksums = sample_checksums(tmp, text.decode())  # read back from the page cache
        os.fsync(fd)
    finally:
        os.close(fd)
    tar_name, idx_name, crc_name = f"{stem}.tar", f"{stem}.idx", f"{stem}.crc"
    _write_side_file(out, idx_name, text)
    _write_side_file(out, crc_name, checksums)
    os.replace(tmp, out / tar_name)
    fsync_dir(out)
    return {"path": tar_name, "samples": samples, "bytes": size, "sha256": sha.hexdigest(), "index": idx_name,
            "index_bytes": len(text), "index_sha256": hashlib.sha256(text).hexdigest(),
            "checksums": crc_name, "checksums_bytes": len(checksums),
            "checksums_sha256": hashlib.sha256(checksums).hexdigest()}


def _write_side_file(out: Path, name: str, data: bytes) -> None:
    """``out/name`` written whole (temp file, fsync, rename)."""
    tmp = out / f".{name}.tmp-{os.getpid()}"
    with open(tmp, "wb") as fh:
        fh.write(data)
        fh.flush()
        os.fsync(fh.fileno())
    os.replace(tmp, out / name)


class WebDatasetSink:
    """The ``--to webdataset`` plugin."""

    name = "webdataset"

    @staticmethod
    def open_shard(out: Path, stem: str) -> TarShardWriter:
        return TarShardWriter(out, stem)

    open_segment = staticmethod(TarSegmentWriter)
    open_assembler = staticmethod(ShardAssembler)

    outputs = staticmethod(file_and_index_outputs)

    verify_shard = staticmethod(verify_tar_shard)
    verify_split = TarShardParts
