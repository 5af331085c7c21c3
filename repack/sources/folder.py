"""ImageFolder-style scanning: class = first folder level; a flat folder is unlabeled.

Hidden files and OS junk are skipped. Every entry obeys the source's ``Confinement``
(``repack.sources.confine``): symlinks are followed inside the source root only (a link leaving
it is quarantined unless allowed), FIFOs, sockets and devices are quarantined, never opened,
and files over the size cap are quarantined from their size. A directory loop is never entered
twice. A file reached through two paths is packed once under its real path (the path without
a symlink), and the alias is quarantined naming it; of two real paths (hard links) the first in
sorted order wins; an --append keeps the path whose sample the dataset holds (``prefer``), so a hard link
added later is the alias then. With ``follow_symlinks=False`` every symlink is quarantined instead.

Confinement per folder: a folder reached without a symlink from the real root is real and inside
the root, so an entry of it that ``os.scandir`` reports as a plain regular file (its d_type) needs
only its ``lstat`` (size, mtime, inode; the size cap): no realpath, no ``Confinement.check``. Only
symlinks and special files go through ``Confinement.check``. Each top-level folder is scanned by
its own task, on a pool of ``workers`` processes (``repack.sources.scan_pool``) when there are at least
``PARALLEL_MIN_FOLDERS`` of them; the result is an ``InputTable`` (columns, see
``repack.sources.columns``), the same whatever the worker count.

Order without a sort of the whole listing: a folder's entries are walked in the byte order of their
name, a folder's name taken with its trailing "/" (``walk_order``). A file name never holds a "/", so
that is the byte order of the full paths ("c01/a.b" before "c01/sub/x"), and the concatenated
walks of the top-level folders are the sorted listing. A worker sends its rels as one names blob
and its stats as int64 bytes; the driver joins the blobs and never decodes a rel.

The walk itself is ``repack.sources.walk`` (no numpy there). Started ahead: `repack images` calls
``walk_ahead`` before it imports the job's modules (``repack.commands.images.walked_ahead``; not for
``--append``), so the walks fork from a small process and run while the driver imports and locks OUT
(``--executor ray``: while it imports Ray and a forked child plans, ``repack.jobs.plan_ahead``); the
job's ``scan_folder`` of the same root and rules takes them. Those walks run in forked children
(``repack.exec.forked.ForkedTasks``), not on a ``ProcessPoolExecutor``: its thread in the driver would
make the next fork unsafe (Ray's driver pool would start through a forkserver). Each file is listed and
stat'ed relative to its open folder (``fstatat``: no path walk per file).
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass
from typing import Callable

import numpy as np

from repack.errors import UsageError
from repack.sources.base import Scan, alias_reason, quarantine_record, sort_key
from repack.sources.columns import NO_LABEL, InputTable, name_ends, same_files
from repack.sources.confine import Confinement
from repack.sources.walk import Walks, taken_ahead


@dataclass(frozen=True)
class _Part:
    """A walk's result as the driver keeps it: columns (names blob, stats (N, 4)), no object per file."""

    names: bytes | memoryview
    stats: np.ndarray
    count: int
    real_paths: dict[int, str]
    quarantine: list[dict]
    skipped: int
    top_dirs: list[str]

    @classmethod
    def unpack(cls, raw: bytes | memoryview) -> "_Part":
        """A walk's bytes (``repack.sources.walk._Found.pack``) as columns: views of ``raw``, nothing copied."""
        view = memoryview(raw)
        line_end = bytes(view[:48]).index(b"\n")
        head_len, names_len = map(int, bytes(view[:line_end]).split())
        at = line_end + 1
        names = view[at + head_len:at + head_len + names_len]
        stats = np.frombuffer(view[at + head_len + names_len:], dtype=np.int64).reshape(-1, 4)
        if not head_len:  # plain files only (the usual folder): no parse
            return cls(names, stats, len(stats), {}, [], 0, [])
        real_paths, quarantine, skipped, top_dirs, count = json.loads(
            bytes(view[at:at + head_len]).decode("utf-8", "surrogateescape"))
        return cls(names, stats, count, {int(k): v for k, v in real_paths.items()}, quarantine, skipped, top_dirs)

