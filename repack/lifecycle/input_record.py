"""What a dataset holds, for `--append` and `repack remove`: the job state ``.repack/inputs-vN.npz``
(columns, ``repack.lifecycle.input_columns``) and the rule that picks the new inputs.

The record holds every input planned in versions 1..N (packed, quarantined, removed) with its
fingerprint [size, mtime_ns] (an s3:// object's: its size and ETag value, ``repack.sources.object_etag``;
0 in a record written before listings gave ETags: the size alone), its sample position, its content's
sha256 where its task hashed it, the sources taken down by `repack remove` (never packed again), and the
next free sample position.

An input of a later scan is *new* when its rel is not in the record. A known rel is skipped when its
size and mtime are the recorded ones, or when only the mtime differs and its sha256 is the recorded one
(a copy of SOURCE, ``cp -r``; an object uploaded again); a removed rel is always skipped (counted). A
known rel whose content differs (or cannot be compared: no recorded sha256) and that has a sample in the
dataset is refused by name: a file never gets two samples. A known rel without a sample that changed is
planned again: quarantined, or a text file that gave no document (blank lines only, ``sampleless_of``).
"""

from __future__ import annotations

import contextlib
import dataclasses
import hashlib
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable, Iterable, Iterator, Sequence, TypeVar

import numpy as np

from repack.distinct import distinct
from repack.errors import UsageError
from repack.exec.ahead import read_ahead
from repack.jobs.base import Plan, read_plan
from repack.lifecycle.first_record import plan_record, version_one_record
from repack.lifecycle.input_columns import (NO_MTIME, InputColumns, member_of, empty_columns, encode_names,
                                            from_bytes, merged, with_quarantined)
from repack.lifecycle.publish import has_inputs_record, known_inputs, read_inputs_record
from repack.manifest.duplicate_groups import report_dropped
from repack.manifest.versions import number_of
from repack.sources.object_etag import ETAG_FLAG
from repack.store import is_remote

T = TypeVar("T")
REFUSED_SHOWN = 10  # names a refusal lists (then a count)
HASH_THREADS = 8    # files hashed at once for a content comparison (reads release the GIL)


def dataset_record(store, current: dict, digests: bool = True, parts: int = 1) -> InputColumns:
    """The record of the published version (version 1: derived from the job's plan and task records);
    UsageError naming what is missing or unreadable when it cannot be had (a remove by an older repack
    wrote none). ``digests=False``: a record that stands on version 1's derived one comes without its
    digests (``InputColumns.digests_from``: the --append selection asks only when it compares contents),
    version 1's plan decoded in ``parts`` processes (``repack.lifecycle.first_record.plan_inputs``)."""
    number = number_of(current)
    if number > 1:
        record = read_inputs_record(store, number, digests, parts)
        if record is None:
            raise UsageError(f"{store.url}: the record of what version {number} holds (.repack/inputs-v{number}.npz) "
                             f"is missing (version {number} was published by an older repack), so new inputs cannot "
                             "be told apart from removed ones; repack from a SOURCE that leaves the removed sources "
                             "out")
        return record
    record = read_inputs_record(store, 1, digests, parts)
    if record is None:
        record = version_one_record(store, digests, parts)
    if record is None:
        return known_inputs(store, current)  # raises, naming what is missing
    return record


def published_digests(store, current: dict, record: InputColumns, rows: np.ndarray | None) -> InputColumns:
    """``record`` (the published version's, as ``dataset_record(..., digests=False)`` derives it) with the
    digests of ``rows`` (None: all). Version 1's record derived from its plan reads only the task records of
    those rows (``plan_record``'s ``wanted``); any other record is derived whole again."""
    if rows is not None and number_of(current) == 1 and not has_inputs_record(store, 1):
        plan = read_plan(store)
        if plan is not None:
            return plan_record(store, plan, inputs=record, wanted=rows)
    return dataset_record(store, current)


