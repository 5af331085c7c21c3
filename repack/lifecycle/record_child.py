"""The dataset's record for `--append`, derived in a forked child process while the driver sets up the
staged job and walks SOURCE.

Deriving the published version's record (``repack.lifecycle.input_record.dataset_record``: version 1's
from its plan, a task at a time, plus the deltas on it) is serial decoding of every existing input's
name and fingerprint; the walk of SOURCE runs on a process pool meanwhile. Done in the driver, the longer
of the two sets the append's time. ``ChildRecord`` forks at the append's start (before the staged
job's imports and the scan's pool) and the child sends back the columns the selection needs, without
the digests (``InputColumns.digests_from`` derives those in the driver, only to compare a known input
whose mtime changed, or to write a whole record). Version 1's plan is decoded by a few processes at once
(``record_parts``; ``repack.exec.forked``). Over the pipe, no pickle::

  b"%d\\n" % len(head) + head (JSON: count, width, next_position, removed, removed_width)
  + names (count x width bytes, the ``S`` array) + size, mtime_ns, position (count int64 each, native)
  + removed (removed x removed_width bytes)

written from the columns' own buffers (``column_pieces``) and read into one buffer sized from the head
(``read_columns``): the driver's columns are views of it, no copy joins or splits the ~43 MB of a million
inputs on either side.

The child dies with the driver (PR_SET_PDEATHSIG) and leaves by ``os._exit``. Where a fork is not safe
(a thread runs: an object store's lock heartbeat), not possible, or the child fails (its error is the
driver's to report: the driver derives again and raises it), the record is derived in the driver.
"""

from __future__ import annotations

import dataclasses
import json
import os
from typing import Callable

import numpy as np

from repack.exec.forked import can_fork, start_child, stop_child
from repack.lifecycle.input_columns import InputColumns

_ERROR = b"-\n"  # what a child that failed sends


MAX_PARTS = 4  # processes that decode version 1's plan at most (``record_parts``)


def record_parts(cpus: int) -> int:
    """How many processes decode version 1's plan for the child (``first_record.plan_inputs``' ``parts``):
    one per 4 CPUs, at most MAX_PARTS, so the walk's pool (a process per CPU) keeps most of the cores. At
    1M inputs the decode is ~0.5 CPU-s (3.3x the 2-core VM's 0.16 s at 300k), about what the walk takes on 16."""
    return max(1, min(MAX_PARTS, cpus // 4))


class ChildRecord:
    """``derive()`` (a record without its digests) run in a forked child (see the module docstring):
    calling it waits for the child's columns, once (``digests(record, rows)``: that record with the digests
    of ``rows`` (None: all), set as its ``digests_from``); ``close()`` stops a child not waited for. In this
    process when a fork is not safe; a child's failure is raised by deriving here."""

    def __init__(self, derive: Callable[[], InputColumns],
                 digests: Callable[[InputColumns, np.ndarray | None], InputColumns]) -> None:
        self._derive, self._digests = derive, digests
        self._record: InputColumns | None = None
        self._pid, self._read_end = 0, -1
        if can_fork():
            self._start()

    def _start(self) -> None:
        self._pid, self._read_end = start_child(lambda: column_pieces(self._derive()), _ERROR)

    def __call__(self) -> InputColumns:
        if self._record is not None:
            return self._record
        record = None
        if self._pid:
            with os.fdopen(self._read_end, "rb") as pipe:
                record = read_columns(pipe)
            os.waitpid(self._pid, 0)
            self._pid = 0
        if record is None:
            record = self._derive()  # raises what the child met, or derives what it could not send
        else:
            record = dataclasses.replace(record, digests_from=self._digests_of(record))
        self._record = record
        return record

    def _digests_of(self, record: InputColumns) -> Callable[[np.ndarray | None], InputColumns]:
        return lambda rows=None: self._digests(record, rows)

    def close(self) -> None:
        """Stop the child when it was not waited for (the append failed first)."""
        if self._pid:
            stop_child(self._pid, self._read_end)
            self._pid = 0


def column_pieces(record: InputColumns) -> list:
    """The pipe's bytes of ``record``'s names, fingerprints, positions and removed sources (see the module
    docstring), as the buffers to write one after the other (the columns themselves where contiguous)."""
    names, removed = np.ascontiguousarray(record.names), np.ascontiguousarray(record.removed)
    head = json.dumps({"count": len(names), "width": names.dtype.itemsize, "next_position": record.next_position,
                       "removed": len(removed), "removed_width": removed.dtype.itemsize}).encode()
    return [b"%d\n" % len(head) + head, names, *(np.ascontiguousarray(column, np.int64)
                                                 for column in (record.size, record.mtime_ns, record.position)),
            removed]


def pack_columns(record: InputColumns) -> bytes:
    """``column_pieces`` joined."""
    return b"".join(memoryview(piece).cast("B") for piece in column_pieces(record))


def read_columns(pipe) -> InputColumns | None:
    """The record a child writes to ``pipe`` (``column_pieces``), read into one buffer sized from its head,
    the columns views of it; None when it is not whole (a child that failed)."""
    line = pipe.readline()
    try:
        head = pipe.read(int(line))
        size = _body_size(json.loads(head))
    except (ValueError, KeyError, TypeError):
        return None
    body = bytearray(size)
    view, at = memoryview(body), 0
    while at < size:
        got = pipe.readinto(view[at:])
        if not got:
            return None
        at += got
    if pipe.read(1):
        return None
    return unpack_columns(b"%d\n" % len(head) + head, body)


def _body_size(head: dict) -> int:
    count, width, gone, gone_width = (int(head[k]) for k in ("count", "width", "removed", "removed_width"))
    return count * (width + 24) + gone * gone_width


def unpack_columns(raw: bytes, body: bytes | bytearray | None = None) -> InputColumns | None:
    """The record of ``pack_columns``' bytes (no digests; ``body``: the bytes after the head, when read
    apart), None when they are not whole. The columns are views of the bytes."""
    try:
        end = raw.index(b"\n")
        length = int(raw[:end])
        head = json.loads(raw[end + 1:end + 1 + length])
        count, width, gone, gone_width = (int(head[k]) for k in ("count", "width", "removed", "removed_width"))
    except (ValueError, KeyError, TypeError):
        return None
    body = memoryview(body) if body is not None else memoryview(raw)[end + 1 + length:]
    sizes = [count * width, count * 8, count * 8, count * 8, gone * gone_width]
    if len(body) != sum(sizes):
        return None
    parts, at = [], 0
    for size in sizes:
        parts.append(body[at:at + size])
        at += size
    names = np.frombuffer(parts[0], f"S{width}") if count else np.array([], dtype="S1")
    removed = np.frombuffer(parts[4], f"S{gone_width}") if gone else np.array([], dtype="S1")
    size, mtime, position = (np.frombuffer(part, np.int64) for part in parts[1:4])
    return InputColumns(names, size, mtime, position, np.zeros((count, 32), np.uint8), np.zeros(count, bool),
                        removed, int(head["next_position"]))