def scan_folder(root: str, confinement: Confinement | None = None, workers: int = 1,
                meanwhile: Callable[[], object] | None = None,
                prefer: Callable[[list[str]], list[bool]] | None = None) -> Scan:
    """Enumerate ``root`` recursively into an ``InputTable``; see the module docstring for the rules.
    ``meanwhile``: the caller's own work, run once in this process while the walks run on the pool (an
    --append reads the dataset's record then). ``prefer``: of a file reached through several paths, which
    of its rels to keep first (an --append: the one the dataset holds a sample of), asked only where a file
    has several."""
    if not os.path.exists(root):
        raise UsageError(f"source {root!r} does not exist")
    if not os.path.isdir(root):
        raise UsageError(f"source {root!r} is not a folder (use --list for a list file)")
    conf = (confinement or Confinement()).rooted(root)
    walks = taken_ahead(conf, workers) or Walks.start(conf, workers)
    parts = [_Part.unpack(raw) for raw in walks.parts(meanwhile)]
    top = walks.top
    labeled = bool(top.top_dirs)
    names = b"".join(part.names for part in parts)
    ends = name_ends(names)
    stats = np.concatenate([part.stats for part in parts])  # one call for all parts, then the columns
    size, mtime, inode, device = (np.ascontiguousarray(stats[:, k]) for k in range(4))
    del stats
    counts = np.array([part.count for part in parts], dtype=np.int64)
    firsts = np.concatenate(([0], np.cumsum(counts)[:-1]))
    real_paths = {int(first) + row: path for part, first in zip(parts, firsts) for row, path in part.real_paths.items()}
    quarantine = [q for part in parts for q in part.quarantine]
    skipped = sum(part.skipped for part in parts)
    # each part is in byte order (see the module docstring); the root's own files come first, and in a
    # labeled tree (the only one with parts after them) they are all quarantined below
    label_names = tuple(top.top_dirs) if labeled else ()
    label_ids = np.repeat(np.arange(-1, len(parts) - 1, dtype=np.int32), counts) if labeled else \
        np.full(len(ends), NO_LABEL, dtype=np.int32)
    del parts
    keep = np.ones(len(ends), dtype=bool)
    table = InputTable(conf.root, names, ends, label_ids, label_names, size, mtime, inode, real_paths)
    _drop_aliases(conf, table, device, keep, quarantine, prefer)
    del device
    if labeled:
        for row in range(int(counts[0])):  # the root's own files
            if keep[row]:
                keep[row] = False
                quarantine.append(quarantine_record(table.rel(row), "file outside the class folders of a labeled tree"))
    if not keep.all():
        table = table.take(np.flatnonzero(keep))
    return Scan(table, tuple(sorted(quarantine, key=lambda q: sort_key(q["source"]))), labeled, skipped)


def _drop_aliases(conf: Confinement, table: InputTable, devices: np.ndarray, keep: np.ndarray,
                  quarantine: list[dict], prefer: Callable[[list[str]], list[bool]] | None = None) -> None:
    """Files reached through several paths (equal device and inode; rows in sorted order): keep one, the
    real path (no symlink on the way) before an alias, else the first, among the paths ``prefer`` picks
    where it picks any (an --append: the path that already has its sample, so that a hard link added
    later never gives one file a second sample); quarantine the others naming it."""
    if len(table) < 2:
        return
    real_paths = table.real_paths
    groups = same_files(table.inodes, devices)
    for group in groups:
        preferred = [row for row, chosen in zip(group, prefer([table.rel(row) for row in group]))
                     if chosen] if prefer is not None else []
        candidates = preferred or group
        winner = next((row for row in candidates if row not in real_paths), candidates[0])
        for row in group:
            if row == winner:
                continue
            keep[row] = False
            rel = table.rel(row)
            real = real_paths.get(row, f"{conf.root}/{rel}")
            head, slash, _ = rel.partition("/")
            quarantine.append(quarantine_record(rel, alias_reason(rel, real, table.rel(winner), conf.root),
                                                head if slash else None))
