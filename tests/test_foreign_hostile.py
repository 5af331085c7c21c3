"""Converters quarantine, never abort: hostile tar shards (pax sizes, header bombs, links, devices) and
parquet files (labels out of range, nested columns, large row groups) set aside by name."""

from __future__ import annotations

import io
import json
import tarfile
from pathlib import Path

from tests.conftest import read_manifest_json, run_repack
from tests.test_convert_foreign import packed_samples
from tests.test_images_job import jpeg_bytes


def write_tar(path: Path, members: list[tuple[str, bytes, dict]], special: list[tarfile.TarInfo] = ()) -> None:
    """A pax tar of (name, data, pax headers) members, then ``special`` (link, device) members."""
    with tarfile.open(path, "w", format=tarfile.PAX_FORMAT) as tar:
        for name, data, pax in members:
            info = tarfile.TarInfo(name)
            info.size, info.pax_headers = len(data), pax
            tar.addfile(info, io.BytesIO(data))
        for info in special:
            tar.addfile(info)


def labeled(key: str, seed: int, label: str, pax: dict | None = None) -> list[tuple[str, bytes, dict]]:
    return [(f"{key}.jpg", jpeg_bytes(seed=seed), pax or {}), (f"{key}.cls", label.encode(), {})]


def test_hostile_tar_members_are_quarantined_by_name(tmp_path):
    src = tmp_path / "wds"
    src.mkdir()
    write_tar(src / "a-good.tar", labeled("g0", 1, "0") + labeled("g1", 2, "1"))
    write_tar(src / "b-huge.tar", labeled("h0", 3, "0", {"size": "1" + "0" * 23}))
    write_tar(src / "c-negative.tar", labeled("n0", 4, "1") + labeled("n1", 5, "1", {"size": "-99999999"}))
    write_tar(src / "d-bomb.tar", labeled("b0", 6, "0", {"comment": "x" * (2 << 20)}))  # a 2 MiB pax header
    link, device, fifo = tarfile.TarInfo("l0.jpg"), tarfile.TarInfo("v0.jpg"), tarfile.TarInfo("f0.jpg")
    link.type, link.linkname = tarfile.LNKTYPE, "g0.jpg"
    device.type, device.devmajor, device.devminor = tarfile.CHRTYPE, 1, 5
    fifo.type = tarfile.FIFOTYPE
    write_tar(src / "e-special.tar", labeled("e0", 7, "1"), [link, device, fifo])
    out = tmp_path / "out"
    done = run_repack("images", src, out, "--from", "webdataset", "--json")
    assert "Traceback" not in done.stderr
    manifest = read_manifest_json(out)
    reasons = {q["source"]: q["reason"] for q in manifest["quarantine"]}
    assert "declares a size of 100000000000000000000000 bytes" in reasons["b-huge.tar/h0.jpg"]
    assert "declares a size of -99999999 bytes" in reasons["c-negative.tar/n1.jpg"]
    assert "over 1048576" in reasons["d-bomb.tar"]
    for name in ("l0.jpg", "v0.jpg", "f0.jpg"):
        assert "not a regular file" in reasons[f"e-special.tar/{name}"]
    sources = sorted(json.loads(s["json"])["source_key"] for s in packed_samples(out))
    assert sources == ["e0", "g0", "g1", "n0"]
    assert run_repack("verify", out).returncode == 0


