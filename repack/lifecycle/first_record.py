"""Version 1's record of its inputs, derived from the job's own state: the plan's input columns
(``plan_inputs``) and the sha256 of each packed input from the task records (``plan_record``).

A pack writes no ``.repack/inputs-v1.npz``: its plan (``plan.json.gz``) and task records already hold
every input's name, fingerprint, sample position and digest. The first `--append` or `repack remove`
stores its record as a delta on this derived one (``repack.lifecycle.publish.write_inputs_record``), so
neither the pack nor the first change writes a row per existing input. The digests are the expensive
part (every task record read and decoded) and an append needs them only for a known input whose mtime
changed: ``version_one_record(..., digests=False)`` leaves them out and says how to get them
(``InputColumns.digests_from``).
"""

from __future__ import annotations

import base64
import dataclasses
import json

import numpy as np

from repack.jobs.base import PLAN_NAME, STATE_DIR, Plan, planned_entries, read_plan
from repack.jobs.record_columns import state_digest_columns
from repack.jobs.task_inputs import fingerprint_rows, input_count, input_names_blob
from repack.exec.forked import forked_map
from repack.lifecycle.input_columns import (NO_MTIME, InputColumns, build_columns, encode_names, names_of_blob,
                                            with_digests)
from repack.sources.columns import join_names


def has_plan(store, state: str = STATE_DIR) -> bool:
    """Whether ``state`` holds a job's plan (``plan.json.gz``, or an older ``plan.json``) to derive from."""
    return store.size(f"{state}/{PLAN_NAME}") is not None or store.size(f"{state}/plan.json") is not None


def version_one_record(store, digests: bool = True, parts: int = 1) -> InputColumns | None:
    """The record of version 1 derived from the dataset's plan and task records (``plan_record``); None
    without a readable plan. ``digests=False``: without the digests (``digests_from`` derives them), the
    plan's columns decoded in ``parts`` processes (``plan_inputs``)."""
    plan = read_plan(store)
    if plan is None:
        return None
    if digests:
        return plan_record(store, plan)
    inputs = plan_inputs(plan, 0, parts)
    return dataclasses.replace(inputs, digests_from=lambda rows=None: plan_record(store, plan, inputs=inputs,
                                                                                 wanted=rows))


def plan_inputs(plan: Plan, next_position: int, parts: int = 1) -> InputColumns:
    """Every input planned in ``plan``: its fingerprint and sample position (no digests: ``with_digests``
    adds them); next_position past the plan's sample keys and ``next_position``. Read from the tasks'
    input columns (``repack.jobs.task_inputs``: the names blobs joined and cut as one byte matrix) without
    an object per input; other payloads (entry lists, text segments and tables) entry by entry. ``parts``
    > 1: the tasks are cut into that many runs of about equal inputs, decoded at once in forked children
    (``repack.exec.forked``; the same columns)."""
    runs = task_runs(plan.tasks, parts)
    if len(runs) > 1:
        columns = [unpack_part(raw) for raw in forked_map(lambda run: pack_part(task_columns(plan.tasks[run])), runs)]
    else:
        columns = [task_columns(plan.tasks)]
    names = np.concatenate([c[0] for c in columns]) if len(columns) > 1 else columns[0][0]
    size, mtime, position = (np.concatenate([c[k] for c in columns]) for k in (1, 2, 3))
    last = int(position.max(initial=-1))
    return build_columns(names, size, mtime, position, {}, max(next_position, last + 1))


def task_runs(tasks, parts: int) -> list[slice]:
    """``tasks`` cut into at most ``parts`` runs of about equal input counts (none empty)."""
    if parts < 2 or len(tasks) < 2:
        return [slice(0, len(tasks))]
    ends = np.cumsum([input_count(task.payload) for task in tasks])
    cuts = np.searchsorted(ends, ends[-1] * np.arange(1, parts) / parts, side="right")
    bounds = sorted({0, *(int(cut) for cut in cuts if 0 < cut < len(tasks)), len(tasks)})
    return [slice(a, b) for a, b in zip(bounds, bounds[1:])]


def task_columns(tasks) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    """(names ``S`` array, size, mtime_ns, position) of the inputs of ``tasks``, in plan order."""
    blobs: list[bytes] = []
    sizes: list[np.ndarray] = []
    mtimes: list[np.ndarray] = []
    positions: list[np.ndarray] = []
    for task in tasks:
        fingerprints = fingerprint_rows(task.payload)
        if fingerprints is not None:
            blob = input_names_blob(task.payload)
            if blob.count(0) != len(fingerprints):
                raise ValueError(f"task {task.task_id}: its input columns differ in length")
            blobs.append(blob)
            sizes.append(fingerprints[:, 0])
            mtimes.append(fingerprints[:, 1])
            positions.append(int(task.payload["inputs"]["first"]) + np.arange(len(fingerprints), dtype=np.int64))
            continue
        entries = list(planned_entries(task.payload))
        blobs.append(join_names([entry["rel"] for entry in entries]))
        sizes.append(np.array([int(entry["fingerprint"][0]) for entry in entries], np.int64))
        mtimes.append(np.array([int(entry["fingerprint"][1]) if len(entry["fingerprint"]) > 1 else NO_MTIME
                                for entry in entries], np.int64))
        positions.append(np.array([int(entry["key"].partition("_")[0]) if "key" in entry else -1
                                   for entry in entries], np.int64))
    blob = b"".join(blobs)
    names = names_of_blob(blob) if blob else np.array([], dtype="S1")
    empty = np.zeros(0, np.int64)
    return (names, *(np.concatenate(column).astype(np.int64, copy=False) if column else empty
                     for column in (sizes, mtimes, positions)))


