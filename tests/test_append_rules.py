"""`repack images --append` keeps what version 1 promised: --dedup holds across versions (a copy of a
sample the dataset holds is never packed), the new samples are made with the dataset's transform options
(other ones are refused by name), and an append killed mid-way is staged again when SOURCE or the
options changed since (it was refused for good, pointing at a full --overwrite)."""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path

from tests.benchmarks.tiny_files import jpeg_bytes, tiny_jpegs
from tests.conftest import duplicate_groups, kill_after_records, read_manifest_json, run_repack, sample_paths


def test_dedup_holds_across_versions(tmp_path):
    src, out = tiny_jpegs(tmp_path / "src", 0, 12, workers=1), tmp_path / "out"
    shutil.copy(src / "c000" / "00000000.jpg", src / "c000" / "zz_copy.jpg")
    run_repack("images", src, out, "--dedup", "--quiet")
    assert len(sample_paths(out)) == 12  # the copy dropped
    unchanged = run_repack("images", src, out, "--dedup", "--append")
    assert "nothing new" in unchanged.stdout  # the dropped copy was packed here
    shutil.copy(src / "c003" / "00000003.jpg", src / "c005" / "late_copy.jpg")  # a copy of a packed sample
    tiny_jpegs(src, 100, 1, workers=1)
    run_repack("images", src, out, "--dedup", "--append", "--quiet")
    paths = sample_paths(out)
    assert len(paths) == 13 and "c100/00000100.jpg" in paths
    assert not {"c000/zz_copy.jpg", "c005/late_copy.jpg"} & set(paths)
    manifest = read_manifest_json(out)
    appended = duplicate_groups(out, manifest["stats"]["appended"][-1]["duplicates"])  # version 1's copy is known
    assert {tuple(g["paths"]) for g in appended} == {("c003/00000003.jpg", "c005/late_copy.jpg")}
    fresh = tmp_path / "fresh"
    run_repack("images", src, fresh, "--dedup", "--quiet")
    counted = ("inputs", "samples", "duplicates_dropped")  # each input counted once, as a fresh pack counts it
    assert {k: manifest["totals"][k] for k in counted} == {k: read_manifest_json(fresh)["totals"][k] for k in counted}


def test_an_input_quarantined_while_planning_and_fixed_is_counted_once(tmp_path):
    """A file over --max-file-size is quarantined while planning (it never reaches a task, nor the record of the
    inputs): once it is small enough --append packs it, its quarantine record goes and it is counted once."""
    src, out = tiny_jpegs(tmp_path / "src", 0, 3, workers=1), tmp_path / "out"
    big = src / "c000" / "zz_big.jpg"
    big.write_bytes(jpeg_bytes(7) + b"\0" * 4096)
    run_repack("images", src, out, "--max-file-size", "3KB", "--quiet")
    assert [q["source"] for q in read_manifest_json(out)["quarantine"]] == ["c000/zz_big.jpg"]
    big.write_bytes(jpeg_bytes(7))
    run_repack("images", src, out, "--max-file-size", "3KB", "--append", "--quiet")
    manifest = read_manifest_json(out)
    assert manifest["quarantine"] == [] and manifest["totals"]["inputs"] == manifest["totals"]["samples"] == 4


