"""The published version's record of its inputs as `repack remove` reads it: the sample positions of the
named sources and the next free position, found layer by layer instead of merging the whole record.

A version's record (``repack.lifecycle.input_record.dataset_record``) is a chain: its own delta file, the
files it extends, down to a whole record or version 1's, derived from the plan. Merged, it is a row per
input (names, fingerprints, digests: reading every task record for them). A remove asks it two things:
where a few names are, and the next free position (its delta records only the removed sources). So each
layer is read as it is stored (``.repack/inputs-vN.npz``: ``parse_record``; version 1: the plan's names
blobs and first positions, no fingerprint or digest decoded) and the names looked up in each, newest
first, as ``merged`` resolves them (a later row's position wins unless it has none). The whole record
(without digests: ``to_bytes`` derives them) is derived only when asked for: a record written whole, or
the sources of a dataset without ``.json`` members. A chain that is not plainly this (an older JSON
record, a plan of entry lists) is merged as before.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable

import numpy as np

from repack.lifecycle.input_columns import InputColumns, names_of_blob, parse_record
from repack.manifest.versions import number_of

# a layer: sorted unique names (``S``) -> (the position of each, -1 where it has none; whether it holds it)
Layer = Callable[[np.ndarray], "tuple[np.ndarray, np.ndarray]"]


@dataclass(frozen=True)
class RecordLayers:
    """The published record's layers, newest first (see the module docstring); ``whole()``: the merged
    record without digests (``dataset_record(..., digests=False)``), derived once, when called."""

    layers: tuple[Layer, ...]
    next_position: int
    derive_whole: Callable[[], InputColumns] = field(repr=False, compare=False)
    _whole: list = field(default_factory=list, repr=False, compare=False)
    _seen: list = field(default_factory=list, repr=False, compare=False)  # [(names, positions, recorded)] looked up

    @classmethod
    def of(cls, whole: InputColumns) -> "RecordLayers":
        """A merged record as its one layer."""
        return cls((_columns_layer(whole),), whole.next_position, lambda: whole)

    def positions_of(self, names: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """(the position the merged record gives each of ``names`` (sorted unique ``S`` array), -1 where
        it gives none; whether the record holds it). Names looked up before are answered from what was
        found then: a remove asks for the same names twice (which are held as given, then where they are),
        and a lookup in version 1's plan decodes every planned name."""
        position = np.full(len(names), -1, np.int64)
        recorded = np.zeros(len(names), bool)
        seen = self._seen[0] if self._seen else (np.zeros(0, "S1"), position[:0], recorded[:0])
        at = np.searchsorted(seen[0], names).clip(0, max(0, len(seen[0]) - 1))
        known = seen[0][at] == names if len(seen[0]) else np.zeros(len(names), bool)
        position[known], recorded[known] = seen[1][at[known]], seen[2][at[known]]
        new = np.flatnonzero(~known)
        if not len(new):
            return position, recorded
        asked = names[new]
        for layer in self.layers:
            found_at, holds = layer(asked)
            take = holds & (position[new] < 0)
            position[new[take]] = found_at[take]
            recorded[new] |= holds
        merged = np.concatenate([seen[0], asked])
        order = np.argsort(merged, kind="stable")
        self._seen[:] = [(merged[order], np.concatenate([seen[1], position[new]])[order],
                          np.concatenate([seen[2], recorded[new]])[order])]
        return position, recorded

    def whole(self) -> InputColumns:
        """The merged record (without digests: ``InputColumns.digests_from`` derives them when written)."""
        if not self._whole:
            self._whole.append(self.derive_whole())
        return self._whole[0]


def record_layers(store, current: dict) -> RecordLayers | None:
    """The layers of the published version's record, None when it is not a chain of ``.npz`` files down to
    a whole one or to version 1's plan of column payloads (the caller then merges it,
    ``dataset_record``, which also names what is missing). UsageError naming a record file that is not
    one."""
    from repack.lifecycle.input_record import dataset_record
    from repack.lifecycle.publish import inputs_record, legacy_inputs_record

    number = number_of(current)
    layers: list[Layer] = []
    next_position = 0
    while True:
        raw = store.read_bytes(inputs_record(number))
        if raw is None:
            if store.size(legacy_inputs_record(number)) is not None:
                return None  # an older repack's JSON record: merged as before
            plan = _plan_layer(store) if number == 1 else None
            if plan is None:
                return None
            layer, last = plan
            layers.append(layer)
            next_position = max(next_position, last + 1)
            break
        stored = parse_record(raw, f"{store.url}/{inputs_record(number)}")
        layers.append(_columns_layer(stored.columns))
        next_position = max(next_position, stored.columns.next_position)
        if stored.base is None:
            break
        if not stored.base < number:
            return None  # dataset_record refuses it by name
        number = stored.base
    return RecordLayers(tuple(layers), next_position, lambda: dataset_record(store, current, digests=False))


