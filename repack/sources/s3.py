"""Inputs in object storage (``s3://bucket/prefix``): paged listing, seekable reads, prefetch.

Listing: every object under the prefix, through the paged ListObjectsV2 (1000 keys a page,
read as columns of keys and sizes: ``repack.store.s3_listing``; no per-object request), the first-level folders listed in parallel
(``list_pages``), sorted by byte path like a folder scan; hidden names and OS junk (in any path
component) are skipped. Images: the class is the first level under the prefix, as in an ImageFolder tree.
Objects are neither symlinks nor special files: of the confinement's rules only the size cap
applies (an object over it is quarantined from its listed size, never read).

Reading (through ``repack.sources.reading``): ``open_object`` gives a buffered, seekable file
over ranged GETs (so text planning can snap chunk cuts to line starts, and gzip/zstd/parquet
readers work unchanged); ``prefetched`` reads a task's inputs in order with many GETs in flight from
the worker's own thread (``repack.store.s3_fetch``: up to 32, a bounded number of bytes ahead, on
kept-alive connections), so the server answers the next objects while the worker checks and packs
one; each GET is signed by ``repack.store.s3_get`` (~0.15 ms of client CPU where boto3's costs ~3.6 ms).
"""

from __future__ import annotations

import io
import itertools
import operator
import os
import re
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from functools import cached_property
from typing import BinaryIO, Callable, Iterable, Iterator

import numpy as np

from repack.errors import RepackError, SourceUnavailable, UsageError
from repack.sources.base import Scan, quarantine_record, sort_key
from repack.sources.columns import NO_LABEL, InputTable, join_names, name_ends, split_names
from repack.sources.confine import Confinement, SourceChanged
from repack.sources.object_etag import etag_value
from repack.sources.walk import JUNK_NAMES, is_junk
from repack.store.s3_client import (client, describe_error, fetcher, getter, is_missing, is_object_fault, lister,
                                    parse_url, retried)
from repack.store.s3_get import Unreadable
from repack.store.s3_listing import ETAGS, KEYS, SIZES

READ_BLOCK = 8 << 20   # bytes per ranged GET of a sequential read
LIST_THREADS = 8       # folders listed at once
LIST_PAGE = 1000       # keys per ListObjectsV2 page (S3's most)
# a path part that is empty, hidden (``.``, ``@``) or junk: every key the rules of ``_plain_keys``
# may skip or refuse matches (a superset); the others are plain paths
_SUSPECT_PATTERN = r"(?:^|/)(?:[./@]|$|(?:%s)(?:/|$))" % "|".join(map(re.escape, sorted(JUNK_NAMES)))
_SUSPECT = re.compile(_SUSPECT_PATTERN)
# the same over a page's keys joined by newlines: a match in any one key is a match here (some keys
# with a newline of their own may match here alone: that page is then read key by key)
_SUSPECT_LINES = re.compile(_SUSPECT_PATTERN, re.M)


@dataclass(frozen=True)
class Listing:
    """What an s3:// prefix holds as inputs: ``objects`` (url, rel, size), sorted by byte path; keys
    that cannot name a file (quarantine records); hidden and junk entries skipped, counted as a
    folder scan counts them (a hidden folder once, however many objects it holds)."""

    objects: tuple[tuple[str, str, int], ...]
    quarantine: tuple[dict, ...]
    skipped: int


