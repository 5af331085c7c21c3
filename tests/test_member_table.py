"""A foreign source's inputs are columns (``repack.sources.member_table.MemberTable``): tar members and parquet
rows, whose items, task payloads and task entries say what each input is and where it lies."""

from __future__ import annotations

import json
import tarfile

from tests.test_tar_headers import _tar


def _round_trip(scan, rows):
    """The task entries of ``rows`` of a scan's table, through the planner's payload, beside its items."""
    from repack.jobs.image_plan import InputColumns, PayloadWriter
    from repack.jobs.task_inputs import task_inputs

    writer = PayloadWriter(InputColumns.of(scan.items, None), scan.classes)
    start, end = rows
    payload = json.loads(json.dumps({"inputs": writer.inputs(start, end, start)}))  # as plan.json.gz holds it
    return list(zip((scan.items[row] for row in range(start, end)), task_inputs(payload)))


def _same(item, entry) -> None:
    assert (entry["rel"], entry["path"], entry["fingerprint"], entry["label"]) == \
        (item.rel, item.path, list(item.fingerprint), item.label)
    assert entry["member"] == dict(item.member) and entry["meta"] == dict(item.meta)


def test_a_foreign_scan_is_columns_and_its_payload_says_what_each_member_is(tmp_path):
    """``--from webdataset``'s scan: a ``MemberTable``, whose items, task payloads (shards, offsets and sizes as
    columns) and task entries name each member's shard, fingerprint, offset, size and sample key; a scan of
    20,000 samples allocates under 300 bytes a sample at its peak (a ``MemberItem`` per sample and the
    listing's ``TarInfo``s took ~2.8 KB)."""
    import tracemalloc

    from repack.sources import scan_foreign
    from repack.sources.base import FieldChoice

    src = tmp_path / "src"
    src.mkdir()
    for shard in range(2):
        (src / f"s{shard}.tar").write_bytes(_tar(tarfile.USTAR_FORMAT, [
            (f"k{shard}{n:05d}.{ext}", data, tarfile.REGTYPE) for n in range(10_000)
            for ext, data in (("jpg", b"\xff\xd8" + bytes([n % 251]) * (n % 700)), ("cls", str(n % 7).encode()))]))
    import repack.sources.tar_shards  # noqa: F401 - the scan's modules, imported before the count

    tracemalloc.start()
    try:
        scan = scan_foreign(str(src), "webdataset", FieldChoice())
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    table = scan.items
    assert hasattr(table, "shard_ids") and len(table) == 20_000 and not scan.quarantine
    assert peak < 300 * 20_000, peak / 20_000
    for start, end in ((0, 3), (9_998, 10_003), (19_990, 20_000)):
        for row, (item, entry) in zip(range(start, end), _round_trip(scan, (start, end))):
            _same(item, entry)
            with open(item.path, "rb") as fh:
                fh.seek(entry["member"]["offset"])
                assert fh.read(entry["member"]["size"]) == b"\xff\xd8" + bytes([row % 10_000 % 251]) * (row % 10_000 % 700)
            assert item.label == str(row % 10_000 % 7) and entry["meta"]["source_key"] == f"k{row // 10_000}{row % 10_000:05d}"


