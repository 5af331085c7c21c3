"""`repack verify` on datasets whose files are not what a file should be: a FIFO where a shard, an index or a
version file belongs (it blocked verify for good), a folder there (a traceback, exit 1), the published
version's own manifest.vN.json gone or a link leaving the dataset, and an LMDB sample whose class the class
map does not name (verify passed it, the reader refused it): each is exit 5 naming the file."""

from __future__ import annotations

import hashlib
import json
import os
import shutil
from pathlib import Path

import pytest

from tests.conftest import read_manifest_json, run_repack
from tests.test_partition_trust import tree


@pytest.fixture(scope="module")
def two_versions(tmp_path_factory) -> Path:
    """A webdataset of 12 photos in shards of 4, then 3 appended: version 2."""
    base = tmp_path_factory.mktemp("irregular")
    src, out = tree(base / "src", 12), base / "out"
    run_repack("images", src, out, "--shard-size", "4", "--quiet")
    tree(base / "more" / "c9", 3)
    shutil.copytree(base / "more" / "c9", src / "c9", dirs_exist_ok=True)
    run_repack("images", src, out, "--shard-size", "4", "--append", "--quiet")
    assert read_manifest_json(out)["dataset_version"]["number"] == 2
    return out


def verify(out: Path) -> tuple[int, list[str]]:
    proc = run_repack("verify", out, "--json", check=False, timeout=60)  # a FIFO blocked it past any timeout
    assert "Traceback" not in proc.stderr, proc.stderr
    return proc.returncode, json.loads(proc.stdout)["problems"]


@pytest.mark.parametrize("rel,kind", [(rel, "FIFO") for rel in ("shard-000001.tar", "shard-000001.idx",
                                                                   "manifest.v2.json", "manifest.v1.json")]
                         + [(rel, "folder") for rel in ("shard-000001.tar", "shard-000001.crc", "manifest.v2.json")])
def test_a_fifo_or_a_folder_in_place_of_a_file_is_named(two_versions, tmp_path, rel, kind):
    """(An empty folder where an older version's manifest.v1.json was is what a gc leaves: no file.)"""
    out = tmp_path / "out"
    shutil.copytree(two_versions, out)
    (out / rel).unlink()
    os.mkfifo(out / rel) if kind == "FIFO" else (out / rel).mkdir()
    code, problems = verify(out)
    assert code == 5 and any(p.startswith(f"{rel}: ") for p in problems), problems


def test_the_published_versions_own_file_gone_or_leaving_the_dataset_is_named(two_versions, tmp_path):
    out = tmp_path / "out"
    shutil.copytree(two_versions, out)
    assert verify(out) == (0, [])
    (out / "manifest.v2.json").unlink()  # verify passed: manifest.v1.json was the newest it compared
    code, problems = verify(out)
    assert code == 5 and any(p.startswith("manifest.v2.json: missing") for p in problems), problems
    (tmp_path / "elsewhere.json").write_bytes((out / "manifest.json").read_bytes())
    (out / "manifest.v2.json").symlink_to(tmp_path / "elsewhere.json")  # a traceback, exit 1
    code, problems = verify(out)
    assert code == 5 and any(p.startswith("manifest.v2.json: ") and "outside" in p for p in problems), problems


def test_an_lmdb_sample_of_a_class_the_map_does_not_name_is_named(tmp_path):
    import lmdb

    src, out = tree(tmp_path / "src", 9), tmp_path / "out"
    run_repack("images", src, out, "--to", "lmdb", "--quiet")
    entry = read_manifest_json(out)["shards"][0]
    path = out / entry["path"]
    env = lmdb.open(str(path), subdir=False, lock=False)
    with env.begin(write=True) as txn:
        txn.put(b"s/0000000001/cls", b"99")
    env.close()
    manifest = read_manifest_json(out)  # recorded again: only the class check can tell
    data = path.read_bytes()
    manifest["shards"][0].update(bytes=len(data), sha256=hashlib.sha256(data).hexdigest())
    manifest["totals"]["bytes"] = len(data) if "bytes" in manifest["totals"] else None
    (out / "manifest.json").write_text(json.dumps(manifest))
    code, problems = verify(out)
    assert code == 5 and any("1 sample(s) hold a class the class map does not name (first: s/0000000001/cls)" in p
                             for p in problems), problems


