"""Inputs stored inside other files, as columns: a ``--from webdataset|parquet`` scan without an object per sample.

A ``MemberTable`` holds, per input, its rel (``<shard rel>/<member name>``, or ``<file rel>/<row>``: a names
blob as ``repack.sources.columns`` has them), a label id, the file it lies in (an index into ``shards``), where
in it (a tar member's data offset and size; a parquet row: its number, its image column the file's, and its
size), its sample key (``source_key``, a second names blob) and, for parquet rows, the ``datasets`` Image
feature's path where it has one (``source_path``: spans of one blob with their ends, not a names blob: such a
path is data, and may hold a NUL; empty for none). It is a
``Sequence[MemberItem]``: code that wants objects (--append's selection, --dedup) indexes it and gets a
``MemberItem`` built on demand; the image planner reads the columns (``repack.jobs.image_plan``).
``MemberRows`` builds one, a shard at a time.
"""

from __future__ import annotations

import json
from array import array
from dataclasses import dataclass

import numpy as np

from repack.sources.base import MemberItem
from repack.sources.columns import _FS, NO_LABEL, LabeledRows, blob_rows, name_at, name_ends, span_rows
from repack.sources.containers import Container


@dataclass(frozen=True, eq=False)
class MemberTable(LabeledRows):
    """Tar members in plan order as columns (see the module docstring)."""

    names: bytes                   # the rels, each followed by a NUL
    ends: np.ndarray               # int64: where each rel's NUL is in ``names``
    label_ids: np.ndarray          # int32 into ``label_names``, NO_LABEL for none
    label_names: tuple[str, ...]
    shards: tuple[Container, ...]  # the shards the members lie in
    shard_ids: np.ndarray          # int32 into ``shards``
    offsets: np.ndarray            # int64: the member's data offset in its shard
    sizes: np.ndarray              # int64: the member's bytes
    keys: bytes                    # each input's sample key (``source_key``), each followed by a NUL
    key_ends: np.ndarray           # int64
    columns: tuple[str | None, ...] = ()  # parquet: each file's image column ("offsets" are row numbers); tar: ()
    source_paths: bytes = b""      # parquet: each row's Image path ("" for none), one after the other
    source_path_ends: np.ndarray | None = None  # int64: where each row's path ends in ``source_paths``

    def __getitem__(self, row):
        if isinstance(row, slice):
            return self.take(range(*row.indices(len(self))))
        at = int(self.shard_ids[row])
        shard = self.shards[at]
        offset, size = int(self.offsets[row]), int(self.sizes[row])
        meta = (("source_file", shard.rel), ("source_key", self.key(row)))
        if not self.columns:
            return MemberItem(shard.path, self.rel(row), self.label(row), size, container=shard.fingerprint,
                              member=(("offset", offset), ("size", size)), meta=meta)
        source_path = self.source_path(row)
        return MemberItem(shard.path, self.rel(row), self.label(row), size, container=shard.fingerprint,
                          member=(("row", offset), ("column", self.columns[at])),
                          meta=meta + ((("source_path", source_path),) if source_path else ()))

    def key(self, row: int) -> str:
        return name_at(self.keys, self.key_ends, row)

    def source_path(self, row: int) -> str:
        """A parquet row's Image path ("" for none, and for a tar member)."""
        if self.source_path_ends is None:
            return ""
        start = int(self.source_path_ends[row - 1]) if row else 0
        return self.source_paths[start:int(self.source_path_ends[row])].decode(*_FS)

    def shard_prints(self, no_mtime: int) -> tuple[np.ndarray, np.ndarray]:
        """Each input's fingerprint as an --append compares it (its shard's): size, and mtime_ns (s3://: the ETag
        value; ``no_mtime`` where the fingerprint has no second value), int64."""
        prints = [shard.fingerprint for shard in self.shards]
        size = np.array([p[0] for p in prints], dtype=np.int64)
        mtime = np.array([p[1] if len(p) > 1 else no_mtime for p in prints], dtype=np.int64)
        return size[self.shard_ids], mtime[self.shard_ids]

    def take(self, rows) -> "MemberTable":
        """The rows ``rows`` (any sequence of row numbers), in that order."""
        index = np.asarray(rows, dtype=np.int64).reshape(-1)
        names, keys = blob_rows(self.names, self.ends, index), blob_rows(self.keys, self.key_ends, index)
        paths, path_ends = span_rows(self.source_paths, self.source_path_ends, index) \
            if self.source_path_ends is not None else (b"", None)
        return MemberTable(names, name_ends(names), self.label_ids[index], self.label_names, self.shards,
                           self.shard_ids[index], self.offsets[index], self.sizes[index], keys, name_ends(keys),
                           self.columns, paths, path_ends)