def test_integer_labels_bounded_and_distinct_strings_distinct_classes(tmp_path):
    src = tmp_path / "wds"
    src.mkdir()
    write_tar(src / "a.tar", labeled("s0", 1, "3") + labeled("s1", 2, "99999999999999999999") + labeled("s2", 3, "7"))
    out = tmp_path / "out"
    run_repack("images", src, out, "--from", "webdataset", "--quiet")
    manifest = read_manifest_json(out)
    assert manifest["classes"] == {"3": 3, "7": 7}  # the source's own indices, the huge one set aside
    assert "over the largest class index 999999999" in manifest["quarantine"][0]["reason"]
    assert manifest["quarantine"][0]["source"] == "a.tar/s1.jpg"
    from pipelines.torch_webdataset import ImageShardDataset

    assert sorted(label for _, label in ImageShardDataset(out, decode=False)) == [3, 7]

    src2 = tmp_path / "wds2"
    src2.mkdir()
    write_tar(src2 / "a.tar", labeled("s0", 1, "01") + labeled("s1", 2, "1") + labeled("s2", 3, " 1\n"))
    out2 = tmp_path / "out2"
    run_repack("images", src2, out2, "--from", "webdataset", "--quiet")
    manifest = read_manifest_json(out2)
    assert manifest["classes"] == {"01": 0, "1": 1}  # two strings, two classes (" 1\n" is "1", stripped)
    assert sorted(int(s["cls"]) for s in packed_samples(out2)) == [0, 1, 1]
    assert run_repack("verify", out2).returncode == 0


def write_parquet(path: Path, table) -> None:
    import pyarrow.parquet as pq

    pq.write_table(table, path)


def test_parquet_labels_out_of_range_stripped_and_nested_fields(tmp_path):
    import datasets
    import pyarrow as pa

    images = [jpeg_bytes(seed=i) for i in range(5)]
    features = datasets.Features({"image": datasets.Image(), "label": datasets.ClassLabel(names=["a", "b"])})
    ds = datasets.Dataset.from_dict({"image": [{"bytes": b, "path": None} for b in images],
                                     "label": [0, 1, 0, 1, 0]}, features=features)
    ds.to_parquet(str(tmp_path / "hf.parquet"))
    table = pa.parquet.read_table(tmp_path / "hf.parquet")  # the same file with values out of range
    labels = pa.array([0, 1, 7, -1, 1], pa.int64())
    write_parquet(tmp_path / "bad.parquet", table.set_column(1, "label", labels).replace_schema_metadata(
        table.schema.metadata))
    out = tmp_path / "out"
    run_repack("images", tmp_path / "bad.parquet", out, "--from", "parquet", "--quiet")
    manifest = read_manifest_json(out)
    assert manifest["totals"]["samples"] == 3 and manifest["classes"] == {"a": 0, "b": 1}
    reasons = {q["source"]: q["reason"] for q in manifest["quarantine"]}
    assert set(reasons) == {"bad.parquet/2", "bad.parquet/3"} and "outside the ClassLabel" in reasons["bad.parquet/2"]
    assert run_repack("verify", out).returncode == 0

    strings = pa.table({"image": pa.array(images[:3], pa.binary()), "label": ["cat ", " cat", "dog\n"]})
    write_parquet(tmp_path / "strings.parquet", strings)
    run_repack("images", tmp_path / "strings.parquet", tmp_path / "out2", "--from", "parquet", "--quiet")
    assert read_manifest_json(tmp_path / "out2")["classes"] == {"cat": 0, "dog": 1}

    nested = pa.table({"image": pa.array([[images[0]], [images[1]]], pa.list_(pa.binary())),
                       "meta": pa.array([{"img": images[0]}, {"img": images[1]}]),
                       "label": pa.array([[1], [2]], pa.list_(pa.int64()))})
    write_parquet(tmp_path / "nested.parquet", nested)
    for field in ("image", "meta"):
        bad = run_repack("images", tmp_path / "nested.parquet", tmp_path / f"x-{field}", "--from", "parquet",
                         "--image-field", field, check=False)
        assert bad.returncode == 2 and "Traceback" not in bad.stderr
        assert len(bad.stderr.strip().splitlines()) == 1 and f"column {field!r} is" in bad.stderr
    flat = pa.table({"image": pa.array(images[:2], pa.binary()), "label": pa.array([[1], [2]], pa.list_(pa.int64()))})
    write_parquet(tmp_path / "listlabel.parquet", flat)
    bad = run_repack("images", tmp_path / "listlabel.parquet", tmp_path / "y", "--from", "parquet", check=False)
    assert bad.returncode == 2 and "label column 'label' is list<" in bad.stderr and "Traceback" not in bad.stderr


