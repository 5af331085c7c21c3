"""Converted sources damaged or disagreeing with themselves: nothing is dropped without a record naming it,
no label is lost or renumbered, and an --append never packs a file twice."""

from __future__ import annotations

import io
import json
import os
import tarfile
from pathlib import Path

import pytest

from tests.conftest import read_manifest_json, run_repack
from tests.test_convert_foreign import packed_samples
from tests.test_foreign_hostile import labeled, write_tar
from tests.test_images_job import jpeg_bytes


def six_samples(path: Path) -> dict[str, int]:
    """A tar of six labeled samples at ``path``; each member's header offset by name."""
    write_tar(path, [m for i in range(6) for m in labeled(f"s{i}", i, str(i))])
    with tarfile.open(path) as tar:
        return {info.name: info.offset for info in tar}


@pytest.mark.parametrize("damage", ["bad checksum", "cut in a header", "cut at a member", "two tars joined"])
def test_a_tar_whose_listing_stops_early_is_named(tmp_path, damage):
    whole = tmp_path / "whole.tar"
    offsets = six_samples(whole)
    raw = bytearray(whole.read_bytes())
    header = offsets["s3.jpg"]
    if damage == "bad checksum":
        raw[header + 148] ^= 0x11
    elif damage == "cut in a header":
        raw = raw[:header + 100]
    elif damage == "cut at a member":
        raw = raw[:header]
    else:
        raw += whole.read_bytes()
    src = tmp_path / "src"
    src.mkdir()
    (src / "a.tar").write_bytes(bytes(raw))
    out = tmp_path / "out"
    run_repack("images", src, out, "--from", "webdataset", "--quiet")
    manifest = read_manifest_json(out)
    assert manifest["totals"]["samples"] == (6 if damage == "two tars joined" else 3)
    [record] = manifest["quarantine"]
    assert record["source"] == "a.tar" and "sample(s) listed before it" in record["reason"]
    assert run_repack("verify", out).returncode == 0


def test_a_whole_tar_with_its_padding_is_clean(tmp_path):
    src = tmp_path / "src"
    src.mkdir()
    six_samples(src / "a.tar")
    with open(src / "a.tar", "ab") as fh:  # a record's padding past the end-of-archive blocks: zeros
        fh.write(bytes(10240))
    run_repack("images", src, tmp_path / "out", "--from", "webdataset", "--quiet")
    manifest = read_manifest_json(tmp_path / "out")
    assert manifest["totals"]["samples"] == 6 and manifest["quarantine"] == []


def test_zero_padded_integer_labels_keep_their_values(tmp_path):
    """As repack's own .cls members are written: a subset of a repacked dataset keeps its class indices."""
    src = tmp_path / "src"
    src.mkdir()
    write_tar(src / "a.tar", labeled("s0", 1, "03") + labeled("s1", 2, "07") + labeled("s2", 3, "12")
              + labeled("s3", 4, "0000000005"))
    out = tmp_path / "out"
    run_repack("images", src, out, "--from", "webdataset", "--quiet")
    assert read_manifest_json(out)["classes"] == {"0000000005": 5, "03": 3, "07": 7, "12": 12}
    assert sorted(int(s["cls"]) for s in packed_samples(out)) == [3, 5, 7, 12]