def test_a_copy_dedup_dropped_stays_out_when_taken_down_or_its_kept_copy_is(tmp_path):
    """A copy --dedup left out has no sample: `remove --sources` naming it records its takedown (it said "not
    found", and a later append packed it), and removing the kept copy does not let an append pack the dropped
    one; changed content is a new input."""
    src, out = tiny_jpegs(tmp_path / "src", 0, 6, workers=1), tmp_path / "out"
    shutil.copy(src / "c000" / "00000000.jpg", src / "c001" / "zz_copy.jpg")
    shutil.copy(src / "c002" / "00000002.jpg", src / "c003" / "zz_copy.jpg")
    shutil.copy(src / "c004" / "00000004.jpg", src / "c005" / "zz_copy.jpg")
    run_repack("images", src, out, "--dedup", "--quiet")
    takedown = tmp_path / "takedown.txt"
    takedown.write_text("c001/zz_copy.jpg\nc002/00000002.jpg\n")
    removed = run_repack("remove", out, "--sources", takedown, "--json", "--quiet")
    assert json.loads(removed.stdout)["published"]
    change = read_manifest_json(out)["dataset_version"]["change"]
    assert change["removed_dropped_copies"] == ["c001/zz_copy.jpg"] and change["not_found"] == []
    assert read_manifest_json(out)["totals"]["taken_down"] == 1
    again = run_repack("remove", out, "--sources", takedown)  # nothing left of either
    assert "not found in the dataset: c001/zz_copy.jpg" in again.stderr
    assert read_manifest_json(out)["totals"]["duplicates_dropped"] == 2
    unchanged = run_repack("images", src, out, "--dedup", "--append")
    assert "nothing new" in unchanged.stdout, unchanged.stdout
    assert not {"c001/zz_copy.jpg", "c003/zz_copy.jpg", "c005/zz_copy.jpg"} & set(sample_paths(out))
    (src / "c003" / "zz_copy.jpg").write_bytes(jpeg_bytes(999))  # other content: a new input
    run_repack("images", src, out, "--dedup", "--append", "--quiet")
    assert "c003/zz_copy.jpg" in sample_paths(out) and "c001/zz_copy.jpg" not in sample_paths(out)
    # a dropped copy quarantined since (garbage now), then taken down: counted once
    (src / "c005" / "zz_copy.jpg").write_bytes(b"garbage")
    run_repack("images", src, out, "--dedup", "--append", "--quiet")
    before = read_manifest_json(out)["totals"]
    takedown.write_text("c005/zz_copy.jpg\n")
    run_repack("remove", out, "--sources", takedown, "--quiet")
    after = read_manifest_json(out)["totals"]
    assert after["taken_down"] == before["taken_down"] + 1


def test_an_append_with_other_transform_options_is_refused_by_name(tmp_path):
    src, out = tiny_jpegs(tmp_path / "src", 0, 6, workers=1), tmp_path / "out"
    run_repack("images", src, out, "--normalize", "--max-side", "16", "--quiet")
    tiny_jpegs(src, 6, 2, workers=1)
    cases = [((), "no --normalize (the dataset: --normalize)"),
             (("--normalize",), "no --max-side (the dataset: --max-side 16)"),
             (("--normalize", "--max-side", "16", "--quality", "70"), "--quality 70 (the dataset: --quality 90)"),
             (("--normalize", "--max-side", "16", "--dedup"), "--dedup (the dataset: no --dedup)"),
             # what an input must pass: an undecodable JPEG was packed by --verify none, the manifest saying decode
             (("--normalize", "--max-side", "16", "--verify", "none"), "--verify none (the dataset: --verify decode)"),
             (("--normalize", "--max-side", "16", "--max-pixels", "100"), "--max-pixels 100 (the dataset: "),
             (("--normalize", "--max-side", "16", "--no-follow-symlinks"), "--no-follow-symlinks (the dataset: "
                                                                           "without --no-follow-symlinks)"),
             (("--normalize", "--max-side", "16", "--max-file-size", "1MB"), "--max-file-size 1000000B (the "
                                                                              "dataset: --max-file-size 268435456B)"),
             (("--normalize", "--max-side", "16", "--shuffle"), "--shuffle (the dataset: no --shuffle)")]
    for extra, named in cases:
        refused = run_repack("images", src, out, "--append", "--quiet", *extra, check=False)
        assert refused.returncode == 2 and named in refused.stderr, (extra, refused.stderr)
    assert len(sample_paths(out)) == 6
    run_repack("images", src, out, "--append", "--normalize", "--max-side", "16", "--quiet")
    assert len(sample_paths(out)) == 8


def add(src, first: int, count: int) -> None:
    """New JPEGs in the 20 class folders the dataset has."""
    for i in range(first, first + count):
        (src / f"c{i % 20:03d}" / f"new{i:05d}.jpg").write_bytes(jpeg_bytes(i))


def test_a_killed_append_is_staged_again_when_source_or_options_changed(tmp_path):
    src, out = tiny_jpegs(tmp_path / "src", 0, 20, workers=1), tmp_path / "out"
    run_repack("images", src, out, "--shard-size", "8", "--quiet")
    add(src, 100, 600)
    for number, change in ((2, "source"), (3, "options")):
        staged = out / ".repack" / f"append-v{number}" / "out"
        args = ["images", src, out, "--shard-size", "8", "--chunk-size", "4", "--workers", "1", "--append", "--quiet"]
        kill_after_records(args, staged, 2)
        assert staged.exists() and not (staged / "manifest.json").exists()
        assert not (out / f"manifest.v{number}.json").exists()
        if change == "source":
            add(src, 5000, 1)
            run_repack(*args)
            assert len(sample_paths(out)) == 621 and "c000/new05000.jpg" in sample_paths(out)
            add(src, 7000, 300)  # the next version's inputs, for the options round
        else:
            run_repack(*args[:-4], "--chunk-size", "16", "--append", "--quiet")  # another chunk size
            assert len(sample_paths(out)) == 921
        assert not staged.parent.exists()
    assert run_repack("verify", out).returncode == 0


