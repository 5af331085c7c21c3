"""`repack remove` (only the shards holding the named samples are rewritten, under new names) and
`repack gc --keep K` (afterwards no file under OUT holds a removed sample's bytes)."""

from __future__ import annotations

import json
from pathlib import Path

from tests.conftest import read_manifest_json, run_repack
from tests.test_dataset_versions import add_inputs, labels_read, make_source, three_versions


def tar_samples(path: Path) -> list[tuple[str, list]]:
    """(key, [(member name, bytes)]) of a shard, in order."""
    from repack.sinks.tar_format import iter_members

    samples: list[tuple[str, list]] = []
    with open(path, "rb") as fh:
        for member in list(iter_members(fh)):
            fh.seek(member.offset)
            key = member.name.partition(".")[0]
            if not samples or samples[-1][0] != key:
                samples.append((key, []))
            samples[-1][1].append((member.name, fh.read(member.size)))
    return samples


def text_in_two_versions(tmp_path: Path, docs: list[str], cut: int, end: int) -> tuple[Path, Path, Path]:
    """(corpus, tokenizer, OUT) of a token dataset under ``tmp_path``: a.jsonl's ``docs[:cut]`` packed (version 1),
    then b.jsonl's ``docs[cut:end]`` appended (version 2)."""
    from tests.tools.text import gpt2_tokenizer, write_tokenizer

    corpus, tok, out = tmp_path / "corpus", tmp_path / "tok", tmp_path / "out"
    corpus.mkdir()
    write_tokenizer(gpt2_tokenizer(), tok)
    (corpus / "a.jsonl").write_text("".join(json.dumps({"text": d}) + "\n" for d in docs[:cut]))
    run_repack("text", corpus, out, "--tokenizer", tok, "--quiet")
    (corpus / "b.jsonl").write_text("".join(json.dumps({"text": d}) + "\n" for d in docs[cut:end]))
    run_repack("text", corpus, out, "--tokenizer", tok, "--append", "--quiet")
    return corpus, tok, out


def every_file_bytes(out: Path) -> list[tuple[str, bytes]]:
    return [(str(p.relative_to(out)), p.read_bytes()) for p in sorted(out.rglob("*")) if p.is_file()]


def test_remove_rewrites_only_the_shards_holding_the_samples_then_gc_deletes_their_bytes(tmp_path):
    src, out = make_source(tmp_path / "src"), tmp_path / "out"
    run_repack("images", src, out, "--shard-size", "4", "--quiet")
    add_inputs(src)
    run_repack("images", src, out, "--shard-size", "4", "--append", "--quiet")
    v2 = read_manifest_json(out)
    gone = {rel: (src / rel).read_bytes() for rel in ("cat/c1.jpg", "dog/d3.jpg")}
    (tmp_path / "takedown.txt").write_text("cat/c1.jpg\ndog/d3.jpg\nnot/there.jpg\n")
    done = run_repack("remove", out, "--sources", tmp_path / "takedown.txt")
    assert "not found in the dataset: not/there.jpg" in done.stderr
    v3 = read_manifest_json(out)
    assert v3["dataset_version"] == {"number": 3, "parent": 2, "change": v3["dataset_version"]["change"]}
    change = v3["dataset_version"]["change"]
    assert change["removed_samples"] == 2 and change["not_found"] == ["not/there.jpg"]
    # shards c0..c3 | c4 d0 d1 d2 | d3 | (v2) new0..2 e0: shard 0 is rewritten without c1, shard 2 (d3 alone) dropped
    assert change["rewritten"] == {"shard-000000.tar": "shard-000000-v3.tar", "shard-000002.tar": None}
    assert [s["path"] for s in v3["shards"]] == ["shard-000000-v3.tar", "shard-000001.tar", "shard-v2-000000.tar"]
    assert v3["shards"][1:] == [v2["shards"][1], v2["shards"][3]]  # the others kept as they are
    old, new = tar_samples(out / "shard-000000.tar"), tar_samples(out / "shard-000000-v3.tar")
    assert new == [s for s in old if json.loads(dict(s[1])[f"{s[0]}.json"])["path"] != "cat/c1.jpg"]
    assert v3["totals"]["samples"] == 11 and len(labels_read(out)) == 11
    assert sorted(labels_read(out, version=2)) == [0] * 8 + [1] * 4 + [2]  # version 2 still readable
    assert run_repack("verify", out).returncode == 0 and run_repack("verify", out, "--version", "2").returncode == 0

    key = tar_samples(out / "shard-v2-000000.tar")[0][0]
    gone["key"] = next(data for name, data in tar_samples(out / "shard-v2-000000.tar")[0][1] if name.endswith(".jpg"))
    (tmp_path / "keys.txt").write_text(f"{key}\n")
    run_repack("remove", out, "--keys", tmp_path / "keys.txt", "--quiet")
    assert read_manifest_json(out)["totals"]["samples"] == 10
    nothing = run_repack("remove", out, "--keys", tmp_path / "keys.txt")
    assert "nothing published" in nothing.stdout and not (out / "manifest.v5.json").exists()

    assert any(data in blob for _, blob in every_file_bytes(out) for data in gone.values())  # still in old versions
    run_repack("gc", out, "--keep", "1")
    for name, blob in every_file_bytes(out):
        for what, data in gone.items():
            assert data not in blob, f"{what}'s bytes are still in {name}"
    assert sorted(p.name for p in out.glob("manifest*.json")) == ["manifest.json", "manifest.v4.json"]
    assert run_repack("verify", out).returncode == 0
    assert sorted(labels_read(out)) == sorted(labels_read(out, version=4)) and len(labels_read(out)) == 10
    old_version = run_repack("verify", out, "--version", "2", check=False)
    assert old_version.returncode != 0 and "no version 2" in old_version.stderr + old_version.stdout


