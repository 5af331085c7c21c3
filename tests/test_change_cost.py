"""Changes cost what changed: a version's record of its inputs is stored as a delta on the previous
one's (read back whole, made whole before `repack gc` deletes what it extends); the first record is read
from the plan's input columns; `repack remove` rewrites each shard holding a named sample on a process
pool, copying the kept byte ranges and laying out the new index from the old one's columns."""

from __future__ import annotations

import hashlib
import json
from pathlib import Path

import numpy as np
import pytest

from repack.lifecycle.input_columns import decode_names, parse_record
from repack.lifecycle.locate import key_position
from repack.lifecycle.shard_index import parse_index
from repack.sinks.sample_checksums import sample_checksums
from repack.sinks.tar_format import index_from_tar
from repack.store import open_store
from tests.conftest import read_manifest_json, run_repack
from tests.test_dataset_versions import add_inputs, make_source, three_versions
from tests.test_images_job import jpeg_bytes
from tests.test_remove_gc import tar_samples
from tests.test_takedowns import packed_sources


def _stored(out: Path, number: int):
    path = out / ".repack" / f"inputs-v{number}.npz"
    return parse_record(path.read_bytes(), str(path))


def _record(out: Path, number: int):
    from repack.lifecycle.publish import read_inputs_record

    return read_inputs_record(open_store(str(out)), number)


def _same(a, b) -> None:
    assert decode_names(a.names) == decode_names(b.names) and a.next_position == b.next_position
    for column in ("size", "mtime_ns", "position", "sha256", "has_sha256", "removed"):
        assert np.array_equal(getattr(a, column), getattr(b, column)), column


def test_a_later_version_stores_only_what_it_changed_and_reads_back_whole(tmp_path):
    src, out = make_source(tmp_path / "src"), tmp_path / "out"
    run_repack("images", src, out, "--shard-size", "4", "--quiet")
    add_inputs(src)
    run_repack("images", src, out, "--shard-size", "4", "--append", "--quiet")
    first = _stored(out, 2)  # version 1 has no record file: version 2's is a delta on the one its plan gives
    assert (first.base, first.depth, len(first.columns)) == (1, 1, 4)
    whole = _record(out, 2)
    assert len(whole) == 13 and bool(whole.has_sha256.all())
    (tmp_path / "gone.txt").write_text("cat/c1.jpg\n")
    run_repack("remove", out, "--sources", tmp_path / "gone.txt", "--quiet")
    removed = _stored(out, 3)  # no row of an input: the removed source only
    assert (removed.base, removed.depth, len(removed.columns)) == (2, 2, 0)
    assert decode_names(removed.columns.removed) == ["cat/c1.jpg"]
    _same(_record(out, 3), whole.with_removed(["cat/c1.jpg"]))

    (src / "dog" / "late.jpg").write_bytes(jpeg_bytes(seed=77))
    run_repack("images", src, out, "--shard-size", "4", "--append", "--quiet")
    added = _stored(out, 4)
    assert (added.base, added.depth, decode_names(added.columns.names)) == (3, 3, ["dog/late.jpg"])
    assert added.columns.position.tolist() == [13] and bool(added.columns.has_sha256.all())
    latest = _record(out, 4)
    assert len(latest) == 14 and decode_names(latest.removed) == ["cat/c1.jpg"] and latest.next_position == 14
    held = packed_sources(out)
    assert "cat/c1.jpg" not in held and "dog/late.jpg" in held and len(held) == 13  # the takedown stays down

    run_repack("gc", out, "--keep", "1")
    made_whole = _stored(out, 4)
    assert made_whole.base is None and not (out / ".repack" / "inputs-v3.npz").exists()
    _same(made_whole.columns, latest)
    (src / "dog" / "later.jpg").write_bytes(jpeg_bytes(seed=78))
    run_repack("images", src, out, "--shard-size", "4", "--append", "--quiet")
    assert sorted(packed_sources(out)) == sorted(held + ["dog/later.jpg"])


