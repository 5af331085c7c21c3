"""The record of what a dataset version holds (``.repack/inputs-vN.npz``): columns, compressed, no
pickle; an older repack's JSON record still loads; a damaged one is refused by name; `repack remove`
finds the shards holding the named samples from it without reading the others."""

from __future__ import annotations

import dataclasses
import hashlib
import io
import json
import zipfile
from pathlib import Path

import numpy as np
import pytest

from repack.errors import UsageError
from repack.lifecycle.input_columns import (NO_MTIME, build_columns, decode_names, encode_names, from_bytes,
                                            from_json_record, to_bytes)
from repack.lifecycle.input_record import select_new
from repack.lifecycle.publish import read_inputs_record
from repack.store import open_store
from tests.conftest import read_manifest_json, run_repack
from tests.test_dataset_versions import make_source
from tests.test_images_job import jpeg_bytes
from tests.test_takedowns import packed_sources


def synthetic(count: int, seed: int = 0):
    """``count`` inputs named like an ImageFolder tree, with sizes, mtimes, positions and digests."""
    rng = np.random.default_rng(seed)
    names = [f"n{i % 1000:08d}/n{i % 1000:08d}_{i:07d}.JPEG" for i in range(count)]
    sizes = rng.integers(500, 200_000, count)
    mtimes = 1_700_000_000_000_000_000 + rng.integers(0, 10**12, count)
    digests = {name: hashlib.sha256(name.encode()).hexdigest() for name in names}
    return build_columns(names, sizes, mtimes, np.arange(count), digests, count)


def test_round_trip_is_exact_and_the_same_bytes_each_time():
    record = synthetic(2_000).with_removed(["n00000007/n00000007_0000007.JPEG", "gone/x.jpg"])
    raw = to_bytes(record)
    assert to_bytes(from_bytes(raw, "x")) == raw == to_bytes(record)  # fixed zip timestamps, sorted rows
    back = from_bytes(raw, "x")
    assert decode_names(back.names) == decode_names(record.names)
    for column in ("size", "mtime_ns", "position", "sha256", "has_sha256", "removed"):
        assert np.array_equal(getattr(back, column), getattr(record, column)), column
    assert back.next_position == 2_000 and back.hex_digest(0) == record.hex_digest(0)


def test_state_is_at_most_64_bytes_per_input():
    count = 50_000
    assert len(to_bytes(synthetic(count))) / count <= 64


def test_a_name_with_surrogate_escapes_round_trips():
    odd = "cat/caf\udce9.jpg"  # a latin-1 byte in a utf-8 tree, as os.fsdecode gives it
    record = build_columns([odd, "cat/a.jpg"], [1, 2], [3, NO_MTIME], [0, 1], {}, 2)
    assert decode_names(from_bytes(to_bytes(record), "x").names) == sorted(["cat/a.jpg", odd],
                                                                           key=lambda n: n.encode("utf-8", "surrogateescape"))


def test_select_new_applies_the_rule_over_columns():
    known = build_columns(["a.jpg", "b.jpg", "q.jpg", "r.jpg"], [10, 20, 30, 40], [1, 2, 3, 4], [0, 1, 2, 3],
                          {"a.jpg": hashlib.sha256(b"A").hexdigest()}, 4, removed=["r.jpg"])
    from repack.lifecycle.input_columns import with_quarantined
    known = with_quarantined(known, ["q.jpg"])
    items = [("a.jpg", [10, 99], b"A"),   # a copy: other mtime, same content
             ("b.jpg", [20, 2], b""),     # the same file
             ("q.jpg", [31, 3], b""),     # quarantined before, changed: planned again
             ("r.jpg", [40, 4], b""),     # taken down: left out, counted
             ("new.jpg", [5, 5], b"")]
    picked = select_new(items, known, lambda i: i[0], lambda i: i[1], lambda i: hashlib.sha256(i[2]).hexdigest())
    assert [i[0] for i in picked.new] == ["q.jpg", "new.jpg"]
    assert picked.removed == 1 and picked.same_content == {"a.jpg": [10, 99]}
    with pytest.raises(UsageError, match="b.jpg"):  # same name, other size: refused by name
        select_new([("b.jpg", [21, 2], b"")], known, lambda i: i[0], lambda i: i[1], lambda i: None)