def test_remove_and_gc_refuse_bad_input_by_name(tmp_path):
    src, out = make_source(tmp_path / "src"), tmp_path / "out"
    run_repack("images", src, out, "--quiet")
    missing = run_repack("remove", out, "--sources", tmp_path / "none.txt", check=False)
    assert missing.returncode == 2 and "none.txt" in missing.stderr
    both = run_repack("remove", out, check=False)
    assert both.returncode == 2 and "--sources" in both.stderr
    empty = run_repack("gc", tmp_path / "nowhere", check=False)
    assert empty.returncode == 2 and "nowhere: no such folder" in empty.stderr


def test_remove_by_key_reads_a_shard_whose_index_edge_line_is_malformed(tmp_path):
    """A shard's span of positions comes from its index's first and last lines, read by the one index
    parser: a malformed line gives no span (the shard is read, its index rebuilt from the tar), never a
    wrong span that skips the shard holding the named sample."""
    src, out = make_source(tmp_path / "src"), tmp_path / "out"
    run_repack("images", src, out, "--shard-size", "4", "--quiet")
    key = tar_samples(out / "shard-000000.tar")[0][0]
    index = out / "shard-000000.idx"
    lines = index.read_text().split("\n")
    lines[1] = f"jpg 512 +3 00000002_{key.partition('_')[2]}.jpg"  # a bad size; its name claims position 2
    index.write_text("\n".join(lines))
    (tmp_path / "keys.txt").write_text(f"{key}\n")
    before = read_manifest_json(out)["totals"]["samples"]
    done = run_repack("remove", out, "--keys", tmp_path / "keys.txt")
    assert "not found" not in done.stderr
    assert read_manifest_json(out)["totals"]["samples"] == before - 1
    assert key not in [k for k, _ in tar_samples(out / read_manifest_json(out)["shards"][0]["path"])]


def test_a_version_file_numbered_past_the_next_is_named_by_verify_and_left_by_gc(tmp_path):
    """Writers publish N + 1 only: a ``manifest.v7.json`` beside version 2 (copied in from elsewhere) is a
    problem verify names, and gc neither parses it (it may be garbage) nor keeps what it names."""
    src, out = make_source(tmp_path / "src"), tmp_path / "out"
    run_repack("images", src, out, "--shard-size", "4", "--quiet")
    add_inputs(src)
    run_repack("images", src, out, "--shard-size", "4", "--append", "--quiet")
    (out / "manifest.v7.json").write_text("not a manifest")
    found = run_repack("verify", out, check=False)
    assert found.returncode == 5 and "manifest.v7.json: numbered past the next version (3)" in found.stderr
    done = run_repack("gc", out, "--keep", "1")
    assert done.returncode == 0 and (out / "manifest.v7.json").read_text() == "not a manifest"
    assert not (out / "manifest.v1.json").exists()
    (out / "manifest.v7.json").unlink()
    assert run_repack("verify", out).returncode == 0


