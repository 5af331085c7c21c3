"""`--append` never gives one source file a second sample: a quarantined file fixed and packed keeps its one
sample when only its mtime changes later, and is refused when its content does; a hard link added to a packed
file is the alias, whatever its name; a dataset packed flat is not appended to from class folders (nor the
other way round)."""

from __future__ import annotations

import os

from tests.conftest import read_manifest_json, run_repack, sample_paths
from tests.test_dataset_versions import make_source
from tests.test_images_job import jpeg_bytes, write_jpegs

ARGS = ("--shard-size", "4")


def test_a_fixed_file_keeps_its_one_sample_through_later_appends(tmp_path):
    src, out = make_source(tmp_path / "src"), tmp_path / "out"
    (src / "cat" / "broken.jpg").write_bytes(b"not an image")
    run_repack("images", src, out, *ARGS, "--quiet")
    (src / "cat" / "broken.jpg").write_bytes(jpeg_bytes(seed=77))
    run_repack("images", src, out, *ARGS, "--append", "--quiet")  # version 2: packed, no longer quarantined
    assert read_manifest_json(out)["quarantine"] == []
    stat = (src / "cat" / "broken.jpg").stat()
    os.utime(src / "cat" / "broken.jpg", ns=(stat.st_atime_ns, stat.st_mtime_ns + 5 * 10**9))  # same bytes
    touched = run_repack("images", src, out, *ARGS, "--append")
    assert "nothing new: version 2" in touched.stdout + touched.stderr
    (src / "cat" / "broken.jpg").write_bytes(jpeg_bytes(seed=78))  # other content under the same name
    changed = run_repack("images", src, out, *ARGS, "--append", check=False)
    assert changed.returncode == 2 and "cat/broken.jpg" in changed.stderr and "changed since" in changed.stderr
    assert sample_paths(out).count("cat/broken.jpg") == 1 and len(sample_paths(out)) == 10


def test_a_hard_link_added_to_a_packed_file_is_the_alias(tmp_path):
    src, out = make_source(tmp_path / "src"), tmp_path / "out"
    run_repack("images", src, out, *ARGS, "--quiet")
    os.link(src / "dog" / "d2.jpg", src / "dog" / "a-link.jpg")  # sorts before the packed name
    (src / "dog" / "d9.jpg").write_bytes(jpeg_bytes(seed=99))  # and one new file
    done = run_repack("images", src, out, *ARGS, "--append")
    assert "published version 2" in done.stdout + done.stderr
    manifest = read_manifest_json(out)
    assert [(q["source"], q["reason"].split(" (")[0]) for q in manifest["quarantine"]] == \
        [("dog/a-link.jpg", "same file as dog/d2.jpg")]
    sources = sample_paths(out)
    assert sorted(sources) == sorted(set(sources)) and "dog/d2.jpg" in sources and "dog/a-link.jpg" not in sources
    assert manifest["totals"]["samples"] == 10
    assert run_repack("verify", out).returncode == 0


def test_a_new_pack_keeps_the_first_name_of_a_hard_linked_file(tmp_path):
    """Without a dataset to prefer one, the rule stays: the first path in sorted order is packed."""
    src, out = make_source(tmp_path / "src"), tmp_path / "out"
    os.link(src / "dog" / "d2.jpg", src / "dog" / "a-link.jpg")
    run_repack("images", src, out, *ARGS, "--quiet")
    assert [q["source"] for q in read_manifest_json(out)["quarantine"]] == ["dog/d2.jpg"]
    assert "dog/a-link.jpg" in sample_paths(out)


def test_an_append_that_would_mix_labeled_and_unlabeled_samples_is_refused(tmp_path):
    flat, out = write_jpegs(tmp_path / "flat", 4, "f"), tmp_path / "out"
    run_repack("images", flat, out, "--quiet")
    write_jpegs(flat / "cat", 2, "c")
    refused = run_repack("images", flat, out, "--append", check=False)
    assert refused.returncode == 2 and "SOURCE has class folders now" in refused.stderr
    assert read_manifest_json(out)["totals"]["samples"] == 4 and "dataset_version" not in read_manifest_json(out)
    labeled, out2 = make_source(tmp_path / "labeled"), tmp_path / "out2"
    run_repack("images", labeled, out2, "--quiet")
    flat2 = write_jpegs(tmp_path / "flat2", 3, "g")
    refused = run_repack("images", flat2, out2, "--append", check=False)
    assert refused.returncode == 2 and "SOURCE has no class folders now" in refused.stderr
    assert read_manifest_json(out2)["totals"]["samples"] == 9