@dataclass(frozen=True, eq=False)
class ObjectColumns:
    """An s3:// prefix's objects as columns, sorted by byte path: ``names`` (the keys below ``root``, which
    is ``s3://bucket[/prefix]``, as a names blob: ``repack.sources.columns``), ``sizes``, ``etags`` (their
    fingerprint values: ``repack.sources.object_etag``), and each key's first path part (``folder_ids`` into
    ``folders``, sorted; NO_LABEL for a key with no ``/``); plus what ``Listing`` says besides."""

    root: str
    names: bytes
    sizes: np.ndarray       # int64
    etags: np.ndarray       # int64
    folder_ids: np.ndarray  # int32
    folders: tuple[str, ...]
    quarantine: tuple[dict, ...]
    skipped: int
    codes: np.ndarray | None = None  # uint8 per row from ``list_columns``' ``page_codes``, when it was given

    def __len__(self) -> int:
        return len(self.sizes)

    @cached_property
    def rels(self) -> list[str]:
        """The keys below the root, decoded (callers that want a str per object: few objects)."""
        return split_names(self.names)

    def input_table(self, label_ids: np.ndarray | None = None, label_names: tuple[str, ...] = ()) -> InputTable:
        """The objects as input columns: path = root/rel, fingerprint [size, ETag value, 0] (an object's is its
        size and ETag; a read checks the size); unlabeled unless ``label_ids`` (into ``label_names``) are given."""
        zeros = np.zeros(len(self), dtype=np.int64)
        ids = label_ids if label_ids is not None else np.full(len(self), NO_LABEL, dtype=np.int32)
        return InputTable(self.root, self.names, name_ends(self.names), ids, label_names, self.sizes, self.etags,
                          zeros)

    def size_refusals(self, confinement: Confinement, among: np.ndarray | None = None) -> dict[int, str]:
        """Row -> the quarantine reason of each object over the confinement's size cap (of the rows where
        ``among`` holds, if given)."""
        if confinement.max_file_bytes is None:
            return {}
        over = self.sizes > confinement.max_file_bytes
        if among is not None:
            over &= among
        return {row: confinement.size_refusal(int(self.sizes[row])) for row in np.flatnonzero(over).tolist()}


def scan_objects(url: str) -> Listing:
    """List every object under ``url`` (see ``Listing``). A key with an empty path part (a leading
    ``/`` under a bucket root, ``//``) is quarantined, never read: read as a URL it would name
    another object, and its class would be empty."""
    found = list_columns(url)
    return Listing(tuple((f"{found.root}/{rel}", rel, size) for rel, size in zip(found.rels, found.sizes.tolist())),
                   found.quarantine, found.skipped)


def list_columns(url: str, page_codes: Callable[[list[str]], np.ndarray] | None = None) -> ObjectColumns:
    """``scan_objects``' listing as columns, made page by page: a key is a ``str`` only while its page is
    read (``page_codes``: a uint8 code per key of a page, e.g. a text file's kind by its name, kept as the
    ``codes`` column). A page whose keys are all plain paths (most pages) is taken whole. S3 lists keys in
    UTF-8 byte order and the folders' pages come in folder order, so the rows are sorted unless objects sit
    beside the folders (then they are sorted here, the one step that decodes every key)."""
    bucket, prefix = parse_url(url)
    base = f"{prefix}/" if prefix else ""
    cut = len(base)
    blobs: list[bytes] = []
    size_parts: list[np.ndarray] = []
    etag_parts: list[np.ndarray] = []
    id_parts: list[np.ndarray] = []
    code_parts: list[np.ndarray] = []
    runs = _FolderRuns()
    quarantine, junk = [], set()
    ordered, last = True, None
    try:
        for keys, page_sizes, page_etags in list_pages(bucket, base):
            page = [key[cut:] for key in keys]
            joined = "\n".join(page)
            if "\0" in joined or _SUSPECT_LINES.search(joined) is not None:  # some key to skip or refuse: one by one
                page, page_sizes, page_etags = _plain_keys(base, page, page_sizes, page_etags, quarantine, junk)
            if not page:
                continue
            ordered = ordered and (last is None or last <= page[0]) and \
                all(map(operator.le, page, itertools.islice(page, 1, None)))  # str order is UTF-8 byte order
            last = page[-1]
            blobs.append(join_names(page))
            size_parts.append(np.array(page_sizes, dtype=np.int64))
            etag_parts.append(np.array(page_etags, dtype=np.int64))
            id_parts.append(runs.ids(page))
            if page_codes is not None:
                code_parts.append(page_codes(page))
    except RepackError:  # a listing page's own error, already in words (``retried``)
        raise
    except Exception as exc:  # noqa: BLE001 - auth, missing bucket, unreachable endpoint: exit 2
        raise describe_error(exc, url) from None
    if not blobs and not quarantine:
        raise UsageError(f"source {url!r} holds no objects")
    names = b"".join(blobs)
    del blobs
    sizes = np.concatenate(size_parts) if size_parts else np.zeros(0, dtype=np.int64)
    etags = np.concatenate(etag_parts) if etag_parts else np.zeros(0, dtype=np.int64)
    folder_ids, folders = runs.sorted_ids(np.concatenate(id_parts) if id_parts else np.zeros(0, dtype=np.int32))
    codes = None if page_codes is None else \
        np.concatenate(code_parts).astype(np.uint8) if code_parts else np.zeros(0, dtype=np.uint8)
    if not ordered:
        rels = split_names(names)
        order = sorted(range(len(rels)), key=lambda row: sort_key(rels[row]))
        names = join_names([rels[row] for row in order])
        sizes, etags, folder_ids = sizes[order], etags[order], folder_ids[order]
        codes = None if codes is None else codes[order]
    return ObjectColumns(f"s3://{bucket}/{prefix}" if prefix else f"s3://{bucket}", names, sizes, etags, folder_ids,
                         folders, tuple(sorted(quarantine, key=lambda q: sort_key(q["source"]))), len(junk), codes)


