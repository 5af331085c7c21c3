"""`repack remove` for a webdataset dataset: each shard holding a named sample rewritten without it
(see repack.lifecycle.remove).

Finding them reads no shard that holds none: ``repack.lifecycle.locate`` picks the shards from the
record of the inputs (named by source) or the key (named by key) and each shard's index span; where
it cannot, every shard is looked at. In a shard, the samples come from its index (the one the manifest
records, else rebuilt from the tar's headers; ``repack.lifecycle.shard_index``), and a sample's source
from its ``.json`` member, read alone (a dataset packed with ``--no-sample-json``: from the record of the
inputs, by the position its key starts with). A shard is rewritten by copying the byte ranges of the kept
samples (headers and data, untouched and in order; each header checked to name its member) into
``<stem>-vN.tar``, with a new index and the kept samples' checksums (from the old ``.crc`` when it is
the one the manifest records, else computed); nothing is decoded or re-encoded.
"""

from __future__ import annotations

import hashlib
import json
import os
from pathlib import Path
from typing import Callable

import numpy as np

from repack.errors import UsageError
from repack.lifecycle.input_columns import InputColumns, decode_names
from repack.lifecycle.locate import key_position, shards_holding, wanted_positions
from repack.lifecycle.rewrite import Rewrite
from repack.lifecycle.shard_index import ShardIndex, parse_index
from repack.manifest import Manifest
from repack.sinks.sample_checksums import HEADER, MAGIC
from repack.sinks.tar_format import BLOCK, end_of_archive, index_from_lines, index_from_tar
from repack.sinks.webdataset import publish_shard

COPY_BYTES = 4 << 20  # one read of kept samples at most


def rewrite_tar_shards(store, out: Path, current: dict, spec, number: int,
                       known: InputColumns | None = None) -> Rewrite:
    """Webdataset: each shard holding a named sample rewritten as ``<stem>-vN.tar`` (+ index) without it
    (``known``: the record of the inputs, to find the shards of sources without reading the others)."""
    manifest = Manifest(out, current)
    wanted = set(spec.names)
    positions = wanted_positions(spec.by, wanted, known)
    candidates = None if positions is None else shards_holding(store, current["shards"], positions)
    wanted_at = None if positions is None else set(positions.tolist())
    if "json" in (current.get("fields") or {}):
        source_of = _json_source
    elif spec.by == "sources" and positions is None:
        raise UsageError(f"{store.url}: its samples have no .json member (packed with --no-sample-json), so their "
                         "sources come from the record of the inputs (.repack/inputs-v*.npz), which is missing or "
                         "holds no positions; remove them by key (--keys) instead")
    else:
        source_of = _recorded_source(known)
    found: set[str] = set()
    sources: set[str] = set()  # of the removed samples, also when named by key
    shards: list[dict] = []
    rewritten: dict[str, str | None] = {}
    removed_classes: dict[str, int] = {}
    names_by_index = {index: name for name, index in (current.get("classes") or {}).items()}
    for entry in current["shards"]:
        if candidates is not None and entry["path"] not in candidates:
            shards.append(entry)
            continue
        local = manifest.path(entry["path"])
        if store.remote:
            store.fetch(entry["path"], local, entry["sha256"])
        try:
            with open(local, "rb", buffering=0) as tar:
                index = _shard_index(store, entry, tar)
                hit = _hits(tar, index, spec.by, wanted, wanted_at, source_of)
                if not hit:
                    shards.append(entry)
                    continue
                for at, source in hit.items():
                    found.add(index.key(at) if spec.by == "keys" else source)
                    if source is not None:
                        sources.add(source)
                    cls = _member_bytes(tar, index.members(at), "cls")
                    name = names_by_index.get(int(cls)) if cls is not None and cls.strip().isdigit() else ""
                    removed_classes[name] = removed_classes.get(name, 0) + 1
                keep = np.ones(index.samples, bool)
                keep[list(hit)] = False
                stem = entry["path"][:-len(".tar")] + f"-v{number}"
                new = _copy_kept(tar, index, keep, out, stem, entry["path"], _old_checksums(store, entry, index))
        finally:
            if store.remote:
                local.unlink(missing_ok=True)
        rewritten[entry["path"]] = new["path"] if new else None
        if new and store.remote:
            store.publish(new["path"], out / new["path"], new["sha256"])
            store.publish(new["index"], out / new["index"])
            store.publish(new["checksums"], out / new["checksums"])
        if new:
            shards.append({**{k: v for k, v in entry.items() if k not in ("path", "index")}, **new})
    totals = {"bytes": sum(s["bytes"] for s in shards), "shards": len(shards)}
    return Rewrite(shards, frozenset(found), rewritten, removed_classes, {"totals": totals}, frozenset(sources))


