"""The text planner's cut on columns: ``TextInputs`` into chunks of segments, and each chunk as a packed
task table.

``plan_chunk_columns`` gives exactly the chunks of ``text_docs.plan_chunks`` (about-equal chunks that
never split a document; the same cut points and boundary rules) without a Python object per input
file: the files between two cut points are taken as whole segments with numpy, and only a file a cut
falls in or at (one per chunk at most) goes through the per-file rule, which may open it to snap the
cut to a document boundary. The result is columns: per segment its file's row, start, end and unit
(``UNITS``), and where each chunk begins.

A chunk's task table (``pack_table``) is ``repack.jobs.task_inputs``' packed form::

  {"root": "/src/",            path = root + rel, except the segments in "path"
   "count": N,                 segments
   "relz": "<packed>",         their files' rels, each followed by a NUL (``pack_column``)
   "startz", "endz": "<packed>"  little-endian int64 columns: bytes or row groups [start, end)
   "unit": "ffb...",           one letter per segment (``text_docs.UNIT_CODES``)
   "fpz": "<packed>",          size, mtime_ns, inode of each file (``delta_columns``)
   "path": {i: path}}          segments opened elsewhere (a list file, a symlinked folder, s3://)

``table_segments``, ``table_rels`` and ``table_fingerprints`` read it and the older table of lists.
"""

from __future__ import annotations

import contextlib
import math
from dataclasses import dataclass

import numpy as np

from repack.jobs.task_inputs import delta_columns, pack_column, undelta_columns, unpack_column
from repack.sources.columns import join_names, split_names
from repack.sources import text_docs
from repack.sources.text_docs import (UNIT_OF, Segment, auto_chunk_bytes, classify, parquet_row_groups, snap_line,
                                      snap_paragraph)
from repack.sources.text_docs import table_segments as old_table_segments
from repack.sources.text_scan import KINDS, TextInputs

BYTES, FILE, ROWGROUPS = 0, 1, 2
UNITS = ("bytes", "file", "rowgroups")
_UNIT_LETTERS = np.frombuffer(b"bfr", np.uint8)  # text_docs.UNIT_CODES, by unit number
_JSONL, _TXT, _PARQUET = (KINDS.index(k) for k in ("jsonl", "txt", "parquet"))


@dataclass(frozen=True)
class ChunkColumns:
    """Segments in plan order (``rows``: the input row of each; ``starts``/``ends``; ``units``) and the segment
    where each chunk begins (``bounds``: one more than the chunks)."""

    rows: np.ndarray
    starts: np.ndarray
    ends: np.ndarray
    units: np.ndarray
    bounds: np.ndarray

    def __len__(self) -> int:
        return len(self.bounds) - 1

    def chunk(self, k: int) -> slice:
        return slice(int(self.bounds[k]), int(self.bounds[k + 1]))


class _Segments:
    """Segments appended in order (arrays in bulk, or one at a time), and the chunk boundaries."""

    def __init__(self) -> None:
        self.parts: list[tuple[np.ndarray, ...]] = []
        self.count = 0
        self.bounds = [0]

    def add(self, rows, starts, ends, units) -> None:
        rows = np.asarray(rows, np.int64)
        if len(rows):
            self.parts.append((rows, np.asarray(starts, np.int64), np.asarray(ends, np.int64),
                               np.asarray(units, np.uint8)))
            self.count += len(rows)

    def close(self) -> None:
        """End the current chunk, if it holds a segment."""
        if self.count > self.bounds[-1]:
            self.bounds.append(self.count)

    def columns(self) -> ChunkColumns:
        self.close()
        joined = [np.concatenate([p[k] for p in self.parts]) if self.parts else np.zeros(0, np.int64)
                  for k in range(4)]
        return ChunkColumns(joined[0], joined[1], joined[2], joined[3].astype(np.uint8), np.asarray(self.bounds,
                                                                                                    np.int64))