def test_a_delta_on_a_missing_record_is_refused_by_name(tmp_path):
    src, out = three_versions(tmp_path)
    (out / ".repack" / "inputs-v2.npz").unlink()
    (src / "dog" / "late.jpg").write_bytes(jpeg_bytes(seed=77))
    refused = run_repack("images", src, out, "--shard-size", "4", "--append", check=False)
    assert refused.returncode == 2 and "inputs-v3.npz extends version 2" in refused.stderr
    assert "Traceback" not in refused.stderr and "dog/late.jpg" not in packed_sources(out)


def test_the_first_record_comes_from_the_plan_columns_not_an_entry_per_input(tmp_path, monkeypatch):
    from repack.lifecycle import first_record
    from repack.lifecycle.input_record import dataset_record

    src, out = make_source(tmp_path / "src"), tmp_path / "out"
    run_repack("images", src, out, "--shard-size", "4", "--quiet")

    def expanded(payload):
        raise AssertionError("a columnar task's inputs expanded into one entry per input")

    monkeypatch.setattr(first_record, "planned_entries", expanded)
    record = dataset_record(open_store(str(out)), read_manifest_json(out))
    files = sorted(p for p in src.rglob("*.jpg"))
    rels = [p.relative_to(src).as_posix() for p in files]
    assert decode_names(record.names) == rels and record.next_position == len(files)
    assert record.size.tolist() == [p.stat().st_size for p in files]
    assert record.mtime_ns.tolist() == [p.stat().st_mtime_ns for p in files]
    assert [record.hex_digest(i) for i in range(len(files))] == [hashlib.sha256(p.read_bytes()).hexdigest()
                                                                  for p in files]
    keys = {json.loads(dict(members)[f"{key}.json"])["path"]: key_position(key)
            for shard in sorted(out.glob("shard-*.tar")) for key, members in tar_samples(shard)}
    assert record.position.tolist() == [keys[rel] for rel in rels]


def test_the_first_record_places_each_digest_by_position_without_a_str_per_input(tmp_path, monkeypatch):
    """Version 1's record (the plan's columns plus the task records' digests) decodes no rel: each unit's
    digests follow its planned inputs less its quarantined ones, placed by sample position; the names are
    the tasks' blobs cut as one byte matrix. A quarantined input in a unit keeps the others' digests in
    place."""
    from repack.jobs import record_columns, task_inputs
    from repack.lifecycle.input_record import dataset_record

    src, out = make_source(tmp_path / "src"), tmp_path / "out"
    (src / "cat" / "c1.jpg").write_bytes(b"not a jpeg")  # quarantined inside the first shard
    run_repack("images", src, out, "--shard-size", "4", "--chunk-size", "2", "--quiet")

    def decoded(*args, **kwargs):
        raise AssertionError("a rel decoded into a str for the record")

    monkeypatch.setattr(task_inputs, "split_names", decoded)
    monkeypatch.setattr(record_columns, "input_rels", decoded)
    record = dataset_record(open_store(str(out)), read_manifest_json(out))
    files = sorted(p for p in src.rglob("*.jpg"))
    assert decode_names(record.names) == [p.relative_to(src).as_posix() for p in files]
    assert [record.hex_digest(i) for i in range(len(files))] == [
        None if p.name == "c1.jpg" else hashlib.sha256(p.read_bytes()).hexdigest() for p in files]