def test_an_objects_etag_is_its_mtime_and_a_record_without_one_knows_it_by_its_size():
    """s3:// rows: the fingerprint's second column holds the ETag value; in a dataset first packed from
    s3://, a row recorded before (0 there) is the same object at the same size whatever its ETag now, and
    refused by name at another size; elsewhere a row of mtime 0 is a local file's, compared by content."""
    from repack.sources.object_etag import etag_value

    old, new = etag_value('"0123456789abcdef0123456789abcdef"'), etag_value('"fedcba9876543210fedcba9876543210"')
    local = build_columns(["legacy.jpg", "tagged.jpg", "copied.jpg"], [10, 20, 30], [0, old, old], [0, 1, 2],
                          {"copied.jpg": hashlib.sha256(b"C").hexdigest()}, 3)
    with pytest.raises(UsageError, match="no recorded sha256.*: legacy.jpg"):  # a local file of mtime 0
        select_new([("legacy.jpg", [10, new], b"L")], local, lambda i: i[0], lambda i: i[1], lambda i: None)
    known = dataclasses.replace(local, pre_etag_objects=True)  # a dataset first packed from s3://
    items = [("legacy.jpg", [10, new], b"L"),   # recorded without an ETag, same size: known
             ("tagged.jpg", [20, old], b"T"),   # the same ETag: known
             ("copied.jpg", [30, new], b"C")]   # another ETag, the same bytes: known by content
    picked = select_new(items, known, lambda i: i[0], lambda i: i[1], lambda i: hashlib.sha256(i[2]).hexdigest())
    assert picked.new == [] and picked.same_content == {"copied.jpg": [30, new]}
    with pytest.raises(UsageError, match="no recorded sha256 to compare.*: tagged.jpg"):
        select_new([("tagged.jpg", [20, new], b"X")], known, lambda i: i[0], lambda i: i[1],
                   lambda i: hashlib.sha256(i[2]).hexdigest())  # no digest recorded: refused, not taken as known
    with pytest.raises(UsageError, match="legacy.jpg"):
        select_new([("legacy.jpg", [11, new], b"")], known, lambda i: i[0], lambda i: i[1], lambda i: None)


def test_an_older_json_record_still_loads():
    old = {"inputs": {"cat/a.jpg": [10, 5], "s3key.jpg": [7]}, "next_position": 9,
           "sha256": {"cat/a.jpg": "ab" * 32}, "removed": ["dog/x.jpg"]}
    record = from_json_record(json.dumps(old).encode(), "inputs-v2.json")
    assert decode_names(record.names) == ["cat/a.jpg", "s3key.jpg"] and record.next_position == 9
    assert record.mtime_ns.tolist() == [5, NO_MTIME] and record.hex_digest(0) == "ab" * 32
    assert decode_names(record.removed) == ["dog/x.jpg"]


def _zip(members: dict[str, np.ndarray]) -> bytes:
    buffer = io.BytesIO()
    with zipfile.ZipFile(buffer, "w") as archive:
        for name, array in members.items():
            member = io.BytesIO()
            np.lib.format.write_array(member, array, allow_pickle=True)
            archive.writestr(f"{name}.npy", member.getvalue())
    return buffer.getvalue()


