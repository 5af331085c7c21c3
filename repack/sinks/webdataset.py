"""WebDataset tar shards with DALI index files (see tar_format for the byte layout).

A shard is written to a hidden temp name and renamed into place only when complete,
after its index; the sha256 is computed while writing. A shard is written either whole by one
task (``TarShardWriter``), or as segments by several chunk tasks (``TarSegmentWriter``: the same
members, no end-of-archive) that ``ShardAssembler`` concatenates in plan order: the bytes are
the same either way.
"""

from __future__ import annotations

import errno
import hashlib
import mmap
import os
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path

from repack.manifest.io import fsync_dir
from repack.sinks.checks import check_file, file_and_index_outputs
from repack.sinks.tar_format import (BLOCK, PADDING, end_of_archive, index_from_lines,
                                     index_from_tar, index_text, iter_members, split_key, ustar_header)


class TarMemberWriter:
    """Appends samples (adjacent members sharing one key) as ustar members to a hidden temp file.

    Writes are batched (one ``writev`` per ~1 MiB); ``hashed`` keeps a running sha256 of it all."""

    def __init__(self, tmp: Path, hashed: bool) -> None:
        self._tmp = tmp
        self._fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
        self._sha = hashlib.sha256() if hashed else None
        self._offset = 0
        self._index: list[list[tuple[str, int, int, str]]] = []
        self._pending: list[bytes] = []
        self._pending_bytes = 0

    def add_sample(self, key: str, members: list[tuple[str, bytes]]) -> None:
        """Write one sample: members [(extension, data)], in the given order."""
        entry = []
        pending = self._pending
        offset = self._offset
        for ext, data in members:
            name = f"{key}.{ext}"
            size = len(data)
            pending.append(ustar_header(name.encode("ascii"), size))
            pending.append(data)
            pad = -size % BLOCK
            if pad:
                pending.append(PADDING[pad])
            entry.append((ext, offset + BLOCK, size, name))
            offset += BLOCK + size + pad
        self._pending_bytes += offset - self._offset
        self._offset = offset
        self._index.append(entry)
        if self._pending_bytes >= WRITE_BATCH or len(pending) >= WRITE_BATCH_IOVECS:
            self._flush()

    def _flush(self) -> None:
        if self._pending:
            _write_all(self._fd, self._pending, self._pending_bytes)
            if self._sha is not None:
                for chunk in self._pending:
                    self._sha.update(chunk)
            self._pending.clear()
            self._pending_bytes = 0

    def abort(self) -> None:
        self._pending.clear()
        if self._fd >= 0:
            os.close(self._fd)
            self._fd = -1
        self._tmp.unlink(missing_ok=True)


WRITE_BATCH = 1 << 20
WRITE_BATCH_IOVECS = 900  # below IOV_MAX (1024)


def _write_all(fd: int, chunks: list, expected: int) -> None:
    written = os.writev(fd, chunks)
    if written < expected:  # short write: finish it
        rest = memoryview(b"".join(chunks))[written:]
        while rest:
            rest = rest[os.write(fd, rest):]


class TarShardWriter(TarMemberWriter):
    """Writes one whole tar shard (``<stem>.tar`` + DALI ``<stem>.idx``), renamed into place on commit."""

    def __init__(self, out: Path, stem: str) -> None:
        self.out = Path(out)
        self.stem = stem
        super().__init__(self.out / f".{stem}.tar.tmp-{os.getpid()}", hashed=True)

    def commit(self) -> dict | None:
        """Finish the shard; rename tar and index into place. None (and nothing on disk) if empty."""
        if not self._index:
            self.abort()
            return None
        self._flush()
        tail = end_of_archive(self._offset)
        os.write(self._fd, tail)
        self._sha.update(tail)
        fd, self._fd = self._fd, -1
        return publish_shard(self.out, self.stem, fd, self._tmp, self._offset + len(tail), self._sha,
                             index_text(self._index), len(self._index))


