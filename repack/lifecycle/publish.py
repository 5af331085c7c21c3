"""Publishing a new version of a finished dataset (append, remove): the writer's half of
``repack.manifest.versions``.

Order (each step atomic; kill -9 between any two leaves the previous version published and
readable, and a re-run completes the same version): version 1's bytes are kept as
``manifest.v1.json`` first; then ``manifest.vN.json`` is written; then ``manifest.json`` gets the same
bytes. ``manifest.vN.json`` beside ``manifest.json`` at N - 1 is *pending*: the next writer (append,
remove, gc) settles it before anything else. Publishing is a commit: a pending version becomes
``manifest.json`` only when it checks out (JSON, schema and the path rule, number N with parent N - 1,
every file it names present with the size it records); otherwise it is moved aside to
``.repack/rejected/`` and reported, and the published version stays.

The dataset's record of what it holds, for appends and removes: ``.repack/inputs-vN.npz`` (job state,
not a dataset file; columns, ``repack.lifecycle.input_columns``): every input planned in versions 1..N
(packed or quarantined by a task, removed later or not: a removed sample is not packed again by the
next append), its fingerprint and sample position, and the next free sample position (keys stay
unique). An older repack's ``inputs-vN.json`` is still read.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import re
import shutil
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Iterator

from repack.errors import ConfinementError, UsageError, raise_if_interrupted
from repack.jobs.base import STATE_DIR, read_plan
from repack.lifecycle.first_record import has_plan, plan_inputs, version_one_record
from repack.lifecycle.input_columns import InputColumns, from_json_record, merged, parse_record, record_depth, to_bytes
from repack.manifest import MANIFEST_NAME, Manifest, ManifestError, dumps_canonical, parse_manifest
from repack.manifest.schema import format_version
from repack.manifest.caps import check_declared_counts, check_manifest_size, check_written_size
from repack.manifest.quarantine_records import (compact as compact_quarantine, expand as expand_quarantine,
                                               listed_records)
from repack.lifecycle.version_names import version_names
from repack.manifest.versions import VERSION_KEY, number_of, stamp, version_file

REJECTED_DIR = f"{STATE_DIR}/rejected"


def inputs_record(number: int) -> str:
    """Where version ``number``'s record of its inputs is (``repack.lifecycle.input_columns``)."""
    return f"{STATE_DIR}/inputs-v{number}.npz"


def legacy_inputs_record(number: int) -> str:
    """Where an older repack wrote version ``number``'s record (JSON)."""
    return f"{STATE_DIR}/inputs-v{number}.json"


def has_inputs_record(store, number: int) -> bool:
    """Whether version ``number``'s record is stored (not derived from the plan)."""
    return store.size(inputs_record(number)) is not None or store.size(legacy_inputs_record(number)) is not None


def read_inputs_record(store, number: int, digests: bool = True, parts: int = 1) -> InputColumns | None:
    """Version ``number``'s record (a delta merged onto the chain of records it extends, which may end at
    version 1's record derived from the plan, ``repack.lifecycle.first_record``; an older repack's JSON
    converted), None when it has none; UsageError naming the file when it is unreadable or extends a record
    that is missing. ``digests=False``: a derived version 1 is read without its digests (``digests_from``),
    decoded in ``parts`` processes (``repack.lifecycle.first_record.plan_inputs``)."""
    raw = store.read_bytes(inputs_record(number))
    if raw is not None:
        where = f"{store.url}/{inputs_record(number)}"
        stored = parse_record(raw, where)
        if stored.base is None:
            return stored.columns
        if not stored.base < number:
            raise UsageError(f"{where} extends version {stored.base}'s record, not an earlier one's; move it aside "
                             "and repack without --append")
        base = read_inputs_record(store, stored.base, digests, parts)
        if base is None and stored.base == 1:
            base = version_one_record(store, digests, parts)
        if base is None:
            raise UsageError(f"{where} extends version {stored.base}'s record, which is missing; move it aside and "
                             "repack without --append")
        return merged(base, stored.columns)
    raw = store.read_bytes(legacy_inputs_record(number))
    if raw is not None:
        return from_json_record(raw, f"{store.url}/{legacy_inputs_record(number)}")
    return None


