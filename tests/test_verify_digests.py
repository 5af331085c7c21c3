"""`repack verify` hashes a local dataset's tars from its start (``repack.lifecycle.verify_digests``):
on processes forked before the driver imports numpy, so the sha256 work overlaps the driver's start-up;
a hashing process that dies leaves its shard "not checked", never passed."""

from __future__ import annotations

import hashlib
import io
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from repack.lifecycle.verify_digests import EarlyDigests, early_files
from repack.manifest import read_manifest
from tests.conftest import ROOT

ORDER_OF_EVENTS = """
import json, sys
events = []
def hook(event, args):
    if event == "os.fork" or (event == "import" and args[0] == "numpy"):
        events.append(event if event == "os.fork" else "import numpy")
sys.addaudithook(hook)
from repack.lifecycle.verify import verify_report
report = verify_report(sys.argv[1], None, 2)
print(json.dumps({"events": events, "problems": list(report.problems)}))
"""


def test_verify_forks_the_tar_hashing_before_it_imports_numpy(packed_photos):
    """The first process verify starts is a hasher, forked before numpy is imported (the pool's workers
    fork after it, to inherit numpy and the sinks), and the dataset still verifies clean."""
    proc = subprocess.run([sys.executable, "-c", ORDER_OF_EVENTS, str(packed_photos)], cwd=ROOT,
                          capture_output=True, text=True, check=True)
    found = json.loads(proc.stdout.strip().splitlines()[-1])
    assert found["problems"] == []
    events = found["events"]
    assert "os.fork" in events and "import numpy" in events, events
    assert events.index("os.fork") < events.index("import numpy"), events


def test_early_digests_are_each_files_sha256_and_a_missing_file_is_unreadable(tmp_path):
    files = []
    for number, size in enumerate((300_000, 5, 70_000)):
        path = tmp_path / f"f{number}"
        path.write_bytes(os.urandom(size))
        files.append((number, str(path), size))
    files.append((3, str(tmp_path / "missing"), 10))
    found = EarlyDigests.start(files, 2).collect()
    assert found == {number: hashlib.sha256(Path(path).read_bytes()).hexdigest() for number, path, _ in files[:3]} | {
        3: None}


def test_the_tars_hashed_early_are_the_indexed_webdataset_shards_inside_the_root(packed_photos):
    manifest = read_manifest(packed_photos)
    shards = manifest.data["shards"]
    assert early_files(manifest) == [(i, str(packed_photos / s["path"]), s["bytes"]) for i, s in enumerate(shards)]
    shards[0] = dict(shards[0], path="../outside.tar")
    assert [number for number, _, _ in early_files(manifest)] == list(range(1, len(shards)))


def test_a_hashing_process_that_dies_leaves_its_shard_not_checked(packed_photos, tmp_path):
    """Shard 0's tar is handed to the hashers as a FIFO: the process reading it blocks and is killed;
    the other shards' digests still land, and the shard check names shard 0 "not checked"."""
    from repack.lifecycle.verify_shards import check_shards
    from repack.store.files import open_files

    manifest = read_manifest(packed_photos)
    files = early_files(manifest)
    fifo = tmp_path / "tar.fifo"
    os.mkfifo(fifo)
    early = EarlyDigests.start([(0, str(fifo), 1 << 40)] + files[1:], 2)
    writer = None
    try:
        deadline = time.monotonic() + 60
        while writer is None:  # opens once a hasher waits on the FIFO; the hasher then blocks reading it
            assert time.monotonic() < deadline, "no hasher opened the FIFO"
            try:
                writer = os.open(fifo, os.O_WRONLY | os.O_NONBLOCK)
            except OSError:
                time.sleep(0.02)
        holder = []
        while not holder:
            assert time.monotonic() < deadline, "no hasher holds the FIFO open"
            holder = [pid for pid in early.pids if holds(pid, fifo)]
        os.kill(holder[0], signal.SIGKILL)
    finally:
        if writer is not None:
            os.close(writer)
    checked = check_shards(open_files(str(packed_photos)), manifest, 2, early)
    assert checked.problems[0] == (f"{manifest.data['shards'][0]['path']}: not checked: the process checking it "
                                   f"died (its sha256: killed by signal {int(signal.SIGKILL)})",)
    assert all(problems == () for problems in checked.problems[1:])