class TarSegmentWriter(TarMemberWriter):
    """A chunk's piece of a shard: complete ustar members, no end-of-archive, not hashed, not fsynced
    (``ShardAssembler`` concatenates the pieces, hashing them once, and fsyncs the shard)."""

    def __init__(self, folder: Path, stem: str) -> None:
        self.folder = Path(folder)
        self.name = f"{stem}.seg"
        self.folder.mkdir(parents=True, exist_ok=True)
        super().__init__(self.folder / f".{self.name}.tmp-{os.getpid()}", hashed=False)

    def commit(self) -> dict:
        """Rename the piece into place; {name, bytes, samples: [[key, [[ext, offset, size], ...]], ...]}."""
        self._flush()
        os.close(self._fd)
        self._fd = -1
        os.replace(self._tmp, self.folder / self.name)
        samples = [[entry[0][3].split(".", 1)[0], [[ext, off, size] for ext, off, size, _ in entry]]
                   for entry in self._index]
        return {"name": self.name, "bytes": self._offset, "samples": samples}


class ShardAssembler:
    """Builds ``<stem>.tar`` (+ ``.idx``) from segments appended in plan order, as they become available.

    The sha256 runs in the caller's thread over a read-only map of each segment (no copy), in
    order; the copy into the shard runs beside it on one helper thread (``copy_file_range`` at
    the segment's offset, inside the kernel), which also writes back every SYNC_EVERY bytes so
    the final fsync stays short."""

    def __init__(self, out: Path, stem: str) -> None:
        self.out = Path(out)
        self.stem = stem
        self._tmp = self.out / f".{stem}.tar.tmp-{os.getpid()}"
        self._fd = -1
        self._sha = hashlib.sha256()
        self._offset = 0
        self._lines: list[str] = []  # the DALI index, one line per sample
        self._copier: ThreadPoolExecutor | None = None
        self._copies: list[Future] = []
        self._unsynced = 0  # the copier's alone

    def add_segment(self, path: Path, piece: dict) -> None:
        """Append one segment (``path`` holds what ``TarSegmentWriter.commit`` described as ``piece``)."""
        if not piece["samples"]:
            return
        if self._fd < 0:
            self._fd = os.open(self._tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
            self._copier = ThreadPoolExecutor(1, thread_name_prefix="repack-copy")
        size = piece["bytes"]
        with open(path, "rb", buffering=0) as src:
            if os.fstat(src.fileno()).st_size != size:
                raise OSError(f"segment {path} is not the {size} bytes its record says")
            try:
                with mmap.mmap(src.fileno(), 0, access=mmap.ACCESS_READ) as view:
                    self._sha.update(view)
            except (OSError, ValueError):  # a file system without mmap (some FUSE mounts): read it
                src.seek(0)
                while block := src.read(ASSEMBLY_BLOCK):
                    self._sha.update(block)
        base = self._offset
        self._copies.append(self._copier.submit(self._copy, path, size, base))
        self._lines += [" ".join([f"{ext} {base + off} {size} {key}.{ext}" for ext, off, size in members])
                        for key, members in piece["samples"]]
        self._offset += size

    def _copy(self, path: Path, size: int, base: int) -> None:
        with open(path, "rb", buffering=0) as src:
            done = 0
            while done < size:
                try:
                    n = os.copy_file_range(src.fileno(), self._fd, size - done, done, base + done)
                except OSError as exc:
                    if exc.errno not in NO_COPY_FILE_RANGE or done:
                        raise
                    n = _copy_by_blocks(src.fileno(), self._fd, size, base)
                if n == 0:
                    raise OSError(f"segment {path} ended after {done} of {size} bytes")
                done += n
        self._unsynced += size
        if self._unsynced >= SYNC_EVERY:
            os.fdatasync(self._fd)
            self._unsynced = 0

    def _drain(self) -> None:
        """Wait for every copy; re-raise the first that failed."""
        if self._copier is not None:
            self._copier.shutdown(wait=True)
            self._copier = None
        copies, self._copies = self._copies, []
        for copy in copies:
            copy.result()

    def commit(self) -> dict | None:
        """Finish and rename into place; the shard entry. None (and nothing on disk) if no samples."""
        if self._fd < 0:
            return None
        self._drain()
        tail = end_of_archive(self._offset)
        if os.pwrite(self._fd, tail, self._offset) != len(tail):
            raise OSError(f"short write at the end of {self._tmp}")
        self._sha.update(tail)
        fd, self._fd = self._fd, -1
        return publish_shard(self.out, self.stem, fd, self._tmp, self._offset + len(tail), self._sha,
                             index_from_lines(self._lines), len(self._lines))

    def abort(self) -> None:
        try:
            self._drain()
        except OSError:
            pass  # the shard is dropped anyway
        if self._fd >= 0:
            os.close(self._fd)
            self._fd = -1
        self._tmp.unlink(missing_ok=True)


SYNC_EVERY = 64 << 20  # bytes copied into a shard between write-backs
ASSEMBLY_BLOCK = 1 << 20
NO_COPY_FILE_RANGE = {errno.EXDEV, errno.ENOSYS, errno.EOPNOTSUPP, errno.EINVAL}  # e.g. older kernels, FUSE


def _copy_by_blocks(src: int, dst: int, size: int, base: int) -> int:
    """The fallback of ``copy_file_range``: ``size`` bytes of ``src`` from 0 to ``dst`` at ``base``."""
    done = 0
    while done < size:
        block = os.pread(src, min(ASSEMBLY_BLOCK, size - done), done)
        if not block:
            break
        written = 0
        while written < len(block):
            written += os.pwrite(dst, block[written:], base + done + written)
        done += len(block)
    return done


def publish_shard(out: Path, stem: str, fd: int, tmp: Path, size: int, sha, index: str, samples: int) -> dict:
    """fsync and close a finished tar temp file, write its index, rename both into place; the shard entry."""
    try:
        os.fsync(fd)
    finally:
        os.close(fd)
    tar_name, idx_name = f"{stem}.tar", f"{stem}.idx"
    text = index.encode()
    idx_tmp = out / f".{idx_name}.tmp-{os.getpid()}"
    with open(idx_tmp, "wb") as fh:
        fh.write(text)
        fh.flush()
        os.fsync(fh.fileno())
    os.replace(idx_tmp, out / idx_name)
    os.replace(tmp, out / tar_name)
    fsync_dir(out)
    return {"path": tar_name, "samples": samples, "bytes": size, "sha256": sha.hexdigest(), "index": idx_name,
            "index_bytes": len(text), "index_sha256": hashlib.sha256(text).hexdigest()}


class WebDatasetSink:
    """The ``--to webdataset`` plugin."""

    name = "webdataset"

    @staticmethod
    def open_shard(out: Path, stem: str) -> TarShardWriter:
        return TarShardWriter(out, stem)

    open_segment = staticmethod(TarSegmentWriter)
    open_assembler = staticmethod(ShardAssembler)

    outputs = staticmethod(file_and_index_outputs)

    @staticmethod
    def verify_shard(root: Path, shard: dict, check) -> None:
        """Check one shard against its manifest entry; report problems through ``check``."""
        tar_path = root / shard["path"]
        if not check_file(root, shard["path"], shard["bytes"], shard["sha256"], check):
            return
        try:
            with open(tar_path, "rb") as fh:
                for member in iter_members(fh):
                    check(member.typeflag in (b"0", b"\x00"), f"{shard['path']}: member {member.name!r} is not "
                                                             "a regular file")
                    key, ext = split_key(member.name)
                    check(bool(key) and bool(ext) and member.name.isascii() and "/" not in member.name
                          and not member.name.startswith("."),
                          f"{shard['path']}: member name {member.name!r} is not a flat KEY.EXT name")
                fh.seek(0)
                rebuilt = index_from_tar(fh)
        except ValueError as exc:
            check(False, f"{shard['path']}: unreadable tar ({exc})")
            return
        count = int(rebuilt.split("\n", 1)[0].split()[1])
        check(count == shard["samples"], f"{shard['path']}: {count} samples, manifest says {shard['samples']}")
        layouts = {tuple(line.split(" ")[4::4]) for line in rebuilt.splitlines()[1:]}
        check(len(layouts) <= 1, f"{shard['path']}: samples differ in their members after the data member "
                                 f"({sorted(layouts)[:3]}): some sample lacks a field")
        if shard.get("index"):
            try:
                on_disk = (root / shard["index"]).read_text()
            except OSError as exc:
                check(False, f"{shard['index']}: missing ({exc.strerror})")
                return
            check(on_disk == rebuilt, f"{shard['index']}: does not match the tar's members")