MAX_DELTAS = 16  # deltas read on top of a whole record at most: the next version's record is whole again


def write_inputs_record(store, number: int, known: InputColumns | Callable[[], InputColumns],
                        delta: InputColumns) -> None:
    """Write version ``number``'s record: ``known`` (version ``number - 1``'s, or a call that derives it:
    called only when the record is written whole) with ``delta`` (the rows it adds or changes and the
    sources it removed). Stored as the delta on version ``number - 1``'s record when it is a file with
    fewer than MAX_DELTAS deltas below it, or version 1's derived from its plan
    (``repack.lifecycle.first_record``: version 2 writes only its own rows), else whole (``merged``)."""
    raw = store.read_bytes(inputs_record(number - 1)) if number > 1 else None
    depth = record_depth(raw, f"{store.url}/{inputs_record(number - 1)}") if raw is not None else None
    if depth is None and number == 2 and store.read_bytes(legacy_inputs_record(1)) is None and has_plan(store):
        depth = 0  # version 1's record is its plan's
    if depth is not None and depth < MAX_DELTAS:
        store.put_bytes(inputs_record(number), to_bytes(delta, base=(number - 1, depth + 1)))
    else:
        store.put_bytes(inputs_record(number), to_bytes(merged(known() if callable(known) else known, delta)))


def make_record_whole(store, number: int) -> bool:
    """Rewrite version ``number``'s record as a whole record when it is a delta (before `repack gc` deletes
    the records it extends); whether it is stored whole now (False: it has none)."""
    raw = store.read_bytes(inputs_record(number))
    if raw is None:
        return store.size(legacy_inputs_record(number)) is not None  # an older repack's JSON record is whole
    if record_depth(raw, f"{store.url}/{inputs_record(number)}"):
        store.put_bytes(inputs_record(number), to_bytes(read_inputs_record(store, number)))
    return True


@contextlib.contextmanager
def locked_dataset(location: str) -> Iterator[tuple[object, Path]]:
    """(store, local folder: the dataset's own, or an object store's scratch) of the published dataset at
    ``location``, with OUT's job lock held (an object store: its lock object too). UsageError before
    anything is created when there is no dataset."""
    from repack.jobs.engine import JobLock, prepare_out, state_dir
    from repack.store import open_store

    store = open_store(location)
    out = Path(store.scratch)
    try:
        current_version(store)
    except UsageError:
        if not store.remote and (state_dir(out) / "lock").is_file():  # a first pack running there: name it
            with JobLock(out, ""):  # JobLockedError naming its process where one holds the lock
                pass
        raise
    prepare_out(out, store)
    with JobLock(out, "", store if store.remote else None):
        if not store.remote:  # a manifest write killed mid-way: its temp file (no other writer runs now)
            from repack.manifest.io import sweep_manifest_temps

            sweep_manifest_temps(out)
        yield store, out


def refuse_names_in_use(store, current: dict, names, what: str) -> None:
    """UsageError naming those of ``names`` (the files a writer is about to put into the dataset) that a
    published version names already (``manifest.json``, or a kept ``manifest.vN.json``): a dataset whose files
    were renamed by hand to what repack would name a new one; writing would change a published version."""
    taken = version_names(store, up_to=number_of(current))  # a pending version is settled before a writer runs
    clash = sorted(set(names) & taken)
    if clash:
        raise UsageError(f"{store.url}: {what} would write {', '.join(clash)}, which a published version of the "
                         "dataset names already (renamed by hand?); nothing was changed")


def read_manifest_file(store, rel: str) -> bytes | None:
    """A manifest file's bytes (None when absent), refused unread (ManifestError) when it is over the cap: a
    1 GB manifest.json was read whole before the cap refused it."""
    check_manifest_size(store.size(rel), f"{store.url}/{rel}")
    return store.read_bytes(rel)


