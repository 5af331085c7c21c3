"""``verify_shard`` of the webdataset format: one tar shard, its ``.idx`` and its ``.crc`` against the
manifest entry.

First the cheap way (``tar_check``): the index's columns checked against every member header at once
with numpy, the per-sample checksums recomputed from those columns. A shard that passes is exactly
what repack writes; anything else (damage, or another tool's header bytes) is walked member by member
(``tar_format.read_archive``), which names each problem as it finds it.

``TarShardParts`` is the same cheap check cut into parts of the index for ``repack verify``'s pool
(``repack.lifecycle.verify_shards``): each part maps the tar and reads only the members its lines name,
the tar's sha256 is another task, and a shard whose parts do not all pass goes through
``verify_tar_shard`` whole.
"""

from __future__ import annotations

import dataclasses
import hashlib
import mmap
import os
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import numpy as np

from repack.sinks.checks import check_file, sha256_file
from repack.sinks.sample_checksums import sample_checksums
from repack.sinks.tar_check import PartCheck, check_part, parts_agree
from repack.sinks.tar_format import BLOCK, index_from_members, read_archive, split_key, tail_problem


def verify_tar_shard(root: Path, shard: dict, check) -> None:
    """Check one shard against its manifest entry; report problems through ``check``. The tar is hashed
    on a thread (hashlib releases the GIL) while its structure is checked."""
    with ThreadPoolExecutor(1, thread_name_prefix="repack-sha256") as hasher:
        hashing = hasher.submit(sha256_file, Path(root) / shard["path"])
        clean = matches_by_index(root, shard)
        if not check_file(root, shard["path"], shard["bytes"], shard["sha256"], check,
                          digest=lambda _: hashing.result()):
            return
    if not clean:
        verify_by_walk(root, shard, check)


PART_SAMPLES = 16384  # samples a part of a shard's check covers at most (``part_count``)
PART_BYTES = 256 << 20  # and archive bytes


