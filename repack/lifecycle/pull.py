"""`repack pull`: copy a dataset from object storage into a local folder, checked as verify checks.

The version is pinned first: ``manifest.json`` is read once, and its bytes are the ones written to
DEST at the end (a version published while the pull runs is not seen: shards are immutable, so the
copy is exactly the pinned version, never a mixture). ``versions`` (``PullSpec``): the pinned
version only (default), the K newest up to it, or every kept one; each is read from its immutable
``manifest.vN.json`` and written to DEST with its bytes, so a reader pinned to ``version=N`` works on
the copy. Every object those versions name is downloaded (size and sha256 checked on the way; an
intact file already in DEST is kept), then the copy is checked as ``repack verify`` checks a folder
(each shard's structure against its index, the side files' sha256), per version; only then are
the version files written and ``manifest.json`` last: a readable manifest in DEST means a complete,
checked copy. A file of the copy that fails raises VerificationError (exit 5); DEST holding a
symlink where a file goes is a UsageError. DEST is new, empty, or an earlier pull's copy of the same
dataset (``.repack/pulled.json`` names its URL and every file a pull into it started to write, so the
files of a pull that was killed are still known): a folder holding a repack job's output, a copy of
another dataset, or files of no dataset is refused before anything in it changes. The files an earlier
pull wrote that no pulled version names are deleted once the copy is checked. Requests are retried as
every S3 call of repack is
(``repack.store.s3_client``), and a whole-object download that still fails is tried again, as uploads are.
"""

from __future__ import annotations

import json
import math
import os
import posixpath
import re
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

from repack.errors import RepackError, UsageError, VerificationError, raise_if_interrupted
from repack.jobs.base import STATE_DIR
from repack.lifecycle.foreign import ENERGON_INDEX_SUFFIX
from repack.lifecycle.publish import refresh_other_views
from repack.lifecycle.verify import check_identities, dataset_problems, totals_problems
from repack.manifest.s3_waits import bounded_pause
from repack.manifest import MANIFEST_NAME, Manifest, ManifestError, atomic_write_bytes, parse_manifest, safe_join
from repack.manifest.versions import check_number, number_of, version_file, version_number
from repack.sinks.checks import sha256_file
from repack.lifecycle.version_names import version_names
from repack.store import LocalStore
from repack.store.files import LocalFiles, RemoteFiles

THREADS = 16
FETCH_ATTEMPTS = 3  # whole-object attempts on top of botocore's per-request retries


@dataclass(frozen=True)
class PullSpec:
    """What to copy: ``versions`` None = every kept version, else the ``versions`` newest up to the
    pinned one (1: the pinned version only)."""

    url: str
    dest: str
    versions: int | None = 1


@dataclass(frozen=True)
class Version:
    """One version to copy: its number, the file it lives in, its exact bytes and its manifest."""

    number: int
    name: str
    raw: bytes
    manifest: Manifest


@dataclass(frozen=True)
class Expected:
    """One object the manifest names, with its size and sha256 when the manifest records them."""

    rel: str
    size: int | None
    sha256: str | None


def expected_objects(manifest: Manifest) -> list[Expected]:
    """Every object of the dataset: shards and their index files, then side files (the tokenizer
    with the sha256 the manifest records for it); paths as ``Manifest.named_files`` spells them (``./x`` is ``x``)."""
    return [Expected(posixpath.normpath(item.rel), item.size, item.sha256) for item in _expected(manifest)]


def _expected(manifest: Manifest) -> list[Expected]:
    found = []
    for shard in manifest.data["shards"]:
        found.append(Expected(shard["path"], shard.get("bytes"), shard.get("sha256")))
        if shard.get("index"):
            found.append(Expected(shard["index"], shard.get("index_bytes"), shard.get("index_sha256")))
        if shard.get("checksums"):
            found.append(Expected(shard["checksums"], shard.get("checksums_bytes"), shard.get("checksums_sha256")))
        if shard.get("source_runs"):  # a token part's document sources (``repack.manifest.source_runs``)
            found.append(Expected(shard["source_runs"], shard.get("source_runs_bytes"), shard.get("source_runs_sha256")))
    for video in manifest.data.get("videos", []):  # a video WebDataset's prepared videos, beside its shards
        found.append(Expected(video["path"], video.get("bytes"), video.get("sha256")))
    for name, rel in manifest.data.get("files", {}).items():
        sha = manifest.data.get("tokenizer", {}).get("sha256") if name == "tokenizer" else None
        found.append(Expected(rel, None, sha))
    return found


