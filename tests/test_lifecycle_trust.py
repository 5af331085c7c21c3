"""A dataset's writers after a crash or with a planted link (review, stop 51): an append never stages outside
OUT, goes on from a pending version another writer left, and a re-run pack leaves no manifest temp file."""

from __future__ import annotations

import os

from tests.conftest import read_manifest_json, run_repack
from tests.test_images_job import write_jpegs


def packed(tmp_path, count: int = 6):
    src, out = tmp_path / "src", tmp_path / "out"
    write_jpegs(src / "a", count, stem="a")
    write_jpegs(src / "b", count, stem="b")
    run_repack("images", src, out, "--quiet")
    return src, out


def test_append_refuses_a_link_planted_in_its_staging_folder(tmp_path):
    """A symbolic link at OUT/.repack/append-v2/out (anyone who can write OUT/.repack) made the staged job write
    its shards, state and manifest into the link's target, and a retry with overwrite delete what was there."""
    src, out = packed(tmp_path)
    victim = tmp_path / "victim"
    write_jpegs(victim, 2, stem="keep")  # files another job owns
    before = sorted(os.listdir(victim))
    (out / ".repack/append-v2").mkdir(parents=True)
    os.symlink(victim, out / ".repack/append-v2/out")
    write_jpegs(src / "c", 3, stem="c")
    proc = run_repack("images", src, out, "--append", check=False)
    assert proc.returncode == 2, proc.stderr  # a link anywhere in the job state: refused before anything is done
    assert "append-v2/out" in proc.stderr and "symbolic link" in proc.stderr
    assert sorted(os.listdir(victim)) == before
    assert "dataset_version" not in read_manifest_json(out)  # version 1, untouched


def test_append_goes_on_from_a_pending_remove(tmp_path):
    """A remove killed between its version file and manifest.json leaves its version pending: the next append
    publishes it and then appends the new inputs (it returned at once, saying it had published, packing none)."""
    src, out = packed(tmp_path)
    first = (out / "manifest.json").read_bytes()
    (tmp_path / "gone.txt").write_text("a/a0.jpg\n")
    run_repack("remove", out, "--sources", tmp_path / "gone.txt", "--quiet")
    (out / "manifest.json").write_bytes(first)  # killed after manifest.v2.json, before manifest.json
    write_jpegs(src / "c", 4, stem="c")
    run_repack("images", src, out, "--append", "--quiet")
    data = read_manifest_json(out)
    assert data["dataset_version"]["number"] == 3
    assert data["dataset_version"]["change"]["kind"] == "append"
    assert data["totals"]["samples"] == 12 - 1 + 4
    assert run_repack("verify", out, check=False).returncode == 0


def test_a_rerun_pack_removes_a_killed_manifest_write(tmp_path):
    """A pack killed just before renaming its manifest into place: the re-run publishes and leaves no temp file."""
    src, out = packed(tmp_path)
    manifest = (out / "manifest.json").read_bytes()
    (out / "manifest.json").unlink()
    (out / ".manifest.json.k1ll3d.tmp").write_bytes(manifest[:100])
    run_repack("images", src, out, "--quiet")
    assert not list(out.glob(".manifest*"))
    assert (out / "manifest.json").exists()