def test_a_hard_link_to_a_packed_file_added_alone_is_recorded(tmp_path):
    """The only new input an alias of a packed file: version N+1 records its quarantine (as a fresh pack of the
    same SOURCE does); it had said "nothing new" and no manifest named it. Once recorded, nothing is new."""
    import os

    src = tiny_jpegs(tmp_path / "src", 0, 6)
    out = tmp_path / "out"
    run_repack("images", src, out, "--quiet")
    packed = sorted(p for p in src.rglob("*.jpg"))[0]
    os.link(packed, packed.parent / "zz_link.jpg")
    run_repack("images", src, out, "--append", "--quiet")
    manifest = read_manifest_json(out)
    assert manifest["dataset_version"]["number"] == 2 and manifest["totals"]["samples"] == 6
    [record] = manifest["quarantine"]
    assert record["source"] == f"{packed.parent.name}/zz_link.jpg" and "same file as" in record["reason"]
    fresh = tmp_path / "fresh"
    run_repack("images", src, fresh, "--quiet")
    assert read_manifest_json(fresh)["quarantine"] == manifest["quarantine"]
    again = run_repack("images", src, out, "--append")
    assert "nothing new" in again.stdout and read_manifest_json(out)["dataset_version"]["number"] == 2


def test_a_finished_stage_is_published_only_by_the_same_append(tmp_path):
    """An append killed after its staged job finished (before its publish): a re-run with another SOURCE
    packs that SOURCE's inputs (the stage of the first is discarded); a re-run of the same append publishes it."""
    import subprocess
    import sys

    src, out = tiny_jpegs(tmp_path / "src", 0, 6, workers=1), tmp_path / "out"
    run_repack("images", src, out, "--quiet")
    first, other = tmp_path / "first", tmp_path / "other"
    shutil.copytree(src, first)
    shutil.copytree(src, other)
    (first / "c000" / "first.jpg").write_bytes(jpeg_bytes(900))
    (other / "c001" / "other.jpg").write_bytes(jpeg_bytes(901))
    killed_before_publish = ("import os, sys\nimport repack.lifecycle.append as a\n"
                             "a.refuse_names_in_use = lambda *args: os._exit(137)\n"
                             "sys.argv = ['repack'] + sys.argv[1:]\nfrom repack.cli import main\nmain()\n")
    for source in (first, other):
        killed = subprocess.run([sys.executable, "-c", killed_before_publish, "images", str(first), str(out),
                                 "--append", "--quiet"], cwd=Path(__file__).parent.parent)
        assert killed.returncode == 137 and (out / ".repack" / "append-v2" / "out" / "manifest.json").exists()
        run_repack("images", source, out, "--append", "--quiet")
        manifest = read_manifest_json(out)
        assert manifest["dataset_version"]["change"]["source"] == str(source)
        added = {"c000/first.jpg"} if source == first else {"c001/other.jpg"}
        assert set(sample_paths(out)) - {p for p in sample_paths(out) if "/0000" in p} == added, source
        shutil.rmtree(out)
        run_repack("images", src, out, "--quiet")


def test_an_append_on_several_nodes_is_refused_before_any_work(tmp_path):
    src, out = tiny_jpegs(tmp_path / "src", 0, 4, workers=1), tmp_path / "out"
    run_repack("images", src, out, "--quiet")
    tiny_jpegs(src, 4, 2, workers=1)
    refused = run_repack("images", src, out, "--append", "--num-nodes", "2", "--node-rank", "0", check=False)
    assert refused.returncode == 2 and "--append cannot be combined with --num-nodes" in refused.stderr
    assert not (out / ".repack" / "append-v2").exists() and len(sample_paths(out)) == 4