def append_delta(store, plan: Plan, known: InputColumns) -> InputColumns:
    """The rows version N+1 adds to ``known`` (its record is ``merged(known, delta)``): the inputs ``plan``
    (the staged job's, in ``store``) planned, with their digests (``plan_record``), and the known inputs
    whose copy the plan recognized by content (``plan.info["same_content"]``: their new fingerprints)."""
    planned = plan_record(store, plan, known.next_position)
    same = plan.info.get("same_content", {})
    if same:
        names = sorted(same)
        copies = InputColumns(encode_names(names), np.array([same[n][0] for n in names], np.int64),
                              np.array([same[n][1] if len(same[n]) > 1 else NO_MTIME for n in names], np.int64),
                              np.full(len(names), -1, np.int64), np.zeros((len(names), 32), np.uint8),
                              np.zeros(len(names), bool), np.array([], dtype="S1"), 0)
        planned = merged(planned, copies)
    return planned


def remove_delta(next_position: int, removed_sources: Iterable[str]) -> InputColumns:
    """What version N+1's record adds after `repack remove`: the removed sources, no rows (``next_position``:
    the known record's)."""
    sources = sorted(set(removed_sources))
    return dataclasses.replace(empty_columns(next_position),
                               removed=distinct(encode_names(sources)) if sources else np.array([], dtype="S1"))


class KnownInputs:
    """The dataset's record for a staged `--append` job, derived once, when first asked: the staged job's
    planner asks while its folder scan runs on the pool (``repack.sources.folder``: ``meanwhile``), so
    reading the record (version 1: from the plan and the task records) overlaps the walk. ``derive`` may
    leave version 1's digests out (``dataset_record(..., digests=False)``): the selection derives them only
    to compare a known input whose mtime changed, and a whole record written from it gets them first."""

    def __init__(self, derive: Callable[[], InputColumns], quarantined: Iterable[str],
                 pre_etag_objects: bool = False,
                 sampleless_of: Callable[[list[str]], set[str]] | None = None,
                 dropped: dict[str, str] | None = None, dropped_prints: dict[str, list[int]] | None = None) -> None:
        self._derive = derive
        self._quarantined = quarantined
        self._pre_etag_objects = pre_etag_objects  # the dataset was first packed from s3:// (InputColumns')
        self._sampleless_of = sampleless_of  # (InputColumns')
        self._dropped = dropped or {}  # the copies --dedup left out (``dropped_copies``)
        self._dropped_prints = dropped_prints or {}  # their fingerprints then (``dropped_prints``)
        self._record: InputColumns | None = None
        self._staged: InputColumns | None = None

    def record(self) -> InputColumns:
        """The published version's record (``dataset_record``)."""
        if self._record is None:
            self._record = self._derive()
        return self._record

    def staged_input(self) -> InputColumns:
        """The record with the rels without a sample as its ``quarantined`` (what ``load_known`` gives)."""
        if self._staged is None:
            self._staged = dataclasses.replace(with_quarantined(self.record(), list(self._quarantined)),
                                               pre_etag_objects=self._pre_etag_objects,
                                               sampleless_of=self._sampleless_of, dropped_copies=self._dropped,
                                               dropped_prints=self._dropped_prints)
        return self._staged


def dropped_copies(manifest: dict, store) -> tuple[dict[str, str], dict[str, list[int]]]:
    """The sources a --dedup dataset left out as copies of a packed sample, in any of its versions (the groups of
    its ``stats.duplicates`` and of each append's, from the manifest or the side file a report names, read from
    ``store``; a report that dropped nothing lists packed copies): rel -> the content's sha256 (hex), and rel -> the
    fingerprint each had when it was left out (where its group recorded one: a report of an older repack has
    none, and those copies are hashed to be compared). They are inputs without a sample that the record of the
    inputs does not hold."""
    stats = manifest.get("stats") or {}
    appended = ((a or {}).get("duplicates") or {} for a in stats.get("appended", ()))
    copies: dict[str, str] = {}
    prints: dict[str, list[int]] = {}
    for report in [stats.get("duplicates") or {}, *appended]:
        if report.get("dropped"):
            rels, shas, found = report_dropped(report, store.read_bytes, store.url, manifest.get("file_digests") or {})
            copies.update(zip(rels, shas))
            prints.update((rel, fingerprint) for rel, fingerprint in zip(rels, found) if fingerprint)
    return copies, prints