class MemberRows:
    """A ``MemberTable`` built a row at a time (``add``), the shards' members in order."""

    def __init__(self, rows_of_files: bool = False) -> None:
        """``rows_of_files``: parquet rows (each file's image column, a row number and an Image path per input)."""
        self.names, self.keys, self.source_paths = bytearray(), bytearray(), bytearray()
        self.source_path_ends = array("q")
        self.rows_of_files = rows_of_files
        self.labels: dict[str, int] = {}
        self.shards: list[Container] = []
        self.columns: list[str | None] = []
        self.label_ids, self.shard_ids = array("i"), array("i")
        self.offsets, self.sizes = array("q"), array("q")

    def add(self, shard: Container, rel: str, key: str, label: str | None, offset: int, size: int,
            column: str | None = None, source_path: str = "") -> None:
        """One input: a tar member (its data ``offset`` and ``size``), or a parquet row (``offset``: its number;
        ``column``: its file's image column; ``source_path``: its Image path, "" for none)."""
        if not self.shards or self.shards[-1] is not shard:
            self.shards.append(shard)
            self.columns.append(column)
        self.names += rel.encode(*_FS) + b"\0"
        self.keys += key.encode(*_FS) + b"\0"
        if self.rows_of_files:
            self.source_paths += source_path.encode(*_FS)
            self.source_path_ends.append(len(self.source_paths))
        self.label_ids.append(NO_LABEL if label is None else self.labels.setdefault(label, len(self.labels)))
        self.shard_ids.append(len(self.shards) - 1)
        self.offsets.append(offset)
        self.sizes.append(size)

    def mark(self) -> tuple[int, ...]:
        """Where the rows end now (``undo`` takes back what was added since)."""
        return (len(self.names), len(self.keys), len(self.source_paths), len(self.shards), len(self.sizes),
                len(self.labels))

    def undo(self, mark: tuple[int, ...]) -> None:
        """Take back the rows added since ``mark``."""
        names, keys, paths, shards, count, labels = mark
        del self.names[names:], self.keys[keys:], self.source_paths[paths:], self.shards[shards:]
        del self.source_path_ends[count if self.rows_of_files else 0:]
        del self.columns[shards:]
        for column in (self.label_ids, self.shard_ids, self.offsets, self.sizes):
            del column[count:]
        for label in list(self.labels)[labels:]:
            del self.labels[label]

    def pack(self, quarantine: list[dict], counts: dict[str, int]) -> bytes:
        """The rows of one shard (a pool task's), with its quarantine records and counts, as bytes (``absorb``): a
        JSON head, the names and keys, then the label ids, offsets and sizes."""
        head = json.dumps([list(self.labels), quarantine, counts]).encode("utf-8", "surrogateescape")
        return b"".join([b"%d %d %d %d\n" % (len(head), len(self.names), len(self.keys), len(self.sizes)), head,
                         bytes(self.names), bytes(self.keys), self.label_ids.tobytes(), self.offsets.tobytes(),
                         self.sizes.tobytes()])

    def absorb(self, raw: bytes, shard: Container) -> tuple[list[dict], dict[str, int]]:
        """Add the rows ``pack`` packed of ``shard`` (tar members); its (quarantine records, counts)."""
        line_end = raw.index(b"\n")
        head_len, names_len, keys_len, count = map(int, raw[:line_end].split())
        at = line_end + 1
        labels, quarantine, counts = json.loads(raw[at:at + head_len].decode("utf-8", "surrogateescape"))
        at += head_len
        if count:
            self.shards.append(shard)
            self.columns.append(None)
            self.names += raw[at:at + names_len]
            self.keys += raw[at + names_len:at + names_len + keys_len]
            at += names_len + keys_len
            local = array("i")
            local.frombytes(raw[at:at + 4 * count])
            ids = [self.labels.setdefault(label, len(self.labels)) for label in labels]
            self.label_ids.extend(ids[lid] if lid != NO_LABEL else NO_LABEL for lid in local)
            at += 4 * count
            self.offsets.frombytes(raw[at:at + 8 * count])
            self.sizes.frombytes(raw[at + 8 * count:at + 16 * count])
            self.shard_ids.extend([len(self.shards) - 1] * count)
        return quarantine, counts

    def table(self) -> MemberTable:
        names, keys = bytes(self.names), bytes(self.keys)

        def column(values: array, dtype) -> np.ndarray:
            return np.frombuffer(values, dtype=dtype).copy() if len(values) else np.zeros(0, dtype=dtype)
        paths = bytes(self.source_paths)
        return MemberTable(names, name_ends(names), column(self.label_ids, np.int32), tuple(self.labels),
                           tuple(self.shards), column(self.shard_ids, np.int32), column(self.offsets, np.int64),
                           column(self.sizes, np.int64), keys, name_ends(keys),
                           tuple(self.columns) if self.rows_of_files else (), paths,
                           column(self.source_path_ends, np.int64) if self.rows_of_files else None)