def test_a_dropped_copy_that_changed_is_counted_once(tmp_path):
    """A copy --dedup left out whose content changed is a new input: packed (other content) or dropped again
    (now a copy of another sample), each version's counts are a fresh --dedup pack's of the same SOURCE."""
    src, out = tiny_jpegs(tmp_path / "src", 0, 6, workers=1), tmp_path / "out"
    copy = src / "c001" / "zz_copy.jpg"
    shutil.copy(src / "c000" / "00000000.jpg", copy)
    run_repack("images", src, out, "--dedup", "--quiet")
    counted = ("inputs", "samples", "duplicates_dropped")
    for content in (src / "c002" / "00000002.jpg", None):  # a copy of another sample, then content of its own
        copy.write_bytes(content.read_bytes() if content else jpeg_bytes(999))
        tiny_jpegs(src, 10 if content else 11, 1, workers=1)  # and a new input: the append publishes
        run_repack("images", src, out, "--dedup", "--append", "--quiet")
        fresh = tmp_path / f"fresh-{content is None}"
        run_repack("images", src, fresh, "--dedup", "--quiet")
        assert ("c001/zz_copy.jpg" in sample_paths(out)) == (content is None)
        assert {k: read_manifest_json(out)["totals"][k] for k in counted} == \
            {k: read_manifest_json(fresh)["totals"][k] for k in counted}, content


def test_a_killed_job_resumed_after_a_derived_change_names_it(tmp_path):
    """A job killed, then re-run after a --dedup copy was added (it is in no task) or the tokenizer file changed in
    place: refused (the plan differs), naming that change, not "planned differently by another repack version"."""
    from tests.tools.text import documents, gpt2_tokenizer, write_tokenizer

    src, out = tiny_jpegs(tmp_path / "src", 0, 40, workers=1), tmp_path / "out"
    args = ["images", src, out, "--dedup", "--chunk-size", "2", "--workers", "1", "--shard-size", "4", "--quiet"]
    kill_after_records(args, out, 2)
    shutil.copy(src / "c000" / "00000000.jpg", src / "c001" / "zz_copy.jpg")
    refused = run_repack(*args, check=False)
    assert refused.returncode == 2 and "--dedup's groups of copies (c000/00000000.jpg, c001/zz_copy.jpg)" in \
        refused.stderr, refused.stderr

    corpus, tok, text_out = tmp_path / "corpus", tmp_path / "tok", tmp_path / "text"
    corpus.mkdir()
    tokenizer = write_tokenizer(gpt2_tokenizer(), tok)
    for i in range(6):
        (corpus / f"{i}.jsonl").write_text("".join(json.dumps({"text": d}) + "\n" for d in documents(30, seed=i)))
    args = ["text", corpus, text_out, "--tokenizer", tokenizer, "--chunk-bytes", "1KiB", "--workers", "1", "--quiet"]
    kill_after_records(args, text_out, 2)
    planned = Path(tokenizer, "tokenizer.json") if Path(tokenizer).is_dir() else Path(tokenizer)
    changed = json.loads(planned.read_text())
    changed["added_tokens"].append({"id": len(changed["model"]["vocab"]) + 5, "content": "<|x|>", "single_word": False,
                                    "lstrip": False, "rstrip": False, "normalized": False, "special": True})
    planned.write_text(json.dumps(changed))
    refused = run_repack(*args, check=False)
    assert refused.returncode == 2 and "the tokenizer file (sha256 " in refused.stderr, refused.stderr


def test_append_with_overwrite_is_refused_and_lifecycle_commands_name_a_missing_folder(tmp_path):
    """--append --overwrite published an append and ignored --overwrite; gc/remove of a path that is not there
    said to run the job 'without --append'."""
    src = tiny_jpegs(tmp_path / "src", 0, 6, workers=1)
    out = tmp_path / "out"
    run_repack("images", src, out, "--quiet")
    before = (out / "manifest.json").read_bytes()
    tiny_jpegs(src, 6, 2, workers=1)
    proc = run_repack("images", src, out, "--append", "--overwrite", check=False)
    assert proc.returncode == 2 and "--append adds to the dataset in OUT and --overwrite replaces it" in proc.stderr
    assert (out / "manifest.json").read_bytes() == before
    (tmp_path / "names.txt").write_text("c000/00000000.jpg\n")
    for args in (("gc", tmp_path / "nope"), ("remove", tmp_path / "nope", "--sources", tmp_path / "names.txt")):
        proc = run_repack(*args, check=False)
        assert proc.returncode == 2 and "nope: no such folder" in proc.stderr and not (tmp_path / "nope").exists()
    (tmp_path / "empty").mkdir()
    proc = run_repack("gc", tmp_path / "empty", check=False)
    assert proc.returncode == 2 and "holds no published dataset" in proc.stderr and "pack one there first" in proc.stderr