def _plain_keys(base: str, page: list[str], sizes: list[int], etags: list[int], quarantine: list[dict],
                junk: set[str]) -> tuple[list[str], list[int], list[int]]:
    """The keys of ``page`` that name an input (and their sizes and ETag values); a key with an empty path part or a NUL
    (a %00 in a URL-encoded listing) quarantined, a hidden or junk one counted in ``junk`` by its hidden part
    (a folder once), a folder marker dropped."""
    kept, kept_sizes, kept_etags = [], [], []
    for rel, size, etag in zip(page, sizes, etags):
        if "\0" in rel:
            quarantine.append(quarantine_record(rel, f"object key {base + rel!r} holds a NUL byte: it names no file, "
                                                     "not read"))
            continue
        if _SUSPECT.search(rel) is None:
            kept.append(rel)
            kept_sizes.append(size)
            kept_etags.append(etag)
            continue
        if not rel or rel.endswith("/"):  # a "folder" marker: no data (one holding bytes names no file either)
            if size:
                quarantine.append(quarantine_record(rel, f"object key {base + rel!r} ends in '/' and holds {size} "
                                                         "bytes: it names no file, not read"))
            continue
        parts = rel.split("/")
        hidden = next((i for i, part in enumerate(parts) if part and is_junk(part)), None)
        if "" in parts[:hidden]:
            quarantine.append(quarantine_record(rel, f"object key {base + rel!r} has an empty path part "
                                                     "(a leading '/' or '//'): it names no file, not read"))
        elif hidden is not None:
            junk.add("/".join(parts[:hidden + 1]))
        else:
            kept.append(rel)
            kept_sizes.append(size)
            kept_etags.append(etag)
    return kept, kept_sizes, kept_etags


class _FolderRuns:
    """Each key's first path part as an id, in the order first met; keys in order come in one run per
    folder, so a folder's name is sliced once per run, not once per key."""

    def __init__(self) -> None:
        self.seen: dict[str, int] = {}
        self.folder, self.at = "\0", NO_LABEL  # the current run's "<name>/" (no key holds a NUL) and its id

    def ids(self, rels: list[str]) -> np.ndarray:
        out: list[int] = []
        for rel in rels:
            if rel.startswith(self.folder):
                out.append(self.at)
                continue
            cut = rel.find("/")
            if cut < 0:
                out.append(NO_LABEL)
                continue
            self.folder = rel[:cut + 1]
            self.at = self.seen.setdefault(self.folder[:-1], len(self.seen))
            out.append(self.at)
        return np.array(out, dtype=np.int32)

    def sorted_ids(self, ids: np.ndarray) -> tuple[np.ndarray, tuple[str, ...]]:
        """``ids`` renumbered into the sorted folder names, and those names."""
        names = tuple(sorted(self.seen, key=sort_key))
        place = {name: i for i, name in enumerate(names)}
        remap = np.array([place[name] for name in self.seen] + [NO_LABEL], dtype=np.int32)  # NO_LABEL indexes the last
        return remap[ids], names


def list_pages(bucket: str, base: str,
               threads: int = LIST_THREADS) -> Iterator[tuple[list[str], list[int], list[int]]]:
    """Every object under ``base`` as pages of (keys, sizes, ETag values), in no promised order: the first level is
    listed with the ``/`` delimiter, and when it holds folders, each folder is listed on its own
    thread (``threads`` at a time, ListObjectsV2 pages of 1,000 keys, no per-object request), so a
    tree of class folders is listed in parallel; the objects directly under ``base`` come with the
    first level."""
    folders: list[str] = []
    for page in _pages(bucket, base, delimiter="/"):
        folders += [p["Prefix"] for p in page.get("CommonPrefixes", ())]
        yield _columns(page)
    if threads <= 1 or len(folders) < 2:
        for folder in folders:
            for page in _pages(bucket, folder):
                yield _columns(page)
        return
    with ThreadPoolExecutor(min(threads, len(folders)), thread_name_prefix="repack-list") as pool:
        for pages in pool.map(lambda folder: [_columns(p) for p in _pages(bucket, folder)], folders):
            yield from pages


