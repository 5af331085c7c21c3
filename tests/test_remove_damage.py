"""`repack remove` refuses a dataset whose files it would rewrite are not the ones the manifest records: it read
damaged bytes, hashed them into the new version, and `repack verify` then said OK (the damage laundered; a later
gc deleted the last file that showed it). Each case: exit 5 naming the file, nothing published."""

from __future__ import annotations

import hashlib
import json

from tests.conftest import read_manifest_json, run_repack
from tests.test_images_job import write_jpegs


def _flip(path, at: int, count: int = 16) -> None:
    with open(path, "r+b") as fh:
        fh.seek(at)
        data = fh.read(count)
        fh.seek(at)
        fh.write(bytes(b ^ 0xFF for b in data))


def _refused(out, names, *, by="--sources") -> str:
    done = run_repack("remove", out, by, names, check=False)
    assert done.returncode == 5 and "nothing removed" in done.stderr and "Traceback" not in done.stderr, done.stderr
    assert not (out / "manifest.v2.json").exists()
    return done.stderr


def test_a_shard_and_its_checksums_damaged_together_are_refused(tmp_path):
    src, out = write_jpegs(tmp_path / "src" / "c", 6, "a").parent, tmp_path / "out"
    run_repack("images", src, out, "--quiet")
    shard = read_manifest_json(out)["shards"][0]
    _flip(out / shard["path"], 512 + 200)  # inside the first sample's image, kept by the remove
    _flip(out / shard["checksums"], 16)
    (tmp_path / "names").write_text("c/a5.jpg\n")
    assert shard["checksums"] in _refused(out, tmp_path / "names")


def test_a_damaged_lmdb_or_one_whose_count_was_edited_is_refused(tmp_path):
    src, out = write_jpegs(tmp_path / "src" / "c", 6, "a").parent, tmp_path / "out"
    run_repack("images", src, out, "--to", "lmdb", "--quiet")
    (tmp_path / "names").write_text("c/a5.jpg\n")
    data = out / "data.lmdb"
    image = (src / "c" / "a1.jpg").read_bytes()
    _flip(data, data.read_bytes().index(image) + 100)
    assert "data.lmdb: sha256 mismatch" in _refused(out, tmp_path / "names")

    import lmdb  # the metadata's count edited, the manifest's size and sha256 recorded again: a sample dropped

    run_repack("images", src, tmp_path / "again", "--to", "lmdb", "--quiet")
    out = tmp_path / "again"
    env = lmdb.open(str(out / "data.lmdb"), subdir=False, lock=False)
    with env.begin(write=True) as txn:
        meta = json.loads(txn.get(b"__meta__"))
        txn.put(b"__meta__", json.dumps({**meta, "count": meta["count"] - 1}).encode())
    env.close()
    manifest = read_manifest_json(out)
    raw = (out / "data.lmdb").read_bytes()
    manifest["shards"][0].update(bytes=len(raw), sha256=hashlib.sha256(raw).hexdigest())
    (out / "manifest.json").write_text(json.dumps(manifest))
    assert "metadata counts 5 samples, the manifest 6" in _refused(out, tmp_path / "names")


def test_damaged_tokens_are_refused(tmp_path):
    from tests.tools.text import gpt2_tokenizer, write_tokenizer

    texts, out = tmp_path / "texts", tmp_path / "out"
    texts.mkdir()
    for i in range(3):
        (texts / f"{i}.txt").write_text(f"document {i} says a few words of its own.\n" * 30)
    run_repack("text", texts, out, "--tokenizer", write_tokenizer(gpt2_tokenizer(), tmp_path / "tok"), "--quiet")
    (tmp_path / "names").write_text("2.txt\n")
    _flip(out / "text_document.bin", 40)
    assert "text_document.bin: sha256 mismatch" in _refused(out, tmp_path / "names")
    with open(out / "text_document.bin", "r+b") as fh:
        fh.truncate(101)  # plainly damaged: a traceback before
    _refused(out, tmp_path / "names")


