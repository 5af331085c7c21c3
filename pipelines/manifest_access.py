"""Shared helpers for the readers: open a WebDataset manifest, parse DALI index files, split work.

Imports ``repack.manifest`` and nothing else from repack. Every file path comes from the
manifest through ``Manifest.path`` (confined to the dataset root). A root may be a folder or
``s3://bucket/prefix`` (``RemoteManifest``: paths are URLs, read through ``object_store``).

An index file (``.idx``, DALI's format v1.2, written by repack next to each tar) has a header
line ``v1.2 <samples>`` and one line per sample: groups of four tokens
``<ext> <data offset> <size> <member name>``, the members of a sample being adjacent in the tar.
The readers use it to ``pread`` exactly the bytes of the samples they own.
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from pipelines import object_store
from pipelines.sample_order import balanced as split_range  # noqa: F401  (the readers' one split rule)
from repack.manifest import Manifest, ManifestError, read_manifest
from repack.manifest.caps import check_declared_counts, check_manifest_size, manifest_cap
from repack.manifest.versions import check_number, read_version


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


def is_labeled(manifest: Manifest) -> bool:
    """True when samples carry a ``.cls`` member."""
    return "cls" in manifest.fields


def shard_files(manifest: Manifest) -> tuple[list[str], list[str]]:
    """Tar and index locations (absolute paths, or s3:// URLs), in manifest order (confined to the root)."""
    shards = manifest.shards
    return [str(manifest.path(s.path)) for s in shards], [str(manifest.path(s.index)) for s in shards]


def parse_index_lines(text: str, where: str) -> list[str]:
    """The sample lines of an index file, after checking its header."""
    lines = text.splitlines()
    if not lines:
        raise ManifestError(f"{where}: empty index file")
    head = lines[0].split()
    if len(head) != 2 or head[0] != "v1.2" or not head[1].isdigit() or int(head[1]) != len(lines) - 1:
        raise ManifestError(f"{where}: not a v1.2 index with a matching sample count")
    return lines[1:]


def parse_sample(line: str, shard: int, where: str, number: int = -1) -> Sample:
    """One index line (line ``number`` of the samples) -> Sample."""
    tokens = line.split(" ")
    if not tokens or len(tokens) % 4:
        raise ManifestError(f"{where}: malformed index line {line[:80]!r}")
    members = []
    names = []
    key = None
    for i in range(0, len(tokens), 4):
        ext, off, size, name = tokens[i:i + 4]
        if not (off.isdigit() and size.isdigit()):
            raise ManifestError(f"{where}: malformed index line {line[:80]!r}")
        members.append((ext, int(off), int(size)))
        names.append(name)
        key = key or name.split(".", 1)[0]
    return Sample(shard, key, tuple(members), min(m[1] for m in members), max(m[1] + m[2] for m in members),
                  tuple(names), number)


def read_index(manifest: Manifest, shard: int, start: int = 0, stop: int | None = None) -> list[Sample]:
    """Samples ``start:stop`` of shard number ``shard``, from its index file."""
    entry = manifest.data["shards"][shard]
    path = manifest.path(entry["index"])
    lines = parse_index_lines(object_store.read_bytes(path).decode("ascii"), str(path))
    if len(lines) != int(entry["samples"]):
        raise ManifestError(f"{path}: {len(lines)} samples, the manifest says {entry['samples']}")
    first = start or 0
    return [parse_sample(line, shard, str(path), first + i) for i, line in enumerate(lines[start:stop])]


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