@contextlib.contextmanager
def held_known(key: str, known: KnownInputs) -> Iterator[KnownInputs]:
    """Hand the staged `--append` job its input for as long as the block runs: ``known``, held in memory
    under ``key`` (the staged spec's ``known_inputs``) for ``load_known``. Nothing is written: the staged job
    plans in the process of the append that runs it, and every run of the append (a resumed one too)
    derives the same record again from the published version (a file would be ~75 B per input, written
    and fsync'd on every append)."""
    _HELD[key] = known
    try:
        yield known
    finally:
        _HELD.pop(key, None)


_HELD: dict[str, KnownInputs] = {}  # known_inputs key -> what held_known hands the staged job


def load_known(path: str | Path) -> InputColumns:
    """The staged `--append` job's input: the record ``held_known`` holds under ``path``, else a record file
    at ``path`` (``to_bytes``); UsageError naming it when neither is there."""
    held = _HELD.get(str(path))
    if held is not None:
        return held.staged_input()
    try:
        raw = Path(path).read_bytes()
    except OSError as exc:
        raise UsageError(f"cannot read the record of the dataset's inputs {str(path)!r}: {exc.strerror}") from None
    return from_bytes(raw, str(path))


@dataclass(frozen=True)
class Selection:
    """What the scan holds that the dataset does not: ``new`` (in scan order), and the known inputs skipped."""

    new: list
    removed: int = 0                       # removed sources found again and left out
    same_content: dict = field(default_factory=dict)  # rel -> [size, mtime_ns]: a copy recognized by sha256


def select_new(items: Sequence[T] | Iterable[T], known: InputColumns, rel: Callable[[T], str],
               fingerprint: Callable[[T], list], digest: Callable[[T], str | None],
               size_is_content: bool = True) -> Selection:
    """Apply the module's rule to ``items`` (``known``: the record, with ``quarantined``: the rels without
    a sample): ``select_new_rows`` over their rels and fingerprints. UsageError naming the changed files."""
    items = items if isinstance(items, list) else list(items)
    prints = [fingerprint(item) for item in items]
    size = np.fromiter((p[0] for p in prints), np.int64, len(prints))
    mtime = np.fromiter((p[1] if len(p) > 1 else NO_MTIME for p in prints), np.int64, len(prints))
    chosen = select_new_rows([rel(item) for item in items], size, mtime, known, lambda row: digest(items[row]),
                             size_is_content)
    return dataclasses.replace(chosen, new=[items[row] for row in chosen.new])