def current_version(store) -> tuple[dict, bytes]:
    """(data, bytes) of the published ``manifest.json``; UsageError when there is none, or when its declared
    sample counts are ones the readers refuse (a change must not publish from them)."""
    try:
        raw = read_manifest_file(store, MANIFEST_NAME)
    except ManifestError as exc:
        raise UsageError(f"{exc}; nothing changed") from None
    if raw is None:
        if not store.remote and not Path(store.url).is_dir():
            raise UsageError(f"{store.url}: no such folder (a dataset's folder, OUT of a job)")
        raise UsageError(f"{store.url} holds no published dataset (no {MANIFEST_NAME}): pack one there first "
                         "(a job without --append)")
    try:
        data = parse_manifest(raw, store.url, f"{store.url}/{MANIFEST_NAME}").data
    except ManifestError as exc:
        raise UsageError(f"{store.url}/{MANIFEST_NAME} is not a valid manifest: {exc}") from None
    try:  # the counts and totals, not the files' sizes: a shard no change reads is never opened (nor stat'ed)
        check_declared_counts(data, lambda rel: sys.maxsize, f"{store.url}/{MANIFEST_NAME}")
    except ManifestError as exc:
        raise UsageError(f"{exc}; nothing changed") from None
    return data, raw


def changeable_version(store) -> tuple[dict, bytes]:
    """``current_version`` with every quarantine record listed (from the side file the manifest names, checked
    against its digest), the form a change derives the next version from."""
    listed_records()  # REPACK_QUARANTINE_LISTED refused before anything changes
    data, raw = current_version(store)
    if number_of(data) == 1:  # the first change keeps version 1's file as it finds it: it must be manifest.json's
        first = store.read_bytes(version_file(1))
        if first is not None and first != raw:
            raise UsageError(f"{store.url}/{version_file(1)} is not {MANIFEST_NAME} (version 1) byte for byte: no "
                             "repack writer leaves it so (a copy from elsewhere?); move it out of the dataset "
                             "(repack verify reports it); nothing changed")
    try:
        return expand_quarantine(data, store.read_bytes, store.url), raw
    except ManifestError as exc:
        raise UsageError(f"{exc}; nothing changed") from None


@dataclass(frozen=True)
class Settled:
    """What ``settle_pending`` did: ``promoted`` (the pending version's data, now the latest) or
    ``rejected`` (why it was not published, and where it was moved), or neither (nothing pending)."""

    promoted: dict | None = None
    rejected: str | None = None


def settle_pending(store, current: dict, say: Callable[[str], None] | None = None) -> Settled:
    """A version written but not yet named by ``manifest.json`` (a run killed in between): publish it
    when ``pending_problem`` finds nothing, else move it to ``.repack/rejected/`` and ``say`` why (default:
    a warning line on stderr). The published version is never replaced by a version that fails."""
    number = number_of(current) + 1
    name = version_file(number)
    raw = store.read_bytes(name)
    if raw is None:  # nothing pending: other loaders' files brought up to the published version (a command
        refresh_other_views(store, Manifest(Path(store.scratch), current), say)  # killed before it did)
        return Settled()
    problem = pending_problem(store, raw, number)
    if problem is None:
        store.put_bytes(MANIFEST_NAME, raw)
        promoted = json.loads(raw)
        refresh_other_views(store, Manifest(Path(store.scratch), promoted), say)
        return Settled(promoted=promoted)
    aside = f"{REJECTED_DIR}/{name}.{hashlib.sha256(raw).hexdigest()[:12]}"
    move(store, name, aside)
    message = (f"{store.url}/{name}: not published ({problem}); moved to {store.url}/{aside}; version "
               f"{number - 1} stays the published one")
    (say or warner(False))(message)
    return Settled(rejected=message)


def warner(as_json: bool) -> Callable[[str], None]:
    """A ``say`` for ``settle_pending``: a ``repack: warning:`` line on stderr, or a JSON line
    (``--log-json``)."""
    def say(message: str) -> None:
        line = json.dumps({"event": "warning", "message": message}) if as_json else f"repack: warning: {message}"
        sys.stderr.write(line + "\n")
        sys.stderr.flush()
    return say


