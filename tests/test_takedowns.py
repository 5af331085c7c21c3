"""Takedowns stay down: `--append` after `repack remove` works and never packs a removed source again; a
copy of SOURCE (new mtimes) adds nothing; a changed file never gets a second sample."""

from __future__ import annotations

import json
import os
import shutil
import tarfile
from pathlib import Path

from repack.lifecycle.input_columns import encode_names
from repack.lifecycle.publish import read_inputs_record
from repack.store import open_store
from tests.conftest import read_manifest_json, run_repack
from tests.test_dataset_versions import make_source
from tests.test_images_job import jpeg_bytes
from tests.test_remove_lmdb_tokens import shard_runs


def packed_sources(out: Path) -> list[str]:
    """The source path of every sample the latest version holds (from each sample's .json member)."""
    sources = []
    for shard in read_manifest_json(out)["shards"]:
        with tarfile.open(out / shard["path"]) as tar:
            sources += [json.loads(tar.extractfile(m).read())["path"] for m in tar if m.name.endswith(".json")]
    return sorted(sources)


def test_append_after_remove_never_packs_a_removed_source_again(tmp_path):
    src, out = make_source(tmp_path / "src"), tmp_path / "out"
    run_repack("images", src, out, "--shard-size", "4", "--quiet")
    (tmp_path / "gone.txt").write_text("cat/c0.jpg\ndog/d1.jpg\n")
    run_repack("remove", out, "--sources", tmp_path / "gone.txt")
    again = run_repack("images", src, out, "--shard-size", "4", "--append")  # the removed files are still in SRC
    assert "nothing new" in again.stdout and "2 removed source(s) found again and left out" in again.stdout
    (src / "cat" / "c0.jpg").write_bytes(jpeg_bytes(seed=77))  # a takedown's name with other content
    (src / "cat" / "late.jpg").write_bytes(jpeg_bytes(seed=78))
    done = run_repack("images", src, out, "--shard-size", "4", "--append", "--json")
    summary = json.loads(done.stdout)
    assert summary["version"] == 3 and summary["removed_skipped"] == 2
    held = packed_sources(out)
    assert "cat/late.jpg" in held and "cat/c0.jpg" not in held and "dog/d1.jpg" not in held
    assert len(held) == len(set(held)) == 8
    assert read_manifest_json(out)["dataset_version"]["change"]["removed_skipped"] == 2
    assert run_repack("verify", out).returncode == 0


def test_a_copy_of_source_with_new_mtimes_adds_nothing(tmp_path):
    src, out = make_source(tmp_path / "src"), tmp_path / "out"
    run_repack("images", src, out, "--shard-size", "4", "--quiet")
    copy = tmp_path / "copy"
    shutil.copytree(src, copy, copy_function=shutil.copyfile)  # `cp -r`: same bytes, new mtimes
    for path in copy.rglob("*.jpg"):
        os.utime(path, ns=(path.stat().st_atime_ns, path.stat().st_mtime_ns + 10**9))
    again = run_repack("images", copy, out, "--shard-size", "4", "--append")
    assert "nothing new" in again.stdout and not (out / "manifest.v2.json").exists()
    (copy / "cat" / "fresh.jpg").write_bytes(jpeg_bytes(seed=60))
    run_repack("images", copy, out, "--shard-size", "4", "--append", "--quiet")
    held = packed_sources(out)
    assert len(held) == len(set(held)) == 10 and "cat/fresh.jpg" in held
    record = read_inputs_record(open_store(str(out)), 2)
    rows, found = record.find(encode_names(["cat/c0.jpg"]))
    assert found[0] and record.mtime_ns[rows[0]] == (copy / "cat" / "c0.jpg").stat().st_mtime_ns  # not hashed again


def test_a_changed_file_is_refused_by_name_never_packed_twice(tmp_path):
    src, out = make_source(tmp_path / "src"), tmp_path / "out"
    run_repack("images", src, out, "--shard-size", "4", "--quiet")
    target = src / "dog" / "d2.jpg"
    data = bytearray(target.read_bytes())
    data[-3] ^= 0xFF  # same size, other content
    target.write_bytes(bytes(data))
    refused = run_repack("images", src, out, "--shard-size", "4", "--append", check=False)
    assert refused.returncode == 2 and "dog/d2.jpg" in refused.stderr and "Traceback" not in refused.stderr
    target.write_bytes(jpeg_bytes(seed=99))  # other size too
    refused = run_repack("images", src, out, "--shard-size", "4", "--append", check=False)
    assert refused.returncode == 2 and "dog/d2.jpg" in refused.stderr
    assert not (out / "manifest.v2.json").exists()
    held = packed_sources(out)
    assert held.count("dog/d2.jpg") == 1 and len(held) == 9