def _shard_index(store, entry: dict, tar) -> ShardIndex:
    """The shard's index (the manifest's, checked by its sha256; else rebuilt from the tar's headers)."""
    raw = store.read_bytes(entry["index"]) if entry.get("index") else None
    index = parse_index(raw, entry.get("index_sha256")) if raw is not None else None
    if index is None:
        with open(tar.name, "rb") as fh:
            index = parse_index(index_from_tar(fh).encode())
    if index is None or not index.adjacent():
        raise UsageError(f"{store.url}/{entry['path']}: its samples are not laid out as repack writes them (run "
                         "repack verify)")
    return index


def _old_checksums(store, entry: dict, index: ShardIndex) -> np.ndarray | None:
    """The per-sample checksums of the shard (uint32 per sample), when its ``.crc`` is the one the
    manifest records and counts its samples; else None (they are computed again)."""
    if not entry.get("checksums") or not entry.get("checksums_sha256"):
        return None
    raw = store.read_bytes(entry["checksums"])
    if raw is None or hashlib.sha256(raw).hexdigest() != entry["checksums_sha256"] or len(raw) < HEADER.size:
        return None
    magic, count = HEADER.unpack_from(raw)
    if magic != MAGIC or count != index.samples or len(raw) != HEADER.size + 4 * count:
        return None
    return np.frombuffer(raw, "<u4", count, HEADER.size)


def _hits(tar, index: ShardIndex, by: str, wanted: set[str], wanted_at: set[int] | None,
          source_of: SourceOf) -> dict[int, str | None]:
    """{sample number: its source} of the named samples in the shard. Named by source with known
    positions, only the samples at those positions are read, and each must name its source: a record
    that disagrees with the shard is an error, never a wrong removal."""
    hit: dict[int, str | None] = {}
    for at, key in enumerate(index.keys()):
        if wanted_at is not None and key_position(key) not in wanted_at:
            continue
        if by == "keys":
            if key in wanted:
                hit[at] = source_of(tar, index, at)
            continue
        source = source_of(tar, index, at)
        if source in wanted:
            hit[at] = source
        elif wanted_at is not None:
            raise UsageError(f"{tar.name}: sample {key} is the source {source!r}, the dataset's record of its "
                             "inputs says otherwise; move .repack/inputs-v*.npz aside and remove again (every "
                             "shard is then read)")
    return hit


def _member_bytes(tar, members, ext: str) -> bytes | None:
    for member_ext, offset, size, name in members:
        if member_ext == ext:
            data = os.pread(tar.fileno(), size, offset)
            if len(data) != size:
                raise UsageError(f"{tar.name}: ends inside member {name} (run repack verify)")
            return data
    return None


SourceOf = Callable[[object, ShardIndex, int], "str | None"]  # (tar, index, sample number) -> its source


def _recorded_source(known: InputColumns | None) -> SourceOf:
    """A sample's source from the record of the inputs, by the position its key starts with (the samples
    of a dataset without a ``.json`` member); None where the record does not hold it."""
    if known is None:
        return lambda tar, index, at: None
    held = np.flatnonzero(known.position >= 0)
    order = held[np.argsort(known.position[held], kind="stable")]
    positions = known.position[order]

    def source_of(tar, index: ShardIndex, at: int) -> str | None:
        position = key_position(index.key(at))
        if position is None:
            return None
        row = int(np.searchsorted(positions, position))
        if row == len(positions) or positions[row] != position:
            return None
        return decode_names(known.names[order[row:row + 1]])[0]

    return source_of


