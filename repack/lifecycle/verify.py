"""`repack verify`: check a dataset against its manifest, in a folder or under s3:// alike.

One implementation over ``repack.store.files`` (a folder, or an object-store prefix whose
objects are downloaded one shard at a time): every shard through its format's ``verify_shard``
(size, sha256, and for tars the archive's own structure against the index), the side files
(the tokenizer's sha256), every file under the root that the manifest does not name, and the
totals. Files that other tools write into a dataset on purpose (megatron-energon's
``energon prepare``) are recognised by ``repack.lifecycle.foreign``: checked where their content can be
checked against the manifest, otherwise listed as not checked, never silently passed.
"""

from __future__ import annotations

import json
import re
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

from repack.lifecycle.foreign import check_foreign, foreign_kind
from repack.manifest import MANIFEST_NAME, Manifest, ManifestError, safe_join
from repack.manifest.paths import PathEscapeError
from repack.sinks import SINKS, get_sink
from repack.sinks.checks import sha256_file
from repack.store.files import open_files


@dataclass(frozen=True)
class Report:
    """What verify found: ``problems`` (empty = the dataset matches its manifest) and ``unchecked``
    (files of other tools that verify accepts without being able to check them)."""

    problems: tuple[str, ...]
    unchecked: tuple[str, ...] = ()
    pending: tuple[str, ...] = ()  # work of a writer not yet published (repack.lifecycle.publish): not a problem


def verify_dataset(location) -> list[str]:
    """Every problem found in the dataset at ``location`` (a folder or s3://bucket/prefix)."""
    return list(verify_report(location).problems)


def verify_report(location, version: int | None = None) -> Report:
    """The full ``Report`` for the dataset at ``location`` (its latest version, or ``version``)."""
    files = open_files(location)
    try:
        manifest = files.manifest(version)
    except ManifestError as exc:
        return Report((str(exc),))
    problems = check_contents(files, manifest)
    listed = set(manifest.named_files())
    names = files.names()
    chain = check_versions(files, names, manifest.root)
    problems += chain.problems
    pending = []
    foreign = []
    for rel in names:
        if rel in listed or rel in chain.kept:
            continue
        if rel in chain.pending_files or is_pending_name(rel, chain.published + 1):
            pending.append(rel)
        elif foreign_kind(rel, manifest) is None:
            problems.append(f"{rel}: a file the manifest does not name (added after the job, or left by another tool)")
        else:
            foreign.append(rel)
    foreign_problems, unchecked = check_foreign(files, manifest, foreign)
    problems += foreign_problems
    problems += check_identities(files, manifest)
    totals = manifest.totals
    if totals.get("samples") != manifest.num_samples:
        problems.append(f"totals.samples {totals.get('samples')} != sum over shards {manifest.num_samples}")
    if totals.get("quarantined") != len(manifest.quarantine):
        problems.append(f"totals.quarantined {totals.get('quarantined')} != {len(manifest.quarantine)} "
                        "quarantine records")
    return Report(tuple(problems), tuple(unchecked), tuple(pending))


@dataclass(frozen=True)
class Chain:
    """The version files of a dataset as verify sees them: ``problems``; ``kept``: the files the
    published versions name; ``published``: the number ``manifest.json`` holds; ``pending_files``: the
    files of versions written after it but not published yet (their manifests and what they name)."""

    problems: list[str]
    kept: set[str]
    published: int
    pending_files: frozenset[str] = frozenset()


def is_pending_name(rel: str, number: int) -> bool:
    """True when ``rel`` is named the way writers name the files they add for version ``number``
    (``shard-vN-…``, ``…-vN.tar``, ``videos-vN/…``, and their hidden temp files): work of a run
    killed before it published ``number``."""
    return any(re.search(rf"-v{number}(?=[-./]|$)", part) for part in rel.split("/"))


def check_versions(files, names: list[str], root: Path) -> Chain:
    """Each published ``manifest.vN.json`` must say it is version N with parent N - 1 and pass the
    manifest's path rule, and ``manifest.json`` must be the newest published one, byte for byte.
    Files named by a version other than the one verified are not strays (verify that version with
    ``--version N`` to check their contents). A version file newer than ``manifest.json`` is pending
    (the next append, remove or gc publishes it or moves it aside): reported, not a problem. ``root``:
    the folder the paths are confined to (the dataset's, or an object store's scratch)."""
    from repack.manifest.versions import VERSION_KEY, load_number, number_of, version_number

    problems: list[str] = []
    kept: set[str] = set()
    published = load_number(files.read(MANIFEST_NAME))
    numbers = sorted(n for n in (version_number(rel) for rel in names) if n is not None)
    pending_files: set[str] = set()
    for number in numbers:
        name = f"manifest.v{number}.json"
        if number > published:
            pending_files.add(name)
            try:
                pending_files.update(Manifest(Path("/"), json.loads(files.read(name) or b"null")).named_files())
            except (ValueError, TypeError, KeyError, AttributeError):
                pass  # garbage: the next writer moves it aside
            continue
        kept.add(name)
        try:
            data = json.loads(files.read(name) or b"null")
            other = Manifest(root, data)
            other.validate()
            info = data.get(VERSION_KEY) or {}
            if number_of(data) != number or (number > 1 and info.get("parent") != number - 1):
                problems.append(f"{name}: says version {number_of(data)} with parent {info.get('parent')!r}")
            kept.update(other.named_files())
        except (ValueError, ManifestError) as exc:
            problems.append(f"{name}: not a readable version manifest ({exc})")
    published_files = [n for n in numbers if n <= published]
    if published_files:
        latest = f"manifest.v{published_files[-1]}.json"
        if files.read(MANIFEST_NAME) != files.read(latest) and published_files[-1] > 1:
            problems.append(f"{MANIFEST_NAME} is not the newest version ({latest}), byte for byte")
    return Chain(problems, kept, published, frozenset(pending_files) - kept)


