"""Shared helpers for the readers: open a WebDataset manifest, parse DALI index files, split work.

Imports ``repack.manifest`` and nothing else from repack. Every file path comes from the
manifest through ``Manifest.path`` (confined to the dataset root). A root may be a folder or
``s3://bucket/prefix`` (``RemoteManifest``: paths are URLs, read through ``object_store``).

An index file (``.idx``, DALI's format v1.2, written by repack next to each tar) has a header
line ``v1.2 <samples>`` and one line per sample: groups of four tokens
``<ext> <data offset> <size> <member name>``, the members of a sample being adjacent in the tar.
The readers use it to ``pread`` exactly the bytes of the samples they own; they hold it as numpy
columns (``repack.manifest.shard_index``), ``Sample`` objects only for the few samples a slow path handles.
"""

from __future__ import annotations

import ctypes
import json
import mmap
import os
import threading
import warnings
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from pipelines import index_process, object_store
from pipelines.cpus import usable_cpus
from pipelines.file_limit import files_allowed
from pipelines.sample_order import balanced as split_range  # noqa: F401  (the readers' one split rule)
from repack.manifest.shard_index import Allocate, IndexColumns, IndexJob, parse_index_set, parse_job, small_index_bytes
from repack.manifest import Manifest, ManifestError, read_manifest
from repack.manifest.caps import check_declared_counts, check_manifest_size, manifest_cap
from repack.manifest.io import open_regular
from repack.manifest.versions import check_number, read_version

INDEX_THREADS = 8  # index files read at once
INDEX_FILES_AT_ONCE = 256  # index files mapped at a time (each mapping holds a file descriptor)
HELPER_MIN_INDEX_BYTES = 16 << 20  # index text parsed in a helper process from this size on (~160,000 samples)
INDEX_PIECE_BYTES = 1 << 20  # index text parsed per task: pieces of every shard spread over all cores (a piece parses at ~13x its size: threads x piece bounds the transient; 256 KB ones cost 1.4x the CPU at 1M samples)


@dataclass(frozen=True)
class Sample:
    """Where one sample's members lie in its shard: ``members`` is ((ext, offset, size), ...),
    ``names`` the member names the index gives (in the same order), ``number`` its line in the index
    (from 0)."""

    shard: int
    key: str
    members: tuple
    start: int  # first data byte of the sample in the tar
    end: int  # one past its last data byte
    names: tuple = ()
    number: int = -1


@dataclass(frozen=True)
class RemoteManifest(Manifest):
    """A manifest read from ``url`` (s3://bucket/prefix): ``path`` gives confined object URLs.
    Confinement is checked as for a folder, against a virtual root named after the URL."""

    url: str = ""

    def path(self, rel: str) -> str:  # type: ignore[override]
        super().path(rel)
        return f"{self.url}/{rel}"


def open_manifest(root: str | os.PathLike, version: int | None = None) -> Manifest:
    """Read and validate the manifest of a folder or of ``s3://bucket/prefix``: the latest version, or
    ``version=N`` (its immutable ``manifest.vN.json``: what this reader reads stays exactly version N
    while later versions are published beside it)."""
    if not object_store.is_remote(root):
        manifest = read_manifest(root, version)  # refuses a manifest over the size cap unread
        check_declared_counts(manifest.data, lambda rel: _local_size(manifest.path(rel)), str(manifest.root))
        return manifest
    url = str(root).rstrip("/")

    def read(name: str) -> bytes | None:
        try:  # at most the cap + 1 bytes: an object over the cap is refused, never read whole
            raw = object_store.read_range(f"{url}/{name}", 0, manifest_cap() + 1)
        except FileNotFoundError:
            return None
        check_manifest_size(len(raw), f"{url}/{name}")
        return raw

    name, raw = read_version(read, version, url)
    try:
        data = json.loads(raw)
    except ValueError as exc:
        raise ManifestError(f"{url}/{name}: not valid JSON ({exc})") from None
    manifest = RemoteManifest(Path("/", *object_store.split_url(url)), data, url)
    manifest.validate()
    check_number(data, version, f"{url}/{name}")
    declared = {s.get(key): s.get(size) for s in data["shards"] for key, size in (("path", "bytes"),
                                                                                 ("index", "index_bytes"))}
    check_declared_counts(data, lambda rel: declared.get(rel) if isinstance(declared.get(rel), int) else None,
                          url)  # the sizes the manifest declares (one HEAD per shard is not spent here)
    return manifest


def _local_size(path) -> int | None:
    try:
        return os.stat(path).st_size
    except OSError:
        return None


