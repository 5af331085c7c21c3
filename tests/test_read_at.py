"""A file range over 2 GiB is read whole: one ``os.pread`` returns at most 0x7ffff000 bytes on Linux, and an LMDB
value (`--to lmdb`) was cut there silently (verify then vouched for the cut database), while a damaged shard's
verify walk failed on its big member with a traceback. Simulated here by a ``pread`` that returns at most 1,000
bytes a call, as the kernel does past 2 GiB."""

from __future__ import annotations

import os

import pytest

from tests.conftest import read_manifest_json, run_repack
from tests.test_images_job import write_jpegs

CAP = 1000


@pytest.fixture
def short_preads(monkeypatch):
    real = os.pread
    monkeypatch.setattr(os, "pread", lambda fd, size, offset: real(fd, min(size, CAP), offset))


def test_read_at_reads_the_whole_range_and_stops_at_the_end(tmp_path, short_preads):
    from repack.read_at import read_at

    blob = os.urandom(10 * CAP + 17)
    (tmp_path / "f").write_bytes(blob)
    fd = os.open(tmp_path / "f", os.O_RDONLY)
    try:
        assert read_at(fd, len(blob) - 5, 5) == blob[5:]
        assert read_at(fd, 5 * CAP, len(blob) - 3 * CAP) == blob[-3 * CAP:]  # the file ends first
    finally:
        os.close(fd)


def test_the_lmdb_parts_and_the_checksum_walk_read_members_whole(tmp_path, short_preads):
    from repack.sinks.lmdb_sink import _read_part
    from repack.sinks.sample_checksums import sample_checksums

    part = tmp_path / "part.bin"
    members = [os.urandom(3 * CAP + 1), os.urandom(CAP - 1)]
    part.write_bytes(members[0] + members[1])
    read = list(_read_part(tmp_path, {"path": "part.bin", "samples": [["k", [["img", 0, len(members[0])],
                                                                             ["json", len(members[0]), CAP - 1]]]]}))
    assert read == [[("img", members[0]), ("json", members[1])]]
    src = write_jpegs(tmp_path / "src" / "c", 3, "a").parent
    out = tmp_path / "out"
    run_repack("images", src, out, "--quiet")
    shard = read_manifest_json(out)["shards"][0]["path"]
    index = (out / shard).with_suffix(".idx").read_text()
    assert sample_checksums(out / shard, index) == (out / shard).with_suffix(".crc").read_bytes()