def holds(pid: int, path: Path) -> bool:
    try:
        return any(os.readlink(f"/proc/{pid}/fd/{fd}") == str(path) for fd in os.listdir(f"/proc/{pid}/fd"))
    except OSError:
        return False


# -- a part's lines checked in their canonical form (tar_check.canonical_lines) ------------------------
def tar_of(samples: list[list[tuple[str, bytes]]]) -> tuple[bytes, bytes]:
    """(tar, idx) as repack writes them for ``samples``: each a list of (member name, data)."""
    from repack.sinks.tar_format import end_of_archive, index_text, ustar_header

    body, lines = bytearray(), []
    for members in samples:
        line = []
        for name, data in members:
            body += ustar_header(name.encode(), len(data))
            line.append((name.split(".", 1)[1], len(body), len(data), name))
            body += data + bytes(-len(data) % 512)
        lines.append(line)
    return bytes(body) + end_of_archive(len(body)), index_text(lines).encode()


def test_the_canonical_check_takes_mixed_first_exts_and_keys_of_any_length():
    """The fast check answers yes for what repack writes when the first member's ext differs per sample
    (jpg / png / a dotted ext) and keys differ in length, and its keys and offsets are the walk's."""
    from repack.sinks.tar_check import check_against_index, parts_agree, check_part
    from repack.sinks.tar_format import index_from_tar

    samples = [[(f"{key}.{ext}", bytes(range(size % 256)) * (1 + size // 256)), (f"{key}.cls", b"7")]
               for key, ext, size in (("a", "jpg", 700), ("bb-01", "png", 1), ("c" * 60, "seg.png", 513),
                                      ("d_4", "jpg", 0), ("e", "webp", 1024))]
    tar, idx = tar_of(samples)
    assert idx.decode() == index_from_tar(io.BytesIO(tar))  # the index repack writes for this tar
    found = check_against_index(tar, idx)
    assert found is not None
    assert [bytes(row).rstrip(b"\0").decode() for row in found.keys] == ["a", "bb-01", "c" * 60, "d_4", "e"]
    assert found.offsets.tolist()[::2] == [int(line.split(" ")[1]) for line in idx.decode().splitlines()[1:]]
    for parts in (2, 3, 5):
        assert parts_agree([check_part(tar, idx, part, parts) for part in range(parts)])


@pytest.mark.parametrize("edit", [
    lambda idx: idx.replace(b"jpg 512 ", b"jpg 512  ", 1),  # two spaces
    lambda idx: idx.replace(b" 1 bb-01.png", b" +1 bb-01.png", 1),  # a sign
    lambda idx: idx.replace(b"bb-01.png cls", b"bb-01.PNG cls", 1),  # name and ext differ
    lambda idx: idx.replace(b"bb-01.cls", b"bb-02.cls", 1),  # a member of another key on the line
    lambda idx: idx.replace(b"d_4.jpg", b"d.4.jpg", 1).replace(b"d_4.cls", b"d.4.cls", 1),  # a dot in the key
    lambda idx: idx.replace(b"\n", b"\r\n"),  # another line end
])
def test_a_line_that_is_not_canonical_gets_no_verdict(edit):
    from repack.sinks.tar_check import check_against_index

    samples = [[(f"{key}.{ext}", b"x" * size), (f"{key}.cls", b"7")]
               for key, ext, size in (("a", "jpg", 700), ("bb-01", "png", 1), ("d_4", "jpg", 3))]
    tar, idx = tar_of(samples)
    assert check_against_index(tar, idx) is not None
    changed = edit(idx)
    assert changed != idx
    assert check_against_index(tar, changed) is None