def test_a_stray_named_like_a_next_versions_file_is_named_unless_a_writer_makes_such_names(two_versions, tmp_path):
    """Only what a writer of this dataset names for version 3 (its files' stems: shard-v3-..., ...-v3.tar) is a
    pending file; ``backup-v3.tar`` and ``old-v3/x.bin`` passed as pending too."""
    out = tmp_path / "out"
    shutil.copytree(two_versions, out)
    (out / "shard-v3-000000.tar").write_bytes(b"a killed append's shard")
    (out / "backup-v3.tar").write_bytes(b"mine")
    (out / "old-v3").mkdir()
    (out / "old-v3" / "x.bin").write_bytes(b"mine")
    proc = run_repack("verify", out, "--json", check=False)
    report = json.loads(proc.stdout)
    assert proc.returncode == 5 and sorted(p.split(":")[0] for p in report["problems"]) == ["backup-v3.tar", "old-v3/x.bin"]
    assert report["pending"] == ["shard-v3-000000.tar"], report


def test_a_version_one_file_that_is_not_the_published_manifest_is_reported_and_refused(tmp_path):
    """At version 1 a manifest.v1.json beside manifest.json was trusted unread: the files it named were no
    strays for verify (exit 0 with an extra shard), and a later --append kept it as version 1's record (a
    sha256 it had changed then failed `verify --version 1` for a shard nothing had touched)."""
    src, out = tree(tmp_path / "src", 8), tmp_path / "out"
    run_repack("images", src, out, "--shard-size", "4", "--quiet")
    published = json.loads((out / "manifest.json").read_bytes())
    shutil.copy(out / "shard-000000.tar", out / "extra.tar")
    stray = {**published, "shards": published["shards"] + [{**published["shards"][0], "path": "extra.tar"}]}
    (out / "manifest.v1.json").write_text(json.dumps(stray, indent=1))
    code, problems = verify(out)
    assert code == 5 and any("manifest.v1.json" in p for p in problems), problems
    assert any(p.startswith("extra.tar") for p in problems), problems  # a stray again
    tree(tmp_path / "more" / "c9", 2)
    shutil.copytree(tmp_path / "more" / "c9", src / "c9")
    refused = run_repack("images", src, out, "--shard-size", "4", "--append", check=False)
    assert refused.returncode == 2 and "manifest.v1.json" in refused.stderr, refused.stderr
    assert json.loads((out / "manifest.json").read_bytes()) == published  # nothing changed
    (out / "manifest.v1.json").unlink()
    (out / "extra.tar").unlink()
    run_repack("images", src, out, "--shard-size", "4", "--append", "--quiet")
    assert json.loads((out / "manifest.v1.json").read_bytes()) == published
    assert read_manifest_json(out)["dataset_version"]["number"] == 2 and verify(out)[0] == 0


def _edited(out: Path, key: str, by: int) -> Path:
    """``out`` with manifest.json's ``totals[key]`` moved by ``by`` (the file rewritten as a writer writes it)."""
    data = json.loads((out / "manifest.json").read_bytes())
    data["totals"][key] += by
    (out / "manifest.json").write_text(json.dumps(data, indent=1))
    return out


@pytest.mark.parametrize("key", ["tokens", "documents", "bytes"])
def test_a_token_datasets_totals_that_its_prefixes_do_not_add_up_to_are_reported(tmp_path, key):
    """Checked for webdataset only: a token dataset's totals.tokens, .documents or .bytes moved by one passed."""
    from tests.test_text_many_files import small_files
    from tests.tools.text import gpt2_tokenizer, write_tokenizer

    small_files(tmp_path / "src", 30)
    tokenizer = write_tokenizer(gpt2_tokenizer(), tmp_path / "gpt2")
    out = tmp_path / "out"
    run_repack("text", tmp_path / "src", out, "--tokenizer", tokenizer, "--doc-per", "file", "--no-merge",
               "--chunk-bytes", "2000", "--quiet")
    assert verify(out)[0] == 0
    code, problems = verify(_edited(out, key, 1))
    assert code == 5 and any(p.startswith(f"totals.{key} ") for p in problems), problems


def test_an_lmdb_datasets_total_bytes_that_its_files_do_not_add_up_to_are_reported(tmp_path):
    src, out = tree(tmp_path / "src", 8), tmp_path / "out"
    run_repack("images", src, out, "--to", "lmdb", "--quiet")
    assert verify(out)[0] == 0
    code, problems = verify(_edited(out, "bytes", 1))
    assert code == 5 and any(p.startswith("totals.bytes ") for p in problems), problems