def plan_chunk_columns(inputs: TextInputs, chunk_bytes: int | None, doc_per: str, field: str
                       ) -> tuple[ChunkColumns, list[dict], np.ndarray]:
    """``text_docs.plan_chunks`` on columns (see the module docstring): the chunks, and the quarantine records
    and rows of ``inputs`` of the parquet files that cannot be read (in no chunk)."""
    table = inputs.table
    kinds, compressed = inputs.codes // 3, inputs.codes % 3 != 0
    units = np.where(kinds == _PARQUET, ROWGROUPS, np.where(compressed | ((kinds == _TXT) & (doc_per == "file")),
                                                           FILE, BYTES)).astype(np.uint8)
    sizes = table.sizes.astype(np.int64, copy=True)
    keep = np.ones(len(table), dtype=bool)
    quarantine: list[dict] = []
    groups: dict[int, list[int]] = {}  # row -> compressed size of each row group (parquet)
    for row in np.flatnonzero(units == ROWGROUPS).tolist():
        found, reason = parquet_row_groups(table.path(row), field)
        if reason:
            quarantine.append({"source": table.rel(row), "line": None, "reason": reason})
            keep[row] = False
        else:
            groups[row] = found
            sizes[row] = sum(found)
    atoms = np.flatnonzero(keep)
    size = sizes[atoms]
    unit = units[atoms]
    total = int(size.sum())
    n = max(1, math.ceil(total / (chunk_bytes or auto_chunk_bytes(total))))
    cuts = [round(k * total / n) for k in range(1, n)]
    ends = np.cumsum(size)
    out = _Segments()
    ci, i = 0, 0
    while i < len(atoms):
        stop = len(atoms)  # the next atom a cut falls in or at (the per-file rule), else none
        if ci < len(cuts):
            c = cuts[ci]
            first_at, first_past = (max(i, int(np.searchsorted(ends, c, side))) for side in ("left", "right"))
            at_end = np.flatnonzero(unit[first_at:first_past] != BYTES)  # a whole file or row groups ending at c
            stop = first_at + int(at_end[0]) if len(at_end) else min(first_past, len(atoms))
        _whole(out, atoms[i:stop], size[i:stop], unit[i:stop], groups)
        if stop == len(atoms):
            break
        ci = _cut_one(out, inputs, int(atoms[stop]), int(unit[stop]), int(ends[stop] - size[stop]), cuts, ci,
                      doc_per, groups)
        i = stop + 1
    return out.columns(), quarantine, np.flatnonzero(~keep)


def _whole(out: _Segments, rows: np.ndarray, size: np.ndarray, unit: np.ndarray, groups: dict) -> None:
    """Files no cut falls in: one whole segment each (an empty file read by byte ranges: none)."""
    if not len(rows):
        return
    ends = size.copy()
    for k in np.flatnonzero(unit == ROWGROUPS).tolist():
        ends[k] = len(groups[int(rows[k])])
    kept = ~((unit == BYTES) & (size == 0))
    out.add(rows[kept], np.zeros(int(kept.sum()), np.int64), ends[kept], unit[kept])


def _cut_one(out: _Segments, inputs: TextInputs, row: int, unit: int, pos: int, cuts: list[int], ci: int,
             doc_per: str, groups: dict) -> int:
    """``plan_chunks``' rule for one file that a cut falls in or at; returns the next cut's number."""
    table = inputs.table
    size = int(table.sizes[row])

    def seg(start: int, end: int) -> None:
        out.add([row], [start], [end], [unit])

    if unit == BYTES:
        local = 0
        cut_inside = ci < len(cuts) and cuts[ci] < pos + size
        opened = text_docs.open_input(table.path(row), table.fingerprint(row), table.rel(row)) if cut_inside else \
            contextlib.nullcontext()
        snap = snap_paragraph if inputs.codes[row] // 3 == _TXT and doc_per == "blank-line" else snap_line
        with opened as fh:
            while ci < len(cuts) and cuts[ci] < pos + size:
                boundary = snap(fh, cuts[ci] - pos, size)
                if boundary > local:
                    seg(local, boundary)
                    local = boundary
                out.close()
                ci += 1
        if local < size:
            seg(local, size)
    elif unit == ROWGROUPS:
        offset, first = pos, 0
        found = groups[row]
        for g, group_size in enumerate(found):
            offset += group_size
            if ci < len(cuts) and cuts[ci] <= offset:
                seg(first, g + 1)
                first = g + 1
                out.close()
                while ci < len(cuts) and cuts[ci] <= offset:
                    ci += 1
        if first < len(found):
            seg(first, len(found))
    else:
        seg(0, size)
        if ci < len(cuts) and cuts[ci] <= pos + size:
            out.close()
            while ci < len(cuts) and cuts[ci] <= pos + size:
                ci += 1
    return ci