def _pages(bucket: str, prefix: str, delimiter: str = "") -> Iterator[dict]:
    """ListObjectsV2 pages under ``prefix``, each request asked again as every S3 request is
    (``s3_client.retried``: a throttled or failing page does not end the listing after botocore's attempts)."""
    asked = {"Bucket": bucket, "Prefix": prefix, "MaxKeys": LIST_PAGE, **({"Delimiter": delimiter} if delimiter else {})}
    while True:
        page = retried(lambda: lister().list_objects_v2(**asked), f"s3://{bucket}/{prefix}")
        yield page
        token = page.get("NextContinuationToken")
        if not page.get("IsTruncated") or not token:
            return
        asked["ContinuationToken"] = token


def _columns(page: dict) -> tuple[list[str], list[int], list[int]]:
    if KEYS in page:
        return page[KEYS], page[SIZES], page[ETAGS]
    contents = page.get("Contents", ())
    return [obj["Key"] for obj in contents], [obj["Size"] for obj in contents], \
        [etag_value(obj.get("ETag")) for obj in contents]


def check_source(url: str) -> None:
    """Fail fast (UsageError naming ``url``) when the prefix cannot be listed or holds nothing, before
    a job creates any state in OUT."""
    bucket, prefix = parse_url(url)
    answer = retried(lambda: client().list_objects_v2(Bucket=bucket, Prefix=f"{prefix}/" if prefix else "", MaxKeys=1),
                     url)
    if not answer.get("KeyCount"):
        raise UsageError(f"source {url!r} holds no objects")


def scan_s3(url: str, confinement: Confinement) -> Scan:
    """Objects under ``url`` as image inputs, in columns (``repack.sources.columns.InputTable``): class =
    first level, a flat prefix is unlabeled; an object over the confinement's size cap is quarantined,
    and so is a key that names no file."""
    listing = list_columns(url)
    labeled = bool(listing.folders)
    refused: dict[int, str] = {}
    if labeled:
        refused = dict.fromkeys(np.flatnonzero(listing.folder_ids == NO_LABEL).tolist(),
                                "file outside the class folders of a labeled tree")
    refused = {**listing.size_refusals(confinement), **refused}  # outside the classes: said first
    table = listing.input_table(listing.folder_ids, listing.folders) if labeled else listing.input_table()
    quarantine = list(listing.quarantine)
    if refused:
        quarantine += [quarantine_record(table.rel(row), reason) for row, reason in refused.items()]
        kept = np.ones(len(table), dtype=bool)
        kept[list(refused)] = False
        table = table.take(np.flatnonzero(kept))
    return Scan(table, tuple(sorted(quarantine, key=lambda q: sort_key(q["source"]))), labeled, listing.skipped)


RANGE_ATTEMPTS = 3  # a ranged read answered with another range, asked again at most this many times


class WrongRange(OSError):
    """An answer for another range than the one asked for (its bytes are not taken)."""


