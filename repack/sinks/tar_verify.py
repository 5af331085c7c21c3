"""``verify_shard`` of the webdataset format: one tar shard, its ``.idx`` and its ``.crc`` against the
manifest entry.

First the cheap way (``tar_check``): the index's columns checked against every member header at once
with numpy, the per-sample checksums recomputed from those columns. A shard that passes is exactly
what repack writes; anything else (damage, or another tool's header bytes) is walked member by member
(``tar_format.read_archive``), which names each problem as it finds it.
"""

from __future__ import annotations

import mmap
import os
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

from repack.sinks.checks import check_file, sha256_file
from repack.sinks.sample_checksums import checksums_from_columns, sample_checksums
from repack.sinks.tar_check import check_against_index
from repack.sinks.tar_format import index_from_members, read_archive, split_key, tail_problem


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


def matches_by_index(root: Path, shard: dict) -> bool:
    """True when the tar, its index and its checksums file are exactly what repack writes for the
    manifest entry (sizes and sha256 of the side files included); False is no verdict."""
    if not shard.get("index"):
        return False
    try:
        index = (Path(root) / shard["index"]).read_bytes()
        with open(Path(root) / shard["path"], "rb") as fh:
            size = os.fstat(fh.fileno()).st_size
            if size != shard["bytes"]:
                return False
            with (mmap.mmap(fh.fileno(), 0, access=mmap.ACCESS_READ) if size else _Empty()) as tar:
                columns = check_against_index(tar, index)
                if columns is None or len(columns.keys) != shard["samples"]:
                    return False
                if not shard.get("checksums"):
                    return True
                expected = checksums_from_columns(tar, columns.offsets, columns.sizes, columns.per_sample)
        problems: list[str] = []
        if not check_file(root, shard["checksums"], shard.get("checksums_bytes", -1), shard.get("checksums_sha256"),
                          lambda ok, message: ok or problems.append(message)):
            return False
        return not problems and (Path(root) / shard["checksums"]).read_bytes() == expected
    except OSError:
        return False


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
            on_disk = (root / shard["index"]).read_text()
        except OSError as exc:
            check(False, f"{shard['index']}: missing ({exc.strerror})")
            return
        check(on_disk == rebuilt, f"{shard['index']}: does not match the tar's members")
    if shard.get("checksums") and check_file(root, shard["checksums"], shard.get("checksums_bytes", -1),
                                             shard.get("checksums_sha256"), check):
        check((root / shard["checksums"]).read_bytes() == sample_checksums(tar_path, rebuilt),
              f"{shard['checksums']}: does not match the samples' bytes")