def open_webdataset(root: str | os.PathLike, modality: str = "images", version: int | None = None) -> Manifest:
    """Read and validate the manifest (latest, or ``version``); require a WebDataset of ``modality``
    with index files."""
    manifest = open_manifest(root, version)
    if manifest.format != "webdataset":
        raise ManifestError(f"{manifest.root}: format {manifest.format!r}, this reader reads 'webdataset'")
    if manifest.modality != modality:
        raise ManifestError(f"{manifest.root}: modality {manifest.modality!r}, this reader reads {modality!r}")
    for shard in manifest.shards:
        if not shard.index:
            raise ManifestError(f"{manifest.root}: shard {shard.path} has no index file")
    return manifest


def image_extensions(manifest: Manifest) -> list[str]:
    """The image member extensions of the dataset (fields typed ``image`` or ``image/...``), sorted."""
    exts = sorted(ext for ext, kind in manifest.fields.items()
                  if isinstance(kind, str) and (kind == "image" or kind.startswith("image/")))
    if not exts:
        raise ManifestError(f"{manifest.root}: the manifest names no image field ({sorted(manifest.fields)})")
    return exts


def dali_misread_refusal(manifest: Manifest) -> str | None:
    """Why DALI must not read this image dataset: it holds images DALI's decoder reads without an error but
    with other pixels than the PyTorch readers (the producer counts them in ``stats.dali_misreads``:
    ``repack.transforms.image_check.dali_misread``). None where there are none."""
    misreads = (manifest.data.get("stats") or {}).get("dali_misreads") or {}
    counted = {str(kind): n for kind, n in misreads.items() if isinstance(n, int) and n > 0} \
        if isinstance(misreads, dict) else {}
    if not counted:
        return None
    kinds = ", ".join(f"{n} {kind}" for kind, n in sorted(counted.items()))
    return (f"{manifest.root}: holds images DALI's decoder reads with other pixels than the PyTorch readers ({kinds}: "
            "DALI puts a gray+alpha TIFF's alpha in the green channel); repack with --normalize (every image becomes "
            "a baseline JPEG) or use the PyTorch reader")


def is_labeled(manifest: Manifest) -> bool:
    """True when samples carry a ``.cls`` member."""
    return "cls" in manifest.fields


def shard_files(manifest: Manifest) -> tuple[list[str], list[str]]:
    """Tar and index locations (absolute paths, or s3:// URLs), in manifest order (confined to the root)."""
    shards = manifest.shards
    return [str(manifest.path(s.path)) for s in shards], [str(manifest.path(s.index)) for s in shards]


def read_index_columns(manifest: Manifest, shards: list[int] | None = None) -> IndexColumns:
    """The index files of ``shards`` (default: all, in manifest order) as one ``IndexColumns``
    (``read_shared_index`` without the mapping)."""
    return read_shared_index(manifest, shards)[0]


def read_shared_index(manifest: Manifest, shards: list[int] | None = None) -> tuple[IndexColumns, Any]:
    """(the index files of ``shards`` (default: all, in manifest order) as one ``IndexColumns``, the
    shared mapping its columns view or None): ``SharedIndex(manifest, shards).get()``."""
    return SharedIndex(manifest, shards).get()


