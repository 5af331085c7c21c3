"""`repack gc OUT --keep K`: delete the files that only versions older than the K newest name.

Kept: the K newest versions (``manifest.json`` and their ``manifest.vN.json``) and every file they
name. Deleted: the ``manifest.vN.json`` of every other version and each file such a version names
that no kept version names (with megatron-energon's ``<tar>.idx`` beside such a tar), and their job-state
records (``.repack/inputs-vN.npz``, an older repack's ``inputs-vN.json``). Once version 1 is gone and the
oldest kept record is whole, the first job's state that version 1's record was derived from goes too
(``drop_first_job_state``). A file no version names at all is never touched (``repack verify`` reports it):
gc deletes only what repack published. Readers pinned to a deleted version lose it: keep as many versions as
readers may pin. Each deletion is one unlink; a gc killed half-way leaves kept versions whole, and a re-run
finishes.
"""

from __future__ import annotations

import errno
from dataclasses import dataclass
from pathlib import Path

from repack.errors import UsageError, raise_if_interrupted
from repack.jobs.base import PLAN_NAME, STATE_DIR
from repack.lifecycle.first_record import has_plan
from repack.lifecycle.foreign import ENERGON_INDEX_SUFFIX
from repack.lifecycle.publish import (current_version, drop_rewrite_temps, inputs_record, legacy_inputs_record,
                                      locked_dataset, make_record_whole, read_manifest_file, remove_prefix,
                                      settle_pending)
from repack.manifest import Manifest, ManifestError, parse_manifest
from repack.manifest.versions import number_of, version_file, version_number


@dataclass(frozen=True)
class GcResult:
    kept: tuple[int, ...]
    deleted_versions: tuple[int, ...]
    deleted_files: tuple[str, ...]
    freed_bytes: int


def collect_garbage(out: str, keep: int) -> GcResult:
    """Delete what no kept version names (see the module docstring)."""
    if keep < 1:
        raise UsageError(f"--keep must be at least 1 (the latest version), got {keep}")
    with locked_dataset(out) as (store, root):
        current, _ = current_version(store)
        if settle_pending(store, current).promoted is not None:
            current, _ = current_version(store)
        latest = number_of(current)
        if not store.remote:  # a rewrite of the next version killed before its rename: its temp files go
            drop_rewrite_temps(root, latest + 1)
        numbers = sorted({n for n in (version_number(rel) for rel in store.list_sizes("manifest.v"))
                          if n is not None and n <= latest} | {latest})  # one numbered past it: verify names it
        kept = tuple(n for n in numbers if n > latest - keep)
        names: dict[int, set[str]] = {n: _named(store, root, n, current if n == latest else None) for n in numbers}
        keep_names = set().union(*(names[n] for n in kept))
        doomed = tuple(n for n in numbers if n not in kept)
        doomed_files = sorted(set().union(*(names[n] for n in doomed)) - keep_names
                              - {version_file(n) for n in doomed})
        # megatron-energon's index beside a deleted tar (energon prepare writes <tar>.idx) goes with it: it indexes
        # nothing any more, and verify would name it as a stray file
        doomed_files += sorted({rel + ENERGON_INDEX_SUFFIX[len(".tar"):] for rel in doomed_files if rel.endswith(".tar")}
                               - keep_names)
        sizes = {rel: store.size(rel) for rel in doomed_files}  # the store's confinement refuses before a delete
        deleted, freed = [], 0
        raise_if_interrupted()  # a signal whose raise was swallowed: nothing is deleted after it

        def delete_files() -> None:  # each file once: the ones deleted leave ``sizes``
            nonlocal freed
            while sizes:
                rel, size = sizes.popitem()
                if size is not None:
                    store.delete(rel)
                    deleted.append(rel)
                    freed += size

        stands_alone = False
        # the oldest kept record stands alone before the records it extends go, and before anything is deleted: a
        # record that cannot be made whole refuses the gc (nothing doomed: only for the job state an older gc left)
        if doomed or (min(kept) > 1 and has_plan(store)):
            try:
                stands_alone = make_record_whole(store, min(kept))
            except OSError as exc:
                if exc.errno not in (errno.ENOSPC, errno.EDQUOT):
                    raise
                delete_files()  # a full disk: the old versions' files go first (the records they extend stay, so
                stands_alone = make_record_whole(store, min(kept))  # the chain is whole until the record is)
        delete_files()
        if stands_alone:  # before version 1's file: a gc killed in between finds version 1 doomed again
            drop_first_job_state(store)
        for number in doomed:  # the version files last: a gc killed before this re-finds what they name, and
            store.delete(inputs_record(number))  # its records go before it (nothing re-finds them after it)
            store.delete(legacy_inputs_record(number))  # an older repack's record
            if store.size(version_file(number)) is not None:
                store.delete(version_file(number))
        return GcResult(kept, doomed, tuple(deleted), freed)


def drop_first_job_state(store) -> None:
    """Delete the state of the job that packed version 1, which version 1's record is derived from
    (``repack.lifecycle.first_record``; no record extends it once the oldest kept one is whole): its plan first,
    so that nothing derives a record from task records half deleted, then text's merge marker, the task records
    (with their digest files and task locks), chunk pieces and parts. ``job.json``, the run token and the job's
    lock files stay (a few hundred bytes): OUT is still that job's output, as a re-run of it (refused: a later
    version is there), `repack merge`, `repack pull` and `repack inspect` read in ``job.json``."""
    from repack.jobs.images import SEGMENTS_DIR
    from repack.jobs.text import MERGED_MARKER

    for name in (PLAN_NAME, "plan.json", MERGED_MARKER):  # "plan.json": an older repack's plan
        store.delete(f"{STATE_DIR}/{name}")
    for folder in (f"{STATE_DIR}/tasks", SEGMENTS_DIR, f"{STATE_DIR}/parts"):
        remove_prefix(store, f"{folder}/")


def _named(store, root: Path, number: int, data: dict | None) -> set[str]:
    """Every file version ``number`` names (its manifest files included)."""
    if data is None:
        try:
            raw = read_manifest_file(store, version_file(number))
            data = parse_manifest(raw, root, f"{store.url}/{version_file(number)}").data
        except (TypeError, ManifestError) as exc:
            raise UsageError(f"{store.url}/{version_file(number)} (version {number}) is not a valid manifest "
                             f"({exc}); nothing deleted") from None
    return set(Manifest(root, data).named_files()) | {version_file(number)}