def test_remove_rewrites_every_hit_shard_from_byte_ranges_with_a_column_built_index(tmp_path):
    src, out = make_source(tmp_path / "src"), tmp_path / "out"
    run_repack("images", src, out, "--shard-size", "3", "--quiet")
    before = read_manifest_json(out)["shards"]
    assert len(before) == 3
    gone = [json.loads(dict(tar_samples(out / s["path"])[1][1])[f"{tar_samples(out / s['path'])[1][0]}.json"])["path"]
            for s in before]  # the middle sample of every shard: each shard rewritten, kept runs on both sides
    (tmp_path / "gone.txt").write_text("".join(f"{rel}\n" for rel in gone))
    run_repack("remove", out, "--sources", tmp_path / "gone.txt", "--quiet")
    after = read_manifest_json(out)
    assert [s["path"] for s in after["shards"]] == [s["path"][:-4] + "-v2.tar" for s in before]
    for old, new in zip(before, after["shards"]):
        kept = [s for s in tar_samples(out / old["path"]) if json.loads(dict(s[1])[f"{s[0]}.json"])["path"] not in gone]
        assert tar_samples(out / new["path"]) == kept
        with open(out / new["path"], "rb") as fh:
            assert (out / new["index"]).read_text() == index_from_tar(fh)
        assert (out / new["checksums"]).read_bytes() == sample_checksums(out / new["path"],
                                                                          (out / new["index"]).read_text())
        assert hashlib.sha256((out / new["path"]).read_bytes()).hexdigest() == new["sha256"]
    assert sorted(packed_sources(out)) == sorted(set(packed_sources(out)))
    assert not set(gone) & set(packed_sources(out)) and run_repack("verify", out).returncode == 0


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_the_index_of_kept_samples_is_laid_out_from_columns(tmp_path, seed):
    """``ShardIndex.text_of`` against an index written line by line, on keys of odd shapes; and
    ``key_positions`` against ``key_position`` key by key."""
    rng = np.random.default_rng(seed)
    stems = ["00000007_cat", "00000012", "123_x_y", "abc_1", "00000099_d.o.g", "9" * 19 + "_big", "_lead"]
    lines, firsts = [], []
    offset = 512
    for number in range(60):
        firsts.append(offset)
        key = stems[number % len(stems)] + f"{number}" if number % len(stems) not in (1, 5) else \
            stems[number % len(stems)]
        key = key if number % len(stems) != 1 else f"{number:08d}"
        members = []
        for ext in (["jpg", "cls"] if number % 3 else ["jpg", "cls", "json"]):
            size = int(rng.integers(0, 3000))
            name = f"{key}.{ext}" if number % 5 or ext != "cls" else f"x{number}/other.{ext}"  # not keyed
            members.append(f"{ext} {offset} {size} {name}")
            offset += 512 + size + (-size % 512)
        lines.append(" ".join(members))
    raw = (f"v1.2 {len(lines)}\n" + "\n".join(lines) + "\n").encode()
    index = parse_index(raw)
    assert index.key_positions().tolist() == [
        -1 if key_position(k) is None or key_position(k) >= 10**18 else key_position(k) for k in index.keys()]
    kept = np.flatnonzero(rng.random(index.samples) < 0.7)
    shift = -np.minimum(rng.integers(0, 50, index.samples) * 512, np.array(firsts) - 512)  # offsets stay >= 512
    expected = []
    for at in kept.tolist():
        tokens = lines[at].split(" ")
        for i in range(1, len(tokens), 4):
            tokens[i] = str(int(tokens[i]) + int(shift[at]))
        expected.append(" ".join(tokens))
    assert index.text_of(kept, shift).decode() == f"v1.2 {len(kept)}\n" + "\n".join(expected) + "\n"
    assert index.text_of(np.arange(index.samples), np.zeros(index.samples, np.int64)) == raw