def test_an_append_counts_its_own_quarantine_records(tmp_path):
    """change.quarantined was the difference of the two versions' record counts: an append that packed a fixed
    input (its record dropped) and quarantined a new one said 0."""
    src, out = tmp_path / "src", tmp_path / "out"
    (src / "cat").mkdir(parents=True)
    (src / "cat" / "a.jpg").write_bytes(jpeg_bytes(1))
    (src / "cat" / "bad.jpg").write_bytes(b"not a jpeg")
    run_repack("images", src, out, "--quiet")
    (src / "cat" / "bad.jpg").write_bytes(jpeg_bytes(2))  # fixed: packed now, its record goes
    (src / "cat" / "new-bad.jpg").write_bytes(b"not one either")
    run_repack("images", src, out, "--append", "--quiet")
    manifest = read_manifest_json(out)
    assert [q["source"] for q in manifest["quarantine"]] == ["cat/new-bad.jpg"]
    assert manifest["dataset_version"]["change"]["quarantined"] == 1


def test_an_append_of_copies_alone_records_them(tmp_path):
    """--append --dedup whose only new inputs are copies of held samples said "nothing new" and recorded nothing:
    once the kept copy was removed, the next append packed the copy (removed content back). It publishes a version
    naming the copies now (stats.appended, duplicates_dropped), which keeps them out; a new group whose first file
    copies a held sample is one group, the held sample first."""
    src, out = tiny_jpegs(tmp_path / "src", 0, 4, workers=1), tmp_path / "out"
    run_repack("images", src, out, "--dedup", "--quiet")
    shutil.copy(src / "c000" / "00000000.jpg", src / "c001" / "zz_a.jpg")
    shutil.copy(src / "c000" / "00000000.jpg", src / "c001" / "zz_b.jpg")
    done = run_repack("images", src, out, "--dedup", "--append")
    assert "published version 2" in done.stdout, done.stdout
    manifest = read_manifest_json(out)
    assert manifest["totals"]["duplicates_dropped"] == 2 and manifest["totals"]["samples"] == 4
    prints = [[(src / rel).stat().st_size, (src / rel).stat().st_mtime_ns] for rel in ("c001/zz_a.jpg", "c001/zz_b.jpg")]
    groups = duplicate_groups(out, manifest["stats"]["appended"][-1]["duplicates"])
    assert groups == [{"paths": ["c000/00000000.jpg", "c001/zz_a.jpg", "c001/zz_b.jpg"], "prints": prints,
                       "sha256": groups[0]["sha256"]}]
    takedown = tmp_path / "takedown.txt"
    takedown.write_text("c000/00000000.jpg\n")
    run_repack("remove", out, "--sources", takedown, "--quiet")
    again = run_repack("images", src, out, "--dedup", "--append")
    assert "nothing new" in again.stdout
    assert not {"c000/00000000.jpg", "c001/zz_a.jpg", "c001/zz_b.jpg"} & set(sample_paths(out))


def test_append_strict_publishes_nothing_when_a_new_input_is_quarantined(tmp_path):
    """--append --strict published a version quarantining a new input, exit 0 (the staged job ran without --strict);
    it exits 6 now before anything is moved into the dataset, and the next append plans SOURCE as it is then."""
    src, out = tiny_jpegs(tmp_path / "src", 0, 3, workers=1), tmp_path / "out"
    run_repack("images", src, out, "--quiet")
    before = (out / "manifest.json").read_bytes()
    tiny_jpegs(src, 3, 2, workers=1)
    (src / "c000" / "zz_bad.jpg").write_bytes(b"not a jpeg")
    strict = run_repack("images", src, out, "--append", "--strict", check=False)
    assert strict.returncode == 6 and "c000/zz_bad.jpg" in strict.stderr and "re-run without --strict" in strict.stderr
    assert (out / "manifest.json").read_bytes() == before and not (out / "manifest.v2.json").exists()
    assert sorted(p.name for p in out.iterdir() if not p.name.startswith(".")) == sorted(
        ["manifest.json", "shard-000000.tar", "shard-000000.idx", "shard-000000.crc"])  # nothing moved in
    (src / "c000" / "zz_bad.jpg").unlink()  # mended: the next --strict append plans SOURCE as it is now
    run_repack("images", src, out, "--append", "--strict", "--quiet")
    manifest = read_manifest_json(out)
    assert manifest["totals"]["samples"] == 5 and manifest["quarantine"] == []
    (src / "c000" / "zz_bad.jpg").write_bytes(b"not a jpeg")
    run_repack("images", src, out, "--append", "--quiet")  # without --strict: published as quarantined
    assert [q["source"] for q in read_manifest_json(out)["quarantine"]] == ["c000/zz_bad.jpg"]


