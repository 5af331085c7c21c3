"""List files name the line of every row they quarantine (a missing file, a folder, a path outside
the root), for images/video lists and text lists alike; labels follow one rule everywhere they
are read (surrounding whitespace stripped): list columns and class folder names."""

from __future__ import annotations

import json

from tests.conftest import read_manifest_json, run_repack
from tests.test_images_job import jpeg_bytes
from tests.tools.text import gpt2_tokenizer, write_tokenizer


def test_image_list_rows_name_their_line_and_labels_are_stripped(tmp_path):
    (tmp_path / "imgs").mkdir()
    for i in range(3):
        (tmp_path / "imgs" / f"{i}.jpg").write_bytes(jpeg_bytes(seed=i))
    (tmp_path / "folder.jpg").mkdir()  # a folder entry
    for kind in ("csv", "jsonl"):
        rows = [("imgs/0.jpg", "cat"), ("imgs/1.jpg", " cat "), ("imgs/2.jpg", "dog\t"),
                ("imgs/missing.jpg", "cat"), ("folder.jpg", "dog")]
        listing = tmp_path / f"list.{kind}"
        if kind == "csv":
            listing.write_text("path,label\n" + "".join(f"{p},{label}\n" for p, label in rows))
        else:
            listing.write_text("".join(json.dumps({"path": p, "label": label}) + "\n" for p, label in rows))
        first = 2 if kind == "csv" else 1  # the line of the first row
        out = tmp_path / f"out-{kind}"
        run_repack("images", listing, out, "--list", "--quiet")
        m = read_manifest_json(out)
        assert m["classes"] == {"cat": 0, "dog": 1} and m["totals"]["samples"] == 3
        reasons = {q["source"]: q["reason"] for q in m["quarantine"]}
        assert reasons["imgs/missing.jpg"].endswith(f"(list.{kind}:{first + 3})"), reasons
        assert reasons["folder.jpg"] == f"not a regular file (folder) (list.{kind}:{first + 4})"
        assert {q["label"] for q in m["quarantine"]} == {"cat", "dog"}


def test_class_folders_differing_by_whitespace_are_one_class(tmp_path):
    src = tmp_path / "src"
    for i, folder in enumerate(("cat", "cat ", " dog", "  ")):
        (src / folder).mkdir(parents=True)
        (src / folder / f"{i}.jpg").write_bytes(jpeg_bytes(seed=i))
    out = tmp_path / "out"
    run_repack("images", src, out, "--quiet")
    m = read_manifest_json(out)
    assert m["classes"] == {"cat": 0, "dog": 1} and m["totals"]["samples"] == 3
    [entry] = m["quarantine"]
    assert entry["source"] == "  /3.jpg" and "empty once its surrounding whitespace is stripped" in entry["reason"]


def test_text_list_rows_name_their_line(tmp_path):
    tok = write_tokenizer(gpt2_tokenizer(), tmp_path / "tok")
    (tmp_path / "t").mkdir()
    (tmp_path / "t" / "a.jsonl").write_text(json.dumps({"text": "hello there"}) + "\n")
    (tmp_path / "t" / "sub.jsonl").mkdir()
    (tmp_path / "t" / "list.txt").write_text("a.jsonl\n# a comment\nmissing.jsonl\nsub.jsonl\n")
    run_repack("text", tmp_path / "t" / "list.txt", tmp_path / "out", "--list", "--tokenizer", tok.parent, "--quiet")
    reasons = {q["source"]: q["reason"] for q in read_manifest_json(tmp_path / "out")["quarantine"]}
    assert reasons["missing.jsonl"].endswith("(list.txt:3)") and "unreadable" in reasons["missing.jsonl"]
    assert reasons["sub.jsonl"] == "not a regular file (folder) (list.txt:4)"


def test_a_list_saved_with_a_byte_order_mark_reads_its_header(tmp_path):
    """Excel's "CSV UTF-8" starts with a byte order mark: the first column is still "path"."""
    (tmp_path / "a.jpg").write_bytes(jpeg_bytes(seed=1))
    (tmp_path / "list.csv").write_bytes(b"\xef\xbb\xbfpath,label\na.jpg,cat\n")
    run_repack("images", tmp_path / "list.csv", tmp_path / "out", "--list", "--quiet")
    manifest = read_manifest_json(tmp_path / "out")
    assert manifest["totals"]["samples"] == 1 and manifest["classes"] == {"cat": 0}