def _json_source(tar, index: ShardIndex, at: int) -> str | None:
    """A sample's source: the ``path`` of its ``.json`` member."""
    raw = _member_bytes(tar, index.members(at), "json")
    if raw is None:
        return None
    try:
        path = json.loads(raw).get("path")
    except (ValueError, AttributeError):
        return None
    return path if isinstance(path, str) else None


def _copy_kept(tar, index: ShardIndex, keep: np.ndarray, out: Path, stem: str, shard: str,
               checksums: np.ndarray | None) -> dict | None:
    """Write the kept samples' bytes (header and data of each member, as they are) as shard ``stem``;
    its entry (None when nothing is kept)."""
    kept = np.flatnonzero(keep)
    if not len(kept):
        return None
    starts, ends = index.spans()
    tmp = out / f".{stem}.tar.tmp-{os.getpid()}"
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
    sha = hashlib.sha256()
    shift = np.zeros(index.samples, np.int64)  # new offset - old offset, per kept sample
    written = 0
    try:
        for run in _runs(kept, starts, ends):
            start, end = int(starts[run[0]]), int(ends[run[-1]])
            data = os.pread(tar.fileno(), end - start, start)
            if len(data) != end - start:
                raise UsageError(f"{shard}: ends at byte {start + len(data)}, inside its samples (run repack verify)")
            _check_headers(data, start, index, run, shard)
            view = memoryview(data)
            while view:
                view = view[os.write(fd, view):]
            sha.update(data)
            shift[run] = written - start
            written += len(data)
        tail = end_of_archive(written)
        os.write(fd, tail)
        sha.update(tail)
    except BaseException:
        os.close(fd)
        tmp.unlink(missing_ok=True)
        raise
    sums = None if checksums is None else HEADER.pack(MAGIC, len(kept)) + checksums[kept].astype("<u4").tobytes()
    return publish_shard(out, stem, fd, tmp, written + len(tail), sha, _index_text(index, kept, shift), len(kept),
                         checksums=sums)


def _runs(kept: np.ndarray, starts: np.ndarray, ends: np.ndarray) -> list[np.ndarray]:
    """The kept samples in runs of adjacent byte ranges, each at most COPY_BYTES (or one sample)."""
    breaks = np.flatnonzero(starts[kept[1:]] != ends[kept[:-1]]) + 1
    runs: list[np.ndarray] = []
    for run in np.split(kept, breaks):
        while len(run):
            stop = max(1, int(np.searchsorted(ends[run] - starts[run[0]], COPY_BYTES, side="right")))
            runs.append(run[:stop])
            run = run[stop:]
    return runs


def _check_headers(data: bytes, start: int, index: ShardIndex, run: np.ndarray, shard: str) -> None:
    """Each member's header in ``data`` (the tar from byte ``start``) names that member."""
    rows = np.arange(index.first[run[0]], index.first[run[-1] + 1])  # a run's samples are consecutive
    fields = index.name_fields(rows, 101)  # a byte in column 100: a name longer than a header holds
    if fields[:, 100].any():
        raise UsageError(f"{shard}: a member name is longer than a ustar header holds (run repack verify)")
    expected = fields[:, :100]
    at = (index.offset[rows] - BLOCK - start)[:, None] + np.arange(100)
    if not np.array_equal(np.frombuffer(data, np.uint8)[at], expected):
        raise UsageError(f"{shard}: a header does not name the member its index says (run repack verify)")


def _index_text(index: ShardIndex, kept: np.ndarray, shift: np.ndarray) -> str:
    """The new shard's DALI index: the kept samples' lines, data offsets moved by their sample's shift."""
    counts = np.diff(index.first)
    rows = np.repeat(index.first[kept] - np.cumsum(counts[kept]) + counts[kept], counts[kept]) + \
        np.arange(int(counts[kept].sum()))  # the kept samples' member rows, in order
    moved = map(str, (index.offset[rows] + np.repeat(shift[kept], counts[kept])).tolist())
    members = map(" ".join, zip(index.exts(rows), moved, map(str, index.size[rows].tolist()), index.names(rows)))
    ends = set((np.cumsum(counts[kept]) - 1).tolist())  # the last member row of each kept sample
    text = "".join(member + ("\n" if at in ends else " ") for at, member in enumerate(members))
    return index_from_lines(text[:-1].split("\n"))