@pytest.mark.parametrize("case", ["garbage", "truncated", "pickled", "unsorted", "short_column", "newer"])
def test_a_damaged_or_hostile_record_is_refused_by_name(case):
    good = to_bytes(synthetic(10))
    with zipfile.ZipFile(io.BytesIO(good)) as archive:
        arrays = {n[:-4]: np.lib.format.read_array(archive.open(n)) for n in archive.namelist()}
    if case == "garbage":
        raw = b"PK\x03\x04 not a zip at all"
    elif case == "truncated":
        raw = good[:len(good) // 2]
    else:
        if case == "pickled":
            arrays["size"] = np.array([object()] * 10, dtype=object)  # would unpickle on load
        elif case == "unsorted":
            arrays["names"] = np.frombuffer(b"b\0a\0" + b"c\0" * 8, np.uint8)
        elif case == "short_column":
            arrays["position"] = arrays["position"][:3]
        else:
            arrays["format"] = np.array([99], np.int64)
        raw = _zip(arrays)
    with pytest.raises(UsageError, match="inputs-v3.npz|format 99"):
        from_bytes(raw, "OUT/.repack/inputs-v3.npz")


def test_append_refuses_a_damaged_record_by_name_and_reads_an_older_json_one(tmp_path):
    src, out = make_source(tmp_path / "src"), tmp_path / "out"
    run_repack("images", src, out, "--shard-size", "4", "--quiet")
    (src / "cat" / "late.jpg").write_bytes(jpeg_bytes(seed=70))
    run_repack("images", src, out, "--shard-size", "4", "--append", "--quiet")
    record_file = out / ".repack" / "inputs-v2.npz"
    record = read_inputs_record(open_store(str(out)), 2)  # a delta on version 1's plan, read back whole
    assert len(record) == 10 and record.next_position == 10 and bool(record.has_sha256.all())
    (src / "cat" / "later.jpg").write_bytes(jpeg_bytes(seed=71))
    saved = record_file.read_bytes()
    record_file.write_bytes(saved[:100])
    refused = run_repack("images", src, out, "--shard-size", "4", "--append", check=False)
    assert refused.returncode == 2 and "inputs-v2.npz" in refused.stderr and "Traceback" not in refused.stderr
    record_file.unlink()  # what an older repack left: the same record as JSON
    names = decode_names(record.names)
    legacy = {"inputs": {n: [int(s), int(m)] for n, s, m in zip(names, record.size, record.mtime_ns)},
              "next_position": record.next_position, "removed": [],
              "sha256": {n: record.hex_digest(i) for i, n in enumerate(names)}}
    (out / ".repack" / "inputs-v2.json").write_text(json.dumps(legacy))
    run_repack("images", src, out, "--shard-size", "4", "--append", "--quiet")
    held = packed_sources(out)
    assert "cat/later.jpg" in held and len(held) == len(set(held)) == 11
    run_repack("gc", out, "--keep", "1")
    assert not (out / ".repack" / "inputs-v2.json").exists() and (out / ".repack" / "inputs-v3.npz").exists()


def test_remove_reads_only_the_shards_holding_the_named_samples(tmp_path):
    src, out = make_source(tmp_path / "src"), tmp_path / "out"
    run_repack("images", src, out, "--shard-size", "2", "--quiet")
    shards = read_manifest_json(out)["shards"]
    assert len(shards) == 5
    target = next(s for s in shards if s["path"] == "shard-000003.tar")
    with open(out / target["path"], "rb") as fh:
        held = [json.loads(m)["path"] for m in _json_members(fh.read())]
    other = out / "shard-000000.tar"
    saved = other.read_bytes()
    other.write_bytes(b"")  # a shard holding none of the names is never opened: damaged, it does not matter
    (tmp_path / "gone.txt").write_text(held[0] + "\n")
    done = run_repack("remove", out, "--sources", tmp_path / "gone.txt", "--json")
    change = read_manifest_json(out)["dataset_version"]["change"]
    assert change["rewritten"] == {"shard-000003.tar": "shard-000003-v2.tar"}, done.stdout
    other.write_bytes(saved)
    assert held[0] not in packed_sources(out) and len(packed_sources(out)) == 8
    assert run_repack("verify", out).returncode == 0
    (tmp_path / "keys.txt").write_text(_first_key(out / "shard-000002.tar") + "\n")
    other.write_bytes(b"")
    run_repack("remove", out, "--keys", tmp_path / "keys.txt", "--quiet")
    assert read_manifest_json(out)["dataset_version"]["change"]["rewritten"] == {
        "shard-000002.tar": "shard-000002-v3.tar"}
    other.write_bytes(saved)
    assert len(packed_sources(out)) == 7 and run_repack("verify", out).returncode == 0


def test_remove_refuses_when_the_record_disagrees_with_the_shards(tmp_path):
    src, out = make_source(tmp_path / "src"), tmp_path / "out"
    run_repack("images", src, out, "--shard-size", "2", "--quiet")
    (src / "cat" / "late.jpg").write_bytes(jpeg_bytes(seed=70))
    run_repack("images", src, out, "--shard-size", "2", "--append", "--quiet")
    record_file = out / ".repack" / "inputs-v2.npz"
    record = read_inputs_record(open_store(str(out)), 2)  # written back whole below
    swapped = record.position.copy()
    swapped[[0, 1]] = swapped[[1, 0]]  # two inputs' positions exchanged
    record_file.write_bytes(to_bytes(type(record)(record.names, record.size, record.mtime_ns, swapped, record.sha256,
                                                  record.has_sha256, record.removed, record.next_position)))
    (tmp_path / "gone.txt").write_text(decode_names(record.names)[0] + "\n")
    refused = run_repack("remove", out, "--sources", tmp_path / "gone.txt", check=False)
    assert refused.returncode == 2 and "record" in refused.stderr and "Traceback" not in refused.stderr
    assert len(packed_sources(out)) == 10  # nothing removed, no version published
    assert not (out / "manifest.v3.json").exists()


def _json_members(raw: bytes) -> list[bytes]:
    with __import__("tarfile").open(fileobj=io.BytesIO(raw)) as tar:
        return [tar.extractfile(m).read() for m in tar if m.name.endswith(".json")]


def _first_key(path: Path) -> str:
    return path.with_suffix(".idx").read_text().split("\n")[1].split(" ")[3].partition(".")[0]