class TarShardParts:
    """``repack verify``'s split of one tar shard's check over processes: ``parts(shard)`` parts of its
    index (``tar_check.check_part``: headers, names, layout, crc32s), each ``check``-ed on its own, and the
    tar's sha256 hashed by another task; ``passes`` joins them. A shard that does not pass is checked again
    whole (``verify_tar_shard``), which names its problems."""

    @staticmethod
    def parts(shard: dict, actual: int | None = None) -> int:
        """How many parts the shard's check is cut into (0: not split; the shard has no index); ``actual``: the
        tar's real size, which bounds what the declared samples and bytes may ask for (a sample takes at least
        a header block)."""
        if not shard.get("index"):
            return 0
        samples, size = max(1, int(shard.get("samples", 0))), int(shard.get("bytes", 0))
        if actual is not None:
            size = min(size, actual)
            samples = max(1, min(samples, actual // BLOCK))
        return min(samples, max(1, -(-samples // PART_SAMPLES), -(-size // PART_BYTES)))

    @staticmethod
    def check(root: Path, shard: dict, part: int, parts: int) -> tuple[dict | None, bytes]:
        """Part ``part`` of ``parts`` of the shard's check: (``PartCheck.summary()`` or None for no
        verdict, the part's key hashes, sorted: the uniqueness check of the dataset merges the sorted
        runs of all parts instead of sorting every key at once)."""
        found = check_shard_part(Path(root), shard, part, parts)
        return (None, b"") if found is None else (found.summary(), np.sort(found.key_hashes).tobytes())

    @staticmethod
    def classes(found: list[tuple[dict | None, bytes]]) -> list[list] | None:
        """[class index, samples, the class its first sample's .json names (None: not named)], by index, over the
        parts of a shard that ``passes`` (None: a part without a count: no ``.cls`` member, or one that is not
        a class index)."""
        parts = [summary for summary, _ in found if summary and summary.get("samples")]
        if not parts or any(summary.get("classes") is None for summary in parts):
            return None
        total: dict[int, int] = {}
        names: dict[int, str | None] = {}
        for summary in parts:
            for index, count in summary["classes"]:
                total[index] = total.get(index, 0) + count
            for index, name in summary.get("class_names") or ():
                names.setdefault(index, name)
        return [[index, total[index], names.get(index)] for index in sorted(total)]

    @staticmethod
    def passes(shard: dict, found: list[tuple[dict | None, bytes]], sha256: str | None) -> bool:
        """True when every part passed, the parts agree and hold the manifest's sample count, and the tar's
        sha256 is the manifest's."""
        if sha256 != shard["sha256"] or any(summary is None for summary, _ in found):
            return False
        parts = [PartCheck.from_summary(summary, hashes) for summary, hashes in found]
        return parts_agree(parts) and parts[0].count == shard["samples"]


def check_shard_part(root: Path, shard: dict, part: int, parts: int) -> PartCheck | None:
    """``tar_check.check_part`` of the shard's files under ``root`` (the tar mapped, not read), the
    manifest's size of the tar and size and sha256 of its checksums file included (the first part checks
    those); None is no verdict."""
    try:
        index = (root / shard["index"]).read_bytes()
        checksums = (root / shard["checksums"]).read_bytes() if shard.get("checksums") else None
        if part == 0 and not (as_recorded(index, shard, "index") and
                              (checksums is None or as_recorded(checksums, shard, "checksums"))):
            return None
        with open(root / shard["path"], "rb") as fh:
            size = os.fstat(fh.fileno()).st_size
            if size != shard["bytes"]:
                return None
            with (mmap.mmap(fh.fileno(), 0, access=mmap.ACCESS_READ) if size else _Empty()) as tar:
                found = check_part(tar, index, part, parts, checksums)
                return None if found is None else dataclasses.replace(found, offsets=None, keys=None)
    except (OSError, ValueError, IndexError, BufferError):  # unreadable, or shapes no canonical shard has:
        return None  # the walk names it


def as_recorded(data: bytes, shard: dict, side: str) -> bool:
    """A side file's bytes (``side``: "index", "checksums") are the size and sha256 the shard entry records
    for it (``<side>_bytes``, ``<side>_sha256``; a value the entry lacks is not compared)."""
    size, sha256 = shard.get(f"{side}_bytes"), shard.get(f"{side}_sha256")
    if side == "checksums" and size is None:
        return False  # every entry with a checksums file records its size
    return (size is None or len(data) == size) and (sha256 is None or hashlib.sha256(data).hexdigest() == sha256)


def matches_by_index(root: Path, shard: dict) -> bool:
    """True when the tar, its index and its checksums file are exactly what repack writes for the
    manifest entry (sizes and sha256 of the side files included); False is no verdict."""
    if not shard.get("index"):
        return False
    found = check_shard_part(Path(root), shard, 0, 1)
    return found is not None and parts_agree([found]) and found.count == shard["samples"]


class _Empty(bytes):
    """An empty tar's bytes as a context manager (a zero-length file cannot be mapped)."""

    def __enter__(self):
        return self

    def __exit__(self, *exc) -> None:
        return None


def verify_by_walk(root: Path, shard: dict, check) -> None:
    """Walk the tar's headers one by one: structure, member names, sample count and layout, the index
    and the checksums file against what the walk rebuilds (the tar's size and sha256 are checked)."""
    tar_path = root / shard["path"]
    try:
        with open(tar_path, "rb") as fh:
            members, end = read_archive(fh)
            trailing = tail_problem(fh, end, os.fstat(fh.fileno()).st_size)
    except ValueError as exc:
        check(False, f"{shard['path']}: unreadable tar ({exc})")
        return
    check(trailing is None, f"{shard['path']}: {trailing}")
    for member in members:
        check(member.typeflag in (b"0", b"\x00"), f"{shard['path']}: member {member.name!r} is not "
                                                 "a regular file")
        key, ext = split_key(member.name)
        check(bool(key) and bool(ext) and member.name.isascii() and "/" not in member.name
              and not member.name.startswith("."),
              f"{shard['path']}: member name {member.name!r} is not a flat KEY.EXT name")
    rebuilt = index_from_members(members)
    count = int(rebuilt.split("\n", 1)[0].split()[1])
    check(count == shard["samples"], f"{shard['path']}: {count} samples, manifest says {shard['samples']}")
    layouts = {tuple(line.split(" ")[4::4]) for line in rebuilt.splitlines()[1:]}
    check(len(layouts) <= 1, f"{shard['path']}: samples differ in their members after the data member "
                             f"({sorted(layouts)[:3]}): some sample lacks a field")
    if shard.get("index"):
        try:
            on_disk = (root / shard["index"]).read_bytes()
        except OSError as exc:
            check(False, f"{shard['index']}: missing ({exc.strerror})")
            return
        laid_out = on_disk == rebuilt.encode()
        check(laid_out, f"{shard['index']}: does not match the tar's members")
        if laid_out:  # said once: an index the tar does not match is no manifest's either
            check(as_recorded(on_disk, shard, "index"), f"{shard['index']}: {len(on_disk)} bytes, sha256 "
                  f"{hashlib.sha256(on_disk).hexdigest()[:12]}..., not the manifest's (index_bytes "
                  f"{shard.get('index_bytes')}, index_sha256 {str(shard.get('index_sha256'))[:12]}...)")
    if shard.get("checksums") and check_file(root, shard["checksums"], shard.get("checksums_bytes", -1),
                                             shard.get("checksums_sha256"), check):
        check((root / shard["checksums"]).read_bytes() == sample_checksums(tar_path, rebuilt),
              f"{shard['checksums']}: does not match the samples' bytes")
