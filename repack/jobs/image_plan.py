"""The image plan's per-input arithmetic, on columns: byte bounds, slot sizes, cuts, task payloads.

Everything here works on whole columns of the inputs in plan order (numpy arrays, and the rels as
one names blob: ``repack.sources.columns``), so planning a million inputs costs a few vectorized
passes rather than a Python object, a dict and several function calls per input: a rel is decoded
only where its JSON escaping is not its length plus the quotes (a non-ASCII or escaped byte), and a
task's payload is its rows' columns sliced as bytes (``repack.jobs.task_inputs``). The results equal
the per-input rules they replace (``sample_bytes_bound``, ``sample_bytes_expected``, ``cut_by_budget``
in ``repack.jobs.images``).
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import TYPE_CHECKING, Sequence

import numpy as np

from repack.distinct import distinct
from repack.errors import UsageError
from repack.jobs.task_inputs import delta_columns, pack_column
from repack.sinks.tar_format import BLOCK, RECORD
from repack.sources.columns import NO_LABEL, blob_range, join_names, name_ends

if TYPE_CHECKING:
    from repack.sources.member_table import MemberTable

ARCHIVE_TAIL_MAX = 2 * BLOCK + RECORD  # end-of-archive blocks + padding to the record size
_JSON_STR = json.encoder.encode_basestring_ascii
_META_FIXED = len('{"bytes": , "class": , "format": "jpg", "height": 1000, "path": , "width": 1000}')
_FS = ("utf-8", "surrogateescape")
_PLAIN = bytes(b for b in range(0x20, 0x80) if b not in b'"\\')  # bytes JSON writes as themselves
_SCAN_BYTES = 1 << 20


@dataclass(frozen=True)
class InputColumns:
    """The inputs in plan order as the planner needs them."""

    names: bytes                      # the rels, each followed by a NUL (``repack.sources.columns``)
    ends: np.ndarray                  # int64: each rel's NUL in ``names``
    label_ids: np.ndarray             # int32 into ``label_names``; NO_LABEL (-1) for none
    label_names: tuple[str, ...]
    sizes: np.ndarray                 # int64
    fingerprints: "Fingerprints"
    paths: dict[int, str]             # row -> path, where not root + rel
    extra: dict[int, dict]            # row -> member/meta fields (inputs stored inside another file)
    root: str | None                  # path = root + rel unless in paths

    @classmethod
    def of(cls, items: Sequence, root: str | None) -> "InputColumns":
        """Columns of ``items``: an ``InputTable`` (read column-wise) or any sequence of ``InputItem``."""
        if hasattr(items, "shard_ids"):  # repack.sources.member_table.MemberTable: tar members
            return cls(items.names, items.ends, items.label_ids, tuple(items.label_names), items.sizes,
                       MemberFields(items), {}, {}, None)
        if hasattr(items, "label_ids"):  # repack.sources.columns.InputTable
            return cls(items.names, items.ends, items.label_ids, tuple(items.label_names), items.sizes,
                       Fingerprints((items.sizes, items.mtimes, items.inodes), None), dict(items.real_paths), {},
                       items.root + "/")
        items = list(items)
        try:
            names = join_names([item.rel for item in items])
        except ValueError:
            raise UsageError("an input path holds a NUL byte; it cannot be planned") from None
        label_names = tuple(sorted({item.label for item in items if item.label is not None}))
        index = {name: i for i, name in enumerate(label_names)}
        label_ids = np.array([index[item.label] if item.label is not None else NO_LABEL for item in items],
                             dtype=np.int32)
        paths = {row: item.path for row, item in enumerate(items) if root is None or item.path != root + item.rel}
        extra = {row: fields for row, item in enumerate(items) if (fields := item.entry_fields())}
        return cls(names, name_ends(names), label_ids, label_names,
                   np.array([item.size for item in items], dtype=np.int64),
                   Fingerprints(None, [item.fingerprint for item in items]), paths, extra, root)

    def __len__(self) -> int:
        return len(self.ends)

    def lengths(self) -> np.ndarray:
        """Each rel's bytes (int64)."""
        lengths = np.diff(self.ends, prepend=-1)
        lengths -= 1
        return lengths

    def rel(self, row: int) -> str:
        start = int(self.ends[row - 1]) + 1 if row else 0
        return self.names[start:int(self.ends[row])].decode(*_FS)

    def name_bytes(self, start: int, end: int) -> bytes:
        """The names blob of rows [start, end)."""
        return blob_range(self.names, self.ends, start, end)

    def per_label(self, length, none: int = 0) -> np.ndarray:
        """length(label name) per input, computed once per label (``none`` for unlabeled inputs)."""
        table = np.array([length(name) for name in self.label_names] + [none], dtype=np.int64)
        return table[self.label_ids]  # NO_LABEL (-1) indexes ``none``

    def json_lengths(self) -> np.ndarray:
        """len(encode_basestring_ascii(rel)) per input: the byte length + 2 quotes, but for the rels holding
        a byte JSON escapes (non-ASCII, control, quote, backslash), computed from the decoded rel."""
        lengths = self.lengths()
        lengths += 2
        if len(self.names.translate(None, _PLAIN)) > len(self):  # more than the NULs: some rel is escaped
            raw = np.frombuffer(self.names, dtype=np.uint8)
            for at in range(0, len(raw), _SCAN_BYTES):  # bounded temporaries
                part = raw[at:at + _SCAN_BYTES]
                escaped = (part >= 0x80) | ((part < 0x20) & (part != 0)) | (part == 0x22) | (part == 0x5C)
                for row in distinct(np.searchsorted(self.ends, at + np.flatnonzero(escaped))).tolist():
                    lengths[row] = len(_JSON_STR(self.rel(row)))
        return lengths