def test_a_parquet_file_over_the_file_size_cap_is_packed_in_bounded_batches(tmp_path):
    """A file (and its one row group) over --max-file-size: its rows are packed, each under the cap; the
    task reads its rows batch by batch (several batches per row group)."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    from repack.sources.parquet_batches import BATCH_BYTES, RowCursor, open_parquet

    images = [jpeg_bytes(seed=i) for i in range(40)]
    table = pa.table({"image": pa.array(images, pa.binary()), "label": [str(i % 3) for i in range(40)]})
    pq.write_table(table, tmp_path / "big.parquet", row_group_size=40)
    size = (tmp_path / "big.parquet").stat().st_size
    cap = max(len(b) for b in images) + 1  # every image fits, the file does not
    assert size > cap
    out = tmp_path / "out"
    run_repack("images", tmp_path / "big.parquet", out, "--from", "parquet", "--max-file-size", str(cap), "--quiet")
    manifest = read_manifest_json(out)
    assert manifest["totals"]["samples"] == 40 and manifest["quarantine"] == []
    assert [s["jpg"] for s in packed_samples(out)] == images

    with open(tmp_path / "big.parquet", "rb") as fh:
        pf = open_parquet(fh)
        average = pf.metadata.row_group(0).total_byte_size / 40
        import repack.sources.parquet_batches as batches

        batches.BATCH_BYTES = int(average * 4)  # four rows a batch: ten batches for the row group
        try:
            cursor = RowCursor(pf, "image")
            read = [cursor.value(row) for row in range(40)]
            assert len(cursor.values) <= 4 and read == images
        finally:
            batches.BATCH_BYTES = BATCH_BYTES


def test_parquet_rows_in_any_order_are_read_in_file_order(tmp_path, monkeypatch):
    """A task's rows in --shuffle's order: each comes back in its place, read in file order (the row group is
    started once, where each row behind the cursor restarted it: 28x slower), with the read-ahead bounded (past
    it a row is read where it comes)."""
    import random

    import pyarrow as pa
    import pyarrow.parquet as pq

    import repack.sources.members as members
    import repack.sources.parquet_batches as batches

    images = [jpeg_bytes(seed=i) for i in range(60)]
    pq.write_table(pa.table({"image": pa.array(images, pa.binary())}), tmp_path / "a.parquet", row_group_size=60)
    rows = list(range(60))
    random.Random(3).shuffle(rows)
    entries = [{"path": str(tmp_path / "a.parquet"), "rel": f"a.parquet/{row}",
                "member": {"row": row, "column": "image"}} for row in rows]
    monkeypatch.setattr(batches, "BATCH_BYTES", 4 * len(images[0]))  # a few rows a batch
    started = []
    real_batch_rows = batches.batch_rows
    monkeypatch.setattr(batches, "batch_rows", lambda *a: started.append(1) or real_batch_rows(*a))
    for budget in (1 << 30, 5 * max(map(len, images))):
        monkeypatch.setattr(members, "REORDER_BYTES", budget)
        started.clear()
        assert list(members.read_members(entries)) == [images[row] for row in rows]
        restarts = len(started)
        if budget == 1 << 30:
            assert restarts == 1
    assert 1 < restarts < 60


def test_a_key_again_after_other_samples_never_joins_the_first_and_compressed_shards_are_named(tmp_path):
    """WebDataset reads a sample as a run of members of one key: a key again after another sample gave its label to
    the first run's image (a red image trained as the blue one's class). The later run is set aside by name, and the
    first run, left without a label, too. A .tar.xz/.tar.bz2/.tar.zst shard was skipped as junk, unnamed. A label
    member with a byte order mark made a class of its own."""
    src = tmp_path / "wds"
    src.mkdir()
    write_tar(src / "a.tar", [("k1.jpg", jpeg_bytes(seed=1), {}), *labeled("k2", 2, "cat"),
                              ("k1.jpg", jpeg_bytes(seed=3), {}), ("k1.cls", b"dog", {}),
                              ("k3.jpg", jpeg_bytes(seed=4), {}), ("k3.cls", b"\xef\xbb\xbfcat", {})])
    for suffix in (".tar.xz", ".tar.bz2", ".tar.zst"):
        (src / f"b{suffix}").write_bytes(b"whatever")
    run_repack("images", src, tmp_path / "out", "--from", "webdataset", "--quiet")
    manifest = read_manifest_json(tmp_path / "out")
    reasons = {q["source"]: q["reason"] for q in manifest["quarantine"]}
    assert "again after other samples" in reasons["a.tar/k1.jpg (again, 2)"]
    assert "again after other samples" in reasons["a.tar/k1.cls (again, 2)"]
    assert reasons["a.tar/k1.jpg"].startswith("no label member")
    assert all(reasons[f"b{suffix}"].startswith(f"compressed tar shard ({suffix})")
               for suffix in (".tar.xz", ".tar.bz2", ".tar.zst"))
    assert manifest["classes"] == {"cat": 0} and manifest["totals"]["samples"] == 2


def test_a_shard_repaired_or_grown_appends_its_new_samples(tmp_path):
    """A shard cut short packed its first samples; re-downloaded whole, the --append said those (byte-identical)
    samples had changed: the container's size stood for each member's. A held member's content is compared now."""
    src = tmp_path / "wds"
    src.mkdir()
    members = [m for i in range(4) for m in labeled(f"s{i}", i, str(i % 2))]
    write_tar(tmp_path / "full.tar", members)
    whole = (tmp_path / "full.tar").read_bytes()
    with tarfile.open(tmp_path / "full.tar") as tar:
        cut = [info.offset for info in tar][4]  # after s0 and s1: a download cut at a member boundary
    (src / "a.tar").write_bytes(whole[:cut])
    run_repack("images", src, tmp_path / "out", "--from", "webdataset", "--quiet")
    assert read_manifest_json(tmp_path / "out")["totals"]["samples"] == 2
    (src / "a.tar").write_bytes(whole)
    done = run_repack("images", src, tmp_path / "out", "--from", "webdataset", "--append")
    assert "2 new sample(s), 4 in all" in done.stdout, done.stdout + done.stderr


