"""`repack verify`: check a dataset against its manifest, in a folder or under s3:// alike.

One implementation over ``repack.store.files`` (a folder, or an object-store prefix whose objects
are downloaded with concurrent ranged GETs): every shard through its format's ``verify_shard`` on all
cores (``verify_shards``: size, sha256, and for tars the archive's own structure against the index),
the side files (the tokenizer's sha256), every file under the root that the manifest does not name,
and the totals. Files that other tools write into a dataset on purpose (megatron-energon's
``energon prepare``) are recognised by ``repack.lifecycle.foreign``: checked where their content can be
checked against the manifest, otherwise listed as not checked, never silently passed.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass
from pathlib import Path

from repack.lifecycle.foreign import check_foreign, foreign_kind
from repack.lifecycle.verify_declared import check_declared
from repack.lifecycle.verify_digests import EarlyDigests, early_files
from repack.manifest import MANIFEST_NAME, Manifest, ManifestError, safe_join
from repack.manifest.io import MANIFEST_TEMP
from repack.manifest.quarantine_records import ROLE as QUARANTINE_ROLE, side_file as quarantine_side_file
from repack.manifest.video_entries import entry_problem, video_entries
from repack.sinks import SINKS
from repack.sinks.checks import sha256_file
from repack.sinks.videos import check_frames
from repack.store.files import open_files


@dataclass(frozen=True)
class Report:
    """What verify found: ``problems`` (empty = the dataset matches its manifest) and ``unchecked``
    (files of other tools that verify accepts without being able to check them)."""

    problems: tuple[str, ...]
    unchecked: tuple[str, ...] = ()
    pending: tuple[str, ...] = ()  # work of a writer not yet published (repack.lifecycle.publish): not a problem


SETTLE_TRIES = 5  # looks at the folder's versions when a writer changed them while verify looked


def verify_dataset(location) -> list[str]:
    """Every problem found in the dataset at ``location`` (a folder or s3://bucket/prefix)."""
    return list(verify_report(location).problems)


def verify_report(location, version: int | None = None, workers: int | None = None) -> Report:
    """The full ``Report`` for the dataset at ``location`` (its latest version, or ``version``), its
    shards checked on ``workers`` processes (default: the usable CPUs)."""
    from repack.manifest.versions import version_number

    files = open_files(location)
    names = [] if files.remote else files.names()
    odd = [] if files.remote else files.irregular([MANIFEST_NAME, *(n for n in names if version_number(n) is not None)])
    if not odd:
        try:
            manifest = files.manifest(version)
        except ManifestError as exc:
            return Report((str(exc),))
        listed = set(manifest.named_files())
        views = _views_manifest(files, manifest, version)
        odd = [] if files.remote else files.irregular(sorted(listed | {n for n in names if foreign_kind(n, views)}))
    if odd:  # what verify reads: a FIFO blocks every read, a folder fails it; the other checks wait for files
        return Report((*odd, "the other checks were not run: each file the dataset names must be a regular file"))
    problems, key_hashes = dataset_problems(files, manifest, workers, start_digests(files, manifest, workers))
    for _ in range(SETTLE_TRIES):  # the folder as one moment saw it: a writer or gc beside verify is no damage
        published = files.read(MANIFEST_NAME)
        names = files.names()
        chain_problems, pending, foreign = folder_problems(files, manifest, listed, names, published, views)
        if not chain_problems or (files.read(MANIFEST_NAME) == published and files.names() == names):
            break  # nothing found, or nothing moved while it was looked at: what it found is so
    problems += chain_problems
    foreign_problems, unchecked = check_foreign(files, views, foreign)
    problems += foreign_problems
    problems += check_identities(files, manifest, key_hashes) + totals_problems(manifest)
    return Report(tuple(problems), tuple(unchecked), tuple(pending))


def dataset_problems(files, manifest, workers: int | None = None,
                     early: EarlyDigests | None = None) -> tuple[list[str], list]:
    """(every problem of the version's files and of what its manifest declares about them: contents, class counts,
    the declared sections; each shard's sample key hashes): verify's checks less the folder's (other versions,
    stray files, other loaders' files), which ``repack pull`` runs on its copy too."""
    problems, key_hashes, classes = check_all_contents(files, manifest, workers, early)
    return problems + check_class_counts(manifest.data, classes) + check_declared(manifest.data), key_hashes


def totals_problems(manifest) -> list[str]:
    """The manifest's totals that its shards and quarantine records do not add up to."""
    problems = []
    totals = manifest.totals
    if totals.get("samples") != manifest.num_samples:
        problems.append(f"totals.samples {totals.get('samples')} != sum over shards {manifest.num_samples}")
    if quarantine_side_file(manifest.data) is not None:  # the side file's count: quarantine_file_problems
        if not isinstance(totals.get("quarantined"), int) or totals["quarantined"] < len(manifest.quarantine):
            problems.append(f"totals.quarantined {totals.get('quarantined')} < the {len(manifest.quarantine)} "
                            "quarantine records the manifest lists")
    elif totals.get("quarantined") != len(manifest.quarantine):
        problems.append(f"totals.quarantined {totals.get('quarantined')} != {len(manifest.quarantine)} "
                        "quarantine records")
    shards = manifest.data["shards"]
    if "shards" in totals and totals["shards"] != len(shards):
        problems.append(f"totals.shards {totals['shards']} != {len(shards)} entries in shards")
    form = manifest.data.get("format")
    if form in ("webdataset", "lmdb") and "bytes" in totals and \
            totals["bytes"] != sum(int(s.get("bytes", 0)) for s in shards):
        problems.append(f"totals.bytes {totals['bytes']} != the shards' {sum(int(s.get('bytes', 0)) for s in shards)}")
    if form == "memmap":  # a token dataset's prefixes: their tokens, documents and bytes (.bin + .idx)
        for key, total in (("tokens", sum(int(s.get("tokens", 0)) for s in shards)),
                           ("documents", manifest.num_samples),
                           ("bytes", sum(int(s.get("bytes", 0)) + int(s.get("index_bytes", 0)) for s in shards))):
            if key in totals and totals[key] != total:
                problems.append(f"totals.{key} {totals[key]} != the prefixes' {total}")
    return problems


def _views_manifest(files, manifest, version: int | None):
    """The version other tools' files in the folder (a wids shard index, energon's prep) are checked against: the
    published one, which repack keeps them at, also when an older kept ``version`` is verified (``manifest``
    where the published one cannot be read: its own problems are said by the chain's checks)."""
    if version is None:
        return manifest
    try:
        return files.manifest(None)
    except ManifestError:
        return manifest


def folder_problems(files, manifest, listed: set[str], names: list[str],
                    published: bytes | None, views=None) -> tuple[list[str], list[str], list[str]]:
    """(problems, pending files, files of another tool's kind) of the dataset's folder listing ``names`` with
    ``published`` (``manifest.json``'s bytes as read with it): the version chain (``check_versions``) and every
    file neither the verified version (``listed``) nor another kept version names; another tool's files are
    known by the version ``views`` (default: ``manifest``)."""
    chain = check_versions(files, names, manifest.root, published)
    problems, pending, foreign = list(chain.problems), [], []
    # a version's side files whose first one may come with the next version (its quarantine beyond the listed,
    # an append's duplicate groups), written before its manifest
    stems = {file_stem(rel) for rel in listed | chain.kept} | {QUARANTINE_ROLE, "duplicates"}
    for rel in names:
        if rel in listed or rel in chain.kept:
            continue
        if rel in chain.pending_files or is_pending_name(rel, chain.published + 1, stems):
            pending.append(rel)
        elif foreign_kind(rel, views or manifest) is None:
            problems.append(f"{rel}: a file the manifest does not name (added after the job, or left by another tool)")
        else:
            foreign.append(rel)
    return problems, pending, foreign


@dataclass(frozen=True)
class Chain:
    """The version files of a dataset as verify sees them: ``problems``; ``kept``: the files the
    published versions name; ``published``: the number ``manifest.json`` holds; ``pending_files``: the
    files of versions written after it but not published yet (their manifests and what they name)."""

    problems: list[str]
    kept: set[str]
    published: int
    pending_files: frozenset[str] = frozenset()


def file_stem(rel: str) -> str:
    """The name a dataset file's writer gives all its versions (``shard`` of ``shard-v2-000001.tar``,
    ``text_document`` of ``.text_document-v3.bin.x1.tmp``, ``videos`` of ``videos-v2/a/b.mp4``)."""
    first = rel.split("/", 1)[0].lstrip(".").split(".", 1)[0]
    return re.sub(r"-(?:v[0-9]+|[0-9]{6})(?=-|$)", "", first)


def is_pending_name(rel: str, number: int, stems: set[str] | None = None) -> bool:
    """True when ``rel`` is named the way writers name the files they add for version ``number``
    (``shard-vN-…``, ``…-vN.tar``, ``videos-vN/…``, and their hidden temp files) after a file the dataset holds
    (``stems``: ``file_stem`` of its files; None: any), or is the temp file of a manifest being written
    (``repack.manifest.io.atomic_write_bytes``): work of a run killed before it published ``number`` (the next
    writer removes a manifest's, ``publish.locked_dataset``). ``notes-v2.txt`` is none: a stray."""
    if MANIFEST_TEMP.fullmatch(rel):
        return True
    first = rel.split("/", 1)[0]
    return bool(re.search(rf"-v{number}(?=[-./]|$)", first)) and (stems is None or file_stem(rel) in stems)


def check_versions(files, names: list[str], root: Path, published_bytes: bytes | None = None) -> Chain:
    """Each published ``manifest.vN.json`` must say it is version N with parent N - 1 and pass the
    manifest's path rule, and ``manifest.json`` must be the newest published one, byte for byte.
    Files named by a version other than the one verified are not strays (verify that version with
    ``--version N`` to check their contents). The version file after ``manifest.json``'s is pending
    (the next append, remove or gc publishes it or moves it aside): reported, not a problem; one numbered
    past it is a problem (writers publish N + 1 only, and gc leaves it alone). ``root``:
    the folder the paths are confined to (the dataset's, or an object store's scratch); ``published_bytes``:
    ``manifest.json`` as read with the listing (read once: a publish between two reads is no mismatch)."""
    from repack.manifest.versions import VERSION_KEY, load_number, number_of, version_number

    problems: list[str] = []
    kept: set[str] = set()
    if published_bytes is None:
        published_bytes = files.read(MANIFEST_NAME)
    published = load_number(published_bytes)
    numbers = sorted(n for n in (version_number(rel) for rel in names) if n is not None)
    pending_files: set[str] = set()
    for number in numbers:
        name = f"manifest.v{number}.json"
        if number > published + 1:
            problems.append(f"{name}: numbered past the next version ({published + 1}): no repack writer leaves "
                            "it (a copy from elsewhere?); move it out of the dataset")
            continue
        if number > published:
            pending_files.add(name)
            try:
                pending_files.update(Manifest(Path("/"), json.loads(files.read(name) or b"null")).named_files())
            except (ValueError, TypeError, KeyError, AttributeError):
                pass  # garbage: the next writer moves it aside
            continue
        kept.add(name)
        try:
            raw_version = files.read(name)
            data = json.loads(raw_version or b"null")
            other = Manifest(root, data)
            other.validate()
            info = data.get(VERSION_KEY) or {}
            if number_of(data) != number or (number > 1 and info.get("parent") != number - 1):
                problems.append(f"{name}: says version {number_of(data)} with parent {info.get('parent')!r}")
            if number != published or raw_version == published_bytes:  # (the published one: below)
                kept.update(other.named_files())
        except (ValueError, OSError, ManifestError) as exc:
            problems.append(f"{name}: not a readable version manifest ({exc})")
    own = f"manifest.v{published}.json"  # the published version's own file: written before manifest.json names it,
    # and kept by every gc; version 1's is written by the first change (before it, one there is no writer's)
    if (published > 1 or own in names) and not any(p.startswith(f"{own}:") for p in problems):
        try:
            raw = files.read(own)
        except (ValueError, OSError) as exc:
            raw, problems = b"", problems + [f"{own}: not readable ({exc})"]
        if raw is None:
            problems.append(f"{own}: missing ({MANIFEST_NAME} is version {published}, and each version keeps its own "
                            "file)")
        elif raw and published_bytes != raw and published == 1:
            problems.append(f"{own}: not the published {MANIFEST_NAME} (version 1) byte for byte: no repack writer "
                            "leaves it so (a copy from elsewhere?); move it out of the dataset")
        elif raw and published_bytes != raw:
            problems.append(f"{MANIFEST_NAME} is not the newest version ({own}), byte for byte")
    return Chain(problems, kept, published, frozenset(pending_files) - kept)


def start_digests(files, manifest, workers: int | None) -> EarlyDigests | None:
    """The tars of a local dataset hashed from now on, on processes forked before verify imports numpy
    and the sinks (``verify_digests``); None for one worker or an object store (hashed while downloaded)."""
    from repack.exec.cpus import available_cpus

    workers = workers or available_cpus()
    if files.remote or workers <= 1 or manifest.format not in SINKS:
        return None
    return EarlyDigests.start(early_files(manifest), workers)


def check_all_contents(files, manifest, workers: int | None = None,
                       early: EarlyDigests | None = None) -> tuple[list[str], list, list]:
    """(problems of every shard and side file in manifest order, each shard's sample key hashes, each shard's
    [class index, samples] pairs: ``ShardsChecked.classes``, None for a shard whose problems leave its classes
    uncounted), the shards checked on ``workers`` processes (``verify_shards``; ``early``: tars already being
    hashed)."""
    from repack.lifecycle.verify_shards import check_shards

    if manifest.format not in SINKS:
        return [f"unknown format {manifest.format!r} in manifest"], [], []
    checked = check_shards(files, manifest, workers, early)
    problems = [problem for found in checked.problems for problem in found]
    side = manifest.data.get("files", {})
    with files.local(list(side.values())) as (root, fetch_problems):
        problems += fetch_problems
        check_side_files(side, manifest.data.get("tokenizer", {}).get("sha256"), root, problems,
                         manifest.data.get("file_digests") or {})
        if manifest.modality == "video" and side.get("file_list"):
            check_file_list(manifest.data, safe_join(root, side["file_list"]), side["file_list"], problems)
        if isinstance(side.get(QUARANTINE_ROLE), str):
            problems += quarantine_file_problems(manifest.data, safe_join(root, side[QUARANTINE_ROLE]))
    if manifest.modality == "video":  # what the readers refuse: every entry's class and frame count
        classes = manifest.data.get("classes") if isinstance(manifest.data.get("classes"), dict) else {}
        problems += [f"video {entry['path']}: {problem}" for entry in video_entries(manifest.data)
                     for problem in [entry_problem(classes, entry)] if problem]
    videos = [v for v in manifest.data.get("videos", []) if isinstance(v, dict) and v.get("path")]
    if videos:  # a video WebDataset's prepared videos beside its shards: as the manifest records them
        with files.local([v["path"] for v in videos]) as (root, fetch_problems):
            problems += fetch_problems
            check_listed_videos(videos, root, problems)
    return problems, list(checked.key_hashes), [None if found else counted for found, counted in
                                                zip(checked.problems, checked.classes)]


def quarantine_file_problems(data: dict, path: Path) -> list[str]:
    """The quarantine side file (``repack.manifest.quarantine_records``) holds ``totals.quarantined`` records and
    begins with the ones the manifest lists (its size and sha256: ``check_side_files``)."""
    from repack.manifest.quarantine_records import decode, record_count

    rel = quarantine_side_file(data)
    try:
        raw = path.read_bytes()
        count, first = record_count(raw, rel), decode(raw, rel, len(data["quarantine"]))  # the rest: columns only
    except OSError:
        return []  # missing: check_side_files named it
    except ManifestError as exc:
        return [str(exc)]
    problems = []
    if count != data["totals"].get("quarantined"):
        problems.append(f"{rel}: {count} quarantine records, totals.quarantined says "
                        f"{data['totals'].get('quarantined')}")
    if first != data["quarantine"]:
        problems.append(f"{rel}: its first records are not the ones the manifest lists")
    return problems


def check_listed_videos(videos: list[dict], root, problems: list[str]) -> None:
    """Each of a video WebDataset's ``videos`` entries exists under ``root`` with the bytes and sha256 it records
    (a reader takes a clip's frames from the file the entry names)."""
    for entry in videos:
        path = safe_join(root, entry["path"])
        if not path.is_file():
            problems.append(f"{entry['path']}: missing (a prepared video the manifest lists)")
        elif entry.get("bytes") is not None and path.stat().st_size != entry["bytes"]:
            problems.append(f"{entry['path']}: {path.stat().st_size} bytes, the manifest says {entry['bytes']}")
        elif entry.get("sha256") and sha256_file(path) != entry["sha256"]:
            problems.append(f"{entry['path']}: sha256 differs from the manifest's")
        else:
            check_frames(path, entry, lambda ok, problem: ok or problems.append(problem))


def check_file_list(data: dict, path: Path, rel: str, problems: list[str]) -> None:
    """A video dataset's DALI file_list holds the manifest's entries, path and label, in order."""
    from repack.sinks.videos import file_list_problem

    try:
        problem = file_list_problem(data, path.read_bytes())
    except OSError:
        return  # missing: check_side_files named it
    if problem:
        problems.append(f"{rel}: {problem}")


def check_side_files(side: dict, tokenizer_sha256: str | None, root, problems: list[str],
                     digests: dict | None = None) -> None:
    """The manifest's side files exist under ``root``; the tokenizer copy still has the sha256 the
    manifest records, and every side file with an entry in ``digests`` (the manifest's ``file_digests``:
    a video dataset's probe.jsonl and DALI file_list.txt) its size and sha256."""
    for name, rel in side.items():
        path = safe_join(root, rel)
        expected = (digests or {}).get(name)
        if not path.is_file():
            problems.append(f"{rel}: missing (the manifest's {name} file)")
        elif name == "tokenizer" and tokenizer_sha256 and sha256_file(path) != tokenizer_sha256:
            problems.append(f"{rel}: sha256 differs from the tokenizer the dataset was made with")
        elif isinstance(expected, dict) and path.stat().st_size != expected.get("bytes"):
            problems.append(f"{rel}: {path.stat().st_size} bytes, the manifest says {expected.get('bytes')}")
        elif isinstance(expected, dict) and sha256_file(path) != expected.get("sha256"):
            problems.append(f"{rel}: sha256 differs from the manifest's")


def check_class_counts(data: dict, classes: list) -> list[str]:
    """The samples' class indices (their ``.cls`` members, counted per shard by ``tar_check.counted``: sparse
    [index, samples, name] triples) against the class map and ``stats.class_counts``: every index names a class,
    the class its samples' ``.json`` names (``tar_check.named_classes``), and as many samples hold each class as
    the manifest counts (a class map edited or merged wrongly gives labels other names)."""
    names = data.get("classes")
    if data.get("format") != "webdataset" or not isinstance(names, dict) or not classes or \
            any(counted is None for counted in classes):
        return []
    found: dict[int, int] = {}
    named: dict[int, str] = {}  # the class a sample's .json names, per index
    for counted in classes:  # [class index, samples, name or None] per shard
        for index, count, *name in counted:
            found[index] = found.get(index, 0) + count
            if name and name[0] is not None:
                named.setdefault(index, name[0])
    name_of = {index: name for name, index in names.items() if isinstance(index, int)}
    problems = [f"{found[index]} sample(s) hold class index {index}, which the class map does not name"
                for index in sorted(found) if index not in name_of]
    problems += [f"class index {index}: its samples' .json names class {named[index]!r}, the class map {name_of[index]!r}"
                 for index in sorted(named) if index in name_of and name_of[index] != named[index]]
    expected = (data.get("stats") or {}).get("class_counts")
    if isinstance(expected, dict):
        for index, name in sorted(name_of.items()):
            held = found.get(index, 0)
            if held != expected.get(name, 0):
                problems.append(f"class {name!r} (index {index}): {held} sample(s) hold it, stats.class_counts says "
                                f"{expected.get(name, 0)}: the class map does not match the samples' .cls members")
    return problems[:DUPLICATES_SHOWN]


# -- sample keys and the class map: each names one thing ---------------------------------------------
DUPLICATES_SHOWN = 10


def check_identities(files, manifest, key_hashes: list | None = None) -> list[str]:
    """Problems of the dataset's names: a sample key held twice (anywhere, not only by adjacent samples;
    webdataset shards, read from their indexes) and a class map that is not one-to-one. ``key_hashes``:
    each shard's key hashes where they were computed already (``check_all_contents``)."""
    return check_class_map(manifest.data.get("classes")) + check_unique_keys(files, manifest, key_hashes)


def check_class_map(classes) -> list[str]:
    """A class map gives each name its own non-negative integer index."""
    if not classes:
        return []
    if not isinstance(classes, dict):
        return [f"classes: a map of name to index expected, got {type(classes).__name__}"]
    problems = [f"classes: {name!r} has index {index!r}, not a non-negative integer"
                for name, index in classes.items() if not isinstance(index, int) or isinstance(index, bool)
                or index < 0]
    names_of: dict[int, list[str]] = {}
    for name, index in classes.items():
        if isinstance(index, int):
            names_of.setdefault(index, []).append(name)
    shared = sorted((index, names) for index, names in names_of.items() if len(names) > 1)
    problems += [f"classes: index {index} is given to {len(names)} names ({', '.join(map(repr, names[:5]))}): "
                 "the class map is not one-to-one" for index, names in shared[:DUPLICATES_SHOWN]]
    if len(shared) > DUPLICATES_SHOWN:
        problems.append(f"classes: {len(shared) - DUPLICATES_SHOWN} more indices given to several names")
    return problems


def check_unique_keys(files, manifest, key_hashes: list | None = None) -> list[str]:
    """Every sample key of a webdataset dataset once. Keys are hashed to 8 bytes a key
    (``repack.sinks.keys``; ``key_hashes``: per shard of the manifest, when known), equal hashes looked
    up again by name, so a report names real duplicates only."""
    import numpy as np

    from repack.distinct import distinct
    from repack.sinks.keys import index_keys
    from repack.sinks.keys import key_hashes as key_hashes_of

    shards = manifest.data["shards"]
    if manifest.format != "webdataset" or not any(shard.get("index") for shard in shards):
        return []

    def shard_keys(shard: dict) -> list[str]:
        raw = files.read(shard["index"]) if shard.get("index") else None
        return index_keys(raw) if raw is not None else []  # a missing index is check_all_contents' to report

    if key_hashes is None:
        key_hashes = [key_hashes_of(shard_keys(shard)) for shard in shards]
    # stable: timsort merges the parts' sorted runs (``TarShardParts.check``) in about half the time
    ordered = np.sort(np.concatenate([np.zeros(0, np.uint64), *key_hashes]), kind="stable")
    held_again = ordered[1:][ordered[1:] == ordered[:-1]]  # hashes held more than once, sorted
    if not len(held_again):
        return []
    suspects = distinct(held_again)
    where: dict[str, list[str]] = {}
    for shard, found in zip(shards, key_hashes):
        if not np.isin(found, suspects).any():
            continue
        keys = shard_keys(shard)
        for key, suspect in zip(keys, np.isin(key_hashes_of(keys), suspects)):
            if suspect:
                where.setdefault(key, []).append(shard["path"])
    twice = sorted((key, shards) for key, shards in where.items() if len(shards) > 1)
    problems = [f"sample key {key!r} is held {len(shards)} times ({', '.join(sorted(set(shards)))}): keys must be "
                "unique" for key, shards in twice[:DUPLICATES_SHOWN]]
    if len(twice) > DUPLICATES_SHOWN:
        problems.append(f"{len(twice) - DUPLICATES_SHOWN} more sample keys held more than once")
    return problems