class SharedIndex:
    """The index files of ``shards`` of a dataset (default: all, in manifest order) as one
    ``IndexColumns``, for the readers. Local index files of at least ``HELPER_MIN_INDEX_BYTES`` in all
    are parsed by a helper process into shared memory (``pipelines.index_process``: the parse threads'
    heap never reaches this process, so DataLoader workers forked from it do not map it) that runs on
    while this process goes on: ``get()`` waits for it, here or in a process forked from here (a
    DataLoader worker), and raises what the parse found (a ``ManifestError`` naming the index file).
    Others are parsed here, at once (``parse_index_files``), and all of them, with a warning, where the
    helper cannot run. Pickled (a spawned worker), it holds the columns by value."""

    def __init__(self, manifest: Manifest, shards: list[int] | None = None) -> None:
        entries = manifest.data["shards"]
        shards = list(range(len(entries))) if shards is None else shards
        self.where = manifest.where
        self._paths = [manifest.path(entries[s]["index"]) for s in shards]
        self._counts = [int(entries[s]["samples"]) for s in shards]
        self._pending: index_process.PendingIndex | None = None
        self._done: tuple[IndexColumns, Any] | None = None
        self._lock = (os.getpid(), threading.Lock())  # one waiter per process resolves the helper's answer
        paths = self._paths
        if (paths and index_process.available() and not any(object_store.is_remote(p) for p in paths)
                and sum(_local_size(p) or 0 for p in paths) >= HELPER_MIN_INDEX_BYTES):
            try:
                self._pending = index_process.PendingIndex([str(p) for p in paths], self._counts)
            except index_process.HelperUnavailable as exc:
                warnings.warn(f"{self.where}: {exc}; parsing the index in this process", stacklevel=3)
        self.in_helper = self._pending is not None  # known at once: nothing waits for the parse
        if self._pending is None:
            self._done = (parse_index_files(paths, self._counts), None)

    def get(self) -> tuple[IndexColumns, Any]:
        """(the columns, the shared mapping they view or None), waiting for the helper if it still parses."""
        if self._done is None:
            if self._lock[0] != os.getpid():  # a forked process: the lock as copied may be held by a thread it lacks
                self._lock = (os.getpid(), threading.Lock())
            with self._lock[1]:
                if self._done is None:
                    try:
                        self._done = self._pending.result()
                    except index_process.HelperUnavailable as exc:
                        warnings.warn(f"{self.where}: {exc}; parsing the index in this process", stacklevel=4)
                        self._done = (parse_index_files(self._paths, self._counts), None)
                    self._pending = None
        return self._done

    def __getstate__(self) -> dict:
        columns, _ = self.get()  # by value: the mapping and the helper stay in this process
        return {**self.__dict__, "_pending": None, "_done": (columns, None), "_lock": None}

    def __setstate__(self, state: dict) -> None:
        self.__dict__.update(state, _lock=(os.getpid(), threading.Lock()))


def parse_index_files(paths: list, counts: list[int], allocate: Allocate | None = None) -> IndexColumns:
    """The index files ``paths`` (each to hold ``counts[i]`` samples) as one ``IndexColumns``: the files
    read by ``INDEX_THREADS`` threads (on s3://, concurrent GETs), their text cut into pieces of whole
    lines (``INDEX_PIECE_BYTES``; small files joined into pieces of that size: ``shard_index.index_jobs``)
    parsed on one thread per usable CPU (numpy parses with the GIL released: a dataset of few large
    shards still parses on every core), the pieces joined once (into arrays from ``allocate``:
    ``shard_index.concat``), each copied into place on those threads. ``files_allowed(INDEX_FILES_AT_ONCE)``
    files are read and parsed at a time (``shard_index.parse_index_set``), the small ones read rather than
    mapped: a mapped file holds a descriptor, and a dataset of more shards than the process may open
    files (``ulimit -n``, 1,024 by default) must still open."""
    small = small_index_bytes(INDEX_PIECE_BYTES)  # joined with their neighbours: read, not mapped
    threads = min(usable_cpus(), max(1, len(paths)))
    pool = ThreadPoolExecutor(threads, thread_name_prefix="repack-index") if threads > 1 else None
    readers = ThreadPoolExecutor(max(1, min(INDEX_THREADS, len(paths))), thread_name_prefix="repack-index-read")
    try:  # parsed, and the pieces copied into place, on the same threads
        columns = parse_index_set(lambda i: index_bytes(paths[i], small), [str(p) for p in paths], counts,
                                  INDEX_PIECE_BYTES, files_allowed(INDEX_FILES_AT_ONCE), readers.map, _parse_and_unmap,
                                  pool.map if pool else map, allocate)
    finally:
        readers.shutdown()
        if pool is not None:
            pool.shutdown()
    release_free_heap()
    return columns


def _parse_and_unmap(job: IndexJob) -> IndexColumns:
    parsed = parse_job(job)
    _unmap_text(job.text)
    for body in job.bodies:  # copied into the job's text
        _unmap_text(body)
    return parsed


def _unmap_text(piece: np.ndarray) -> None:
    """Unmap this process's pages of a parsed piece of a memory-mapped index file (the page cache keeps
    them; a neighbouring piece's reader maps a shared page again): the parse then holds about one
    piece of text per thread, not every file's (at 10M synthetic samples: 577 MB of text in its RSS)."""
    base = piece.base
    while isinstance(base, np.ndarray):
        base = base.base
    text = base.obj if isinstance(base, memoryview) else base
    if not isinstance(text, mmap.mmap) or text.closed or not len(piece):
        return
    start = piece.ctypes.data - np.frombuffer(text, dtype=np.uint8).ctypes.data
    lo = start - start % mmap.PAGESIZE
    text.madvise(mmap.MADV_DONTNEED, lo, start + len(piece) - lo)