def refuse_links(root: Path, rel: str) -> Path:
    """``root/rel``, refusing a symlink at the file or any folder on the way (a copy never writes
    through a link, wherever it points)."""
    path = root
    for part in rel.split("/"):
        path = path / part
        if path.is_symlink():
            raise UsageError(f"{path}: a symbolic link in the destination; pull writes plain files only "
                             "(remove the link, or pull into another folder)")
    return safe_join(root, rel)


def pinned_versions(remote: RemoteFiles, versions: int | None) -> list[Version]:
    """The versions to copy, newest first: the one ``manifest.json`` holds now (read once: the pin),
    then older kept ones as ``versions`` says; each validated (the manifest's path rule, its number)."""
    store = remote.store
    raw = store.read_bytes(MANIFEST_NAME)
    if raw is None:
        raise ManifestError(f"{store.url}/{MANIFEST_NAME}: no manifest (the job has not finished, or this is not "
                            "a repack output)")
    latest = _version(remote, MANIFEST_NAME, raw, None)
    found = [latest]
    if versions == 1:
        return found
    older = sorted((n for n in (version_number(rel) for rel in store.list_sizes("manifest.v")) if n is not None
                    and n < latest.number), reverse=True)
    for number in older[:None if versions is None else versions - 1]:
        name = version_file(number)
        body = store.read_bytes(name)
        if body is None:
            continue  # removed by a gc since the listing: no longer kept
        found.append(_version(remote, name, body, number))
    return found


def _version(remote: RemoteFiles, name: str, raw: bytes, number: int | None) -> Version:
    where = remote.store.where(name)
    manifest = parse_manifest(raw, remote.store.scratch, where, remote.store.url)
    data = manifest.data
    check_number(data, number, where)
    return Version(number_of(data), name, raw, manifest)


def pull(spec: PullSpec) -> Manifest:
    """Copy the pinned version(s) of the dataset under ``spec.url`` into the folder ``spec.dest`` (see the
    module docstring); the pinned manifest."""
    remote = RemoteFiles(spec.url)
    pinned = pinned_versions(remote, spec.versions)
    root = Path(spec.dest)
    if root.exists() and not root.is_dir():
        raise UsageError(f"{str(root)!r} exists and is not a folder")
    from repack.jobs.engine import JobLock, prepare_out

    refuse_other_dest(root, remote)
    prepare_out(root)  # as every writer's: the job state inside DEST (never through a link), DEST writable
    with JobLock(root):  # as every writer of a dataset: a second pull, a gc or a remove on DEST exits 3
        refuse_other_dest(root, remote)  # again, now that no other writer runs
        return _pull_locked(spec, remote, pinned, root)


PULLED = ".repack/pulled.json"  # {"url": the dataset pulled, "files": every file a pull into DEST started to write}


def pulled_record(root: Path) -> dict | None:
    """DEST's record of its pulls (None: none, or not readable as one)."""
    try:
        data = json.loads(refuse_links(root, PULLED).read_bytes())
    except (OSError, ValueError):
        return None
    return data if isinstance(data, dict) and isinstance(data.get("url"), str) and \
        isinstance(data.get("files"), list) else None


def refuse_other_dest(root: Path, remote: RemoteFiles) -> None:
    """UsageError when DEST holds what a pull of ``remote`` must not replace: a repack job's output (its
    ``.repack/job.json``), a pull of another dataset, or anything else that is not a copy of this dataset (a
    ``manifest.json`` without a record is an older repack's pull only when it is, byte for byte, one of this
    dataset's versions: a manifest alone proves nothing)."""
    if not root.is_dir():
        return
    url = remote.store.url
    if (root / STATE_DIR / "job.json").exists():
        raise UsageError(f"{root} holds the output of a repack job (.repack/job.json): a pull would replace its "
                         "files; pull into a new or empty folder")
    record = pulled_record(root)
    if record is not None:
        if record["url"] != url:
            raise UsageError(f"{root} holds a copy of {record['url']}, not of {url}: pull into a new or empty folder")
        return
    found = sorted(entry.name for entry in os.scandir(root) if entry.name != STATE_DIR)
    if not found:
        return
    shown = ", ".join(found[:3]) + (" ..." if len(found) > 3 else "")
    if MANIFEST_NAME not in found or not _a_version_of(refuse_links(root, MANIFEST_NAME), remote):
        raise UsageError(f"{root} is not empty and holds no copy of {url} ({shown}); pull into a new or empty folder")


def _a_version_of(local: Path, remote: RemoteFiles) -> bool:
    """The manifest at ``local`` is, byte for byte, a version of the dataset at ``remote`` that it still keeps."""
    try:
        raw = local.read_bytes()
        number = number_of(json.loads(raw))
    except (OSError, ValueError, TypeError, AttributeError, ManifestError):
        return False
    return any(remote.store.read_bytes(name) == raw for name in (version_file(number), MANIFEST_NAME))