def select_new_rows(rels: list[str] | np.ndarray, size: np.ndarray, mtime: np.ndarray, known: InputColumns,
                    digest: Callable[[int], str | None], size_is_content: bool = True) -> Selection:
    """The module's rule over scanned inputs given as columns (``rels``: str, or their ``S`` array, e.g.
    ``names_of_blob`` of a scan's names blob: no str per input; int64 ``size`` and ``mtime``, NO_MTIME where
    a fingerprint has none), vectorized over the record's columns: ``new`` holds the row numbers of the new
    inputs, ascending. The candidates for a content comparison (``digest(row)``) are hashed on a thread
    pool; only their rels and the refused ones are decoded. UsageError naming the changed files.
    ``size_is_content``: False where the fingerprint's size is a container's (a tar member's, a parquet row's): a
    container grown or repaired says nothing of its members' bytes, so a held one's content is compared."""
    if not len(rels):
        return Selection([])
    names = rels if isinstance(rels, np.ndarray) else encode_names(rels)
    rels = _RelsOf(names) if isinstance(rels, np.ndarray) else rels

    def print_of(row: int) -> list[int]:  # a scanned input's fingerprint as a record or a group keeps it
        return [int(size[row]), int(mtime[row])] if mtime[row] != NO_MTIME else [int(size[row])]
    removed = known.is_removed(names)
    rows, recorded = known.find(names)
    known_mtime = known.mtime_ns[rows]
    same_print = known_mtime == mtime
    # an object recorded before listings gave ETags: known by its size alone (a container's had no second
    # column, NO_MTIME; an object's 0, told from a local file of mtime 0 by the dataset's first SOURCE)
    pre_etag = (known_mtime == NO_MTIME) | ((known_mtime == 0) if known.pre_etag_objects else False)
    same_print |= pre_etag & (mtime >= ETAG_FLAG)
    same_print &= recorded & (known.size[rows] == size)
    again = recorded & known.is_quarantined(names) & ~removed
    new_mask = ~removed & ((~recorded) | (again & ~same_print))
    if known.dropped_copies:  # a copy --dedup left out, its content unchanged: known, not new
        copies = distinct(encode_names(list(known.dropped_copies)))
        copy_rows = np.flatnonzero(new_mask & ~recorded & member_of(copies, names)).tolist()
        if known.dropped_prints:  # the fingerprint it was dropped with: the same content, known without a read
            same = [i for i in copy_rows if known.dropped_prints.get(rels[i]) == print_of(i)]
            new_mask[same] = False
            copy_rows = [i for i in copy_rows if new_mask[i]]
        for i, found in zip(copy_rows, read_ahead(copy_rows, digest, HASH_THREADS, 4 * HASH_THREADS)):
            if found is not None and found == known.dropped_copies.get(rels[i]):
                new_mask[i] = False
    held = recorded & ~again & ~removed & ~same_print  # a known input with a sample, another fingerprint
    changed_mask = held & (known.size[rows] != size) if size_is_content else np.zeros_like(held)
    if (held & ~changed_mask).any():  # contents to compare: their recorded digests (derived now if left out)
        known = known.digested(rows[held & ~changed_mask])
    unknown_mask = held & ~changed_mask & ~known.has_sha256[rows]
    compare = np.flatnonzero(held & ~changed_mask & known.has_sha256[rows]).tolist()
    changed = np.flatnonzero(changed_mask).tolist()  # rows, then their rels
    unknown = np.flatnonzero(unknown_mask).tolist()
    same: dict[str, list] = {}
    for i, found in zip(compare, read_ahead(compare, digest, HASH_THREADS, 4 * HASH_THREADS)):
        if found == known.hex_digest(int(rows[i])):
            same[rels[i]] = print_of(i)
        else:
            changed.append(i)
    if (changed or unknown) and known.sampleless_of is not None:  # no sample to hold twice: packed now
        sampleless = known.sampleless_of([rels[i] for i in changed + unknown])
        new_mask[[i for i in changed + unknown if rels[i] in sampleless]] = True
        changed = [i for i in changed if rels[i] not in sampleless]
        unknown = [i for i in unknown if rels[i] not in sampleless]
    changed, unknown = [rels[i] for i in changed], [rels[i] for i in unknown]
    if changed or unknown:
        raise UsageError("--append: " + "; ".join(
            part for part in (_listed(sorted(changed), "changed since the dataset packed them (same name, other "
                                                       "content)"),
                              _listed(unknown, "have another mtime (or ETag) and no recorded sha256 to compare "
                                               "(packed by an older repack, or a large s3:// text object)")) if part) +
            "; a file never gets two samples: put new content under a new name, or restore the packed file")
    return Selection(np.flatnonzero(new_mask).tolist(), int(removed.sum()), same)


class _RelsOf:
    """``rels[i]`` of an ``S`` array of names, decoded when asked (the few rels a selection names)."""

    def __init__(self, names: np.ndarray) -> None:
        self.names = names

    def __getitem__(self, row: int) -> str:
        return bytes(self.names[row]).decode("utf-8", "surrogateescape")


def _listed(names: list[str], what: str) -> str:
    if not names:
        return ""
    shown = ", ".join(names[:REFUSED_SHOWN]) + (f" and {len(names) - REFUSED_SHOWN} more"
                                                if len(names) > REFUSED_SHOWN else "")
    return f"{len(names)} source(s) {what}: {shown}"


def file_sha256(path: str) -> str | None:
    """sha256 of a local file or an s3:// object (None when unreadable)."""
    try:
        if is_remote(path):
            from repack.sources.reading import open_input  # the object-store stack, only for a remote input

            with open_input(path) as fh:
                return hashlib.file_digest(fh, "sha256").hexdigest()
        with open(path, "rb") as fh:
            return hashlib.file_digest(fh, "sha256").hexdigest()
    except OSError:
        return None