@pytest.mark.parametrize("seed", range(6))
def test_the_index_of_kept_samples_copied_from_the_old_text_is_the_one_laid_out_from_columns(seed):
    """``ShardIndex.shifted_text`` (old lines copied, offsets written anew) gives ``text_of``'s bytes: runs
    long and short, offsets that lose a digit as they move down (10**k boundaries), samples of 1-3 members,
    names not starting with the key, and a text with a size written with leading zeros (laid out anew)."""
    rng = np.random.default_rng(seed)
    lines, firsts = [], []
    offset = 512
    samples = 3000
    for number in range(samples):
        firsts.append(offset)
        key = f"{number:08d}_{'x' * int(rng.integers(0, 4))}"
        members = []
        for ext in ["jpg", "cls", "json"][:1 + number % 3]:
            size = int(rng.integers(0, 9000)) if number % 11 else int(rng.integers(90_000, 400_000))
            name = f"{key}.{ext}" if number % 7 else f"other{number}.{ext}"
            members.append(f"{ext} {offset} {size} {name}")
            offset += 512 + size + (-size % 512)
        lines.append(" ".join(members))
    raw = (f"v1.2 {len(lines)}\n" + "\n".join(lines) + "\n").encode()
    index = parse_index(raw)
    starts, ends = index.spans()
    for share in (1.0, 0.999, 0.98, 0.9, 0.5):
        kept = np.flatnonzero(rng.random(index.samples) < share)
        if seed % 2:
            kept = kept[kept >= int(rng.integers(0, 50))]  # the first samples gone: every offset moves
        removed_before = np.cumsum(ends - starts) - (ends - starts)  # bytes of the samples before each one
        kept_before = np.zeros(index.samples, np.int64)
        kept_before[kept] = np.cumsum(ends[kept] - starts[kept]) - (ends[kept] - starts[kept])
        shift = kept_before - removed_before  # each kept sample moved down by the bytes removed before it
        assert index.shifted_text(kept, shift) == index.text_of(kept, shift), share
    tokens = lines[1].split(" ")
    tokens[2] = "00" + tokens[2]  # a size the parser reads, written as repack never writes it
    padded = parse_index(raw.replace(lines[1].encode(), " ".join(tokens).encode(), 1))
    kept, shift = np.arange(1, padded.samples), np.full(padded.samples, -512)
    assert padded.shifted_text(kept, shift) == padded.text_of(kept, shift)
    assert padded.text_of(kept, shift).split(b"\n")[1].split(b" ")[2] == tokens[2].lstrip("0").encode()


def test_an_index_of_many_pieces_parsed_on_threads_is_the_serial_parse(monkeypatch):
    """A shard's index cut into many pieces (``CHUNK_BYTES`` made small) and parsed on threads gives the
    columns of the one-thread parse, and the same layout of kept samples; a malformed piece is still
    refused (None)."""
    import dataclasses

    from repack.exec import cpus
    from repack.manifest import shard_index as columns_parser

    lines = [" ".join(f"{ext} {512 + 3072 * n + 1024 * m} {100 + n % 97} {n:08d}_s{n % 13}.{ext}"  # as in a tar
                      for m, ext in enumerate(["jpg", "cls", "json"])) for n in range(2000)]
    raw = (f"v1.2 {len(lines)}\n" + "\n".join(lines) + "\n").encode()
    serial = columns_parser.parse_index(raw, "index")
    monkeypatch.setattr(columns_parser, "CHUNK_BYTES", 4096)
    monkeypatch.setattr(cpus, "_worker_cpus", 4)
    assert len(columns_parser.index_pieces(raw, "index")[1]) > 20
    threaded = parse_index(raw)
    for field in dataclasses.fields(serial):
        a, b = getattr(serial, field.name), getattr(threaded.columns, field.name)
        assert (np.array_equal(a, b) and a.dtype == b.dtype) if isinstance(a, np.ndarray) else a == b, field.name
    kept = np.arange(0, 2000, 3)
    shift = np.zeros(2000, np.int64)
    assert threaded.shifted_text(kept, shift) == threaded.text_of(kept, shift)
    assert parse_index(raw.replace(b" 1536 ", b" 15x6 ", 1)) is None


def test_deltas_chain_at_most_max_deltas_then_a_whole_record(tmp_path):
    """A record extended version after version: each a delta on the one before, read back as the whole
    record; after MAX_DELTAS deltas the next is whole again."""
    from repack.lifecycle.input_columns import build_columns, merged, to_bytes
    from repack.lifecycle.input_record import remove_delta
    from repack.lifecycle.publish import MAX_DELTAS, inputs_record, write_inputs_record

    store = open_store(str(tmp_path))
    (tmp_path / ".repack").mkdir()
    known = build_columns(["a/0.jpg"], [10], [1], [0], {"a/0.jpg": "ab" * 32}, 1)
    store.put_bytes(inputs_record(1), to_bytes(known))
    for number in range(2, MAX_DELTAS + 3):
        rel = f"a/{number}.jpg"
        delta = build_columns([rel], [number], [number], [number - 1], {}, number)
        if number % 3 == 0:
            delta = remove_delta(known.next_position, [f"a/{number - 1}.jpg"])
        write_inputs_record(store, number, known, delta)
        known = merged(known, delta)
        stored = parse_record((tmp_path / inputs_record(number)).read_bytes(), "x")
        expected_depth = (number - 1) % (MAX_DELTAS + 1)
        assert stored.depth == expected_depth and (stored.base is None) == (expected_depth == 0)
        _same(_record(tmp_path, number), known)
    assert len(known) == 1 + len([n for n in range(2, MAX_DELTAS + 3) if n % 3]) and len(known.removed) > 0