def test_counts_the_shards_do_not_hold_are_refused_before_a_change(tmp_path):
    """A shard's declared count edited (-1; or 9 and 11 for two shards of 10, totals unchanged): --append published
    "3 new sample(s), 52 in all" for 63, remove said "-10 sample(s) removed", or "0 removed" after removing one."""
    src, out = write_jpegs(tmp_path / "src" / "c", 8, "a").parent, tmp_path / "out"
    run_repack("images", src, out, "--shard-size", "4", "--quiet")
    good = read_manifest_json(out)
    (tmp_path / "names").write_text("c/a1.jpg\n")
    negative = json.loads(json.dumps(good))
    negative["shards"][0]["samples"] = -1
    (out / "manifest.json").write_text(json.dumps(negative))
    write_jpegs(src / "c", 2, "new")
    for args in (("images", src, out, "--append"), ("remove", out, "--sources", tmp_path / "names")):
        done = run_repack(*args, check=False)
        assert done.returncode == 2 and "declares -1 samples" in done.stderr and "Traceback" not in done.stderr, args
    swapped = json.loads(json.dumps(good))
    swapped["shards"][0]["samples"], swapped["shards"][1]["samples"] = 3, 5
    (out / "manifest.json").write_text(json.dumps(swapped))
    assert "holds 4 samples, the manifest says 3" in _refused(out, tmp_path / "names")


INTERRUPTED_REWRITE = """
import os, signal, sys, time
import repack.lifecycle.remove as remove
def stopped(store, out, current, spec, number, known):  # a SIGTERM while the rewrites write their temp files
    (out / f".shard-000000-v{number}.tar.tmp-99999").write_bytes(b"part of a shard")
    os.kill(os.getpid(), signal.SIGTERM)
    time.sleep(5)
remove.REWRITERS["webdataset"] = stopped
sys.argv = ['repack'] + sys.argv[1:]
from repack.cli import main
main()
"""


def test_an_interrupted_remove_leaves_no_temp_file_and_gc_clears_a_killed_ones(tmp_path):
    """An interrupted remove said "temp files removed" and left its rewrites' temp files (a shard's worth each);
    neither gc nor --append ever deleted those of a remove killed with -9."""
    import subprocess
    import sys

    from tests.conftest import ROOT

    src, out = write_jpegs(tmp_path / "src" / "c", 6, "a").parent, tmp_path / "out"
    run_repack("images", src, out, "--quiet")
    (tmp_path / "names").write_text("c/a1.jpg\n")
    done = subprocess.run([sys.executable, "-c", INTERRUPTED_REWRITE, "remove", str(out), "--sources",
                           str(tmp_path / "names")], capture_output=True, text=True, cwd=ROOT)
    assert done.returncode == 143 and "temp files removed" in done.stderr, done.stderr
    assert not list(out.glob(".*.tmp-*"))
    (out / ".shard-000000-v2.tar.tmp-4242").write_bytes(b"a killed remove's")
    run_repack("gc", out)
    assert not list(out.glob(".*.tmp-*")) and run_repack("verify", out).returncode == 0


SWALLOWED_BEFORE_PUBLISH = """
import os, signal, sys, time
import repack.lifecycle.remove as remove
found = remove.published_record
def swallowing(*args, **kwargs):  # the handler's raise swallowed by C code (an import, a callback)
    try:
        os.kill(os.getpid(), signal.SIGTERM)
        time.sleep(1)
    except BaseException:
        pass
    return found(*args, **kwargs)
remove.published_record = swallowing
sys.argv = ['repack'] + sys.argv[1:]
from repack.entry import main
main()
"""


def test_a_change_publishes_nothing_after_a_swallowed_signal_and_gc_frees_space_beside_a_missing_shard(tmp_path):
    """remove published version 2 after a SIGTERM whose raise was swallowed, then said it was interrupted (143);
    gc refused a dataset one of whose shards is missing ("not a valid manifest"), freeing nothing."""
    import subprocess
    import sys

    from tests.conftest import ROOT

    src, out = write_jpegs(tmp_path / "src" / "c", 8, "a").parent, tmp_path / "out"
    run_repack("images", src, out, "--shard-size", "4", "--quiet")
    (tmp_path / "names").write_text("c/a1.jpg\n")
    done = subprocess.run([sys.executable, "-c", SWALLOWED_BEFORE_PUBLISH, "remove", str(out), "--sources",
                           str(tmp_path / "names")], capture_output=True, text=True, cwd=ROOT)
    assert done.returncode == 143 and "published" not in done.stdout + done.stderr, done.stdout + done.stderr
    assert not (out / "manifest.v2.json").exists()
    run_repack("remove", out, "--sources", tmp_path / "names", "--quiet")
    kept = [s["path"] for s in read_manifest_json(out)["shards"]]
    (out / kept[-1]).unlink()  # a shard of the latest version lost
    freed = run_repack("gc", out)
    assert "deleted 1 older version(s)" in freed.stdout + freed.stderr
