"""The published version's record for `--append`, its derivation started before the append's imports and lock.

An append's critical path is SOURCE's walk and, beside it, the child that derives the dataset's record
(``repack.lifecycle.record_child``); both used to start after the append's imports (~0.15 s on the device
machine). ``record_ahead`` forks that child at the command's start, from a process that has imported little
(this module imports no numpy), before the walk's children (``repack.sources.walk.walk_ahead``): the child
reads the published manifest itself, without the lock, derives the record and sends it tagged with the
sha256 of the manifest's bytes. ``taken_record`` hands it to the append, which takes it only when the
version it locked is that one (``ChildRecord``'s ``tag``: a writer that published in between, or a pending
version promoted, gives other bytes, and the record is derived again under the lock).

Nothing starts for an object store's dataset, where no manifest is there to read, or where a fork is not
safe (``repack.exec.forked.can_fork``); the append then forks its child as before.
"""

from __future__ import annotations

import contextlib
import os
from typing import Iterator

from repack.exec.forked import FAILED_LINE, can_fork, start_child, stop_child

_AHEAD: dict[str, tuple[int, int]] = {}  # dataset folder -> (pid, pipe) of a child no append took yet


@contextlib.contextmanager
def record_ahead(location: str) -> Iterator[None]:
    """Fork the child that derives the record of the dataset in folder ``location`` now (see the module docstring);
    an append inside the block takes it (``taken_record``); one not taken is stopped on leaving the block. Inside
    a block of the same dataset, the outer block's child is the one (none is forked)."""
    key = _key(location)
    mine = key is not None and key not in _AHEAD and can_fork() and os.path.isfile(os.path.join(key, "manifest.json"))
    if mine:
        _AHEAD[key] = start_child(lambda: _tagged_pieces(key), FAILED_LINE)
    try:
        yield
    finally:
        child = _AHEAD.pop(key, None) if mine else None
        if child is not None:
            stop_child(*child)


def taken_record(location: str) -> tuple[int, int] | None:
    """The (pid, pipe) of the child ``record_ahead`` forked for the dataset at ``location``, once; None without one."""
    key = _key(location)
    return _AHEAD.pop(key, None) if key is not None else None


def _key(location: str) -> str | None:
    from repack.store import is_remote

    return None if is_remote(location) else os.path.realpath(location)


def _tagged_pieces(location: str) -> list:
    """In the child: the record's pipe pieces, tagged with the manifest it was derived from."""
    from repack.exec.cpus import available_cpus
    from repack.lifecycle.input_record import dataset_record
    from repack.lifecycle.publish import current_version
    from repack.lifecycle.record_child import column_pieces, record_parts
    from repack.sinks.checks import bytes_digest
    from repack.store import open_store

    store = open_store(location)
    current, raw = current_version(store)
    record = dataset_record(store, current, digests=False, parts=record_parts(available_cpus()))
    return column_pieces(record, tag=bytes_digest(raw)["sha256"])