def pack_table(inputs: TextInputs, chunks: ChunkColumns, k: int) -> dict:
    """Chunk ``k``'s task table (see the module docstring)."""
    table = inputs.table
    part = chunks.chunk(k)
    rows = chunks.rows[part]
    first, last = int(rows[0]), int(rows[-1])
    if last - first + 1 == len(rows):  # consecutive files (the usual case): one slice of the names blob
        names = table.names[int(table.ends[first - 1]) + 1 if first else 0:int(table.ends[last]) + 1]
    else:
        names = table.take(rows).names
    packed = {"root": table.root + "/", "count": len(rows), "relz": pack_column(names),
              "startz": pack_column(chunks.starts[part].astype("<i8").tobytes()),
              "endz": pack_column(chunks.ends[part].astype("<i8").tobytes()),
              "unit": _UNIT_LETTERS[chunks.units[part]].tobytes().decode("ascii"),
              "fpz": pack_column(delta_columns([table.sizes[rows], table.mtimes[rows], table.inodes[rows]]))}
    if table.real_paths:
        moved = {str(i): table.real_paths[r] for i, r in enumerate(rows.tolist()) if r in table.real_paths}
        if moved:
            packed["path"] = moved
    return packed


def chunk_bytes_of(chunks: ChunkColumns, k: int) -> int:
    """The bytes of chunk ``k``'s byte-range and whole-file segments (its progress units)."""
    part = chunks.chunk(k)
    counted = chunks.units[part] != ROWGROUPS
    return int((chunks.ends[part] - chunks.starts[part])[counted].sum())


def table_rels(table: dict) -> list[str]:
    """The rel of each segment of a task table (either form)."""
    return split_names(unpack_column(table["relz"])) if "relz" in table else list(table["rel"])


def table_names(table: dict) -> bytes:
    """The rels of a task table's segments as a names blob (``repack.sources.columns``), either form."""
    return unpack_column(table["relz"]) if "relz" in table else join_names(table["rel"])


def table_fingerprints(table: dict) -> list[list[int]]:
    """The [size, mtime_ns, inode] of each segment's file (either form)."""
    if "fpz" in table:
        return undelta_columns(unpack_column(table["fpz"]), table["count"]).tolist() if table["count"] else []
    return [list(fp) for fp in table["fingerprint"]]


def table_segments(table: dict) -> list[Segment]:
    """The segments of a task table (either form)."""
    if "relz" not in table:
        return old_table_segments(table)
    rels, fps = table_rels(table), table_fingerprints(table)
    starts = np.frombuffer(unpack_column(table["startz"]), "<i8").tolist()
    ends = np.frombuffer(unpack_column(table["endz"]), "<i8").tolist()
    root, moved = table["root"], table.get("path", {})
    out = []
    for i, (rel, start, end, unit, fp) in enumerate(zip(rels, starts, ends, table["unit"], fps)):
        kind, compression = classify(rel.rsplit("/", 1)[-1])  # a planned rel always classifies
        out.append(Segment(moved.get(str(i)) or root + rel, rel, kind, compression, start, end, UNIT_OF[unit],
                           tuple(fp)))
    return out