def pending_problem(store, raw: bytes, number: int) -> str | None:
    """Why the bytes of pending version ``number`` must not be published (None: they may): not JSON,
    fails the schema or the path rule, says another number or parent, or names a file the store lacks
    or holds with another size than recorded."""
    try:
        manifest = parse_manifest(raw, store.scratch, f"{store.url}/{version_file(number)}")
        data = manifest.data
        info = data.get(VERSION_KEY)
        if number_of(data) != number or not isinstance(info, dict) or info.get("parent") != number - 1:
            return f"says version {number_of(data)} with parent {info.get('parent') if isinstance(info, dict) else None}"
    except (ValueError, ManifestError) as exc:
        return str(exc)
    sizes: dict[str, int | None] = {rel: None for rel in manifest.named_files()}
    sizes.update({s["path"]: s["bytes"] for s in data["shards"]})
    sizes.update({s["index"]: s.get("index_bytes") for s in data["shards"] if s.get("index")})
    for rel, size in sizes.items():
        try:
            found = store.size(rel)
        except ConfinementError as exc:
            return str(exc)
        if found is None:
            return f"{rel} is missing"
        if size is not None and found is not None and found != size:
            return f"{rel} has {found} bytes, the version records {size}"
    return None


def promote_pending(store, current: dict, say: Callable[[str], None] | None = None) -> dict | None:
    """The promoted data of ``settle_pending`` (None when nothing was pending or it was rejected)."""
    return settle_pending(store, current, say).promoted


def publish(store, out: Path, current: dict, current_raw: bytes, body: dict, change: dict,
            say: Callable[[str], None] | None = None) -> dict:
    """Publish ``body`` (every quarantine record listed) as the version after ``current``, recording ``change``;
    returns its data with every record (what is written lists a few, the rest in the version's side file:
    ``repack.manifest.quarantine_records``). Other loaders' views of the dataset follow it
    (``foreign.refresh_views``: ``say`` warns of one repack cannot rewrite)."""
    raise_if_interrupted()  # a signal whose raise was swallowed: nothing is published after it
    full = stamp(body, current, change)
    data, side = compact_quarantine(full, number_of(full))
    data["version"] = full["version"] = format_version(data)
    Manifest(out, data).validate()
    raw = dumps_canonical(data, indent=1)
    check_written_size(raw, data, f"{store.url}/{version_file(number_of(data))}")
    store.check_lock()  # an object store's lock taken over by another run: publish nothing
    if number_of(current) == 1 and store.read_bytes(version_file(1)) is None:
        store.put_bytes(version_file(1), current_raw)
    if side is not None:  # the version's quarantine side file, before the manifest that names it
        store.put_bytes(*side)
    store.put_bytes(version_file(number_of(data)), raw)
    store.put_bytes(MANIFEST_NAME, raw)
    clear_leftovers(store, number_of(data), set(Manifest(out, data).named_files()))
    refresh_other_views(store, Manifest(out, data), say)
    return full


def refresh_other_views(store, manifest: Manifest, say: Callable[[str], None] | None = None) -> None:
    """``foreign.refresh_views`` of the published (or pulled) version: after it is published, so a failure here is a
    warning (the version stands; the next command that takes the dataset's lock tries again)."""
    from repack.errors import RepackError
    from repack.lifecycle.foreign import refresh_views

    try:
        warnings = refresh_views(store, manifest)
    except (RepackError, OSError, ValueError) as exc:
        warnings = [f"{store.url}: other loaders' files not brought up to version {number_of(manifest.data)} "
                    f"({exc}); `repack verify` names them"]
    for warning in warnings:
        (say or warner(False))(warning)


def leftover_pattern(number: int) -> re.Pattern:
    """The names repack's writers give the files they add to a dataset for version ``number`` (an append's
    ``shard-vN-XXXXXX.tar``, a rewrite's ``<stem>-vN.tar``, a token prefix's ``<prefix>-vN.bin``, an LMDB's
    ``data-vN.lmdb``, a video append's ``videos-vN/``, ``probe-vN.jsonl`` and ``file_list-vN.txt``, an image
    append's ``duplicates-vN.groups``, a version's ``quarantine-vN.records``, with their side files and hidden temp
    files)."""
    n = int(number)
    return re.compile(rf"\.?(?:shard-v{n}-[0-9]+\.(?:tar|idx|crc)|[^/]+-v{n}(?:[-_][0-9]+)?\.(?:tar|idx|crc|lmdb|bin|sources)"
                      rf"|probe-v{n}\.jsonl|file_list-v{n}\.txt|duplicates-v{n}\.groups|quarantine-v{n}\.records|videos-v{n}/.+)(?:\.tmp-[0-9]+|\.[^/]+\.tmp)?")