@dataclass(frozen=True)
class Fingerprints:
    """Fingerprints as columns (size, mtime_ns, inode: a folder scan) or as lists (other sources: their own
    length)."""

    columns: tuple[np.ndarray, ...] | None
    lists: list[list[int]] | None

    def payload(self, start: int, end: int) -> dict:
        """Rows [start, end) as a task payload's column: "fpz" (the packed size, mtime_ns and inode columns) or
        "fp" (a list per input)."""
        if self.columns is not None:
            return {"fpz": pack_column(delta_columns([column[start:end] for column in self.columns]))}
        return {"fp": self.lists[start:end]}


@dataclass(frozen=True)
class MemberFields:
    """Where tar members or parquet rows lie (a ``MemberTable``'s files, offsets or rows, and sizes) and their
    sample keys, as a task payload's columns (``repack.jobs.task_inputs``): the fingerprint checked is the file's."""

    table: MemberTable

    def payload(self, start: int, end: int) -> dict:
        """Rows [start, end): "shards" ([path, fingerprint, rel] of each shard they lie in; parquet: and its image
        column), "memz" (the packed columns: index into "shards", data offset or row number, size), "keyz" (their
        sample keys, a names blob) and, for parquet rows, "spathz" (their Image paths' lengths, int64, then the
        paths one after the other: a path may hold a NUL)."""
        table = self.table
        ids = table.shard_ids[start:end]
        used, local = np.unique(ids, return_inverse=True) if len(ids) else (ids, ids)
        shards = [table.shards[int(i)] for i in used.tolist()]
        keys = blob_range(table.keys, table.key_ends, start, end)
        payload = {"shards": [[shard.path, list(shard.fingerprint), shard.rel] for shard in shards],
                   "memz": pack_column(delta_columns([local.astype(np.int64), table.offsets[start:end],
                                                      table.sizes[start:end]])),
                   "keyz": pack_column(keys)}
        if table.columns:  # parquet rows: each file's image column, and the rows' Image paths
            for shard, at in zip(payload["shards"], used.tolist()):
                shard.append(table.columns[at])
            ends = table.source_path_ends[start:end]
            first = int(table.source_path_ends[start - 1]) if start else 0
            lengths = np.diff(ends, prepend=first).astype("<i8")
            payload["spathz"] = pack_column(lengths.tobytes() + table.source_paths[first:int(ends[-1]) if len(ends)
                                                                                    else first])
        return payload


def _digits(values: np.ndarray) -> np.ndarray:
    """Decimal digits of each non-negative value."""
    digits = np.ones(len(values), dtype=np.int64)
    for power in range(1, 19):
        digits += values >= 10 ** power
    return digits


def _image_and_cls(cols: InputColumns, cls_blocks) -> np.ndarray:
    """Each sample's image member (header and padded data) plus ``cls_blocks`` (bytes: a cls member)."""
    out = cols.sizes + (BLOCK - 1)
    out //= BLOCK
    out *= BLOCK
    out += BLOCK
    out += cls_blocks
    return out


def _add_json(out: np.ndarray, meta: np.ndarray) -> np.ndarray:
    """``out`` plus a json member of ``meta`` bytes (header and padding), in place."""
    meta += BLOCK - 1
    meta //= BLOCK
    meta *= BLOCK
    out += meta
    out += BLOCK
    return out