def _columns_layer(columns: InputColumns) -> Layer:
    def find(names: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        rows, holds = columns.find(names)
        return np.where(holds, columns.position[rows] if len(columns) else -1, -1), holds
    return find


PLAN_PARTS = 8  # processes that look names up in version 1's plan at most (one per 2 CPUs)


def _plan_layer(store) -> tuple[Layer, int] | None:
    """(version 1's layer: the plan's names and positions, the last position) when every task's inputs
    are columns (``repack.jobs.task_inputs``), else None. Nothing is decoded until names are looked up;
    then the tasks are cut into runs (one per 2 CPUs, at most PLAN_PARTS) that decode their names and look
    up the few named ones at once, in forked children (``repack.exec.forked``), each sending back
    only what it found (no sort of the plan's names). A name planned twice takes its last row, as
    ``plan_inputs``."""
    from repack.exec.cpus import available_cpus
    from repack.jobs.base import read_plan
    from repack.jobs.task_inputs import input_count
    from repack.lifecycle.first_record import task_runs
    from repack.exec.forked import forked_map

    plan = read_plan(store)
    if plan is None:
        return None
    last = -1
    for task in plan.tasks:
        inputs = task.payload.get("inputs")
        if not isinstance(inputs, dict) or "relz" not in inputs or "first" not in inputs:
            return None
        count = input_count(task.payload)
        if count:
            last = max(last, int(inputs["first"]) + count - 1)
    runs = task_runs(plan.tasks, max(1, min(PLAN_PARTS, available_cpus() // 2)))

    def find(names: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        found_at, holds = np.full(len(names), -1, np.int64), np.zeros(len(names), bool)
        if not len(names):
            return found_at, holds
        for raw in forked_map(lambda run: _found_in(plan.tasks[run], names), runs):
            named, position = np.frombuffer(raw, np.int64).reshape(2, -1)
            found_at[named] = position  # a later run's row wins, as a later row in a run
            holds[named] = True
        return found_at, holds

    return find, last


def _found_in(tasks, names: np.ndarray) -> bytes:
    """Which of ``names`` (sorted unique ``S``) the ``tasks`` plan, as bytes: int64 (the named one's row in
    ``names``) for each, then int64 (its position); a name planned twice: its last row. ValueError naming a
    task whose input columns differ in length; UsageError for an empty planned name."""
    from repack.jobs.task_inputs import input_count, input_names_blob

    blobs = [input_names_blob(task.payload) for task in tasks]
    counts = np.array([input_count(task.payload) for task in tasks], np.int64)
    blob = b"".join(blobs)
    if blob.count(0) != int(counts.sum()):
        bad = next(task for task, part, count in zip(tasks, blobs, counts) if part.count(0) != count)
        raise ValueError(f"task {bad.task_id}: its input columns differ in length")
    planned = names_of_blob(blob) if blob else np.array([], dtype="S1")
    firsts = np.array([int(task.payload["inputs"]["first"]) for task in tasks], np.int64)
    starts = np.cumsum(counts) - counts
    position = np.repeat(firsts - starts, counts) + np.arange(len(planned), dtype=np.int64)
    at = np.searchsorted(names, planned).clip(0, len(names) - 1) if len(planned) else np.zeros(0, np.int64)
    rows = np.flatnonzero(names[at] == planned)  # ascending: a later duplicate comes later
    order = np.argsort(at[rows], kind="stable")
    rows, named = rows[order], at[rows][order]
    keep = np.ones(len(rows), bool)
    keep[:-1] = named[1:] != named[:-1]
    return np.concatenate([named[keep], position[rows[keep]]]).astype(np.int64).tobytes()