def check_contents(files, manifest) -> list[str]:
    """Problems of every shard and side file (in manifest order), fetched through ``files``."""
    if manifest.format not in SINKS:
        return [f"unknown format {manifest.format!r} in manifest"]
    sink = get_sink(manifest.format)

    def shard_problems(shard: dict) -> list[str]:
        try:
            manifest.path(shard["path"])
        except PathEscapeError as exc:
            return [str(exc)]
        rels = [shard["path"]] + [shard[side] for side in ("index", "checksums", "source_runs") if shard.get(side)]
        with files.local(rels) as (root, problems):
            sink.verify_shard(root, shard, lambda ok, message: ok or problems.append(message))
            return problems

    def side_problems(_: None) -> list[str]:
        side = manifest.data.get("files", {})
        with files.local(list(side.values())) as (root, problems):
            check_side_files(side, manifest.data.get("tokenizer", {}).get("sha256"), root, problems)
            return problems

    units = [(shard_problems, shard) for shard in manifest.data["shards"]] + [(side_problems, None)]
    with ThreadPoolExecutor(files.threads) as pool:
        return [p for found in pool.map(lambda unit: unit[0](unit[1]), units) for p in found]


def check_side_files(side: dict, tokenizer_sha256: str | None, root, problems: list[str]) -> None:
    """The manifest's side files exist under ``root``; the tokenizer copy still has the sha256 the
    manifest records."""
    for name, rel in side.items():
        path = safe_join(root, rel)
        if not path.is_file():
            problems.append(f"{rel}: missing (the manifest's {name} file)")
        elif name == "tokenizer" and tokenizer_sha256 and sha256_file(path) != tokenizer_sha256:
            problems.append(f"{rel}: sha256 differs from the tokenizer the dataset was made with")


# -- sample keys and the class map: each names one thing ---------------------------------------------
DUPLICATES_SHOWN = 10


def check_identities(files, manifest) -> list[str]:
    """Problems of the dataset's names: a sample key held twice (anywhere, not only by adjacent samples;
    webdataset shards, read from their indexes) and a class map that is not one-to-one."""
    return check_class_map(manifest.data.get("classes")) + check_unique_keys(files, manifest)


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


def _index_keys(raw: bytes) -> list[str]:
    """The sample keys a DALI index lists (one line per sample; the first member's name gives the key)."""
    from repack.sinks.tar_format import split_key

    keys = []
    for line in raw.decode("utf-8", "surrogateescape").splitlines()[1:]:
        fields = line.split(" ")
        if len(fields) >= 4:
            keys.append(split_key(fields[3])[0])
    return keys


def check_unique_keys(files, manifest) -> list[str]:
    """Every sample key of a webdataset dataset once. Keys are hashed to 8 bytes a key (a numpy array:
    10M keys, 80 MB), equal hashes looked up again by name, so a report names real duplicates only."""
    import hashlib

    import numpy as np

    indexed = [shard for shard in manifest.data["shards"] if shard.get("index")]
    if manifest.format != "webdataset" or not indexed:
        return []

    def shard_keys(shard: dict) -> list[str]:
        raw = files.read(shard["index"])
        return _index_keys(raw) if raw is not None else []  # a missing index is check_contents' to report

    def digest(key: str) -> int:
        return int.from_bytes(hashlib.blake2b(key.encode("utf-8", "surrogateescape"), digest_size=8).digest(),
                              "little")

    hashes = np.concatenate([np.fromiter((digest(k) for k in shard_keys(s)), dtype=np.uint64) for s in indexed])
    values, counts = np.unique(hashes, return_counts=True)
    suspects = set(values[counts > 1].tolist())
    if not suspects:
        return []
    where: dict[str, list[str]] = {}
    for shard in indexed:
        for key in shard_keys(shard):
            if digest(key) in suspects:
                where.setdefault(key, []).append(shard["path"])
    twice = sorted((key, shards) for key, shards in where.items() if len(shards) > 1)
    problems = [f"sample key {key!r} is held {len(shards)} times ({', '.join(sorted(set(shards)))}): keys must be "
                "unique" for key, shards in twice[:DUPLICATES_SHOWN]]
    if len(twice) > DUPLICATES_SHOWN:
        problems.append(f"{len(twice) - DUPLICATES_SHOWN} more sample keys held more than once")
    return problems