def test_a_shard_copy_is_its_kept_byte_ranges_written_back_as_it_goes(tmp_path, monkeypatch):
    """``copy_kept`` (the helper thread's copy, hashed and indexed beside it): the new tar is the kept
    samples' byte ranges in order plus the end of the archive, its index and sha256 are the tar's own, and
    the copy starts the disk's write-back every SYNC_EVERY bytes (a bounded count of fdatasync calls)."""
    import os

    from repack.lifecycle import tar_copy
    from repack.sinks.tar_format import end_of_archive

    src, out = make_source(tmp_path / "src"), tmp_path / "out"
    run_repack("images", src, out, "--quiet")
    entry = read_manifest_json(out)["shards"][0]
    index = parse_index((out / entry["index"]).read_bytes())
    old = (out / entry["path"]).read_bytes()
    keep = np.ones(index.samples, bool)
    keep[[0, 3, 4, index.samples - 1]] = False  # runs: 1-2, 5..n-2
    syncs = []
    real_fdatasync = os.fdatasync

    def counted(fd):
        syncs.append(fd)
        real_fdatasync(fd)

    monkeypatch.setattr(tar_copy, "SYNC_EVERY", 4096)
    monkeypatch.setattr(tar_copy, "HASH_PIECE", 1536)  # the hash thread's pieces cut runs mid-way
    monkeypatch.setattr(tar_copy.os, "fdatasync", counted)
    new_dir = tmp_path / "new"
    new_dir.mkdir()
    with open(out / entry["path"], "rb") as tar:
        new = tar_copy.copy_kept(tar.fileno(), index, keep, new_dir, "shard-x", entry["path"], None)
    starts, ends = index.spans()
    body = b"".join(old[int(starts[k]):int(ends[k])] for k in np.flatnonzero(keep).tolist())
    data = (new_dir / new["path"]).read_bytes()
    assert data == body + end_of_archive(len(body)) and new["samples"] == int(keep.sum())
    assert new["sha256"] == hashlib.sha256(data).hexdigest() and new["bytes"] == len(data)
    with open(new_dir / new["path"], "rb") as fh:
        assert (new_dir / new["index"]).read_text() == index_from_tar(fh)
    assert len(syncs) == len(body) // 4096  # one per 4096 bytes copied, runs cut where a write-back is due