class RemoteFile(io.RawIOBase):
    """A read-only, seekable object: each read is one ranged GET (buffer it: ``open_object``); an
    object whose size is no longer ``size`` (the planned one) raises SourceChanged."""

    def __init__(self, url: str, size: int | None = None) -> None:
        self.url = url
        self.bucket, self.key = parse_url(url)
        if size is None:
            try:
                size = client().head_object(Bucket=self.bucket, Key=self.key)["ContentLength"]
            except Exception as exc:  # noqa: BLE001
                raise _os_error(exc, url) from None
        self.size = size
        self.pos = 0

    def readable(self) -> bool:
        return True

    def seekable(self) -> bool:
        return True

    def tell(self) -> int:
        return self.pos

    def seek(self, offset: int, whence: int = os.SEEK_SET) -> int:
        base = {os.SEEK_SET: 0, os.SEEK_CUR: self.pos, os.SEEK_END: self.size}[whence]
        self.pos = max(0, base + offset)
        return self.pos

    def readinto(self, buffer) -> int:
        """Bytes at the position into ``buffer``; an answer for another range is asked again (RANGE_ATTEMPTS),
        then an OSError naming the object."""
        for attempt in range(RANGE_ATTEMPTS):
            try:
                return self._read_into(buffer)
            except WrongRange:
                if attempt == RANGE_ATTEMPTS - 1:
                    raise
        return 0

    def _read_into(self, buffer) -> int:
        want = min(len(buffer), self.size - self.pos)
        if want <= 0:
            return 0
        try:
            answer = client().get_object(Bucket=self.bucket, Key=self.key,
                                         Range=f"bytes={self.pos}-{self.pos + want - 1}")
            body = answer["Body"].read()
        except Exception as exc:  # noqa: BLE001
            raise _os_error(exc, self.url) from None
        answered = answer.get("ContentRange") or ""
        total = answered.rpartition("/")[2]
        if total.isdigit() and int(total) != self.size:  # "bytes a-b/total": the object was replaced
            raise SourceChanged(f"source changed: {self.url} is {total} bytes, {self.size} when planned; "
                                "re-run with --overwrite to start over")
        first = answered.removeprefix("bytes ").partition("-")[0]
        if (first != str(self.pos) if answered else self.pos != 0) or len(body) > want:  # another place's bytes
            raise WrongRange(5, f"the S3 endpoint answered bytes {self.pos}-{self.pos + want - 1} with "
                             f"{answered or 'the object from its start'} ({len(body)} bytes)", self.url)
        buffer[:len(body)] = body
        self.pos += len(body)
        return len(body)


def _os_error(exc: BaseException, url: str) -> OSError | SourceUnavailable:
    """A read failure: an OSError where the answer was about the object (missing, refused, archived: the input
    is quarantined with the reason), SourceUnavailable where the endpoint did not serve it (the task fails,
    a re-run asks again)."""
    if is_missing(exc):
        return FileNotFoundError(2, "no such object", url)
    if is_object_fault(exc):
        return OSError(5, str(describe_error(exc, url)), url)
    return SourceUnavailable(str(describe_error(exc, url)))


def open_object(url: str, size: int | None = None) -> BinaryIO:
    """A buffered, seekable s3:// object (its size from a HEAD unless given)."""
    return io.BufferedReader(RemoteFile(url, size), READ_BLOCK)


def read_object(url: str) -> bytes:
    """A whole object in one GET (``repack.store.s3_get``: a signed request on a kept-alive socket,
    boto3 for anything but the object's bytes); OSError naming ``url`` when it cannot be read."""
    bucket, key = parse_url(url)
    try:
        return getter().get(bucket, key)
    except (Unreadable, SourceUnavailable):
        raise
    except Exception as exc:  # noqa: BLE001 - boto3's errors for answers that are not the object
        raise _os_error(exc, url) from None


def _read_after(bucket: str, key: str, spent: int, why: str, delegate: bool) -> bytes:
    """An object the pipelined GETs could not read, read by ``s3_get`` (its attempts left, boto3's
    answers); OSError naming the URL when it cannot be read."""
    try:
        return getter().get_after(bucket, key, spent, why, delegate)
    except (Unreadable, SourceUnavailable):
        raise
    except Exception as exc:  # noqa: BLE001 - boto3's errors for answers that are not the object
        raise _os_error(exc, f"s3://{bucket}/{key}") from None


def prefetched(urls: Iterable[str], sizes: list[int | None] | None = None) -> Iterator[bytes | OSError]:
    """The bytes of each object (or the OSError reading it), in order: ``repack.store.s3_fetch`` keeps up
    to ``DEPTH`` GETs in flight on kept-alive connections from this thread, and at most ``AHEAD_BYTES``
    of ``sizes`` (the planned sizes) asked for ahead of the object handed out."""
    objects = [parse_url(url) for url in urls]
    for result in fetcher(_read_after).fetch(objects, sizes):
        if isinstance(result, SourceUnavailable):
            raise result  # the endpoint's fault, not the object's: the task fails (a re-run asks again)
        yield result if isinstance(result, (bytes, OSError)) else OSError(5, f"{type(result).__name__}: {result}")
