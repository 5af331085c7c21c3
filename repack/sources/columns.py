"""Scanned inputs as columns: one row per input file, no Python object per input.

An ``InputTable`` holds what a folder scan found: the inputs' paths relative to the root as one
bytes blob (``names``: each rel in the file-system encoding, utf-8 with surrogateescape, followed by
one NUL; ``ends``: the position of each NUL), a label id per input into ``label_names`` (-1:
unlabeled), and the fingerprint columns (size, mtime_ns, inode) as numpy arrays. An input's real
path is ``root + "/" + rel`` except where ``real_paths`` says otherwise (a file reached through a
symlinked folder). It is a ``Sequence[InputItem]``: code that wants objects (--append's selection,
--dedup's hashing, the video job) indexes or iterates it and gets an ``InputItem`` built on demand;
the image planner reads the columns (``repack.jobs.image_plan``) and never decodes a rel.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from functools import cached_property

import numpy as np

from repack.sources.base import InputItem, clean_label, join_names, quarantine_record

NO_LABEL = -1
_FS = ("utf-8", "surrogateescape")


def name_ends(names: bytes) -> np.ndarray:
    """The position of each NUL of a names blob (one per rel), int64."""
    return np.flatnonzero(np.frombuffer(names, dtype=np.uint8) == 0).astype(np.int64)


def split_names(names: bytes) -> list[str]:
    """The rels of a names blob, decoded."""
    return names.decode(*_FS).split("\0")[:-1] if names else []


def blob_rows(names: bytes, ends: np.ndarray, index: np.ndarray) -> bytes:
    """The names blob of the rows ``index`` (int64 row numbers, in that order) of the blob ``names``."""
    if len(index) == len(ends) and (index == np.arange(len(ends))).all():
        return names
    if len(index) * 8 < len(ends):  # a few rows (an --append's new inputs): sliced out one by one
        starts = np.concatenate(([0], ends[:-1] + 1)) if len(ends) else np.zeros(0, dtype=np.int64)
        return b"".join([names[start:end + 1] for start, end in zip(starts[index].tolist(), ends[index].tolist())])
    parts = names.split(b"\0")
    return b"".join([parts[i] + b"\0" for i in index.tolist()])


def span_rows(blob: bytes, ends: np.ndarray, index: np.ndarray) -> tuple[bytes, np.ndarray]:
    """The spans ``index`` of ``blob`` (values one after the other, each ending at its ``ends``: no separator, so
    a value may hold any byte), in that order: their blob and ends."""
    starts = np.concatenate(([0], ends[:-1])).astype(np.int64) if len(ends) else np.zeros(0, np.int64)
    picked = b"".join([blob[a:b] for a, b in zip(starts[index].tolist(), ends[index].tolist())])
    return picked, np.cumsum(ends[index] - starts[index]).astype(np.int64)


def name_at(names: bytes, ends: np.ndarray, row: int) -> str:
    """Row ``row`` of a names blob, decoded."""
    start = int(ends[row - 1]) + 1 if row else 0
    return names[start:int(ends[row])].decode(*_FS)


def blob_range(names: bytes, ends: np.ndarray, start: int, end: int) -> bytes:
    """The names blob of rows [start, end) of the blob ``names`` (each row followed by its NUL)."""
    if start >= end:
        return b""
    first = int(ends[start - 1]) + 1 if start else 0
    return names[first:int(ends[end - 1]) + 1]


class LabeledRows(Sequence):
    """What a table of inputs as columns (``names``, ``ends``, ``label_ids``, ``label_names``) answers of its
    rows, shared by ``InputTable`` and ``repack.sources.member_table.MemberTable``; ``self[row]`` is the class's."""

    names: bytes
    ends: np.ndarray
    label_ids: np.ndarray
    label_names: tuple[str, ...]

    def __len__(self) -> int:
        return len(self.ends)

    def __iter__(self):
        return (self[row] for row in range(len(self)))

    def rel(self, row: int) -> str:
        return name_at(self.names, self.ends, row)

    def label(self, row: int) -> str | None:
        lid = int(self.label_ids[row])
        return None if lid == NO_LABEL else self.label_names[lid]

    def label_set(self) -> set[str]:
        """The labels some input carries."""
        if not len(self.label_ids):
            return set()
        counts = np.bincount(self.label_ids + 1, minlength=len(self.label_names) + 1)  # NO_LABEL counted at 0
        return {self.label_names[i] for i in np.flatnonzero(counts[1:]).tolist()}


