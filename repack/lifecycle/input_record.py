"""What a dataset holds, for `--append`: the job state ``.repack/inputs-vN.json`` and the rule that picks
the new inputs.

The record (job state, not a dataset file; ``repack.lifecycle.publish`` writes its first two keys)::

  {"inputs": {rel: [size, mtime_ns]},  every input planned in versions 1..N (packed, quarantined, removed)
   "next_position": P,                 the next free sample position (keys stay unique)
   "sha256": {rel: hex},               the content of each packed input, where its task hashed it
   "removed": [rel, ...]}              sources taken down by `repack remove`: never packed again

An input of a later scan is *new* when its rel is not in the record. A known rel is skipped when its
size and mtime are the recorded ones, or when only the mtime differs and its sha256 is the recorded one
(a copy of SOURCE, ``cp -r``); a removed rel is always skipped (counted). A known rel whose content
differs (or cannot be compared: no recorded sha256) and that has a sample in the dataset is refused by
name: a file never gets two samples. A known rel that was quarantined is planned again.
"""

from __future__ import annotations

import hashlib
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Callable, Iterable, TypeVar

from repack.errors import UsageError
from repack.jobs.base import STATE_DIR, Plan
from repack.jobs.record_columns import state_digests
from repack.lifecycle.publish import inputs_record, known_inputs, plan_inputs
from repack.manifest.versions import number_of

T = TypeVar("T")
REFUSED_SHOWN = 10  # names a refusal lists (then a count)
HASH_THREADS = 8    # files hashed at once for a content comparison (reads release the GIL)


def task_digests(store, state: str = STATE_DIR) -> dict[str, str]:
    """{rel: sha256} from the task records under ``state``/tasks/ (the tasks that hash their inputs)."""
    return state_digests(store, state)


def dataset_record(store, current: dict) -> dict:
    """The record of the published version (version 1: derived from the job's plan and task records);
    UsageError naming what is missing when it cannot be had (a remove by an older repack wrote none)."""
    number = number_of(current)
    if number > 1 and store.read_bytes(inputs_record(number)) is None:
        raise UsageError(f"{store.url}: the record of what version {number} holds ({inputs_record(number)}) is "
                         f"missing (version {number} was published by an older repack), so new inputs cannot be "
                         "told apart from removed ones; repack from a SOURCE that leaves the removed sources out")
    record = known_inputs(store, current)
    if number == 1 and "sha256" not in record:
        record["sha256"] = task_digests(store)
    record.setdefault("sha256", {})
    record.setdefault("removed", [])
    return record


def record_after_append(plan: Plan, known: dict, digests: dict[str, str]) -> dict:
    """Version N+1's record: ``known`` plus the inputs ``plan`` planned (their digests from its tasks), and
    the known inputs whose copy the plan recognized by content (``plan.info["same_content"]``: their new
    fingerprints)."""
    record = plan_inputs(plan, known)
    inputs = record["inputs"]
    for rel, fingerprint in plan.info.get("same_content", {}).items():
        inputs[rel] = list(fingerprint)
    record["inputs"] = dict(sorted(inputs.items()))
    record["sha256"] = dict(sorted({**known.get("sha256", {}), **digests}.items()))
    record["removed"] = list(known.get("removed", []))
    return record


def record_after_remove(known: dict, removed_sources: Iterable[str]) -> dict:
    """Version N+1's record after `repack remove`: ``known`` with the removed sources added."""
    removed = sorted(set(known.get("removed", [])) | set(removed_sources))
    return {**known, "removed": removed}


@dataclass(frozen=True)
class Selection:
    """What the scan holds that the dataset does not: ``new`` (in scan order), and the known inputs skipped."""

    new: list
    removed: int = 0                       # removed sources found again and left out
    same_content: dict = field(default_factory=dict)  # rel -> [size, mtime_ns]: a copy recognized by sha256


def select_new(items: Iterable[T], known: dict, rel: Callable[[T], str], fingerprint: Callable[[T], list],
               digest: Callable[[T], str | None]) -> Selection:
    """Apply the module's rule to ``items`` (``known``: the record plus ``quarantined``, the rels without a
    sample). The candidates for a content comparison are hashed on a thread pool. UsageError naming the
    changed files."""
    inputs, digests = known["inputs"], known.get("sha256", {})
    removed, quarantined = set(known.get("removed", ())), set(known.get("quarantined", ()))
    new: list = []
    compare: list[tuple[T, list]] = []  # same name and size, another mtime, a recorded sha256
    changed: list[str] = []
    unknown: list[str] = []  # another mtime, no recorded sha256 to compare with
    skipped_removed = 0
    for item in items:
        name = rel(item)
        if name in removed:
            skipped_removed += 1
            continue
        old = inputs.get(name)
        now = list(fingerprint(item)[:2])
        if old is None or name in quarantined:
            if now != list(old or ()):
                new.append(item)
        elif now == list(old):
            continue
        elif now[0] != old[0]:
            changed.append(name)
        elif digests.get(name) is None:
            unknown.append(name)
        else:
            compare.append((item, now))
    same: dict[str, list] = {}
    with ThreadPoolExecutor(max_workers=HASH_THREADS) as pool:
        for (item, now), found in zip(compare, pool.map(lambda pair: digest(pair[0]), compare)):
            if found == digests[rel(item)]:
                same[rel(item)] = now
            else:
                changed.append(rel(item))
    if changed or unknown:
        raise UsageError("--append: " + "; ".join(
            part for part in (_listed(sorted(changed), "changed since the dataset packed them (same name, other "
                                                       "content)"),
                              _listed(unknown, "have another mtime and no recorded sha256 to compare (packed by an "
                                               "older repack)")) if part) +
            "; a file never gets two samples: put new content under a new name, or restore the packed file")
    return Selection(new, skipped_removed, same)


def _listed(names: list[str], what: str) -> str:
    if not names:
        return ""
    shown = ", ".join(names[:REFUSED_SHOWN]) + (f" and {len(names) - REFUSED_SHOWN} more"
                                                if len(names) > REFUSED_SHOWN else "")
    return f"{len(names)} source(s) {what}: {shown}"


def file_sha256(path: str) -> str | None:
    """sha256 of a local file (None when unreadable)."""
    try:
        with open(path, "rb") as fh:
            return hashlib.file_digest(fh, "sha256").hexdigest()
    except OSError:
        return None
