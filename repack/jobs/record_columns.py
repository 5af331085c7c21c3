"""Per-input values of a task record as compact columns (an image task's record, saved as JSON).

A record holds, per packed input, its content sha256 and its read and check times. As JSON lists
of ``[rel, hex]`` and integers that was ~150 bytes per input, kept for the dataset's life; here:

  "sha256": base64 of the 32-byte digests of the packed inputs, in plan order (43 B per input);
            which inputs they are: the unit's planned inputs less its quarantined ones
  "us":     base64 of the zlib'd little-endian uint32 read times then check times (microseconds)

A text task's record keeps its digests out of the JSON, in a binary file beside it
(``tasks/<task id>.sha256``, ``digest_rows_name``; 32 B per input instead of 43 B of base64), one row per
segment of its plan table::

  mask     ceil(n / 8) bytes   np.packbits of "this segment has a digest" (n = the task's segments)
  digests  32 B per set bit    the raw sha256 of those segments' files, in table order

and its per-segment counts as one ``pack_ints`` string (zlib'd little-endian int64 columns, base64).

``unit_digest_columns`` pairs a unit's digests with its inputs' rels; ``state_digest_columns`` reads every
task record of a job state (images: sha256 columns; text: digest files; video and older text records:
their ``digests`` pairs) into one list of rels and one joined bytes of raw digests.
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


def pack_times(*columns: list[int]) -> str:
    """Equal-length integer columns (microseconds) as one base64 string of zlib'd uint32."""
    flat = np.clip(np.concatenate([np.asarray(c, dtype=np.int64) for c in columns]) if columns else
                   np.zeros(0, dtype=np.int64), 0, 2**32 - 1).astype("<u4")
    return base64.b64encode(zlib.compress(flat.tobytes(), 6)).decode("ascii")


def unpack_times(packed: str, parts: int) -> list[np.ndarray]:
    """The ``parts`` columns of ``pack_times`` (int64 arrays)."""
    flat = np.frombuffer(zlib.decompress(base64.b64decode(packed)), dtype="<u4").astype(np.int64)
    return _equal_parts(flat, parts)


def _equal_parts(flat: np.ndarray, parts: int) -> list[np.ndarray]:
    """``np.split(flat, parts)`` by slicing (views; the driver splits ~8,000 records' columns); ValueError when
    they do not split evenly; an empty ``flat``: ``parts`` empty copies."""
    if not len(flat):
        return [flat.copy() for _ in range(parts)]
    size, rest = divmod(len(flat), parts)
    if rest:
        raise ValueError("array split does not result in an equal division")
    return [flat[at:at + size] for at in range(0, len(flat), size)]


def pack_ints(*columns) -> str:
    """Equal-length integer columns as one base64 string of zlib'd little-endian int64."""
    flat = np.concatenate([np.asarray(c, dtype="<i8") for c in columns]) if columns else np.zeros(0, "<i8")
    return base64.b64encode(zlib.compress(flat.astype("<i8").tobytes(), 6)).decode("ascii")


def unpack_ints(packed: str, parts: int) -> list[np.ndarray]:
    """The ``parts`` columns of ``pack_ints`` (int64 arrays); ValueError when they do not split evenly."""
    flat = np.frombuffer(zlib.decompress(base64.b64decode(packed)), dtype="<i8").astype(np.int64)
    if len(flat) % parts:
        raise ValueError(f"{len(flat)} values do not make {parts} equal columns")
    return np.split(flat, parts) if len(flat) else [flat.copy() for _ in range(parts)]


def digest_rows_name(task_id: str, state: str = STATE_DIR) -> str:
    """Where a text task's digest file is (beside its record ``tasks/<id>.json``)."""
    return f"{state}/tasks/{task_id}.sha256"


def pack_digest_rows(digests: list[bytes | None]) -> bytes:
    """A digest file's bytes (see the module docstring): one row per segment, None where it has no digest."""
    mask = np.fromiter((d is not None for d in digests), dtype=bool, count=len(digests))
    if any(d is not None and len(d) != DIGEST_BYTES for d in digests):
        raise ValueError("a digest is not 32 bytes")
    return np.packbits(mask).tobytes() + b"".join(d for d in digests if d is not None)


def unpack_digest_rows(raw: bytes, count: int) -> list[str | None]:
    """The hex digest of each of ``count`` rows of a digest file (None where it has none); ValueError
    when the file does not hold ``count`` rows."""
    head = -(-count // 8)
    mask = np.unpackbits(np.frombuffer(raw[:head], np.uint8), count=count).astype(bool) if count else \
        np.zeros(0, bool)
    if len(raw) < head or len(raw) != head + DIGEST_BYTES * int(mask.sum()):
        raise ValueError(f"a digest file of {len(raw)} bytes does not hold {count} rows")
    found = iter(raw[at:at + DIGEST_BYTES].hex() for at in range(head, len(raw), DIGEST_BYTES))
    return [next(found) if has else None for has in mask.tolist()]


def packed_rels(tasks, record: dict) -> list[str]:
    """The rels of a unit's packed inputs in plan order: its planned inputs less its quarantined ones."""
    refused = {q["source"] for q in record.get("quarantine", ())}
    rels = [rel for task in tasks for rel in input_rels(task.payload)]
    return [rel for rel in rels if rel not in refused] if refused else rels


def unit_digest_columns(tasks, record: dict, rows: bytes | None = None) -> tuple[list[str], bytes]:
    """(rels, their raw 32-byte sha256 digests joined) of a unit's packed inputs, from its record (any
    form; ``rows``: a text task's digest file; a hex digest that is not one is left out)."""
    if rows is not None:
        from repack.jobs.text_plan import table_rels

        rels = [rel for task in tasks for rel in table_rels(task.payload["table"])]
        pairs = [(rel, d) for rel, d in zip(rels, unpack_digest_rows(rows, len(rels))) if d is not None]
        return [rel for rel, _ in pairs], b"".join(bytes.fromhex(d) for _, d in pairs)
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
    for rel in store.list_names(f"{state}/tasks/"):  # names only: no stat per task lock
        if not rel.endswith(".json"):
            continue
        raw = store.read_bytes(rel)
        try:
            record = json.loads(raw) if raw is not None else None
        except ValueError:
            continue
        if not isinstance(record, dict):
            continue
        task_id = rel.rsplit("/", 1)[-1][:-len(".json")]
        rows = store.read_bytes(digest_rows_name(task_id, state)) if record.get("digest_rows") else None
        tasks: list = []
        if "sha256" in record or rows is not None:
            if tasks_of is None:
                plan = plan if plan is not None else read_plan(store, state)
                tasks_of = {}
                for uid, unit in (plan.units if plan is not None else ()):
                    tasks_of[uid] = list(unit)
                    tasks_of.update((t.task_id, [t]) for t in unit)
            tasks = tasks_of.get(task_id)
            if tasks is None:
                continue
        try:
            unit_rels, unit_raw = unit_digest_columns(tasks, record, rows)
        except (ValueError, KeyError, TypeError):
            continue
        rels += unit_rels
        digests.append(unit_raw)
    return rels, b"".join(digests)


def state_digests(store, state: str = STATE_DIR) -> dict[str, str]:
    """{rel: sha256 hex} of ``state_digest_columns``."""
    rels, raw = state_digest_columns(store, state)
    return {rel: raw[i * DIGEST_BYTES:(i + 1) * DIGEST_BYTES].hex() for i, rel in enumerate(rels)}
