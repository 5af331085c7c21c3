"""What writers leave and what they may touch in a dataset: gc keeps a file a kept version names in another
spelling (``./a``); the temp file of a manifest write killed mid-way is pending for verify and gone after the
next writer; a remove or an append never writes over a file a published version names (a dataset renamed by
hand), it refuses and changes nothing."""

from __future__ import annotations

import json
from pathlib import Path

from tests.conftest import read_manifest_json, run_repack
from tests.test_images_job import write_jpegs


def packed(tmp_path: Path) -> tuple[Path, Path]:
    src = write_jpegs(tmp_path / "src" / "c", 8, "a").parent
    out = tmp_path / "out"
    run_repack("images", src, out, "--shard-size", "4", "--quiet")
    return src, out


def takedown(tmp_path: Path, *names: str) -> Path:
    listing = tmp_path / "takedown.txt"
    listing.write_text("".join(f"{n}\n" for n in names))
    return listing


def rename_everywhere(out: Path, old: str, new: str) -> None:
    for manifest in [out / "manifest.json", *out.glob("manifest.v*.json")]:
        data = json.loads(manifest.read_text())
        for shard in data["shards"]:
            for key in ("path", "index", "checksums"):
                if shard.get(key, "").startswith(old):
                    shard[key] = new + shard[key][len(old):]
        manifest.write_text(json.dumps(data))


def test_gc_keeps_a_file_the_kept_version_names_as_dot_slash(tmp_path):
    _, out = packed(tmp_path)
    run_repack("remove", out, "--sources", takedown(tmp_path, "c/a0.jpg"), "--quiet")  # shard-000001 shared by v1, v2
    rename_everywhere(out, "shard-000001", "./shard-000001")
    assert run_repack("verify", out).returncode == 0
    run_repack("gc", out, "--keep", "1")
    assert (out / "shard-000001.tar").exists() and not (out / "shard-000000.tar").exists()
    assert run_repack("verify", out).returncode == 0


def test_a_manifest_temp_left_by_a_killed_write_is_pending_then_cleared(tmp_path):
    src, out = packed(tmp_path)
    temp = out / ".manifest.json.k1ll3d.tmp"
    temp.write_bytes((out / "manifest.json").read_bytes()[:40])  # the write stopped here
    checked = run_repack("verify", out)
    assert checked.returncode == 0 and ".manifest.json.k1ll3d.tmp" in checked.stdout + checked.stderr
    write_jpegs(src / "c", 10, "a")
    run_repack("images", src, out, "--shard-size", "4", "--append", "--quiet")
    assert not temp.exists() and run_repack("verify", out).returncode == 0


def test_remove_and_append_refuse_to_write_over_a_published_file(tmp_path):
    src, out = packed(tmp_path)
    for ext in ("tar", "idx", "crc"):
        (out / f"shard-000000.{ext}").rename(out / f"shard-000000-v2.{ext}")
    rename_everywhere(out, "shard-000000", "shard-000000-v2")
    before = {p.name: p.read_bytes() for p in out.iterdir() if p.is_file()}
    refused = run_repack("remove", out, "--sources", takedown(tmp_path, "c/a0.jpg"), check=False)
    assert refused.returncode == 2 and "shard-000000-v2.tar" in refused.stderr and "published version" in refused.stderr
    assert {p.name: p.read_bytes() for p in out.iterdir() if p.is_file()} == before
    (out / "shard-000001.tar").rename(out / "shard-v2-000000.tar")
    rename_everywhere(out, "shard-000001.tar", "shard-v2-000000.tar")
    write_jpegs(src / "c", 10, "a")
    refused = run_repack("images", src, out, "--shard-size", "4", "--append", check=False)
    assert refused.returncode == 2 and "shard-v2-000000.tar" in refused.stderr
    assert read_manifest_json(out)["totals"]["samples"] == 8 and run_repack("verify", out).returncode == 0