def test_gc_on_a_full_disk_deletes_the_old_files_before_it_writes_the_kept_record(tmp_path, monkeypatch):
    """gc first rewrote the oldest kept record whole (~54 bytes an input): on a full disk it failed with "No space
    left on device" and deleted nothing, though freeing space is what it is for. The record's write failing for
    want of space (simulated: the first write of it) now lets the old versions' files go first."""
    import errno

    from repack.lifecycle import gc, publish

    src, out = three_versions(tmp_path)
    v1_only = {s["path"] for s in json.loads((out / "manifest.v1.json").read_text())["shards"]} - \
        {s["path"] for s in read_manifest_json(out)["shards"]}
    assert v1_only and all((out / rel).exists() for rel in v1_only)
    whole, calls = publish.make_record_whole, []

    def full_disk_once(store, number):
        calls.append(all(not (out / rel).exists() for rel in v1_only))  # were the old files gone when it ran?
        if len(calls) == 1:
            raise OSError(errno.ENOSPC, "No space left on device")
        return whole(store, number)

    monkeypatch.setattr(gc, "make_record_whole", full_disk_once)
    done = gc.collect_garbage(str(out), keep=1)
    assert calls == [False, True] and done.deleted_versions == (1, 2)
    assert not any((out / rel).exists() for rel in v1_only)
    assert run_repack("verify", out).returncode == 0
    from tests.test_images_job import jpeg_bytes

    (src / "cat" / "late.jpg").write_bytes(jpeg_bytes(seed=77))  # the record the next change reads is whole and right
    assert "1 new sample(s)" in run_repack("images", src, out, "--shard-size", "4", "--append").stdout


def test_a_full_disk_while_a_change_publishes_says_so_and_that_a_rerun_resumes(tmp_path):
    """A disk that filled while a version was published ended in a bare "No space left on device", exit 2 (a bad
    job), naming no file and not saying that the same command resumes."""
    import subprocess
    import sys

    from tests.conftest import ROOT

    src, out = make_source(tmp_path / "src"), tmp_path / "out"
    run_repack("images", src, out, "--quiet")
    (tmp_path / "takedown.txt").write_text("cat/c1.jpg\n")
    full = ("import errno, sys\nimport repack.lifecycle.remove as r\n"
            "def full(*a, **k):\n    raise OSError(errno.ENOSPC, 'No space left on device')\n"
            "r.publish = full\nsys.argv = ['repack'] + sys.argv[1:]\nfrom repack.entry import main\nmain()\n")
    done = subprocess.run([sys.executable, "-c", full, "remove", str(out), "--sources", str(tmp_path / "takedown.txt")],
                          capture_output=True, text=True, cwd=ROOT)
    assert done.returncode == 4 and "No space left on device" in done.stderr and "re-run the same command" in done.stderr
    assert "Traceback" not in done.stderr
    run_repack("remove", out, "--sources", tmp_path / "takedown.txt")
    assert run_repack("verify", out).returncode == 0


def test_a_remove_of_many_unknown_names_keeps_a_few_in_the_change_record(tmp_path):
    """A takedown list of thousands of names the dataset never held: the published change record keeps the
    first NOT_FOUND_KEPT of them and their count (it listed every one: 3.3 MB of manifest.json for 100,000), and
    the command still says how many were not found."""
    from repack.lifecycle.remove import NOT_FOUND_KEPT

    src, out = make_source(tmp_path / "src"), tmp_path / "out"
    run_repack("images", src, out, "--shard-size", "4", "--quiet")
    unknown = [f"none/{i:05d}.jpg" for i in range(3 * NOT_FOUND_KEPT)]
    (tmp_path / "takedown.txt").write_text("\n".join(["cat/c1.jpg", *unknown]) + "\n")
    done = run_repack("remove", out, "--sources", tmp_path / "takedown.txt")
    assert f"{len(unknown)} name(s) not found" in done.stdout + done.stderr
    change = read_manifest_json(out)["dataset_version"]["change"]
    assert change["removed_samples"] == 1 and change["not_found"] == unknown[:NOT_FOUND_KEPT]
    assert change["not_found_count"] == len(unknown)