def test_parquet_rows_are_columns_with_their_image_paths(tmp_path):
    """``--from parquet``'s scan: a ``MemberTable`` of rows (each file's image column, the row, the Image feature's
    path where a row has one); payload and entries name the same row, column and path; ClassLabel names kept; an
    unlabeled row and a null image quarantined."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    from repack.sources import scan_foreign
    from repack.sources.base import FieldChoice
    from repack.sources.parquet_batches import open_parquet

    images = [{"bytes": b"\xff\xd8" + bytes([n]) * (n + 1) if n != 5 else None, "path": f"orig/{n}.jpg" if n % 2 else None}
              for n in range(40)]
    images[33]["path"] = "orig/\x0033.jpg"  # a path is data: a NUL in it shifted every later row's path
    table = pa.table({"image": pa.array(images, type=pa.struct([("bytes", pa.binary()), ("path", pa.string())])),
                      "label": pa.array([n % 3 if n != 7 else None for n in range(40)], pa.int64())})
    meta = {"info": {"features": {"image": {"_type": "Image"}, "label": {"_type": "ClassLabel", "names": ["a", "b", "c"]}}}}
    (tmp_path / "src").mkdir()
    for part in range(2):
        pq.write_table(table.replace_schema_metadata({"huggingface": json.dumps(meta)}),
                       tmp_path / "src" / f"p{part}.parquet", row_group_size=16)
    scan = scan_foreign(str(tmp_path / "src"), "parquet", FieldChoice())
    assert hasattr(scan.items, "shard_ids") and len(scan.items) == 76
    assert {q["source"]: q["reason"][:12] for q in scan.quarantine} == {
        "p0.parquet/5": "image not em", "p1.parquet/5": "image not em", "p0.parquet/7": "no label in ",
        "p1.parquet/7": "no label in "}
    assert scan.classes == {"a": 0, "b": 1, "c": 2}
    pairs = _round_trip(scan, (30, 45))
    for item, entry in pairs:
        _same(item, entry)
        file, row = entry["rel"].split("/")
        assert entry["member"] == {"row": int(row), "column": "image"} and entry["meta"]["source_key"] == row
        assert entry["meta"].get("source_path") == (f"orig/{row}.jpg".replace("/33", "/\x0033") if int(row) % 2 else
                                                    None)
        assert entry["label"] == "abc"[int(row) % 3]
        with open(entry["path"], "rb") as fh:
            column = open_parquet(fh).read(columns=["image"]).column(0).to_pylist()
        assert column[int(row)]["bytes"] == b"\xff\xd8" + bytes([int(row)]) * (int(row) + 1)
    assert {entry["meta"]["source_file"] for _, entry in pairs} == {"p0.parquet", "p1.parquet"}


def test_tar_shards_read_on_a_pool_give_what_one_process_gives(tmp_path):
    """Local shards are read a shard a task on the scan pool: the same table (rows, shards, offsets, sizes,
    keys, labels) and the same quarantine and counts as one process reads, with a cut shard, a pax shard
    (read by tarfile) and shards whose labels first appear in different orders."""
    import numpy as np

    from repack.sources import scan_foreign
    from repack.sources.base import FieldChoice

    src = tmp_path / "src"
    src.mkdir()
    for shard in range(6):
        members = [(f"s{shard}k{n:03d}.{ext}", data, tarfile.REGTYPE) for n in range(40)
                   for ext, data in (("jpg", b"\xff\xd8" + bytes([n]) * (n + shard)), ("cls", b"%d" % ((n + shard) % 5)),
                                     ("txt", b"caption"))]
        raw = _tar(tarfile.PAX_FORMAT if shard == 4 else tarfile.USTAR_FORMAT, members)
        (src / f"{shard:02d}.tar").write_bytes(raw[:len(raw) // 2] if shard == 2 else raw)
    alone = scan_foreign(str(src), "webdataset", FieldChoice(), None, 1)
    pooled = scan_foreign(str(src), "webdataset", FieldChoice(), None, 2)
    a, b = alone.items, pooled.items
    assert len(a) == len(b) > 200 and a.names == b.names and a.keys == b.keys and a.label_names == b.label_names
    assert [s.rel for s in a.shards] == [s.rel for s in b.shards]
    for column in ("label_ids", "shard_ids", "offsets", "sizes"):
        assert np.array_equal(getattr(a, column), getattr(b, column)), column
    assert alone.quarantine == pooled.quarantine and any("02.tar" in q["source"] for q in alone.quarantine)
    assert alone.not_carried == pooled.not_carried and alone.not_carried[0][0] == "txt"


def test_a_set_aside_samples_name_label_beside_index_labels_is_no_crash(tmp_path):
    """Shards whose kept samples are labeled 3 and a sample over the size cap labeled "cat": the kept ones
    packed, the big one quarantined (the bound check read "cat" as an index: ValueError)."""
    from tests.conftest import read_manifest_json, run_repack
    from tests.test_images_job import jpeg_bytes

    (tmp_path / "src").mkdir()
    (tmp_path / "src" / "s.tar").write_bytes(_tar(tarfile.USTAR_FORMAT, [
        ("a.jpg", jpeg_bytes(seed=1), tarfile.REGTYPE), ("a.cls", b"3", tarfile.REGTYPE),
        ("b.jpg", jpeg_bytes(seed=2) + bytes(3000), tarfile.REGTYPE), ("b.cls", b"cat", tarfile.REGTYPE)]))
    done = run_repack("images", tmp_path / "src", tmp_path / "out", "--from", "webdataset", "--verify", "none",
                      "--max-file-size", "2KB", "--quiet")
    assert done.returncode == 0
    m = read_manifest_json(tmp_path / "out")
    assert m["totals"]["samples"] == 1 and [q["source"] for q in m["quarantine"]] == ["s.tar/b.jpg"]
