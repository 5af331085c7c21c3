"""Per-input values of a task record as compact columns (an image task's record, saved as JSON).

A record holds, per packed input, its content sha256 and its read and check times. As JSON lists
of ``[rel, hex]`` and integers that was ~150 bytes per input, kept for the dataset's life; here:

  "sha256": base64 of the 32-byte digests of the packed inputs, in plan order (43 B per input);
            which inputs they are: the unit's planned inputs less its quarantined ones
  "us":     base64 of the zlib'd little-endian uint32 read times then check times (microseconds)

``unit_digest_columns`` pairs a unit's digests with its inputs' rels; ``state_digest_columns`` reads every
task record of a job state (images: sha256 columns; video, text: their ``digests`` pairs) into one list
of rels and one joined bytes of raw digests.
"""

from __future__ import annotations

import base64
import json
import zlib

import numpy as np

from repack.jobs.base import STATE_DIR, Plan, read_plan
from repack.jobs.task_inputs import task_inputs

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
    rels = [rel for task in tasks for rel in _rels(task.payload)]
    return [rel for rel in rels if rel not in refused] if refused else rels


def _rels(payload: dict) -> list[str]:
    inputs = payload.get("inputs", ())
    return inputs["rel"] if isinstance(inputs, dict) else [e["rel"] for e in task_inputs(payload)]


def unit_digest_columns(tasks, record: dict) -> tuple[list[str], bytes]:
    """(rels, their raw 32-byte sha256 digests joined) of a unit's packed inputs, from its record (either
    form; a hex digest that is not one is left out)."""
    if "sha256" in record:
        rels, raw = packed_rels(tasks, record), base64.b64decode(record["sha256"])
        count = min(len(rels), len(raw) // DIGEST_BYTES)
        return rels[:count], raw[:count * DIGEST_BYTES]
    rels, digests = [], []
    for rel, digest in record.get("digests", ()):
        try:
            raw = bytes.fromhex(digest) if isinstance(digest, str) else b""
        except ValueError:
            continue
        if len(raw) == DIGEST_BYTES:
            rels.append(str(rel))
            digests.append(raw)
    return rels, b"".join(digests)


def state_digest_columns(store, state: str = STATE_DIR, plan: Plan | None = None) -> tuple[list[str], bytes]:
    """(rels, their raw sha256 digests joined, in the same order; a later rel's digest wins) from the task
    records of a job state (the tasks that hash their inputs); a damaged record's inputs stay without a
    digest. ``plan``: the state's plan, when the caller has read it already."""
    tasks_of: dict[str, list] | None = None
    rels: list[str] = []
    digests: list[bytes] = []
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
        tasks: list = []
        if "sha256" in record:
            if tasks_of is None:
                plan = plan if plan is not None else read_plan(store, state)
                tasks_of = {}
                for uid, unit in (plan.units if plan is not None else ()):
                    tasks_of[uid] = list(unit)
                    tasks_of.update((t.task_id, [t]) for t in unit)
            tasks = tasks_of.get(rel.rsplit("/", 1)[-1][:-len(".json")])
            if tasks is None:
                continue
        try:
            unit_rels, unit_raw = unit_digest_columns(tasks, record)
        except (ValueError, KeyError, TypeError):
            continue
        rels += unit_rels
        digests.append(unit_raw)
    return rels, b"".join(digests)


def state_digests(store, state: str = STATE_DIR) -> dict[str, str]:
    """{rel: sha256 hex} of ``state_digest_columns``."""
    rels, raw = state_digest_columns(store, state)
    return {rel: raw[i * DIGEST_BYTES:(i + 1) * DIGEST_BYTES].hex() for i, rel in enumerate(rels)}