@dataclass(frozen=True, eq=False)
class InputTable(LabeledRows):
    """Inputs in plan order as columns (see the module docstring)."""

    root: str                                 # real root folder; an input's path is root/rel unless in real_paths
    names: bytes                              # the rels, each followed by a NUL
    ends: np.ndarray                          # int64: where each rel's NUL is in ``names``
    label_ids: np.ndarray                     # int32, NO_LABEL for none
    label_names: tuple[str, ...]
    sizes: np.ndarray                         # int64
    mtimes: np.ndarray                        # int64 (ns)
    inodes: np.ndarray                        # int64
    real_paths: dict[int, str] = field(default_factory=dict)  # row -> real path, where not root/rel

    @classmethod
    def of_rels(cls, root: str, rels: list[str], label_ids, label_names, sizes, mtimes, inodes,
                real_paths: dict[int, str] | None = None) -> "InputTable":
        """A table from rels as str (a small scan, a test)."""
        names = join_names(rels)
        return cls(root, names, name_ends(names), np.asarray(label_ids, dtype=np.int32), tuple(label_names),
                   np.asarray(sizes, dtype=np.int64), np.asarray(mtimes, dtype=np.int64),
                   np.asarray(inodes, dtype=np.int64), dict(real_paths or {}))

    def __getitem__(self, row):
        if isinstance(row, slice):
            return self.take(range(*row.indices(len(self))))
        return InputItem(self.path(row), self.rel(row), self.label(row), int(self.sizes[row]),
                         int(self.mtimes[row]), int(self.inodes[row]))

    @property
    def starts(self) -> np.ndarray:
        """Where each rel begins in ``names``."""
        return np.concatenate(([0], self.ends[:-1] + 1)) if len(self.ends) else np.zeros(0, dtype=np.int64)

    @cached_property
    def rels(self) -> list[str]:
        """Every rel as str (decoded once, on demand: --append's selection; the planner does not need it)."""
        return split_names(self.names)

    def path(self, row: int) -> str:
        """The real path an input is opened by."""
        found = self.real_paths.get(row)
        return found if found is not None else f"{self.root}/{self.rel(row)}"

    def fingerprint(self, row: int) -> list[int]:
        return [int(self.sizes[row]), int(self.mtimes[row]), int(self.inodes[row])]

    def take(self, rows) -> "InputTable":
        """The rows ``rows`` (any sequence of row numbers), in that order."""
        index = np.asarray(rows, dtype=np.int64)
        if len(index) == 0:
            index = np.zeros(0, dtype=np.int64)
        moved = {new: self.real_paths[old] for new, old in enumerate(index.tolist()) if old in self.real_paths} \
            if self.real_paths else {}
        names = blob_rows(self.names, self.ends, index)
        return InputTable(self.root, names, name_ends(names), self.label_ids[index], self.label_names,
                          self.sizes[index], self.mtimes[index], self.inodes[index], moved)

    def renamed(self, rels: dict[int, str]) -> "InputTable":
        """This table with the rels of some rows (``rels``: row -> rel) spelled otherwise; each row opens the same
        path as before."""
        spelled = self.rels.copy()
        real_paths = dict(self.real_paths)
        for row, rel in rels.items():
            real_paths[row] = self.path(row)
            spelled[row] = rel
            if real_paths[row] == f"{self.root}/{rel}":
                del real_paths[row]
        names = join_names(spelled)
        return InputTable(self.root, names, name_ends(names), self.label_ids, self.label_names, self.sizes,
                          self.mtimes, self.inodes, real_paths)

    def clean_labels(self) -> tuple["InputTable", list[dict]]:
        """``clean_label`` applied to the label names (names equal once cleaned become one); rows whose
        label is only whitespace are dropped, with their quarantine records."""
        cleaned = [clean_label(name) for name in self.label_names]
        if cleaned == list(self.label_names):
            return self, []
        names = tuple(sorted({c for c in cleaned if c is not None}))
        remap = np.array([names.index(c) if c is not None else -2 for c in cleaned] + [NO_LABEL], dtype=np.int32)
        ids = remap[self.label_ids]  # NO_LABEL (-1) indexes the appended NO_LABEL
        bad = np.flatnonzero(ids == -2)
        quarantine = [quarantine_record(self.rel(row), f"class name {self.label(row)!r} is empty once its "
                                                       "surrounding whitespace is stripped") for row in bad.tolist()]
        relabeled = InputTable(self.root, self.names, self.ends, ids, names, self.sizes, self.mtimes, self.inodes,
                               self.real_paths)
        if len(bad):
            relabeled = relabeled.take(np.flatnonzero(ids != -2))
        return relabeled, quarantine


def same_files(inodes: np.ndarray, devices: np.ndarray) -> list[list[int]]:
    """The groups of rows that are one file (equal device and inode), each in row order, in the order of their
    first rows; [] when every row is its own file (one sort)."""
    if len(inodes) < 2:
        return []
    if (devices == devices[0]).all():  # one file system (the usual case): no inode repeats, no alias
        if (inodes[1:] > inodes[:-1]).all():  # files made in name order: ascending inodes, none twice
            return []
        ordered = np.sort(inodes)  # else any order (files made by many processes): a quicksort, not a timsort
        if not (ordered[1:] == ordered[:-1]).any():
            return []
        del ordered
    order = np.lexsort((np.arange(len(inodes)), inodes, devices))  # by device, inode, then row
    same = (inodes[order][1:] == inodes[order][:-1]) & (devices[order][1:] == devices[order][:-1])
    groups: dict[tuple[int, int], list[int]] = {}
    for at in np.flatnonzero(same).tolist():
        for row in (int(order[at]), int(order[at + 1])):
            group = groups.setdefault((int(devices[row]), int(inodes[row])), [])
            if not group or group[-1] != row:  # rows ascend within a group (the lexsort's last key)
                group.append(row)
    return sorted(groups.values())