def test_an_input_with_a_sample_that_a_staged_plan_sets_aside_keeps_it_unrecorded(tmp_path):
    """A packed file deleted from a list file's folder, or replaced by a hard link to a packed copy of the same
    bytes: the append's plan sets it aside, and its record beside the sample made a later append pack it again (or,
    refused, blocked the append). The dataset keeps the sample and records nothing of it; the new rows are packed."""
    src, out = tiny_jpegs(tmp_path / "src", 0, 4, workers=1), tmp_path / "out"
    shutil.copy(src / "c000" / "00000000.jpg", src / "c000" / "copy.jpg")
    listing = tmp_path / "list.csv"
    rows = sorted(p.relative_to(tmp_path).as_posix() for p in src.rglob("*.jpg"))
    listing.write_text("path\n" + "".join(f"{row}\n" for row in rows))
    run_repack("images", listing, out, "--list", "--quiet")
    (src / "c001" / "00000001.jpg").unlink()  # gone from disk, still listed
    (src / "c000" / "copy.jpg").unlink()
    os.link(src / "c000" / "00000000.jpg", src / "c000" / "copy.jpg")  # a hard link now, same bytes
    tiny_jpegs(src, 4, 2, workers=1)
    listing.write_text(listing.read_text() + "".join(f"src/c{i:03d}/{i:08d}.jpg\n" for i in (4, 5)))
    done = run_repack("images", listing, out, "--list", "--append")
    assert "2 new sample(s)" in done.stdout, done.stdout
    manifest = read_manifest_json(out)
    assert manifest["totals"]["samples"] == 7 and manifest["quarantine"] == []
    again = run_repack("images", listing, out, "--list", "--append")
    assert "nothing new" in again.stdout


def test_an_append_compares_a_dropped_copy_by_its_fingerprint_before_reading_it(tmp_path):
    """--dedup records each dropped copy's fingerprint in its group (``prints``): an --append takes a copy of the
    same size and mtime as the same content without reading it (as it takes any input: it read and hashed every
    dropped copy at every append, 2.6-3.3x a plain full pack at 200,000 copies); one of another mtime is read and
    compared with the group's sha256."""
    src, out = tiny_jpegs(tmp_path / "src", 0, 6, workers=1), tmp_path / "out"
    copy = src / "c001" / "zz_copy.jpg"
    shutil.copy(src / "c000" / "00000000.jpg", copy)
    run_repack("images", src, out, "--dedup", "--quiet")
    stat = copy.stat()
    group = duplicate_groups(out, read_manifest_json(out)["stats"]["duplicates"])[0]
    assert group["paths"] == ["c000/00000000.jpg", "c001/zz_copy.jpg"]
    assert group["prints"] == [[stat.st_size, stat.st_mtime_ns]]
    other = bytearray(copy.read_bytes())  # other bytes of the same size and mtime: taken by the fingerprint, unread
    other[len(other) // 2] ^= 0xFF
    copy.write_bytes(bytes(other))
    os.utime(copy, ns=(stat.st_atime_ns, stat.st_mtime_ns))
    tiny_jpegs(src, 6, 1, workers=1)
    done = json.loads(run_repack("images", src, out, "--dedup", "--append", "--json", "--quiet").stdout)
    assert done["published"] and read_manifest_json(out)["totals"]["samples"] == 7
    os.utime(copy, ns=(stat.st_atime_ns, stat.st_mtime_ns + 10**9))  # another mtime: read, other content: packed
    run_repack("images", src, out, "--dedup", "--append", "--quiet")
    manifest = read_manifest_json(out)
    assert manifest["totals"]["samples"] == 8 and "c001/zz_copy.jpg" in sample_paths(out)