def test_what_a_killed_writer_left_is_moved_aside_when_another_publishes_its_number(tmp_path):
    """An append killed after moving its new shard in, then a remove takes version 2: the append's files
    (named as version 2's, which the remove's version 2 does not name) go to .repack/rejected/; a file of the
    user's own stays where it is."""
    _, out = packed(tmp_path)
    left = {f"shard-v2-000000.{ext}": (out / f"shard-000001.{ext}").read_bytes() for ext in ("tar", "idx", "crc")}
    for name, data in left.items():
        (out / name).write_bytes(data)
    (out / "notes-v2.txt").write_text("mine\n")
    checked = run_repack("verify", out, "--json", check=False)  # the shards: version 2's pending work until then;
    assert checked.returncode == 5 and json.loads(checked.stdout)["problems"] == [  # the notes: no writer's file
        "notes-v2.txt: a file the manifest does not name (added after the job, or left by another tool)"]
    run_repack("remove", out, "--sources", takedown(tmp_path, "c/a0.jpg"), "--quiet")
    aside = out / ".repack" / "rejected" / "leftovers-v2"
    assert {p.name: p.read_bytes() for p in aside.iterdir()} == left and not (out / "shard-v2-000000.tar").exists()
    assert (out / "notes-v2.txt").read_text() == "mine\n"
    (out / "notes-v2.txt").unlink()  # not the dataset's: verify would name it
    assert run_repack("verify", out).returncode == 0


def test_overwrite_leaves_no_version_of_the_replaced_dataset(tmp_path):
    """Versions 1-3 (append, remove), then --overwrite from other content and an append: no version file or
    versioned shard of the replaced dataset is left, so gc never publishes one over the new dataset."""
    src, out = packed(tmp_path)
    write_jpegs(src / "c", 10, "a")
    run_repack("images", src, out, "--shard-size", "4", "--append", "--quiet")
    run_repack("remove", out, "--sources", takedown(tmp_path, "c/a0.jpg"), "--quiet")
    assert (out / "manifest.v3.json").exists()
    other = write_jpegs(tmp_path / "other" / "d", 6, "b").parent
    run_repack("images", other, out, "--shard-size", "4", "--overwrite", "--quiet")
    assert not list(out.glob("manifest.v*.json")) and not list(out.glob("shard-*-v*"))
    write_jpegs(other / "d", 8, "b")
    run_repack("images", other, out, "--shard-size", "4", "--append", "--quiet")
    run_repack("gc", out, "--keep", "1")
    manifest = read_manifest_json(out)
    assert manifest["dataset_version"]["number"] == 2 and manifest["totals"]["samples"] == 8
    assert run_repack("verify", out).returncode == 0


def test_overwrite_after_a_kill_removes_the_killed_runs_unrecorded_shards(tmp_path):
    """A kill between a shard's rename and its record's save leaves the shard without a record; the source
    then shrinks, the re-run is refused (source changed) and --overwrite gives a clean dataset."""
    src, out = packed(tmp_path)  # shards 0 and 1
    (out / ".repack" / "tasks" / "shard-000001.json").unlink()
    (out / "manifest.json").unlink()
    (out / ".shard-000001.idx.tmp-4242").write_bytes(b"half")
    for name in ("a4.jpg", "a5.jpg", "a6.jpg", "a7.jpg"):
        (src / "c" / name).unlink()
    refused = run_repack("images", src, out, "--shard-size", "4", check=False)
    assert refused.returncode == 2 and "--overwrite" in refused.stderr
    run_repack("images", src, out, "--shard-size", "4", "--overwrite", "--quiet")
    assert sorted(p.name for p in out.iterdir() if p.name != ".repack") == \
        ["manifest.json", "shard-000000.crc", "shard-000000.idx", "shard-000000.tar"]
    assert run_repack("verify", out).returncode == 0


def test_a_job_another_repack_started_is_not_resumed(tmp_path):
    src, out = packed(tmp_path)
    job = out / ".repack" / "job.json"
    job.write_text(job.read_text().replace('"tool_version":"', '"tool_version":"0.0.1-other+'))
    assert run_repack("images", src, out, "--shard-size", "4").returncode == 0  # finished: nothing to resume
    (out / "manifest.json").unlink()  # unfinished
    refused = run_repack("images", src, out, "--shard-size", "4", check=False)
    assert refused.returncode == 2 and "started by repack 0.0.1-other+" in refused.stderr
    run_repack("images", src, out, "--shard-size", "4", "--overwrite", "--quiet")
    assert run_repack("verify", out).returncode == 0