def index_bytes(path, read_below: int = 0) -> bytes | mmap.mmap:
    """An index file's bytes: a local file memory-mapped (page cache, not the heap: a large ``bytes``
    freed raises glibc's mmap threshold, and the parse's working arrays then stay resident in the
    threads' heaps, which forked DataLoader workers map), or read when under ``read_below`` bytes (a
    mapping holds a file descriptor while it lives); an s3:// object read whole."""
    if object_store.is_remote(path):
        return object_store.read_bytes(path)
    with open_regular(path) as fh:  # a FIFO in its place is refused, never waited on
        size = os.fstat(fh.fileno()).st_size
        if size < read_below:
            return fh.read()
        return mmap.mmap(fh.fileno(), size, access=mmap.ACCESS_READ) if size else b""


def release_free_heap() -> None:
    """Hand the heap that parsing freed back to the system (glibc's ``malloc_trim``; elsewhere nothing):
    a DataLoader worker forked next maps every resident page of this process (measured at 200,000
    samples: 356 bytes a sample resident after parsing, 144 after the trim)."""
    try:
        ctypes.CDLL(None).malloc_trim(0)
    except (OSError, AttributeError):
        pass


def sample_at(index: IndexColumns, sample: int, shard: int | None = None) -> Sample:
    """Global sample ``sample`` of ``index`` as a ``Sample`` (its shard number: ``shard``, default the
    index's own numbering)."""
    members = range(int(index.first_member[sample]), int(index.first_member[sample + 1]))
    spans = tuple((index.exts[int(index.ext[m])], int(index.offset[m]), int(index.size[m])) for m in members)
    own = int(index.shard_of(np.array([sample]))[0])
    return Sample(own if shard is None else shard, index.key(sample), spans, min(m[1] for m in spans),
                  max(m[1] + m[2] for m in spans), index.names(sample), sample - int(index.shard_starts[own]))


def read_index(manifest: Manifest, shard: int, start: int = 0, stop: int | None = None) -> list[Sample]:
    """Samples ``start:stop`` of shard number ``shard``, from its index file."""
    index = read_index_columns(manifest, [shard])
    return [sample_at(index, i, shard) for i in range(index.samples)[start:stop]]


CHECKSUMS_MAGIC = b"RPKCRC1\n"  # the per-sample checksum file (layout: repack/sinks/sample_checksums.py)


def missing_checksums(manifest: Manifest) -> list[str]:
    """The shards (paths) whose manifest entry names no per-sample checksum file."""
    return [entry["path"] for entry in manifest.data["shards"] if not entry.get("checksums")]


def read_checksums(manifest: Manifest, shard: int) -> np.ndarray:
    """The per-sample crc32s of shard number ``shard`` (uint32, one per index line), from its ``.crc``
    side file: 8 bytes magic, uint64 sample count, then uint32 per sample, all little-endian."""
    entry = manifest.data["shards"][shard]
    if not entry.get("checksums"):
        raise ManifestError(f"{manifest.where}: shard {entry['path']} has no per-sample checksum file")
    path = manifest.path(entry["checksums"])
    raw = object_store.read_bytes(path)
    samples = int(entry["samples"])
    if (len(raw) != 16 + 4 * samples or raw[:8] != CHECKSUMS_MAGIC
            or int.from_bytes(raw[8:16], "little") != samples):
        raise ManifestError(f"{path}: not the per-sample checksum file of {samples} samples (run `repack verify`)")
    return np.frombuffer(raw, dtype="<u4", offset=16)


def segments(counts: list[int], order: list[int], start: int, stop: int) -> list[tuple[int, int, int]]:
    """Map positions ``start:stop`` of the shards concatenated in ``order`` to (shard, local start, local stop)."""
    out = []
    base = 0
    for shard in order:
        n = counts[shard]
        lo, hi = max(start, base), min(stop, base + n)
        if lo < hi:
            out.append((shard, lo - base, hi - base))
        base += n
        if base >= stop:
            break
    return out


def parse_label(data: bytes) -> int:
    """A ``.cls`` member (ASCII decimal digits, zero-padded) -> int; never unpickles anything."""
    if not data or not data.isdigit():
        raise ValueError(f"a .cls member must be ASCII digits, got {bytes(data[:20])!r}")
    return int(data)


PILLOW_PIXELS = 89_478_485  # Pillow's default MAX_IMAGE_PIXELS (its bomb error at twice as many)


def checked_pixels(manifest) -> int | None:
    """The ``--max-pixels`` an images dataset was checked with where a reader's Pillow must be let decode more
    than its default (``pil_images.allow_pixels``), else None."""
    options = (manifest.data.get("created_by") or {}).get("options") or {}
    checked = options.get("max_pixels")
    return checked if isinstance(checked, int) and not isinstance(checked, bool) and checked > PILLOW_PIXELS else None