def test_parquet_metadata_of_another_shape_is_refused_or_ignored_by_name(tmp_path):
    """ClassLabel names that are not distinct strings (ints, lists, a string: indexed letter by letter into wrong
    labels, names equal once stripped) and two columns named "label" gave tracebacks or wrong labels; metadata
    whose info or features are not objects gave a traceback."""
    import pyarrow as pa

    images = pa.array([jpeg_bytes(seed=i) for i in range(2)], pa.binary())
    labels = pa.array([0, 1], pa.int64())
    table = pa.table({"image": images, "label": labels})
    cases = {"ints": {"info": {"features": {"label": {"_type": "ClassLabel", "names": [10, 20]}}}},
             "string": {"info": {"features": {"label": {"_type": "ClassLabel", "names": "notalist"}}}},
             "stripped": {"info": {"features": {"label": {"_type": "ClassLabel", "names": [" cat", "cat"]}}}},
             "info-list": {"info": []}, "features-list": {"info": {"features": []}}}
    for name, metadata in cases.items():
        folder = tmp_path / name
        folder.mkdir()
        write_parquet(folder / "a.parquet", table.replace_schema_metadata({"huggingface": json.dumps(metadata)}))
        done = run_repack("images", folder, tmp_path / f"out-{name}", "--from", "parquet", check=False)
        assert "Traceback" not in done.stderr, (name, done.stderr)
        if name.endswith("list"):
            assert done.returncode == 0 and read_manifest_json(tmp_path / f"out-{name}")["classes"] == {"0": 0, "1": 1}
        else:
            assert done.returncode == 2 and "are not distinct non-empty strings" in done.stderr, (name, done.stderr)
    folder = tmp_path / "twice"
    folder.mkdir()
    write_parquet(folder / "a.parquet", pa.Table.from_arrays([images, labels, labels], ["image", "label", "label"]))
    done = run_repack("images", folder, tmp_path / "out-twice", "--from", "parquet", check=False)
    assert done.returncode == 2 and "2 columns are named 'label'" in done.stderr