def state_files(out: Path) -> dict[str, int]:
    """{path under OUT/.repack: bytes} of every file of the job state."""
    return {str(p.relative_to(out / ".repack")): p.stat().st_size for p in (out / ".repack").rglob("*") if p.is_file()}


KEPT_STATE = ["inputs-v2.npz", "job.json", "lock", "run", "workers.lock"]  # after gc --keep 1 at version 2


def test_gc_deletes_version_1s_job_state_and_every_change_and_check_works_without_it(tmp_path):
    """Version 1's record is derived from its job's plan and task records (~53 B an input); gc kept them beside the
    oldest kept record it writes whole (~42 B an input), so the job state stayed over 64 B an input for good. Once
    version 1 is gone they go too; a re-run of the first job, appends, removes, verify and inspect work without
    them, and the whole record carries version 1's digests (a known input touched is recognized by content)."""
    import os

    from tests.benchmarks.tiny_files import file_path, tiny_jpegs

    src, out = tmp_path / "src", tmp_path / "out"
    tiny_jpegs(src, 0, 300)
    run_repack("images", src, out, "--quiet")
    tiny_jpegs(src, 300, 4)
    run_repack("images", src, out, "--append", "--quiet")
    assert "plan.json.gz" in state_files(out) and sum(state_files(out).values()) / 304 > 64
    first_job = {rel: (out / ".repack" / rel).read_bytes() for rel in state_files(out)
                 if rel == "plan.json.gz" or rel.startswith("tasks/")}
    run_repack("gc", out, "--keep", "1")
    assert sorted(state_files(out)) == KEPT_STATE
    assert sum(state_files(out).values()) / 304 <= 64
    for rel, data in first_job.items():  # as an older repack's gc left them: the next gc deletes them
        (out / ".repack" / rel).parent.mkdir(exist_ok=True)
        (out / ".repack" / rel).write_bytes(data)
    assert run_repack("gc", out, "--keep", "1").returncode == 0 and sorted(state_files(out)) == KEPT_STATE
    assert run_repack("verify", out).returncode == 0 and run_repack("verify", out, "--version", "2").returncode == 0
    assert "samples 304" in run_repack("inspect", out).stdout

    again = run_repack("images", src, out, check=False)  # the first job again, SOURCE grown since
    assert again.returncode == 2 and "holds version 2 of its dataset" in again.stderr and "--append" in again.stderr
    assert "Traceback" not in again.stderr and read_manifest_json(out)["dataset_version"]["number"] == 2
    tiny_jpegs(src, 304, 2)
    touched = file_path(src, 7, ".jpg")
    os.utime(touched, ns=(touched.stat().st_atime_ns, touched.stat().st_mtime_ns + 10**9))  # same bytes
    assert "2 new sample(s), 306 in all" in run_repack("images", src, out, "--append").stdout
    (tmp_path / "gone.txt").write_text(f"{touched.relative_to(src)}\n")
    run_repack("remove", out, "--sources", tmp_path / "gone.txt", "--quiet")
    key = tar_samples(out / read_manifest_json(out)["shards"][-1]["path"])[0][0]
    (tmp_path / "keys.txt").write_text(f"{key}\n")
    run_repack("remove", out, "--keys", tmp_path / "keys.txt", "--quiet")
    assert read_manifest_json(out)["totals"]["samples"] == 304
    assert run_repack("verify", out).returncode == 0 and run_repack("verify", out, "--version", "3").returncode == 0
    assert "nothing new" in run_repack("images", src, out, "--append").stdout  # the removed input stays out