def test_merging_again_after_a_change_is_refused(tmp_path):
    """Partitions merged, then a remove: a merge re-run (a Job retried) would publish version 1 again, the removed
    sample back in it."""
    src = write_jpegs(tmp_path / "src" / "c", 8, "a").parent
    out = tmp_path / "out"
    for rank in (0, 1):
        run_repack("images", src, out, "--shard-size", "4", "--num-nodes", "2", "--node-rank", str(rank), "--quiet")
    run_repack("merge", out)
    assert run_repack("merge", out).returncode == 0  # nothing changed since: the same version 1
    run_repack("remove", out, "--sources", takedown(tmp_path, "c/a0.jpg"), "--quiet")
    refused = run_repack("merge", out, check=False)
    assert refused.returncode == 2 and "holds version 2" in refused.stderr
    assert read_manifest_json(out)["dataset_version"]["number"] == 2 and run_repack("verify", out).returncode == 0


def test_the_first_job_run_again_after_a_remove_and_gc_is_refused(tmp_path):
    """A remove, then gc deletes version 1's shard: the job's task looks unfinished, and running the job again
    (a cron retry) would publish version 1 over version 2, the removed sample back in it."""
    src, out = packed(tmp_path)
    run_repack("remove", out, "--sources", takedown(tmp_path, "c/a0.jpg"), "--quiet")
    run_repack("gc", out, "--keep", "1")
    refused = run_repack("images", src, out, "--shard-size", "4", check=False)
    assert refused.returncode == 2 and "holds version 2 of its dataset" in refused.stderr
    manifest = read_manifest_json(out)
    assert manifest["dataset_version"]["number"] == 2 and manifest["totals"]["samples"] == 7
    assert run_repack("verify", out).returncode == 0


def test_a_folder_with_a_manifest_json_but_no_job_is_not_packed_into(tmp_path):
    """Another tool's ``manifest.json`` is not a repack job; a repack dataset copied without ``.repack/`` (a pull,
    an rsync) is not this job's: both refused without --overwrite, nothing touched."""
    src = write_jpegs(tmp_path / "src" / "c", 4, "a").parent
    foreign = tmp_path / "foreign"
    foreign.mkdir()
    (foreign / "manifest.json").write_text('{"my": "own"}')
    refused = run_repack("images", src, foreign, check=False)
    assert refused.returncode == 2 and "holds no repack job (manifest.json)" in refused.stderr
    assert (foreign / "manifest.json").read_text() == '{"my": "own"}'
    _, out = packed(tmp_path)
    copy = tmp_path / "copy"
    copy.mkdir()
    for path in out.iterdir():
        if path.is_file():
            (copy / path.name).write_bytes(path.read_bytes())
    before = {p.name: p.read_bytes() for p in copy.iterdir()}
    refused = run_repack("images", src, copy, check=False)
    assert refused.returncode == 2 and "holds a repack images dataset (8 samples) without its job state" in refused.stderr
    assert {p.name: p.read_bytes() for p in copy.iterdir() if p.name != ".repack"} == before


def test_overwrite_into_a_foreign_folder_replaces_only_the_names_it_writes(tmp_path):
    """--overwrite into a folder repack never wrote to: another tool's ``shard-000005.tar`` (webdataset's own
    ShardWriter pattern) is not a shard a killed repack run left, so it stays."""
    src = write_jpegs(tmp_path / "src" / "c", 4, "a").parent
    out = tmp_path / "out"
    out.mkdir()
    for name in ("shard-000000.tar", "shard-000005.tar", "notes.txt"):
        (out / name).write_bytes(b"theirs")
    run_repack("images", src, out, "--overwrite", "--quiet")
    assert (out / "shard-000005.tar").read_bytes() == (out / "notes.txt").read_bytes() == b"theirs"
    assert (out / "shard-000000.tar").read_bytes() != b"theirs"


