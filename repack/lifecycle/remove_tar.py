"""`repack remove` for a webdataset dataset: each shard holding a named sample rewritten without it
(see repack.lifecycle.remove).

Finding them reads no shard that holds none: ``repack.lifecycle.locate`` picks the shards from the
record of the inputs (named by source) or the key (named by key) and each shard's index span; where
it cannot, every shard is looked at. In a shard, the samples come from its index (the one the manifest
records, else rebuilt from the tar's headers), and a sample's source from its ``.json`` member, read
alone. A shard is rewritten by copying the byte ranges of the kept samples (headers and data, untouched
and in order: each header checked to name its member) into ``<stem>-vN.tar``, with a new index and
per-sample checksums; nothing is decoded or re-encoded.
"""

from __future__ import annotations

import hashlib
import json
import os
from pathlib import Path

from repack.errors import UsageError
from repack.lifecycle.input_columns import InputColumns
from repack.lifecycle.locate import index_samples, key_position, shards_holding, wanted_positions
from repack.lifecycle.rewrite import Rewrite
from repack.manifest import Manifest
from repack.sinks.tar_format import BLOCK, end_of_archive, index_from_tar, index_from_lines
from repack.sinks.webdataset import publish_shard

COPY_BYTES = 4 << 20  # one read of kept samples at most


def rewrite_tar_shards(store, out: Path, current: dict, spec, number: int,
                       known: InputColumns | None = None) -> Rewrite:
    """Webdataset: each shard holding a named sample rewritten as ``<stem>-vN.tar`` (+ index) without it
    (``known``: the record of the inputs, to find the shards of sources without reading the others)."""
    manifest = Manifest(out, current)
    wanted = set(spec.names)
    positions = wanted_positions(spec.by, wanted, known)
    if positions is not None and not len(positions):
        return Rewrite(list(current["shards"]), frozenset(), {}, {}, {}, frozenset())
    candidates = None if positions is None else shards_holding(store, current["shards"], positions)
    wanted_at = None if positions is None else set(positions.tolist())
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
                samples = _shard_samples(store, entry, tar)
                hit = _hits(tar, samples, spec.by, wanted, wanted_at)
                if not hit:
                    shards.append(entry)
                    continue
                for at, source in hit.items():
                    found.add(samples[at][0] if spec.by == "keys" else source)
                    if source is not None:
                        sources.add(source)
                    cls = _member_bytes(tar, samples[at][1], "cls")
                    name = names_by_index.get(int(cls)) if cls is not None and cls.strip().isdigit() else ""
                    removed_classes[name] = removed_classes.get(name, 0) + 1
                stem = entry["path"][:-len(".tar")] + f"-v{number}"
                new = _copy_kept(tar, [s for at, s in enumerate(samples) if at not in hit], out, stem, entry["path"])
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


def _shard_samples(store, entry: dict, tar) -> list[tuple[str, list[tuple[str, int, int, str]]]]:
    """The shard's samples from its index (the manifest's, checked by its sha256; else rebuilt from the tar)."""
    raw = store.read_bytes(entry["index"]) if entry.get("index") else None
    samples = index_samples(raw, entry) if raw is not None else None
    if samples is None:
        with open(tar.name, "rb") as fh:
            samples = index_samples(index_from_tar(fh).encode(), {})
    if samples is None:
        raise UsageError(f"{store.url}/{entry['path']}: its samples cannot be listed (run repack verify)")
    return samples


def _hits(tar, samples, by: str, wanted: set[str], wanted_at: set[int] | None) -> dict[int, str | None]:
    """{sample number: its source} of the named samples in the shard. Named by source with known
    positions, only the samples at those positions are read, and each must name its source: a record
    that disagrees with the shard is an error, never a wrong removal."""
    hit: dict[int, str | None] = {}
    for at, (key, members) in enumerate(samples):
        if wanted_at is not None and key_position(key) not in wanted_at:
            continue
        if by == "keys":
            if key in wanted:
                hit[at] = _source(tar, members)
            continue
        source = _source(tar, members)
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


def _source(tar, members) -> str | None:
    raw = _member_bytes(tar, members, "json")
    if raw is None:
        return None
    try:
        path = json.loads(raw).get("path")
    except (ValueError, AttributeError):
        return None
    return path if isinstance(path, str) else None


def _copy_kept(tar, kept, out: Path, stem: str, shard: str) -> dict | None:
    """Write the ``kept`` samples' bytes (header and data of each member, as they are) as shard ``stem``;
    its entry (None when nothing is kept)."""
    if not kept:
        return None
    spans = [_span(sample, shard) for sample in kept]
    tmp = out / f".{stem}.tar.tmp-{os.getpid()}"
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
    sha = hashlib.sha256()
    lines: list[str] = []
    written = 0
    try:
        run_start, run_end, run = spans[0][0], spans[0][0], []
        for (start, end), sample in zip(spans, kept):
            if start != run_end or end - run_start > COPY_BYTES:
                written = _copy_run(tar, fd, sha, run_start, run_end, run, written, lines, shard)
                run_start, run = start, []
            run.append(sample)
            run_end = end
        written = _copy_run(tar, fd, sha, run_start, run_end, run, written, lines, shard)
        tail = end_of_archive(written)
        os.write(fd, tail)
        sha.update(tail)
    except BaseException:
        os.close(fd)
        tmp.unlink(missing_ok=True)
        raise
    return publish_shard(out, stem, fd, tmp, written + len(tail), sha, index_from_lines(lines), len(kept))


def _span(sample, shard: str) -> tuple[int, int]:
    """[first header, end of last member's padding) of a sample whose members are adjacent."""
    members = sample[1]
    start = members[0][1] - BLOCK
    at = start
    for _, offset, size, name in members:
        if offset != at + BLOCK or size < 0:
            raise UsageError(f"{shard}: sample {sample[0]} is not laid out as repack writes it (member {name} at "
                             f"{offset}); run repack verify")
        at = offset + size + (-size % BLOCK)
    return start, at


def _copy_run(tar, fd: int, sha, start: int, end: int, samples, written: int, lines: list[str], shard: str) -> int:
    """Copy bytes [start, end) of the tar (the ``samples``, adjacent) to ``fd`` at ``written``; their index
    lines go to ``lines``; returns the new end."""
    if not samples:
        return written
    data = os.pread(tar.fileno(), end - start, start)
    if len(data) != end - start:
        raise UsageError(f"{shard}: ends at byte {start + len(data)}, inside its samples (run repack verify)")
    shift = written - start
    for key, members in samples:
        parts = []
        for ext, offset, size, name in members:
            header = offset - BLOCK - start
            encoded = name.encode("ascii")
            if data[header:header + len(encoded)] != encoded or (len(encoded) < 100 and data[header + len(encoded)]):
                raise UsageError(f"{shard}: the header at byte {offset - BLOCK} does not name {name} (run repack "
                                 "verify)")
            parts.append(f"{ext} {offset + shift} {size} {name}")
        lines.append(" ".join(parts))
    view = memoryview(data)
    while view:
        view = view[os.write(fd, view):]
    sha.update(data)
    return written + len(data)