def parquet(path: Path, images: list[bytes], labels: list, names: list[str] | None, row_group_size=None,
            metadata_label: str = "label") -> None:
    """A datasets-style parquet file: the Image struct column, integer labels, ClassLabel ``names`` (or none)."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    features = {"image": {"_type": "Image"}}
    if names is not None:
        features[metadata_label] = {"_type": "ClassLabel", "names": names}
    column = pa.array([{"bytes": b, "path": None} for b in images],
                      pa.struct([("bytes", pa.binary()), ("path", pa.string())]))
    columns = {"image": column, **({"label": pa.array(labels, pa.int64())} if labels is not None else {})}
    table = pa.table(columns).replace_schema_metadata(
        {b"huggingface": json.dumps({"info": {"features": features}}).encode()})
    pq.write_table(table, path, row_group_size=row_group_size)


def test_parquet_files_with_other_class_names_lose_no_label(tmp_path):
    src = tmp_path / "src"
    src.mkdir()
    parquet(src / "a.parquet", [jpeg_bytes(seed=1), jpeg_bytes(seed=2)], [0, 1], ["cat", "dog"])
    parquet(src / "b.parquet", [jpeg_bytes(seed=3), jpeg_bytes(seed=4)], [0, 2], ["cat", "dog", "bird"])
    parquet(src / "c.parquet", [jpeg_bytes(seed=5)], [1], None)  # no names: its 1 is no class of the others
    out = tmp_path / "out"
    run_repack("images", src, out, "--from", "parquet", "--quiet")
    manifest = read_manifest_json(out)
    assert manifest["classes"] == {"cat": 0, "dog": 1, "bird": 2}
    classes = [(json.loads(s["json"])["source_key"], json.loads(s["json"])["class"], int(s["cls"]))
               for s in packed_samples(out)]
    assert classes == [("0", "cat", 0), ("1", "dog", 1), ("0", "cat", 0), ("1", "bird", 2)]
    [record] = manifest["quarantine"]
    assert record["source"] == "c.parquet/0" and "without ClassLabel names" in record["reason"]
    assert run_repack("verify", out).returncode == 0


def test_parquet_negative_labels_damage_and_stale_metadata(tmp_path):
    src = tmp_path / "src"
    src.mkdir()
    parquet(src / "a.parquet", [jpeg_bytes(seed=i) for i in range(4)], [2, 10, -1, 0], None)
    parquet(src / "b.parquet", [jpeg_bytes(seed=i + 10, size=(64, 64)) for i in range(6)], [0, 1] * 3, ["x", "y"],
            row_group_size=2)
    parquet(src / "c.parquet", [jpeg_bytes(seed=30)], None, ["x", "y"])  # metadata names a column it lacks
    import pyarrow.parquet as pq

    raw = bytearray((src / "b.parquet").read_bytes())
    page = pq.ParquetFile(src / "b.parquet").metadata.row_group(1).column(0).data_page_offset
    raw[page:page + 40] = b"\xff" * 40  # the second row group's page header
    (src / "b.parquet").write_bytes(bytes(raw))
    out = tmp_path / "out"
    done = run_repack("images", src / "a.parquet", out, "--from", "parquet", "--quiet")
    manifest = read_manifest_json(out)
    assert manifest["classes"] == {"0": 0, "10": 10, "2": 2}  # -1 is no class: the others keep their values
    assert [q["source"] for q in manifest["quarantine"]] == ["a.parquet/2"]
    assert "negative" in manifest["quarantine"][0]["reason"]
    done = run_repack("images", src / "b.parquet", tmp_path / "damaged", "--from", "parquet", "--quiet")
    manifest = read_manifest_json(tmp_path / "damaged")
    assert manifest["totals"]["samples"] == 2 and "Traceback" not in done.stderr
    [record] = manifest["quarantine"]
    assert record["source"] == "b.parquet" and record["reason"].startswith("parquet file damaged after 2 row(s)")
    done = run_repack("images", src / "c.parquet", tmp_path / "stale", "--from", "parquet", check=False)
    assert done.returncode == 0 and "Traceback" not in done.stderr
    assert read_manifest_json(tmp_path / "stale")["totals"]["samples"] == 1


def test_a_duplicate_never_gets_a_second_sample_on_append(tmp_path):
    """A quarantined second copy (a tar's second member of one name, a list's row listed twice) is named apart
    from the packed first: an --append after its container or file changed mtime packs nothing new."""
    src = tmp_path / "wds"
    src.mkdir()
    with tarfile.open(src / "a.tar", "w") as tar:
        for name, data in (("k.jpg", jpeg_bytes(seed=1)), ("k.cls", b"0"), ("l.jpg", jpeg_bytes(seed=2)),
                           ("l.cls", b"1"), ("l.jpg", jpeg_bytes(seed=3))):
            info = tarfile.TarInfo(name)
            info.size = len(data)
            tar.addfile(info, io.BytesIO(data))
    listed = tmp_path / "files"
    listed.mkdir()
    for name in ("a", "b"):
        (listed / f"{name}.jpg").write_bytes(jpeg_bytes(seed=ord(name)))
    (listed / "list.csv").write_text("path,label\na.jpg,x\nb.jpg,y\na.jpg,x\n")
    for source, flag, changed in ((src, "--from", src / "a.tar"), (listed / "list.csv", "--list", listed / "a.jpg")):
        out = tmp_path / f"out-{flag}"
        args = [flag, "webdataset"] if flag == "--from" else [flag]
        run_repack("images", source, out, *args, "--quiet")
        assert read_manifest_json(out)["totals"]["samples"] == 2
        [record] = read_manifest_json(out)["quarantine"]
        assert record["source"] == ("a.tar/l.jpg" if flag == "--from" else "a.jpg") + " (again, 2)"
        os.utime(changed, ns=(10**18, 10**18))  # the same bytes, another mtime (cp without -p)
        run_repack("images", source, out, *args, "--append", "--quiet")
        manifest = read_manifest_json(out)
        assert manifest["totals"]["samples"] == 2, manifest["quarantine"]
        assert len(packed_samples(out)) == 2


def test_an_older_datasets_record_of_a_copy_under_the_packed_name_is_not_planned_again(tmp_path):
    """A dataset of an older repack named a tar's second member of one name as the packed first: its record
    names an input that holds a sample, which an --append after the shard changed packed a second time."""
    src = tmp_path / "wds"
    src.mkdir()
    write_tar(src / "a.tar", [("k.jpg", jpeg_bytes(seed=1), {}), ("k.cls", b"0", {}), ("l.jpg", jpeg_bytes(seed=2), {}),
                              ("l.cls", b"1", {}), ("l.jpg", jpeg_bytes(seed=3), {})])
    out = tmp_path / "out"
    run_repack("images", src, out, "--from", "webdataset", "--quiet")
    manifest = read_manifest_json(out)
    manifest["quarantine"][0]["source"] = "a.tar/l.jpg"  # as the older repack wrote it
    (out / "manifest.json").write_text(json.dumps(manifest))
    assert "nothing new" in run_repack("images", src, out, "--from", "webdataset", "--append").stdout
    os.utime(src / "a.tar", ns=(10**18, 10**18))
    write_tar(src / "b.tar", labeled("m", 4, "0"))
    run_repack("images", src, out, "--from", "webdataset", "--append", "--quiet")
    manifest = read_manifest_json(out)
    assert manifest["totals"]["samples"] == 3 and len(packed_samples(out)) == 3
    assert [q["source"] for q in manifest["quarantine"]] == ["a.tar/l.jpg (again, 2)"]  # one record of the copy


def listed_jpeg(tmp_path: Path, rows: str) -> tuple[Path, Path]:
    """``data/a.jpg`` and ``data/list.csv`` (``rows`` after its header) packed into ``out``: (the list, OUT)."""
    data = tmp_path / "data"
    data.mkdir()
    (data / "a.jpg").write_bytes(jpeg_bytes(seed=1))
    (data / "list.csv").write_text("path\n" + rows)
    out = tmp_path / "out"
    run_repack("images", data / "list.csv", out, "--list", "--quiet")
    return data / "list.csv", out


def test_a_copy_new_in_an_append_is_recorded(tmp_path):
    """A list row naming a packed file again, added alone: version N+1 records it, as a fresh pack does."""
    listing, out = listed_jpeg(tmp_path, "a.jpg\n")
    data = listing.parent
    (data / "list.csv").write_text("path\na.jpg\na.jpg\n")
    run_repack("images", data / "list.csv", out, "--list", "--append", "--quiet")
    assert [q["source"] for q in read_manifest_json(out)["quarantine"]] == ["a.jpg (again, 2)"]


def test_fields_name_members_whatever_their_case(tmp_path):
    """Member extensions are read lower-cased: --image-field JPG / --label-field CLS name them too (every sample
    was quarantined and the job exited 7)."""
    src = tmp_path / "src"
    src.mkdir()
    write_tar(src / "a.tar", [("k.JPG", jpeg_bytes(seed=1), {}), ("k.CLS", b"0", {}),
                              ("l.JPG", jpeg_bytes(seed=2), {}), ("l.CLS", b"1", {})])
    for field in (("--image-field", "JPG"), ("--label-field", "CLS")):
        out = tmp_path / f"out{field[0]}"
        run_repack("images", src, out, "--from", "webdataset", *field, "--quiet")
        assert read_manifest_json(out)["totals"]["samples"] == 2


def test_a_list_written_again_in_another_spelling_packs_nothing_twice(tmp_path):
    """A list regenerated with ./ paths or absolute ones (or the dataset made from such a list and the new one
    plain): every file already held is known; only the new file is packed. A spelling that would name another
    file through a symbolic link is not taken."""
    data = tmp_path / "data"
    (data / "real").mkdir(parents=True)
    for name, seed in (("a", 1), ("b", 2), ("c", 3)):
        (data / f"{name}.jpg").write_bytes(jpeg_bytes(seed=seed))
    (data / "real" / "d.jpg").write_bytes(jpeg_bytes(seed=4))
    listing = data / "list.csv"
    for first, again in ((["a.jpg", "b.jpg"], ["./a.jpg", str(data / "b.jpg"), "c.jpg"]),
                         (["./a.jpg", "./b.jpg"], ["a.jpg", "b.jpg", "c.jpg"])):
        out = tmp_path / f"out-{first[0]}"
        listing.write_text("path\n" + "".join(f"{p}\n" for p in first))
        run_repack("images", listing, out, "--list", "--quiet")
        listing.write_text("path\n" + "".join(f"{p}\n" for p in again))
        run_repack("images", listing, out, "--list", "--append", "--quiet")
        manifest = read_manifest_json(out)
        assert manifest["totals"]["samples"] == 3 and manifest["quarantine"] == []
        paths = sorted(json.loads(s["json"])["path"] for s in packed_samples(out))
        assert paths == sorted(first + ["c.jpg"])
    (tmp_path / "via").symlink_to(data)  # the list read through a link; rows written with the real path
    out = tmp_path / "out-via"
    (data / "list.csv").write_text("path\na.jpg\n")
    run_repack("images", tmp_path / "via" / "list.csv", out, "--list", "--quiet")
    (data / "list.csv").write_text(f"path\n{data / 'a.jpg'}\nb.jpg\n")
    run_repack("images", tmp_path / "via" / "list.csv", out, "--list", "--append", "--quiet")
    assert sorted(json.loads(s["json"])["path"] for s in packed_samples(out)) == ["a.jpg", "b.jpg"]
    (data / "real" / "deep").mkdir()
    (data / "d.jpg").write_bytes(jpeg_bytes(seed=5))
    (data / "deep").symlink_to(data / "real" / "deep")  # deep/.. is data/real, not data
    out = tmp_path / "out-link"
    listing.write_text("path\nd.jpg\n")
    run_repack("images", listing, out, "--list", "--quiet")
    listing.write_text("path\ndeep/../d.jpg\n")  # lexically d.jpg; it opens data/real/d.jpg
    run_repack("images", listing, out, "--list", "--append", "--quiet")
    assert sorted(json.loads(s["json"])["path"] for s in packed_samples(out)) == ["d.jpg", "deep/../d.jpg"]


def test_an_unnamed_files_integer_labels_are_not_names_of_digits(tmp_path):
    """Beside a file whose ClassLabel names are "1", "2", "3", another file's integer label 1 (an index) is not
    the class named "1": quarantined, where it was packed as that class."""
    src = tmp_path / "src"
    src.mkdir()
    parquet(src / "a.parquet", [jpeg_bytes(seed=i) for i in range(3)], [0, 1, 2], ["1", "2", "3"])
    parquet(src / "b.parquet", [jpeg_bytes(seed=i + 5) for i in range(3)], [0, 1, 2], None)
    out = tmp_path / "out"
    run_repack("images", src, out, "--from", "parquet", "--quiet")
    manifest = read_manifest_json(out)
    assert manifest["totals"]["samples"] == 3 and manifest["classes"] == {"1": 0, "2": 1, "3": 2}
    assert sorted(q["source"] for q in manifest["quarantine"]) == ["b.parquet/0", "b.parquet/1", "b.parquet/2"]
    assert all("an integer index" in q["reason"] for q in manifest["quarantine"])


def test_rows_listed_twice_in_another_spelling_are_named_apart_each(tmp_path):
    """An image list naming a file as ``./a.jpg`` and twice as ``a.jpg``: the rows set aside have a name each (two
    records had the same source)."""
    _, out = listed_jpeg(tmp_path, "a.jpg\n./a.jpg\na.jpg\n")
    sources = [q["source"] for q in read_manifest_json(out)["quarantine"]]
    assert sorted(sources) == ["a.jpg", "a.jpg (again, 2)"] and len(packed_samples(out)) == 1


def test_a_text_list_row_repeated_is_named_apart_with_its_line_and_never_packed_twice(tmp_path):
    """A text list naming a file twice quarantined the repeat under the packed file's own name, with no line:
    an --append then took that file for one without a sample and, once it changed, packed it a second time.
    The repeat is ``a.jsonl (again, 2)`` with its row's line; another spelling is a second path, not a symlink.
    An older repack's record under the packed name is known for what it is."""
    from tests.tools.text import gpt2_tokenizer, write_tokenizer

    tok = write_tokenizer(gpt2_tokenizer(), tmp_path / "tok")
    data = tmp_path / "data"
    data.mkdir()
    for name in ("a", "b"):
        (data / f"{name}.jsonl").write_text(json.dumps({"text": f"doc {name}"}) + "\n")
    (data / "list.txt").write_text("a.jsonl\nb.jsonl\na.jsonl\n./b.jsonl\n")
    out = tmp_path / "out"
    run_repack("text", data / "list.txt", out, "--list", "--tokenizer", tok, "--quiet")
    records = {q["source"]: q["reason"] for q in read_manifest_json(out)["quarantine"]}
    assert records == {"a.jsonl (again, 2)": "listed twice (list.txt:3): read once",
                       "./b.jsonl": "same file as b.jsonl (hard link or second path): read once, under b.jsonl "
                                    "(list.txt:4)"}
    manifest = read_manifest_json(out)
    manifest["quarantine"] = [{"source": "a.jsonl", "line": None, "reason": "listed twice: read once"}
                              if q["source"] == "a.jsonl (again, 2)" else q for q in manifest["quarantine"]]
    (out / "manifest.json").write_text(json.dumps(manifest))  # as an older repack wrote it
    with open(data / "a.jsonl", "a") as grown:
        grown.write(json.dumps({"text": "doc a again"}) + "\n")
    refused = run_repack("text", data / "list.txt", out, "--list", "--tokenizer", tok, "--append", check=False)
    assert refused.returncode == 2 and "changed since the dataset packed them" in refused.stderr, refused.stdout