def test_overwrite_keeps_the_lock_it_holds(tmp_path):
    """--overwrite clears the job state but not its lock files: a second run while the first is stopped after its
    wipe and plan (its new job.json written) is refused (exit 3), as it is without --overwrite."""
    import os
    import signal
    import subprocess
    import sys

    from tests.conftest import ROOT

    src = write_jpegs(tmp_path / "src" / "c", 400, "a").parent
    out = tmp_path / "out"
    run_repack("images", src, out, "--shard-size", "4", "--quiet")
    job = out / ".repack" / "job.json"
    before = job.stat().st_mtime_ns
    first = subprocess.Popen([sys.executable, "-m", "repack", "images", str(src), str(out), "--shard-size", "4",
                              "--overwrite", "--workers", "1", "--quiet"], cwd=ROOT, start_new_session=True,
                             stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        while first.poll() is None:
            try:
                if job.stat().st_mtime_ns != before:
                    break
            except FileNotFoundError:
                pass
        os.killpg(first.pid, signal.SIGSTOP)
        assert first.poll() is None, "the first run ended before it could be stopped"
        second = run_repack("images", src, out, "--shard-size", "4", check=False)
        assert second.returncode == 3 and "already running a job" in second.stderr
    finally:
        os.killpg(first.pid, signal.SIGCONT)
        first.wait(120)
    assert first.returncode == 0 and run_repack("verify", out).returncode == 0


def test_a_source_changed_while_the_job_ran_says_to_start_over(tmp_path):
    """A file of the last shard grows after the plan: its task fails, and the message does not promise that a
    plain re-run resumes (it is refused: the source changed); it says --overwrite."""
    import os
    import signal
    import subprocess
    import sys

    from tests.conftest import ROOT

    src = write_jpegs(tmp_path / "src" / "c", 400, "a").parent
    out = tmp_path / "out"
    job = out / ".repack" / "job.json"
    run = subprocess.Popen([sys.executable, "-m", "repack", "images", str(src), str(out), "--shard-size", "4",
                            "--workers", "1", "--quiet"], cwd=ROOT, start_new_session=True,
                           stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    try:
        while run.poll() is None and not job.exists():
            pass
        os.killpg(run.pid, signal.SIGSTOP)
        assert run.poll() is None, "the run ended before it could be stopped"
        last = sorted((src / "c").iterdir(), key=lambda p: p.name.encode())[-1]
        with open(last, "ab") as fh:
            fh.write(b"\0" * 10)
    finally:
        os.killpg(run.pid, signal.SIGCONT)
    _, err = run.communicate(timeout=120)
    assert run.returncode == 4 and "the source changed while the job ran" in err and "--overwrite" in err, err
    assert "a re-run resumes" not in err


def test_verify_beside_a_gc_or_a_publish_reports_no_damage(tmp_path, monkeypatch):
    """A `gc` that deletes old versions right after verify listed the folder, and a `remove` that publishes
    between verify's reads of manifest.json, left a healthy dataset reported damaged (a vanished version
    "not readable", its files strays, "manifest.json is not the newest version"): verify looks again when
    the folder moved while it looked. The writers are the real CLI, run inside verify's own steps."""
    from repack.lifecycle.verify import verify_report
    from repack.store import files as store_files

    src, out = packed(tmp_path)
    for name in ("c/a0.jpg", "c/a1.jpg", "c/a2.jpg"):  # versions 2-4
        assert run_repack("remove", out, "--sources", takedown(tmp_path, name)).returncode == 0
    listing = store_files.LocalFiles.names
    writers = iter([["gc", out, "--keep", "1"], ["remove", out, "--sources", takedown(tmp_path, "c/a4.jpg")]])

    def names_then_a_writer(self):
        found = listing(self)
        command = next(writers, None)
        if command is not None:
            assert run_repack(*command).returncode == 0
        return found

    monkeypatch.setattr(store_files.LocalFiles, "names", names_then_a_writer)
    for _ in range(2):
        assert verify_report(out).problems == ()
    assert next(writers, None) is None  # both writers ran inside a verify
    assert read_manifest_json(out)["dataset_version"]["number"] == 5


def test_a_side_file_write_killed_before_the_manifest_leaves_no_temp_after_the_rerun(tmp_path):
    """A text job killed while it renamed ``tokenizer.json`` or its ``.sources`` into OUT (after its tasks,
    before the manifest) left the temp of that write; the re-run resumed every task and published, but the temp
    stayed, and verify failed on it for good. The re-run's job now removes every killed write's temp."""
    from tests.tools.text import documents, train_bpe, write_tokenizer

    src, out = tmp_path / "src", tmp_path / "out"
    src.mkdir()
    for n, text in enumerate(documents(6)):
        (src / f"d{n}.txt").write_text(text + "\n")
    tokenizer = write_tokenizer(train_bpe(documents(40)), tmp_path / "tok")
    command = ["text", src, out, "--tokenizer", tokenizer, "--quiet"]
    run_repack(*command)
    reference = {p.name: p.read_bytes() for p in out.iterdir() if p.is_file() and p.name != "manifest.json"}
    temps = [out / ".tokenizer.json.k1ll3d0x.tmp", out / ".text_document.sources.k1ll3d0y.tmp"]
    for temp in temps:  # what the killed writes left, then no manifest yet
        temp.write_bytes(b"partial")
    (out / ".notes.20240101.tmp").write_bytes(b"a user's, not a write of repack's: left alone")
    (out / "manifest.json").unlink()
    run_repack(*command)
    assert not any(temp.exists() for temp in temps) and (out / ".notes.20240101.tmp").exists()
    (out / ".notes.20240101.tmp").unlink()
    assert {p.name: p.read_bytes() for p in out.iterdir() if p.is_file() and p.name != "manifest.json"} == reference
    assert run_repack("verify", out).returncode == 0


def test_an_overwrite_killed_while_it_deletes_never_leaves_a_manifest_naming_a_deleted_file(tmp_path, monkeypatch):
    """--overwrite deleted the old dataset's files in name order: data.lmdb before manifest.json, so a kill in
    between left a readable manifest naming a missing database. The manifests go first now: a kill at the
    manifest's deletion leaves the old dataset whole. (The kill: the delete of manifest.json raises.)"""
    from repack.cli import cli
    from repack.store.local import LocalStore

    src = write_jpegs(tmp_path / "src" / "c", 6, "a").parent
    out = tmp_path / "out"
    run_repack("images", src, out, "--to", "lmdb", "--quiet")

    class Killed(BaseException):
        pass

    deleted: list[str] = []
    delete = LocalStore.delete

    def delete_until_the_manifest(self, rel):
        if rel == "manifest.json":
            raise Killed
        deleted.append(rel)
        delete(self, rel)

    monkeypatch.setattr(LocalStore, "delete", delete_until_the_manifest)
    try:
        cli.main(["images", str(src), str(out), "--to", "lmdb", "--shuffle", "--overwrite", "--quiet"],
                 standalone_mode=False)
    except Killed:
        pass
    assert deleted == [] and (out / "data.lmdb").exists()
    monkeypatch.undo()
    assert run_repack("verify", out).returncode == 0


def files_of(out: Path) -> dict[str, bytes]:
    return {p.relative_to(out).as_posix(): p.read_bytes() for p in out.rglob("*")
            if p.is_file() and ".repack" not in p.relative_to(out).parts}


def test_lmdb_and_token_removes_refuse_to_write_over_a_published_file(tmp_path):
    """The LMDB and token rewriters never checked: an LMDB renamed to data-v2.lmdb was rewritten in place (exit 0,
    version 1 lost), and a token prefix renamed to the next remove's name for another prefix was overwritten
    before the remove failed (exit 2, the latest version broken). Both now refuse by name and change nothing."""
    from tests.tools.text import documents, gpt2_tokenizer, write_tokenizer

    src = write_jpegs(tmp_path / "src" / "c", 6, "a").parent
    lmdb = tmp_path / "lmdb"
    run_repack("images", src, lmdb, "--to", "lmdb", "--quiet")
    (lmdb / "data.lmdb").rename(lmdb / "data-v2.lmdb")
    rename_everywhere(lmdb, "data.lmdb", "data-v2.lmdb")
    corpus, tok, text = tmp_path / "corpus", tmp_path / "tok", tmp_path / "text"
    corpus.mkdir()
    write_tokenizer(gpt2_tokenizer(), tok)
    docs = documents(200, seed=3)
    for name, part in (("a", docs[:100]), ("b", docs[100:])):
        (corpus / f"{name}.jsonl").write_text("".join(json.dumps({"text": d}) + "\n" for d in part))
    run_repack("text", corpus, text, "--tokenizer", tok, "--chunk-bytes", "4KB", "--no-merge", "--quiet")
    manifest = read_manifest_json(text)
    first, last = manifest["shards"][0]["prefix"], manifest["shards"][-1]["prefix"]
    for suffix in (".bin", ".idx", ".sources"):
        (text / f"{last}{suffix}").rename(text / f"{first}-v2{suffix}")
    raw = (text / "manifest.json").read_text().replace(f'"{last}', f'"{first}-v2').replace(f" {last}", f" {first}-v2")
    (text / "manifest.json").write_text(raw)
    assert run_repack("verify", lmdb).returncode == 0 and run_repack("verify", text).returncode == 0
    for out, args, named in ((lmdb, ("--sources", "c/a0.jpg"), "data-v2.lmdb"),
                             (text, ("--keys", "a.jsonl#0"), f"{first}-v2.bin")):
        args = (args[0], takedown(tmp_path, args[1]))
        before = files_of(out)
        refused = run_repack("remove", out, *args, check=False)
        assert refused.returncode == 2 and named in refused.stderr and "published version" in refused.stderr, \
            refused.stderr
        assert files_of(out) == before and run_repack("verify", out).returncode == 0
