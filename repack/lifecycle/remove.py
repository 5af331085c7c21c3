"""`repack remove OUT --sources FILE | --keys FILE`: publish a version without some samples.

One rewriter per format (repack.lifecycle.remove_tar, remove_lmdb, remove_tokens: each returns a
``repack.lifecycle.rewrite.Rewrite``), one way of publishing. Webdataset shards:

A sample is named by its source (the ``path`` of its ``.json`` member: the input's path relative to
SOURCE, or ``<shard>/<member>`` for converted datasets) or by its key (the member name before the
first dot). Only the shards holding a named sample are read (found from the record of the inputs,
``repack.lifecycle.locate``) and rewritten: their other samples are copied, member bytes untouched
and in order, into a new shard ``<stem>-vN.tar`` (+ its DALI index; a shard left empty is dropped);
every other shard stays as it is. The new version lists the shards in the
same order. The removed bytes stay in the files of older versions until ``repack gc`` deletes the
files no kept version names. Names that match no sample are reported (and recorded in the
version's change), never silently ignored; when none matches nothing is published.

Crash anywhere and re-run: the rewritten shards are deterministic (rewritten again, same bytes) and
the version is published as ``repack.lifecycle.publish`` says.
"""

from __future__ import annotations

import dataclasses
import os
import posixpath
import stat
import time
from dataclasses import dataclass

from repack.errors import UsageError
from repack.lifecycle.input_record import dataset_record, dropped_copies, remove_delta
from repack.lifecycle.publish import (changeable_version, drop_rewrite_temps, locked_dataset, promote_pending, publish,
                                      write_inputs_record)
from repack.lifecycle.record_layers import RecordLayers, record_layers
from repack.manifest.versions import number_of


NOT_FOUND_KEPT = 100  # names a remove's change record keeps of those it did not find (all: 'not_found_count')


@dataclass(frozen=True)
class RemoveSpec:
    """What to remove: source paths or sample keys (one kind per run)."""

    out: str
    names: tuple[str, ...]
    by: str  # "sources" or "keys"


@dataclass(frozen=True)
class RemoveResult:
    manifest: dict
    published: bool
    removed: int
    not_found: tuple[str, ...]
    seconds: float


MAX_NAMES_BYTES = 256 * 2**20  # a names file (--sources/--keys); larger ones are refused unread