def _dataset_files(store) -> list[str]:
    """The files of the dataset's folder outside ``.repack/`` (a local one: its top level, then each folder in it
    but the job state's; no stat per file, nothing of the tasks' thousands of records listed)."""
    if store.remote:
        return [rel for rel in store.list_sizes("") if not rel.startswith(f"{STATE_DIR}/")]
    found = []
    with os.scandir(store.root) as entries:
        for entry in entries:
            if entry.name == STATE_DIR:
                continue
            if entry.is_dir(follow_symlinks=False):
                found += store.list_names(f"{entry.name}/")
            else:
                found.append(entry.name)
    return found


def drop_rewrite_temps(out: Path, number: int) -> None:
    """Delete the temp files of version ``number``'s rewrites (``.<stem>-vN.tar.tmp-PID``, an LMDB's
    ``.data-vN.lmdb.tmp-remove``): called under the dataset's lock, where no writer of that version runs."""
    for temp in Path(out).glob(f".*-v{int(number)}.*.tmp-*"):
        temp.unlink(missing_ok=True)


def clear_leftovers(store, number: int, named: set[str]) -> list[str]:
    """Move the files of version ``number`` (``leftover_pattern``) that its published manifest does not name to
    ``.repack/rejected/leftovers-vN/``: what a writer killed before it published ``number`` left, when another
    command took the number (an append killed after moving its shards in, then a remove; the files of a
    pending version that was rejected), which verify would otherwise report as named by no version for good.
    Called by the writer that published ``number``; only files named as repack names that version's, so
    nothing else in OUT is touched, nor a file an earlier version names (a token dataset packed with
    ``--name notes-v2``: version 1's own prefix). The rels moved."""
    pattern = leftover_pattern(number)
    aside = [rel for rel in _dataset_files(store) if rel not in named and pattern.fullmatch(rel)]
    if aside:  # rare (a writer killed before it published): only then are the older versions read
        kept = version_names(store, up_to=int(number) - 1)
        aside = [rel for rel in aside if rel not in kept]
    moved = []
    for rel in aside:  # the version is published by now: a file that cannot be moved is said, not raised
        try:
            move(store, rel, f"{REJECTED_DIR}/leftovers-v{int(number)}/{rel}")
        except (ConfinementError, OSError) as exc:  # a symbolic link in its place, say: left as it is
            sys.stderr.write(f"repack: warning: version {int(number)} is published; {rel}, named as its files are "
                             f"but not by its manifest, was left in place: {exc}\n")
            continue
        moved.append(rel)
    return moved


def known_inputs(store, current: dict) -> InputColumns:
    """The record of the published version (version 1: derived from the job's plan, without digests)."""
    number = number_of(current)
    record = read_inputs_record(store, number)
    if record is not None:
        return record
    plan = read_plan(store) if number == 1 else None
    if plan is None:
        raise UsageError(f"{store.url}: the record of what version {number} holds ({inputs_record(number)}) is "
                         "missing, so new inputs cannot be told apart; repack without --append")
    return plan_inputs(plan, 0)


def move(store, src: str, dst: str) -> None:
    """Rename ``src`` to ``dst`` inside the dataset (an object store: a server-side copy, then a delete;
    the sha256 metadata travels with the object)."""
    if not store.remote:
        source = store.path(src)  # refused (a link) before a folder is made for it
        store.path(dst).parent.mkdir(parents=True, exist_ok=True)  # e.g. a video's videos-vN/<class>/
        os.replace(source, store.path(dst))
        return
    store.move(src, dst)


def remove_prefix(store, prefix: str) -> None:
    """Delete every file under ``prefix`` (a folder path ending in /), and its local scratch copy."""
    if store.remote:
        for rel in store.list_sizes(prefix):
            store.delete(rel)
    shutil.rmtree(Path(store.scratch) / prefix, ignore_errors=True)
