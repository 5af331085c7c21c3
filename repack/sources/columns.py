"""Scanned inputs as columns: one row per input file, no Python object per input.

An ``InputTable`` holds what a folder scan found: ``rels`` (paths relative to the root), a label id
per input into ``label_names`` (-1: unlabeled), and the fingerprint columns (size, mtime_ns, inode)
as numpy arrays. An input's real path is ``root + "/" + rel`` except where ``real_paths`` says
otherwise (a file reached through a symlinked folder). It is a ``Sequence[InputItem]``: code that
wants objects (--append's selection, --dedup's hashing, the video job) indexes or iterates it and
gets an ``InputItem`` built on demand; the image planner reads the columns.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

import numpy as np

from repack.sources.base import InputItem, clean_label, quarantine_record

NO_LABEL = -1


@dataclass(frozen=True, eq=False)
class InputTable(Sequence):
    """Inputs in plan order as columns (see the module docstring)."""

    root: str                                 # real root folder; an input's path is root/rel unless in real_paths
    rels: list[str]
    label_ids: np.ndarray                     # int32, NO_LABEL for none
    label_names: tuple[str, ...]
    sizes: np.ndarray                         # int64
    mtimes: np.ndarray                        # int64 (ns)
    inodes: np.ndarray                        # int64
    real_paths: dict[int, str] = field(default_factory=dict)  # row -> real path, where not root/rel

    def __len__(self) -> int:
        return len(self.rels)

    def __getitem__(self, row):
        if isinstance(row, slice):
            return self.take(range(*row.indices(len(self))))
        return InputItem(self.path(row), self.rels[row], self.label(row), int(self.sizes[row]),
                         int(self.mtimes[row]), int(self.inodes[row]))

    def __iter__(self):
        return (self[row] for row in range(len(self)))

    def path(self, row: int) -> str:
        """The real path an input is opened by."""
        found = self.real_paths.get(row)
        return found if found is not None else f"{self.root}/{self.rels[row]}"

    def label(self, row: int) -> str | None:
        lid = int(self.label_ids[row])
        return None if lid == NO_LABEL else self.label_names[lid]

    def fingerprint(self, row: int) -> list[int]:
        return [int(self.sizes[row]), int(self.mtimes[row]), int(self.inodes[row])]

    def label_set(self) -> set[str]:
        """The labels some input carries."""
        used = np.unique(self.label_ids)
        return {self.label_names[i] for i in used.tolist() if i != NO_LABEL}

    def take(self, rows) -> "InputTable":
        """The rows ``rows`` (any sequence of row numbers), in that order."""
        index = np.asarray(rows, dtype=np.int64)
        if len(index) == 0:
            index = np.zeros(0, dtype=np.int64)
        rels = self.rels
        moved = {new: self.real_paths[old] for new, old in enumerate(index.tolist()) if old in self.real_paths} \
            if self.real_paths else {}
        return InputTable(self.root, [rels[i] for i in index.tolist()], self.label_ids[index], self.label_names,
                          self.sizes[index], self.mtimes[index], self.inodes[index], moved)

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
        quarantine = [quarantine_record(self.rels[row], f"class name {self.label(row)!r} is empty once its "
                                                        "surrounding whitespace is stripped") for row in bad.tolist()]
        relabeled = InputTable(self.root, self.rels, ids, names, self.sizes, self.mtimes, self.inodes,
                               self.real_paths)
        if len(bad):
            relabeled = relabeled.take(np.flatnonzero(ids != -2))
        return relabeled, quarantine