def _write_record(root: Path, url: str, files: set[str]) -> None:
    atomic_write_bytes(refuse_links(root, PULLED), json.dumps({"url": url, "files": sorted(files)}).encode())


def _pull_locked(spec: PullSpec, remote: RemoteFiles, pinned: list[Version], root: Path) -> Manifest:
    """``pull`` with DEST's job lock held."""
    items = {item.rel: item for version in reversed(pinned) for item in expected_objects(version.manifest)}
    targets = {rel: refuse_links(root, rel) for rel in items}
    record = pulled_record(root)
    # an earlier pull's files (its manifests', and every file a killed one started): those not pulled now go
    earlier = version_names(LocalStore(str(root))) | set(record["files"] if record else ())
    _write_record(root, remote.store.url, earlier | set(items))  # before any download: a kill leaves them known
    for old in [root / MANIFEST_NAME, *root.glob("manifest.v*.json")]:  # a readable manifest = a complete copy
        refuse_links(root, old.name).unlink(missing_ok=True)

    def copy(item: Expected) -> None:
        local = targets[item.rel]
        if item.sha256 and local.is_file() and (item.size is None or local.stat().st_size == item.size) \
                and sha256_file(local) == item.sha256:
            return
        fetch_retried(remote, item, local)

    with ThreadPoolExecutor(THREADS) as pool:
        list(pool.map(copy, items.values()))
    problems = []
    for version in pinned:
        copied = Manifest(root, version.manifest.data)
        files = LocalFiles(root, copied)
        found, key_hashes = dataset_problems(files, copied)  # as verify checks a folder, less the folder's own checks
        found += check_identities(files, copied, key_hashes) + totals_problems(copied)
        problems += [f"version {version.number}: {p}" for p in found]
    if problems:
        raise VerificationError(f"{spec.url}: the copy in {spec.dest} fails {len(problems)} check(s), no manifest "
                                "written: " + "; ".join(problems[:5]))
    latest = pinned[0]
    raise_if_interrupted()  # a signal whose raise was swallowed: no manifest is written after it
    for version in reversed(pinned):
        if version.number > 1 or len(pinned) > 1:
            atomic_write_bytes(refuse_links(root, version_file(version.number)), version.raw)
    atomic_write_bytes(refuse_links(root, MANIFEST_NAME), latest.raw)
    stale = {rel for rel in earlier - set(items)  # the version files were just written
             if rel != MANIFEST_NAME and version_number(rel) is None}
    # megatron-energon's index beside a tar no pulled version names goes with it, as gc deletes it
    stale |= {rel[:-len(".tar")] + ENERGON_INDEX_SUFFIX for rel in stale if rel.endswith(".tar")} - set(items)
    _drop_stale(root, stale, set(items))
    _write_record(root, remote.store.url, set(items))
    pulled = Manifest(root, latest.manifest.data)
    refresh_other_views(LocalStore(str(root)), pulled)  # a wids index of DEST follows; a stale energon prep is named
    return pulled


_TEMP = re.compile(r"\.[^/]+\.tmp-[0-9]+(?:\.[^/]+)?")  # a download's temp file (``.NAME.tmp-PID``, boto3's ``.XXXX``)


def _drop_stale(root: Path, stale: set[str], pulled: set[str]) -> None:
    """Delete from the copy the files an earlier pull left that no pulled version names, and the temp files of
    downloads that were killed: ``repack verify`` of the copy would name them. A file of ``pulled`` is never
    deleted, whatever its name (a dataset may name a file ``.NAME.tmp-1``)."""
    doomed = set(stale)
    for path in root.rglob(".*.tmp-*"):
        rel = path.relative_to(root).as_posix()
        if not rel.startswith(".repack/") and _TEMP.fullmatch(path.name):
            doomed.add(rel)
    for rel in sorted(doomed - pulled):
        try:
            path = safe_join(root, rel)
        except (ValueError, ManifestError):
            continue
        if path.is_file() and not path.is_symlink():
            path.unlink()


def fetch_retried(remote: RemoteFiles, item: Expected, local: Path) -> None:
    """Download one object and check its size; a transfer that fails (botocore's attempts spent, a
    stream cut) is tried again up to FETCH_ATTEMPTS times; a content mismatch is not retried."""
    for attempt in range(FETCH_ATTEMPTS):
        try:
            remote.store.fetch(item.rel, local, item.sha256)
            break
        except VerificationError:
            raise
        except RepackError:
            if attempt == FETCH_ATTEMPTS - 1:
                raise
            time.sleep(bounded_pause(attempt, math.inf))
    if item.size is not None and local.stat().st_size != item.size:
        raise VerificationError(f"{remote.store.where(item.rel)}: {local.stat().st_size} bytes, "
                                f"manifest says {item.size}")