def test_text_append_after_remove_by_source(tmp_path):
    from tests.tools.text import documents, gpt2_tokenizer, write_tokenizer

    docs = documents(30, seed=5)
    corpus, tok, out = tmp_path / "corpus", tmp_path / "tok", tmp_path / "out"
    corpus.mkdir()
    write_tokenizer(gpt2_tokenizer(), tok)
    for name, part in (("a.jsonl", docs[:10]), ("b.jsonl", docs[10:20])):
        (corpus / name).write_text("".join(json.dumps({"text": d}) + "\n" for d in part))
    run_repack("text", corpus, out, "--tokenizer", tok, "--quiet")
    (tmp_path / "gone.txt").write_text("b.jsonl\n")
    run_repack("remove", out, "--sources", tmp_path / "gone.txt", "--quiet")
    (corpus / "c.jsonl").write_text("".join(json.dumps({"text": d}) + "\n" for d in docs[20:]))
    done = run_repack("text", corpus, out, "--tokenizer", tok, "--append")
    assert "1 removed source(s) found again and left out" in done.stdout
    manifest = read_manifest_json(out)
    assert manifest["totals"]["documents"] == 20  # a.jsonl and c.jsonl: b.jsonl stays down
    assert [run[0] for s in manifest["shards"] for run in shard_runs(out, s)] == ["a.jsonl", "c.jsonl"]
    assert run_repack("verify", out).returncode == 0
    copy = tmp_path / "copy"
    shutil.copytree(corpus, copy, copy_function=shutil.copyfile)  # new mtimes: compared by sha256
    for path in copy.iterdir():
        os.utime(path, ns=(path.stat().st_atime_ns, path.stat().st_mtime_ns + 10**9))
    again = run_repack("text", copy, out, "--tokenizer", tok, "--append")
    assert "nothing new" in again.stdout


def test_a_takedown_of_a_quarantined_input_stays_down_once_the_file_is_fixed(tmp_path):
    """The name of an input the dataset quarantined was "not found" (exit 0, nothing recorded), and once the
    file was fixed, `--append` packed it: the taken-down source was in the latest version."""
    src, out = make_source(tmp_path / "src"), tmp_path / "out"
    (src / "cat" / "bad.jpg").write_bytes(b"\xff\xd8 not a jpeg")
    run_repack("images", src, out, "--shard-size", "4", "--quiet")
    assert [q["source"] for q in read_manifest_json(out)["quarantine"]] == ["cat/bad.jpg"]
    (tmp_path / "gone.txt").write_text("cat/bad.jpg\n")
    said = run_repack("remove", out, "--sources", tmp_path / "gone.txt")
    assert "1 quarantined input(s) taken down, 0 name(s) not found" in said.stdout
    manifest = read_manifest_json(out)
    assert manifest["quarantine"] == [] and manifest["dataset_version"]["change"]["removed_quarantined"] == ["cat/bad.jpg"]
    totals = manifest["totals"]
    assert totals["inputs"] == totals["samples"] + totals["quarantined"] + totals["removed"] + totals["taken_down"]
    (src / "cat" / "bad.jpg").write_bytes(jpeg_bytes(seed=91))  # fixed
    again = run_repack("images", src, out, "--shard-size", "4", "--append")
    assert "1 removed source(s) found again and left out" in again.stdout
    assert "cat/bad.jpg" not in packed_sources(out) and run_repack("verify", out).returncode == 0


def test_a_takedown_names_a_list_datasets_source_in_either_spelling(tmp_path):
    """A dataset packed from a list holds its rows as written (./cat/c0.jpg, an absolute path): a takedown of
    cat/c0.jpg said "not found" (exit 0, nothing removed), though --append takes both spellings for one input."""
    src, out = make_source(tmp_path / "src"), tmp_path / "out"
    listing = src / "list.csv"
    listing.write_text(f"path,label\n./cat/c0.jpg,cat\ncat/c1.jpg,cat\n{src / 'dog' / 'd0.jpg'},dog\ndog/d1.jpg,dog\n")
    run_repack("images", listing, out, "--list", "--quiet")
    (tmp_path / "gone.txt").write_text("cat/c0.jpg\ndog/d0.jpg\n./dog/d0.jpg\n./dog/d1.jpg\ncat/none.jpg\n")
    said = run_repack("remove", out, "--sources", tmp_path / "gone.txt")
    assert "3 sample(s) removed" in said.stdout and said.stderr == "not found in the dataset: cat/none.jpg\n"
    assert packed_sources(out) == ["cat/c1.jpg"]
    assert read_manifest_json(out)["dataset_version"]["change"]["not_found"] == ["cat/none.jpg"]
    listing.write_text("path,label\ncat/c0.jpg,cat\ncat/c1.jpg,cat\n./dog/d0.jpg,dog\ndog/d1.jpg,dog\n")
    again = run_repack("images", listing, out, "--list", "--append")
    assert "nothing new" in again.stdout and packed_sources(out) == ["cat/c1.jpg"]
