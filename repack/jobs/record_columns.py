"""Per-input values of a task record as compact columns (an image task's record, saved as JSON).

A record holds, per packed input, its content sha256 and its read and check times. As JSON lists
of ``[rel, hex]`` and integers that was ~150 bytes per input, kept for the dataset's life; here:

  "sha256": base64 of the 32-byte digests of the packed inputs, in plan order (43 B per input);
            which inputs they are: the unit's planned inputs less its quarantined ones
  "us":     base64 of the zlib'd little-endian uint32 read times then check times (microseconds)

``unit_digests`` pairs a unit's digests with its inputs' rels; ``state_digests`` reads every task
record of a job state (images: sha256 columns; video, text: their ``digests`` pairs).
"""

from __future__ import annotations

import base64
import json
import zlib

import numpy as np

from repack.jobs.base import STATE_DIR, Plan, read_plan
from repack.jobs.task_inputs import input_rels

DIGEST_BYTES = 32


def pack_digests(digests: list[bytes]) -> str:
    """Raw sha256 digests, in order, as one base64 string."""
    return base64.b64encode(b"".join(digests)).decode("ascii")


def unpack_digests(packed: str) -> list[str]:
    """The hex digests of ``pack_digests``."""
    raw = base64.b64decode(packed)
    return [raw[i:i + DIGEST_BYTES].hex() for i in range(0, len(raw), DIGEST_BYTES)]


def join_digests(parts: list[str]) -> str:
    """Several ``pack_digests`` strings as one (in order)."""
    return base64.b64encode(b"".join(base64.b64decode(p) for p in parts)).decode("ascii")


def pack_times(*columns: list[int]) -> str:
    """Equal-length integer columns (microseconds) as one base64 string of zlib'd uint32."""
    flat = np.clip(np.concatenate([np.asarray(c, dtype=np.int64) for c in columns]) if columns else
                   np.zeros(0, dtype=np.int64), 0, 2**32 - 1).astype("<u4")
    return base64.b64encode(zlib.compress(flat.tobytes(), 6)).decode("ascii")


def unpack_times(packed: str, parts: int) -> list[np.ndarray]:
    """The ``parts`` columns of ``pack_times`` (int64 arrays)."""
    flat = np.frombuffer(zlib.decompress(base64.b64decode(packed)), dtype="<u4").astype(np.int64)
    return np.split(flat, parts) if len(flat) else [flat.copy() for _ in range(parts)]


def join_times(parts: list[str], columns: int) -> str:
    """Several ``pack_times`` strings as one: each column concatenated in order."""
    unpacked = [unpack_times(p, columns) for p in parts]
    return pack_times(*(np.concatenate([u[c] for u in unpacked]) for c in range(columns)))


def packed_rels(tasks, record: dict) -> list[str]:
    """The rels of a unit's packed inputs in plan order: its planned inputs less its quarantined ones."""
    refused = {q["source"] for q in record.get("quarantine", ())}
    rels = [rel for task in tasks for rel in input_rels(task.payload)]
    return [rel for rel in rels if rel not in refused] if refused else rels


def unit_digests(tasks, record: dict) -> list[tuple[str, str]]:
    """(rel, sha256 hex) of a unit's packed inputs, from its record (either form)."""
    if "sha256" in record:
        return list(zip(packed_rels(tasks, record), unpack_digests(record["sha256"])))
    return [(str(r), str(d)) for r, d in record.get("digests", ()) if isinstance(d, str)]


def state_digests(store, state: str = STATE_DIR) -> dict[str, str]:
    """{rel: sha256} from the task records of a job state (the tasks that hash their inputs); a damaged
    record's inputs stay without a digest."""
    plan: Plan | None = None
    tasks_of: dict[str, list] = {}
    digests: dict[str, str] = {}
    for rel in sorted(store.list_sizes(f"{state}/tasks/")):
        if not rel.endswith(".json"):
            continue
        raw = store.read_bytes(rel)
        try:
            record = json.loads(raw) if raw is not None else None
        except ValueError:
            continue
        if not isinstance(record, dict):
            continue
        if "sha256" in record:
            if plan is None:
                plan = read_plan(store, state)
                if plan is None:
                    continue
                for uid, tasks in plan.units:
                    tasks_of[uid] = list(tasks)
                    tasks_of.update((t.task_id, [t]) for t in tasks)
            tasks = tasks_of.get(rel.rsplit("/", 1)[-1][:-len(".json")])
            if tasks is None:
                continue
        else:
            tasks = []
        try:
            digests.update(unit_digests(tasks, record))
        except (ValueError, KeyError, TypeError):
            continue
    return digests