def test_a_prefix_copied_and_hashed_while_the_index_is_parsed_gives_the_same_shard(tmp_path, monkeypatch):
    """``CopiedPrefix``: the old tar's first bytes copied into the temp file and hashed from byte 0 (here
    the whole tar, before ``copy_kept`` takes it: past every cut) give the shard, index and sha256 of a copy
    without it, whether the first sample is kept (its run taken up to the cut), dropped (nothing taken:
    written over) or the last samples are (the file cut back to its length); a prefix not taken leaves no
    temp file."""
    import os
    import threading
    import time

    from repack.lifecycle import tar_copy

    src, out = make_source(tmp_path / "src"), tmp_path / "out"
    run_repack("images", src, out, "--quiet")
    entry = read_manifest_json(out)["shards"][0]
    index = parse_index((out / entry["index"]).read_bytes())
    size = (out / entry["path"]).stat().st_size
    monkeypatch.setattr(tar_copy, "SYNC_EVERY", 4096)
    monkeypatch.setattr(tar_copy, "HASH_PIECE", 1536)
    for dropped in ([3, 4], [0, 5], [index.samples - 2, index.samples - 1]):
        keep = np.ones(index.samples, bool)
        keep[dropped] = False
        made = {}
        for way in ("plain", "prefix"):
            new_dir = tmp_path / f"{way}-{dropped[0]}"
            new_dir.mkdir()
            with open(out / entry["path"], "rb") as tar:
                prefix = None
                if way == "prefix":
                    prefix = tar_copy.CopiedPrefix(tar.fileno(), tar_copy.temp_path(new_dir, "shard-x"))
                    deadline = time.monotonic() + 30
                    while (prefix._copied < size or prefix._states[-1][0] < size) and time.monotonic() < deadline:
                        time.sleep(0.01)
                    assert prefix._copied == size and prefix._states[-1][0] == size
                try:
                    new = tar_copy.copy_kept(tar.fileno(), index, keep, new_dir, "shard-x", entry["path"], None, prefix)
                finally:
                    if prefix is not None:
                        prefix.close()
            made[way] = ((new_dir / new["path"]).read_bytes(), (new_dir / new["index"]).read_text(), new["sha256"])
            assert not [p.name for p in new_dir.iterdir() if ".tmp-" in p.name], way  # no temp file left
        assert made["prefix"] == made["plain"], dropped
        assert made["plain"][2] == hashlib.sha256(made["plain"][0]).hexdigest()
    keep = np.ones(index.samples, bool)
    keep[index.samples // 2] = False
    starts, _ = index.spans()
    cut = int(starts[index.samples // 2])
    for limit in (cut // 2, cut + 3000):  # the caller's guess of the cut: short of it (the rest copied after), past it
        new_dir = tmp_path / f"limit-{limit}"
        new_dir.mkdir()
        with open(out / entry["path"], "rb") as tar:
            prefix = tar_copy.CopiedPrefix(tar.fileno(), tar_copy.temp_path(new_dir, "shard-x"), limit)
            for thread in prefix._threads:
                thread.join(30)
            assert prefix._copied == limit and prefix._states[-1][0] == limit  # each stopped at the limit
            new = tar_copy.copy_kept(tar.fileno(), index, keep, new_dir, "shard-x", entry["path"], None, prefix)
            prefix.close()
        data = (new_dir / new["path"]).read_bytes()
        assert new["sha256"] == hashlib.sha256(data).hexdigest() and data[:cut] == (out / entry["path"]).read_bytes()[:cut]
    real_copy_range = tar_copy._copy_range

    def refused_in_the_prefix(src, dst, view, start, end, at):
        if threading.current_thread().name.startswith("repack-prefix"):
            raise OSError(28, "No space left on device")
        real_copy_range(src, dst, view, start, end, at)

    monkeypatch.setattr(tar_copy, "_copy_range", refused_in_the_prefix)  # the prefix's copy fails: copy_kept does it
    failed_dir = tmp_path / "failed"
    failed_dir.mkdir()
    with open(out / entry["path"], "rb") as tar:
        prefix = tar_copy.CopiedPrefix(tar.fileno(), tar_copy.temp_path(failed_dir, "shard-x"))
        new = tar_copy.copy_kept(tar.fileno(), index, keep, failed_dir, "shard-x", entry["path"], None, prefix)
        prefix.close()
    data = (failed_dir / new["path"]).read_bytes()
    assert new["sha256"] == hashlib.sha256(data).hexdigest() and data[:cut] == (out / entry["path"]).read_bytes()[:cut]
    monkeypatch.setattr(tar_copy, "_copy_range", real_copy_range)
    idle = tmp_path / "idle"
    idle.mkdir()
    with open(out / entry["path"], "rb") as tar:
        prefix = tar_copy.CopiedPrefix(tar.fileno(), tar_copy.temp_path(idle, "shard-x"))
        assert tar_copy.copy_kept(tar.fileno(), index, np.zeros(index.samples, bool), idle, "shard-x", "x.tar", None,
                                  prefix) is None  # nothing kept: the prefix is not taken
        prefix.close()
    assert os.listdir(idle) == []


def test_remove_copies_a_shards_prefix_while_it_parses_and_publishes_the_same_bytes(tmp_path, monkeypatch):
    """`repack remove` of a source in the middle of a shard starts its ``CopiedPrefix`` before the index is
    parsed, up to a little past where the record of the inputs puts the source (here every shard's prefix
    counts: PREFIX_MIN 0); the published shards equal a remove without it, byte for byte."""
    import shutil

    from repack.cli import cli
    from repack.lifecycle import remove_tar

    src, out = make_source(tmp_path / "src"), tmp_path / "out"
    run_repack("images", src, out, "--quiet")
    shutil.copytree(out, tmp_path / "plain")
    sources = packed_sources(out)
    (tmp_path / "gone.txt").write_text(sources[len(sources) // 2] + "\n")
    limits = []
    made = remove_tar.CopiedPrefix

    def spied(tar_fd, tmp, limit=None):
        limits.append(limit)
        return made(tar_fd, tmp, limit)

    monkeypatch.setattr(remove_tar, "CopiedPrefix", spied)
    monkeypatch.setattr(remove_tar, "PREFIX_MIN", 0)
    cli.main(["remove", str(out), "--sources", str(tmp_path / "gone.txt")], standalone_mode=False)
    from repack.exec.cpus import available_cpus

    size = (out / read_manifest_json(tmp_path / "plain")["shards"][0]["path"]).stat().st_size
    assert len(limits) == (available_cpus() > 1)
    assert all(size // 4 < limit - remove_tar.PREFIX_SLACK < 3 * size // 4 for limit in limits)  # ~the middle
    monkeypatch.setattr(remove_tar, "PREFIX_MIN", 1 << 62)  # no prefix
    cli.main(["remove", str(tmp_path / "plain"), "--sources", str(tmp_path / "gone.txt")], standalone_mode=False)
    assert len(limits) == (available_cpus() > 1)
    for name in ("manifest.json", *(s["path"] for s in read_manifest_json(out)["shards"])):
        if name != "manifest.json":
            assert (out / name).read_bytes() == (tmp_path / "plain" / name).read_bytes(), name
    assert sources[len(sources) // 2] not in packed_sources(out) and run_repack("verify", out).returncode == 0
    assert not list(out.glob(".*tmp*"))


def test_a_shard_whose_header_disagrees_with_its_index_is_refused_before_a_byte_is_copied(tmp_path, monkeypatch):
    """The hash thread starts before the header check, but no byte is copied until it passes: a kept
    member whose header names another member is refused by name, the hashing stopped, no file left."""
    import os

    from repack.errors import UsageError
    from repack.lifecycle import tar_copy

    src, out = make_source(tmp_path / "src"), tmp_path / "out"
    run_repack("images", src, out, "--quiet")
    entry = read_manifest_json(out)["shards"][0]
    index = parse_index((out / entry["index"]).read_bytes())
    bad = bytearray((out / entry["path"]).read_bytes())
    header = int(index.offset[int(index.first[2])]) - 512  # sample 2's first member: kept
    bad[header] ^= 1
    (tmp_path / "bad.tar").write_bytes(bytes(bad))
    copied = []
    monkeypatch.setattr(tar_copy, "_copy_ranges", lambda *args: copied.append(args))
    keep = np.ones(index.samples, bool)
    keep[0] = False
    new_dir = tmp_path / "new"
    new_dir.mkdir()
    with open(tmp_path / "bad.tar", "rb") as tar:
        with pytest.raises(UsageError, match="does not name the member"):
            tar_copy.copy_kept(tar.fileno(), index, keep, new_dir, "shard-x", "bad.tar", None)
    assert not copied and os.listdir(new_dir) == []
    monkeypatch.undo()
    key, members = tar_samples(out / entry["path"])[0]  # sample 0, named by its source through the command:
    (tmp_path / "gone.txt").write_text(json.loads(dict(members)[f"{key}.json"])["path"] + "\n")
    (out / entry["path"]).write_bytes(bytes(bad))  # refused by name, nothing published
    before = (out / "manifest.json").read_bytes()
    refused = run_repack("remove", out, "--sources", tmp_path / "gone.txt", check=False)
    assert refused.returncode == 2 and "does not name the member" in refused.stderr
    assert "Traceback" not in refused.stderr and (out / "manifest.json").read_bytes() == before
    assert not list(out.glob("*-v2.*")) and not list(out.glob(".*tmp*"))


def test_the_pool_takes_the_largest_shards_first():
    from repack.lifecycle.remove_tar import largest_first

    assert largest_first([10, 30, 20, 30, 0]) == [1, 3, 2, 0, 4]
    assert largest_first([]) == []