def pack_part(columns: tuple[np.ndarray, ...]) -> bytes:
    """``task_columns``' columns as bytes: ``b"COUNT WIDTH\n"``, the names' byte matrix, then size, mtime_ns
    and position (COUNT int64 each, native order)."""
    names = np.ascontiguousarray(columns[0])
    return b"".join([b"%d %d\n" % (len(names), names.dtype.itemsize), names.tobytes(),
                     *(np.ascontiguousarray(column, np.int64).tobytes() for column in columns[1:])])


def unpack_part(raw: bytes) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    """The columns of ``pack_part``'s bytes; ValueError when they are not whole."""
    head = raw.index(b"\n")  # the body is not copied: the columns are views of ``raw``
    count, width = (int(value) for value in raw[:head].split())
    view = memoryview(raw)[head + 1:]
    if len(view) != count * (width + 24):
        raise ValueError("a part of the plan's input columns is not whole")
    names = np.frombuffer(view[:count * width], f"S{width}") if count else np.array([], dtype="S1")
    at = count * width
    return (names, *(np.frombuffer(view[at + k * count * 8:at + (k + 1) * count * 8], np.int64) for k in range(3)))


def task_digests(store, state: str = STATE_DIR, plan: Plan | None = None) -> tuple[list[str], bytes]:
    """(rels, their raw sha256 digests joined) from the task records under ``state``/tasks/ (the tasks that
    hash their inputs; ``plan``: the state's plan, when read already)."""
    return state_digest_columns(store, state, plan)


def plan_record(store, plan: Plan, next_position: int = 0, state: str = STATE_DIR,
                inputs: InputColumns | None = None, wanted: np.ndarray | None = None) -> InputColumns:
    """The record of the inputs a job planned (``plan``, its state under ``state``): the plan's input
    columns (``plan_inputs``, or ``inputs`` when decoded already) with the sha256 of each packed input from
    its task record. An image unit's record holds its digests in plan order, one per planned input less
    the quarantined ones, so each digest is placed by its input's sample position: no rel decoded or looked
    up. ``wanted``: the rows whose digests are asked for; the records of units that plan none of them are
    not read (their rows stay without a digest). Any other record form (text digest files, video
    ``digests`` pairs, entry-list payloads) is read by name, whole (``task_digests``)."""
    record = inputs if inputs is not None else plan_inputs(plan, next_position)
    # the rows to place digests in, ordered by their sample positions (all rows, or the rows asked for)
    order = np.argsort(record.position, kind="stable") if wanted is None else np.unique(np.asarray(wanted, np.int64))
    if wanted is not None:
        order = order[np.argsort(record.position[order], kind="stable")]
    positions = record.position[order]
    units = dict(plan.units)
    units.update((task.task_id, (task,)) for task in plan.tasks)
    sha, has = np.zeros(record.sha256.shape, np.uint8), np.zeros(len(record), bool)  # calloc'd: untouched rows free
    for rel in store.list_names(f"{state}/tasks/"):  # names only: no stat per task lock
        if not rel.endswith(".json"):
            continue
        tasks = units.get(rel.rsplit("/", 1)[-1][:-len(".json")])
        if wanted is not None and tasks is not None and not any(_plans_any(task, positions) for task in tasks):
            continue  # a job's task records share one form: a record read tells whether it is another
        raw = store.read_bytes(rel)
        try:
            saved = json.loads(raw) if raw is not None else None
        except ValueError:
            continue
        if not isinstance(saved, dict):
            continue
        if saved.get("digest_rows") or "digests" in saved or (
                "sha256" in saved and (tasks is None or not all(map(_column_payload, tasks)))):
            return with_digests(record, *task_digests(store, state, plan))  # a form placed by name
        if "sha256" not in saved or tasks is None:
            continue
        planned = np.concatenate([int(t.payload["inputs"]["first"]) + np.arange(input_count(t.payload), dtype=np.int64)
                                  for t in tasks])
        refused = [q["source"] for q in saved.get("quarantine", ()) if isinstance(q, dict) and "source" in q]
        if refused:
            rows, found = record.find(encode_names(refused))
            planned = planned[~np.isin(planned, record.position[rows[found]])]
        try:
            digests = base64.b64decode(saved["sha256"])
        except (ValueError, TypeError):
            continue
        count = min(len(planned), len(digests) // 32)
        if not count or not len(positions):
            continue
        at = np.searchsorted(positions, planned[:count]).clip(0, len(positions) - 1)
        hit = positions[at] == planned[:count]
        if wanted is None and not hit.all():
            continue  # a record that does not match its plan: its inputs stay without a digest
        rows = order[at[hit]]
        sha[rows] = np.frombuffer(digests, np.uint8, 32 * count).reshape(count, 32)[hit]
        has[rows] = True
    return dataclasses.replace(record, sha256=sha, has_sha256=has)


def _plans_any(task, positions: np.ndarray) -> bool:
    """Whether ``task`` plans a sample at one of ``positions`` (sorted) (a task without input columns: True)."""
    if not _column_payload(task):
        return True
    first = int(task.payload["inputs"]["first"])
    return bool(np.searchsorted(positions, first + input_count(task.payload)) > np.searchsorted(positions, first))


def _column_payload(task) -> bool:
    """Whether a task's inputs are columns with a fingerprint column (``repack.jobs.task_inputs``)."""
    inputs = task.payload.get("inputs")
    return isinstance(inputs, dict) and ("fpz" in inputs or "fp3" in inputs) and "first" in inputs


