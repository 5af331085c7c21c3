"""WebDataset tar shards with DALI index files (see tar_format for the byte layout).

A shard is written to a hidden temp name and renamed into place only when complete,
after its index; the sha256 is computed while writing.
"""

from __future__ import annotations

import hashlib
import os
from pathlib import Path

from repack.manifest.io import fsync_dir
from repack.sinks.checks import check_file, file_and_index_outputs
from repack.sinks.tar_format import (BLOCK, end_of_archive, index_from_tar, index_text, iter_members, padding,
                                     split_key, ustar_header)


class TarShardWriter:
    """Appends samples (adjacent members sharing one key) to one tar shard."""

    def __init__(self, out: Path, stem: str) -> None:
        self.out = Path(out)
        self.stem = stem
        self.tar_name = f"{stem}.tar"
        self.idx_name = f"{stem}.idx"
        self._tmp = self.out / f".{self.tar_name}.tmp-{os.getpid()}"
        self._fd = os.open(self._tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
        self._sha = hashlib.sha256()
        self._offset = 0
        self._index: list[list[tuple[str, int, int, str]]] = []

    def add_sample(self, key: str, members: list[tuple[str, bytes]]) -> None:
        """Write one sample: members [(extension, data)], in the given order."""
        entry = []
        for ext, data in members:
            name = f"{key}.{ext}"
            header = ustar_header(name.encode("ascii"), len(data))
            pad = padding(len(data))
            chunks = [header, data, pad] if pad else [header, data]
            written = os.writev(self._fd, chunks)
            expected = BLOCK + len(data) + len(pad)
            while written < expected:  # short write: finish it
                rest = b"".join(chunks)[written:]
                written += os.write(self._fd, rest)
            for chunk in chunks:
                self._sha.update(chunk)
            entry.append((ext, self._offset + BLOCK, len(data), name))
            self._offset += expected
        self._index.append(entry)

    @property
    def samples(self) -> int:
        return len(self._index)

    def commit(self) -> dict | None:
        """Finish the shard; rename tar and index into place. None (and nothing on disk) if empty."""
        if not self._index:
            self.abort()
            return None
        tail = end_of_archive(self._offset)
        os.write(self._fd, tail)
        self._sha.update(tail)
        size = self._offset + len(tail)
        os.fsync(self._fd)
        os.close(self._fd)
        self._fd = -1
        index = index_text(self._index).encode()
        idx_tmp = self.out / f".{self.idx_name}.tmp-{os.getpid()}"
        with open(idx_tmp, "wb") as fh:
            fh.write(index)
            fh.flush()
            os.fsync(fh.fileno())
        os.replace(idx_tmp, self.out / self.idx_name)
        os.replace(self._tmp, self.out / self.tar_name)
        fsync_dir(self.out)
        return {"path": self.tar_name, "samples": len(self._index), "bytes": size,
                "sha256": self._sha.hexdigest(), "index": self.idx_name, "index_bytes": len(index),
                "index_sha256": hashlib.sha256(index).hexdigest()}

    def abort(self) -> None:
        if self._fd >= 0:
            os.close(self._fd)
            self._fd = -1
        self._tmp.unlink(missing_ok=True)


class WebDatasetSink:
    """The ``--to webdataset`` plugin."""

    name = "webdataset"

    @staticmethod
    def open_shard(out: Path, stem: str) -> TarShardWriter:
        return TarShardWriter(out, stem)

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