def read_names(path: str, limit: int = MAX_NAMES_BYTES, null: bool = False) -> tuple[str, ...]:
    """Non-empty lines of a names file (UsageError naming it when unreadable, not a regular file, over
    ``limit`` bytes, or empty). Opened with O_NONBLOCK: a FIFO or device is refused, never waited on.
    A line ends at LF (CRLF too: the CR goes); a CR anywhere else is part of the name, which a file name may
    hold. ``null``: names end at NUL bytes instead and are taken exactly (``find -print0``: a name may hold
    LF, end with CR or start with U+FEFF)."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK)
    except OSError as exc:
        raise UsageError(f"cannot read {path!r}: {exc.strerror}") from None
    try:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode):
            raise UsageError(f"{path!r} is not a regular file (a FIFO, device or folder): write the names to a file")
        if st.st_size > limit:
            raise UsageError(f"{path!r} is {st.st_size} bytes, over the {limit}-byte cap on a names file")
        chunks, size = [], 0
        while size <= limit:
            chunk = os.read(fd, min(1 << 20, limit + 1 - size))
            if not chunk:
                break
            chunks.append(chunk)
            size += len(chunk)
        raw = b"".join(chunks)
    except OSError as exc:
        raise UsageError(f"cannot read {path!r}: {exc.strerror}") from None
    finally:
        os.close(fd)
    if len(raw) > limit:
        raise UsageError(f"{path!r} grew past the {limit}-byte cap on a names file while being read")
    if null:
        names = tuple(name for name in raw.decode("utf-8", "surrogateescape").split("\0") if name)
    else:  # a byte order mark (Excel's and Notepad's "UTF-8") is no part of the first name, as the list readers drop it
        text = raw.removeprefix(b"\xef\xbb\xbf").decode("utf-8", "surrogateescape")
        names = tuple(line.removesuffix("\r") for line in text.split("\n") if line.strip())
        # (a CR alone is no line end: "a\rb.jpg" names that file, never "a" and "b.jpg")
    if not names:
        shape = "NUL-separated names" if null else "one source path or key per line"
        raise UsageError(f"{path!r} names nothing ({shape})")
    return names


def published_record(store, current: dict) -> RecordLayers | None:
    """The published version's record of its inputs, as layers (``repack.lifecycle.record_layers``: the
    named sources' positions found without merging a row per input), None when it has none to extend
    (its datasets refuse --append and say why; a remove then reads every shard)."""
    try:
        layers = record_layers(store, current)
        if layers is None:  # not plain layers: merged as a whole (without digests), or its absence named
            layers = RecordLayers.of(dataset_record(store, current, digests=False))
        return layers
    except UsageError:
        return None


def record_removed(store, known: RecordLayers | None, number: int, sources) -> None:
    """Write version ``number``'s input record: the published one (``known``), plus the removed sources, so
    that `--append` works after a remove and never packs them again: a delta of the removed sources,
    or, where the record is written whole, the merged record (derived only then). Before the version
    is published: a crash in between leaves a record of an unpublished version, rewritten by the re-run.
    Nothing is written without a published record."""
    if known is not None:
        write_inputs_record(store, number, known.whole, remove_delta(known.next_position, sources))


def _tar(store, out, current, spec, number, known):
    from repack.lifecycle.remove_tar import rewrite_tar_shards

    return rewrite_tar_shards(store, out, current, spec, number, known)


def _lmdb(store, out, current, spec, number, known):  # finds its samples without the record of the inputs
    from repack.lifecycle.remove_lmdb import rewrite_lmdb

    return rewrite_lmdb(store, out, current, spec, number)


def _tokens(store, out, current, spec, number, known):  # finds its samples without the record of the inputs
    from repack.lifecycle.remove_tokens import rewrite_token_prefixes

    return rewrite_token_prefixes(store, out, current, spec, number)


# (store, out, current, spec, version, the published record or None) -> Rewrite. Each format's module is
# imported when its dataset is rewritten: a webdataset remove never imports lmdb (~0.15 s of start-up).
REWRITERS = {"webdataset": _tar, "lmdb": _lmdb, "memmap": _tokens}


def held_spellings(current: dict, known: RecordLayers | None, spec: RemoveSpec) -> dict[str, tuple[str, ...]]:
    """Each named source the record does not hold that the record holds spelled otherwise, as {held spelling:
    the names given}. A dataset packed from a folder: a path given whole (``/data/src/cat/a.jpg`` or
    ``s3://bucket/src/cat/a.jpg`` for ``cat/a.jpg``, ``cat//a.jpg``) or from the current folder
    (``src/cat/a.jpg``). From a list file (whose sources are its rows as written): ``./a.jpg``, ``a//b.jpg``, an
    absolute path inside the list's folder (``listfile.canonical_rel``); as --append takes both spellings for one
    input, a takedown does."""
    options = (current.get("created_by") or {}).get("options") or {}
    if spec.by != "sources" or known is None:
        return {}
    from repack.lifecycle.input_columns import decode_names, encode_names
    from repack.sources.listfile import spelled_otherwise, canonical_rel

    given = sorted(set(spec.names))
    source = str(options.get("source") or "")
    if not given or not source:
        return {}
    try:
        _, recorded = known.positions_of(encode_names(given))
    except UsageError:  # a record whose names cannot be cut: the remove reads every shard instead
        return {}
    missing = [name for name, held in zip(given, recorded.tolist()) if not held]
    if not missing:
        return {}
    if not options.get("list_file"):
        return _folder_spellings(known, missing, source)
    base = os.path.dirname(os.path.abspath(source))
    roots = tuple(dict.fromkeys((base, os.path.realpath(base))))
    wanted: dict[str, tuple[str, ...]] = {}
    for name in missing:
        wanted[canonical_rel(name, roots)] = wanted.get(canonical_rel(name, roots), ()) + (name,)
    plain = sorted(rel for rel, names in wanted.items() if names != (rel,))  # given ./a.jpg, held a.jpg
    found = {rel: wanted[rel] for rel, held in zip(plain, known.positions_of(encode_names(plain))[1].tolist()) if held}
    names = known.whole().names  # given a.jpg, held ./a.jpg (or absolute): the few names spelled otherwise
    others = decode_names(names[spelled_otherwise(names)])
    found.update({held: wanted[canonical_rel(held, roots)] for held in others if canonical_rel(held, roots) in wanted})
    return found


def _folder_spellings(known: RecordLayers, missing: list[str], source: str) -> dict[str, tuple[str, ...]]:
    """``held_spellings`` of a dataset packed from folder (or prefix) ``source``: a name given as a path inside it."""
    from repack.lifecycle.input_columns import encode_names
    from repack.sources.listfile import canonical_rel

    if source.startswith("s3://"):
        prefix = source.rstrip("/") + "/"
        wanted: dict[str, tuple[str, ...]] = {}
        for name in missing:
            if name.startswith(prefix):
                rel = posixpath.normpath(name[len(prefix):])
                wanted[rel] = wanted.get(rel, ()) + (name,)
    else:  # a whole path, or one relative to the current folder (``find src`` run beside SOURCE ``src``)
        root = os.path.abspath(source)
        roots = tuple(dict.fromkeys((root, os.path.realpath(root))))
        wanted = {}
        for name in missing:
            for spelled in (name, os.path.abspath(name)):
                rel = canonical_rel(spelled, roots)
                if rel != name and not os.path.isabs(rel) and not rel.startswith("../") and rel not in (".", ".."):
                    wanted[rel] = wanted.get(rel, ()) + (name,)
                    break
    rels = sorted(wanted)
    if not rels:
        return {}
    held = known.positions_of(encode_names(rels))[1].tolist()
    return {rel: wanted[rel] for rel, found in zip(rels, held) if found}


def _whole_input(record: dict) -> bool:
    """A quarantine record of a whole input (not of one line of a text file)."""
    return record.get("line") is None or bool(record.get("no_documents"))


def quarantined_named(current: dict, names) -> frozenset[str]:
    """The names that are sources the dataset quarantined whole: a takedown of such an input is recorded, so
    that an append never packs it once it is fixed."""
    held = {q["source"] for q in current.get("quarantine", ()) if _whole_input(q)}
    return frozenset(name for name in names if name in held)


def dropped_copies_named(store, current: dict, known: RecordLayers | None, names: set[str]) -> frozenset[str]:
    """The names that are copies the --dedup dataset left out and no remove took down yet: a takedown of one is
    recorded, so that no append packs it once its kept copy is gone."""
    named = sorted(names & set(dropped_copies(current, store)[0]))
    if not named:
        return frozenset()
    from repack.lifecycle.input_columns import encode_names

    record = known.whole() if known is not None else dataset_record(store, current, digests=False)
    return frozenset(name for name, gone in zip(named, record.is_removed(encode_names(named)).tolist()) if not gone)


def remove_samples(spec: RemoveSpec) -> RemoveResult:
    """Publish the version without the named samples (see the module docstring)."""
    started = time.time()
    with locked_dataset(spec.out) as (store, out):  # out: an object store's scratch holds a shard per rewriting process
        current, raw = changeable_version(store)
        promoted = promote_pending(store, current)
        if promoted is not None:
            current, raw = changeable_version(store)
        rewriter = REWRITERS.get(current["format"])
        if rewriter is None or current["modality"] == "video":
            raise UsageError(f"repack remove rewrites image (webdataset, lmdb) and token memmap datasets; "
                             f"{store.url} holds {current['modality']} in {current['format']}")
        number = number_of(current) + 1
        drop_rewrite_temps(out, number)  # a rewrite killed before its rename
        known = published_record(store, current)
        spelled = held_spellings(current, known, spec)  # held name -> the name as given, where they differ
        if spelled:
            given = {name for names in spelled.values() for name in names}
            spec = dataclasses.replace(spec, names=tuple(dict.fromkeys(
                [name for name in spec.names if name not in given] + list(spelled))))
        try:
            done = rewriter(store, out, current, spec, number, known)
        except BaseException:  # interrupted or failed: its workers are stopped, their temp files go
            drop_rewrite_temps(out, number)
            raise
        shards = done.shards
        taken_down = quarantined_named(current, spec.names) if spec.by == "sources" else frozenset()
        copies_down = dropped_copies_named(store, current, known, set(spec.names) - done.found - taken_down) \
            if spec.by == "sources" else frozenset()
        not_found = tuple(sorted({given for name in set(spec.names) - done.found - taken_down - copies_down
                                  for given in spelled.get(name, (name,))}))
        if not done.found and not taken_down and not copies_down:
            return RemoveResult(current, False, 0, not_found, time.time() - started)
        removed = sum(s["samples"] for s in current["shards"]) - sum(s["samples"] for s in shards)
        body = {key: value for key, value in current.items() if key not in ("run", "dataset_version")}
        extra = dict(done.extra)
        totals = dict(current["totals"])
        totals.update(samples=sum(s["samples"] for s in shards), removed=totals.get("removed", 0) + removed,
                      **extra.pop("totals", {}))
        stats = dict(current.get("stats", {}))
        counts = dict(stats.get("class_counts", {}))
        for name, n in done.removed_classes.items():
            if name in counts:
                counts[name] -= n
        if "class_counts" in stats:
            stats["class_counts"] = counts
        if "formats" in stats and done.removed_formats:  # the samples' image formats, as inspect reports them
            stats["formats"] = _less(stats["formats"], done.removed_formats)
        if stats.get("dali_misreads") and done.removed_misreads:  # what DALI's loaders refuse (image_check)
            stats["dali_misreads"] = _less(stats["dali_misreads"], done.removed_misreads)
            if not stats["dali_misreads"]:
                del stats["dali_misreads"]
        stats.update(extra.pop("stats", {}))
        if taken_down:  # the version holds nothing of them, and no later append packs them once fixed
            body["quarantine"] = [q for q in current["quarantine"] if not _whole_input(q) or q["source"] not in taken_down]
            if "quarantined" in totals:
                totals["quarantined"] = len(body["quarantine"])
            totals["taken_down"] = totals.get("taken_down", 0) + len(taken_down)  # inputs = samples + those
        if copies_down:  # counted as taken down, no longer as dropped duplicates
            totals["taken_down"] = totals.get("taken_down", 0) + len(copies_down)
            if "duplicates_dropped" in totals:
                totals["duplicates_dropped"] -= len(copies_down)
        body.update(shards=shards, totals=totals, stats=stats, **extra,
                    run={"command": "remove", "seconds": round(time.time() - started, 3)})
        change = {"kind": "remove", "by": spec.by, "removed_samples": removed, "rewritten": done.rewritten,
                  "not_found": list(not_found[:NOT_FOUND_KEPT]),
                  **({"not_found_count": len(not_found)} if len(not_found) > NOT_FOUND_KEPT else {}),
                  **({"removed_quarantined": sorted(taken_down)} if taken_down else {}),
                  **({"removed_dropped_copies": sorted(copies_down)} if copies_down else {})}
        removed_sources = done.removed_sources if done.removed_sources is not None else \
            (done.found if spec.by == "sources" else frozenset())
        record_removed(store, known, number, removed_sources | taken_down | copies_down)
        data = publish(store, out, current, raw, body, change)
        return RemoveResult(data, True, removed, not_found, time.time() - started)


def _less(counts: dict[str, int], removed: dict[str, int]) -> dict[str, int]:
    """``counts`` less the ``removed`` ones, those left at 0 dropped."""
    return {name: n - removed.get(name, 0) for name, n in counts.items() if n - removed.get(name, 0) > 0}