def sample_bounds(cols: InputColumns, with_json: bool = True) -> np.ndarray:
    """Upper bound of each sample's bytes in a tar (any label, any metadata escaping): the image, a cls
    and (``with_json``) a json member of at most 256 + 6 x (rel and label bytes), headers and padding."""
    out = _image_and_cls(cols, 2 * BLOCK)
    if not with_json:
        return out
    meta = cols.lengths()
    meta += cols.per_label(len)
    meta *= 6
    meta += 256
    return _add_json(out, meta)


def sample_expected(cols: InputColumns, with_json: bool = True) -> np.ndarray:
    """Each sample's bytes in a tar when its image is stored as read and (``with_json``) its metadata holds a
    4-digit width and height (``repack.jobs.images.sample_json``'s length; a chunk's slot is the sum)."""
    out = _image_and_cls(cols, cols.per_label(lambda name: 2 * BLOCK, none=0))
    if not with_json:
        return out
    meta = cols.json_lengths()
    meta += cols.per_label(lambda name: len(_JSON_STR(name)), none=len("null"))
    meta += _digits(cols.sizes)
    meta += _META_FIXED
    return _add_json(out, meta)


def cut_runs(bounds: np.ndarray, start: int, end: int, max_count: int | None,
             max_bytes: int | None) -> list[tuple[int, int]]:
    """Cut rows [start, end) into runs [s, e) of at most ``max_count`` rows and ``max_bytes`` bytes
    (the sum of ``bounds`` plus the end-of-archive once), greedily in order; a run holds at least one row."""
    cum = np.concatenate(([0], np.cumsum(bounds[start:end], dtype=np.int64)))
    runs: list[tuple[int, int]] = []
    s = 0
    n = end - start
    while s < n:
        e = n
        if max_count is not None:
            e = min(e, s + max_count)
        if max_bytes is not None:
            fit = int(np.searchsorted(cum, cum[s] + max_bytes - ARCHIVE_TAIL_MAX, side="right")) - 1
            e = min(e, max(fit, s + 1))
        runs.append((start + s, start + e))
        s = e
    return runs


class PayloadWriter:
    """Task payloads (``payload["inputs"]``, see ``repack.jobs.task_inputs``) of row ranges of ``cols``."""

    def __init__(self, cols: InputColumns, classes: dict[str, int]) -> None:
        self.cols = cols
        self.class_of = np.array([classes.get(name, NO_LABEL) for name in cols.label_names] + [NO_LABEL],
                                 dtype="<i4")  # by label id; NO_LABEL indexes the last
        self.path_rows = np.array(sorted(cols.paths), dtype=np.int64)
        self.extra_rows = np.array(sorted(cols.extra), dtype=np.int64)

    def inputs(self, start: int, end: int, first: int) -> dict:
        """The columnar inputs of rows [start, end); ``first``: the sample position of row ``start``."""
        cols = self.cols
        inputs: dict = {"first": first, "count": end - start, "relz": pack_column(cols.name_bytes(start, end)),
                        **cols.fingerprints.payload(start, end)}
        ids = cols.label_ids[start:end]
        low, high = (int(ids.min()), int(ids.max())) if len(ids) else (NO_LABEL, NO_LABEL)
        if high != NO_LABEL:
            used = [low] if low == high else distinct(ids[ids != NO_LABEL]).tolist()  # a task of one class: usual
            classes = self.class_of[np.where(ids == NO_LABEL, len(cols.label_names), ids)]
            lost = np.flatnonzero((ids != NO_LABEL) & (classes == NO_LABEL))
            if len(lost):  # a scan's rule let a label reach the plan without a class: never packed as "no label"
                row = start + int(lost[0])
                raise ValueError(f"input {cols.rel(row)!r}: its label {cols.label_names[int(ids[lost[0]])]!r} is not "
                                 "in the class map")
            inputs["clsz"] = pack_column(classes.tobytes())
            inputs["names"] = {str(int(self.class_of[i])): cols.label_names[i] for i in used}
        if cols.root is not None:
            inputs["root"] = cols.root
        for key, rows, values in (("path", self.path_rows, cols.paths), ("extra", self.extra_rows, cols.extra)):
            lo, hi = np.searchsorted(rows, [start, end])
            if hi > lo:
                inputs[key] = {str(row - start): values[row] for row in rows[lo:hi].tolist()}
        return inputs