def test_a_gc_killed_while_it_deletes_version_1s_job_state_leaves_a_dataset_that_works_and_a_rerun_finishes(
        tmp_path):
    """The plan goes first (nothing derives version 1's record from task records half deleted), version 1's
    manifest last: a gc killed between the plan and the task records is found with version 1 to delete again."""
    import subprocess
    import sys

    from tests.conftest import ROOT

    src, out = make_source(tmp_path / "src"), tmp_path / "out"
    run_repack("images", src, out, "--shard-size", "4", "--quiet")
    add_inputs(src)
    run_repack("images", src, out, "--shard-size", "4", "--append", "--quiet")
    killed = ("import os, signal, sys\nimport repack.lifecycle.gc as gc\n"
              "gc.remove_prefix = lambda store, prefix: os.kill(os.getpid(), signal.SIGKILL)\n"
              "sys.argv = ['repack'] + sys.argv[1:]\nfrom repack.entry import main\nmain()\n")
    done = subprocess.run([sys.executable, "-c", killed, "gc", str(out), "--keep", "1"], capture_output=True,
                          text=True, cwd=ROOT)
    assert done.returncode == -9
    left = state_files(out)
    assert "plan.json.gz" not in left and any(rel.startswith("tasks/") for rel in left)
    assert (out / "manifest.v1.json").exists() and run_repack("verify", out).returncode == 0
    again = run_repack("images", src, out, "--shard-size", "4", check=False)
    assert again.returncode == 2 and "holds version 2" in again.stderr and "Traceback" not in again.stderr
    run_repack("gc", out, "--keep", "1")
    assert sorted(state_files(out)) == KEPT_STATE and not (out / "manifest.v1.json").exists()
    from tests.test_images_job import jpeg_bytes

    (src / "emu" / "e1.jpg").write_bytes(jpeg_bytes(seed=91))
    assert "1 new sample(s)" in run_repack("images", src, out, "--shard-size", "4", "--append").stdout
    assert run_repack("verify", out).returncode == 0


def test_gc_deletes_the_first_jobs_state_of_text_lmdb_and_merged_datasets(tmp_path):
    """A text dataset's task digest files and merge marker, an LMDB dataset's records, a merged dataset's plan: gone
    with version 1; an append, a remove and a merge run again after it refuse or work as before."""
    from tests.test_dataset_writers import takedown
    from tests.test_images_job import write_jpegs
    from tests.tools.text import documents

    docs = documents(30, seed=5)
    corpus, tok, text = text_in_two_versions(tmp_path, docs, 20, 25)
    assert "merged.json" in state_files(text)
    run_repack("gc", text, "--keep", "1")
    assert sorted(state_files(text)) == KEPT_STATE
    (corpus / "c.jsonl").write_text("".join(json.dumps({"text": d}) + "\n" for d in docs[25:]))
    assert "published version 3" in run_repack("text", corpus, text, "--tokenizer", tok, "--append").stdout
    run_repack("remove", text, "--sources", takedown(tmp_path, "a.jsonl"), "--quiet")
    assert read_manifest_json(text)["totals"]["samples"] == 10 and run_repack("verify", text).returncode == 0

    src, lmdb = make_source(tmp_path / "src"), tmp_path / "lmdb"
    run_repack("images", src, lmdb, "--to", "lmdb", "--quiet")
    run_repack("remove", lmdb, "--sources", takedown(tmp_path, "cat/c1.jpg"), "--quiet")
    run_repack("gc", lmdb, "--keep", "1")
    assert sorted(state_files(lmdb)) == KEPT_STATE
    run_repack("remove", lmdb, "--sources", takedown(tmp_path, "dog/d1.jpg"), "--quiet")
    assert read_manifest_json(lmdb)["totals"]["samples"] == 7 and run_repack("verify", lmdb).returncode == 0

    parts = write_jpegs(tmp_path / "parts_src" / "c", 8, "a").parent
    merged = tmp_path / "merged"
    for rank in (0, 1):
        run_repack("images", parts, merged, "--shard-size", "4", "--num-nodes", "2", "--node-rank", str(rank),
                   "--quiet")
    run_repack("merge", merged)
    run_repack("remove", merged, "--sources", takedown(tmp_path, "c/a0.jpg"), "--quiet")
    run_repack("gc", merged, "--keep", "1")
    assert not any(rel == "plan.json.gz" or rel.startswith("tasks/") for rel in state_files(merged))
    refused = run_repack("merge", merged, check=False)
    assert refused.returncode == 2 and "holds version 2" in refused.stderr and "Traceback" not in refused.stderr
    assert run_repack("verify", merged).returncode == 0
