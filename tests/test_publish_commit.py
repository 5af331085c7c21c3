"""Publishing is a commit: a pending manifest (written, not yet ``manifest.json``) is published only when
it checks out, else moved to ``.repack/rejected/`` and reported while the published version stays; an
interrupted append or remove leaves ``repack verify`` of the published version at exit 0, the unfinished
work reported as pending."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest

from tests.conftest import read_manifest_json, run_repack
from tests.test_dataset_versions import add_inputs, make_source


@pytest.fixture(scope="module")
def interrupted(tmp_path_factory) -> tuple[Path, Path, bytes]:
    """SRC with new inputs, OUT at version 1 holding the files of the version 2 an append of them
    publishes, and that version's manifest bytes: what a run killed between writing its files and
    manifest.v2.json (then manifest.json) leaves. Built once (the version 2 is made in a copy of OUT);
    tests take a copy of OUT (``copy_of``)."""
    base = tmp_path_factory.mktemp("interrupted")
    src, out, twin = make_source(base / "src"), base / "out", base / "twin"
    run_repack("images", src, out, "--shard-size", "4", "--quiet")
    shutil.copytree(out, twin)
    add_inputs(src)
    run_repack("images", src, twin, "--shard-size", "4", "--append", "--quiet")
    for path in twin.iterdir():
        if path.is_file() and path.name.startswith("shard-v2-"):
            shutil.copy(path, out / path.name)
    shutil.copy(twin / "manifest.v1.json", out / "manifest.v1.json")
    return src, out, (twin / "manifest.v2.json").read_bytes()


def copy_of(interrupted, tmp_path: Path) -> tuple[Path, Path, bytes]:
    """(SRC, a copy of the interrupted OUT of this test's own, version 2's manifest bytes)."""
    src, out, v2 = interrupted
    shutil.copytree(out, tmp_path / "out", symlinks=True)
    return src, tmp_path / "out", v2


def damaged(raw: bytes, how: str) -> bytes:
    data = json.loads(raw)
    if how == "missing file":
        data["shards"][-1]["path"] = "shard-v2-999999.tar"
    elif how == "wrong size":
        data["shards"][-1]["bytes"] += 1
    elif how == "bad path":
        data["shards"][-1]["path"] = "../elsewhere.tar"
    elif how == "wrong parent":
        data["dataset_version"]["parent"] = 7
    return json.dumps(data).encode()


@pytest.mark.parametrize("command", ["remove", "append", "gc"])
@pytest.mark.parametrize("how", ["not json", "missing file", "wrong size", "bad path", "wrong parent"])
def test_a_bad_pending_manifest_is_moved_aside_and_the_published_version_stays(interrupted, tmp_path, command, how):
    src, out, real = copy_of(interrupted, tmp_path)
    pending = b"{not json" if how == "not json" else damaged(real, how)
    (out / "manifest.v2.json").write_bytes(pending)
    v1 = (out / "manifest.json").read_bytes()
    (tmp_path / "takedown.txt").write_text("cat/c1.jpg\n")
    args = {"remove": ("remove", out, "--sources", tmp_path / "takedown.txt"),
            "append": ("images", src, out, "--shard-size", "4", "--append"),
            "gc": ("gc", out, "--keep", "1")}[command]
    proc = run_repack(*args)
    assert "manifest.v2.json: not published" in proc.stderr and "rejected" in proc.stderr
    assert "Traceback" not in proc.stderr
    rejected = [p for p in (out / ".repack" / "rejected").iterdir() if p.is_file()]
    assert [p.read_bytes() for p in rejected] == [pending]
    current = read_manifest_json(out)
    if command == "gc":  # nothing to publish: version 1 stays
        assert (out / "manifest.json").read_bytes() == v1
    else:  # the command's own version 2, checked and published
        assert current["dataset_version"]["number"] == 2 and current["dataset_version"]["change"]["kind"] == \
            {"remove": "remove", "append": "append"}[command]
    verify = run_repack("verify", out, check=False)
    # remove: the rejected version's files (named as version 2's, which the remove's version 2 does not name)
    # are moved aside with it; append wrote the same new shards again; gc: they are version 2's pending work
    assert verify.returncode == 0, verify.stderr
    if command == "remove":
        assert not (out / "shard-v2-000000.tar").exists()
        assert (out / ".repack" / "rejected" / "leftovers-v2" / "shard-v2-000000.tar").is_file()


def test_a_good_pending_manifest_is_published_by_the_next_writer(interrupted, tmp_path):
    src, out, v2 = copy_of(interrupted, tmp_path)
    (out / "manifest.v2.json").write_bytes(v2)
    proc = run_repack("gc", out, "--keep", "2")
    assert "not published" not in proc.stderr
    assert (out / "manifest.json").read_bytes() == v2 and not (out / ".repack" / "rejected").exists()
    assert run_repack("verify", out).returncode == 0


def test_verify_of_the_published_version_passes_after_an_interrupted_append_or_remove(interrupted, tmp_path):
    src, out, v2 = copy_of(interrupted, tmp_path)  # killed after the new shards were renamed into OUT ...
    proc = run_repack("verify", out)
    assert "OK" in proc.stdout and "pending" in proc.stderr and "shard-v2-000000.tar" in proc.stderr
    (out / "manifest.v2.json").write_bytes(v2)  # ... and after manifest.v2.json was written
    proc = run_repack("verify", out, "--json")
    report = json.loads(proc.stdout)
    assert report["ok"] and "manifest.v2.json" in report["pending"] and "shard-v2-000000.tar" in report["pending"]
    (out / "manifest.v2.json").unlink()
    (out / "shard-000000-v2.tar").write_bytes(b"half of a rewritten shard")  # remove killed mid-rewrite
    (out / ".shard-000001-v2.tar.tmp-123").write_bytes(b"its temp")
    proc = run_repack("verify", out, "--json")
    assert json.loads(proc.stdout)["ok"] and "shard-000000-v2.tar" in json.loads(proc.stdout)["pending"]
    (out / "evil.tar").write_bytes(b"not ours")  # a stray is still a problem
    proc = run_repack("verify", out, check=False)
    assert proc.returncode == 5 and "evil.tar: a file the manifest does not name" in proc.stderr


def test_a_link_named_as_the_new_versions_files_is_said_not_failed_once_published(tmp_path):
    """A symbolic link in OUT named as version 2's files are (a shard that version does not rewrite) made a
    remove that had published version 2 exit 5 and leave an empty leftovers folder: a script running
    `remove && gc` read a takedown that was live as failed. Now it is a warning; the link and what it
    points to are left alone."""
    src, out, outside = make_source(tmp_path / "src"), tmp_path / "out", tmp_path / "outside"
    run_repack("images", src, out, "--shard-size", "4", "--quiet")
    outside.mkdir()
    (outside / "x").write_bytes(b"not repack's")
    (out / "shard-000002-v2.tar").symlink_to(outside / "x")  # shard-000002 keeps its samples: no -v2 of it
    (tmp_path / "names.txt").write_text("cat/c0.jpg\n")
    done = run_repack("remove", out, "--sources", tmp_path / "names.txt", check=False)
    assert done.returncode == 0, done.stderr
    assert "1 sample(s) removed" in done.stdout and "was left in place" in done.stderr
    assert read_manifest_json(out)["dataset_version"]["number"] == 2
    assert (out / "shard-000002-v2.tar").is_symlink() and (outside / "x").read_bytes() == b"not repack's"
    assert not (out / ".repack" / "rejected" / "leftovers-v2").exists()
