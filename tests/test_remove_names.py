"""`repack remove` finds every named source, whatever its name, and names the shards it rewrites the same way
however often a shard is rewritten: a source whose name holds no ASCII letter or digit (its sample key is the
position alone) is removed like any other; a shard rewritten by versions 2 and 3 is ``shard-XXXXXX-v3.tar``."""

from __future__ import annotations


from tests.conftest import ROOT, read_manifest_json, run_repack, sample_paths
from tests.test_images_job import jpeg_bytes, write_jpegs

NAMELESS = ["ü", "___", "日本"]  # no slug: keys 000000NN with no "_"


def test_sources_without_a_slug_are_removed(tmp_path):
    src, out = write_jpegs(tmp_path / "src" / "c", 12, "a").parent, tmp_path / "out"
    for number, name in enumerate(NAMELESS):
        (src / "c" / f"{name}.jpg").write_bytes(jpeg_bytes(seed=40 + number))
    run_repack("images", src, out, "--shard-size", "5", "--quiet")
    listing = tmp_path / "takedown.txt"
    listing.write_text("".join(f"c/{name}.jpg\n" for name in NAMELESS) + "c/a3.jpg\n", encoding="utf-8")
    done = run_repack("remove", out, "--sources", listing)
    assert "4 sample(s) removed, 0 name(s) not found" in done.stdout + done.stderr
    left = sample_paths(out)
    assert len(left) == 11 and not {f"c/{name}.jpg" for name in NAMELESS} & set(left) and "c/a3.jpg" not in left
    assert run_repack("verify", out).returncode == 0


def test_a_shard_rewritten_again_keeps_one_version_suffix(tmp_path):
    src, out = write_jpegs(tmp_path / "src" / "c", 8, "a").parent, tmp_path / "out"
    run_repack("images", src, out, "--quiet")
    for version, name in ((2, "a1"), (3, "a5")):
        listing = tmp_path / f"takedown{version}.txt"
        listing.write_text(f"c/{name}.jpg\n")
        run_repack("remove", out, "--sources", listing, "--quiet")
        assert [s["path"] for s in read_manifest_json(out)["shards"]] == [f"shard-000000-v{version}.tar"]
    assert sorted(sample_paths(out)) == sorted(f"c/a{i}.jpg" for i in range(8) if i not in (1, 5))
    assert run_repack("verify", out).returncode == 0 and run_repack("verify", out, "--version", "2").returncode == 0
    stats = read_manifest_json(out)["stats"]  # what inspect reports: the samples left, by format and class
    assert stats["formats"] == {"jpg": 6} and stats["class_counts"] == {"c": 6}


def test_a_rewrite_worker_killed_ends_in_one_line_and_exit_4_and_a_rerun_completes(tmp_path):
    """A rewrite process killed (the OOM killer) ended the remove in a 45-line traceback, exit 1."""
    import subprocess
    import sys

    from tests.conftest import ROOT

    src, out = write_jpegs(tmp_path / "src" / "c", 12, "a").parent, tmp_path / "out"
    run_repack("images", src, out, "--shard-size", "4", "--quiet")
    listing = tmp_path / "takedown.txt"
    listing.write_text("c/a1.jpg\nc/a5.jpg\nc/a9.jpg\n")
    killed_worker = ("import os, sys\nimport repack.lifecycle.remove_tar as r\n"
                     "def dies(*args, **kwargs):\n    os._exit(137)\n"
                     "r.copy_kept = dies\nsys.argv = ['repack'] + sys.argv[1:]\nfrom repack.cli import main\nmain()\n")
    died = subprocess.run([sys.executable, "-c", killed_worker, "remove", str(out), "--sources", str(listing)],
                          capture_output=True, text=True, cwd=ROOT)
    assert died.returncode == 4 and died.stderr.count("\n") == 1 and "a worker process died" in died.stderr
    assert not (out / "manifest.v2.json").exists() and len(sample_paths(out)) == 12
    run_repack("remove", out, "--sources", listing)
    assert len(sample_paths(out)) == 9 and run_repack("verify", out).returncode == 0


def test_sources_given_as_paths_inside_a_folder_source_are_removed(tmp_path):
    """A takedown list of full paths (``/data/src/c/a1.jpg`` for ``c/a1.jpg``), as `find SOURCE` prints them, said
    "no named sample found" with exit 0 and removed nothing; a path outside SOURCE is still not found."""
    src, out = write_jpegs(tmp_path / "src" / "c", 6, "a").parent, tmp_path / "out"
    run_repack("images", src, out, "--quiet")
    listing = tmp_path / "takedown.txt"
    listing.write_text(f"{src}/c/a1.jpg\n{src.resolve()}/c//a2.jpg\nc//a3.jpg\n{tmp_path}/elsewhere/c/a4.jpg\n")
    done = run_repack("remove", out, "--sources", listing)
    assert "3 sample(s) removed, 1 name(s) not found" in done.stdout + done.stderr, done.stdout + done.stderr
    assert f"not found in the dataset: {tmp_path}/elsewhere/c/a4.jpg" in done.stderr
    assert sorted(sample_paths(out)) == ["c/a0.jpg", "c/a4.jpg", "c/a5.jpg"]
    assert read_manifest_json(out)["dataset_version"]["change"]["not_found"] == [f"{tmp_path}/elsewhere/c/a4.jpg"]
    import subprocess  # as `find src` prints it beside SOURCE: from the current folder
    import sys

    (tmp_path / "found.txt").write_text("src/c/a4.jpg\n")
    beside = subprocess.run([sys.executable, "-m", "repack", "remove", "out", "--sources", "found.txt"], cwd=tmp_path,
                            capture_output=True, text=True, env={**__import__("os").environ,
                                                                 "PYTHONPATH": str(ROOT)})
    assert "1 sample(s) removed, 0 name(s) not found" in beside.stdout + beside.stderr, beside.stderr
    assert sorted(sample_paths(out)) == ["c/a0.jpg", "c/a5.jpg"]
    (src / "c" / "a1.jpg").touch()  # the taken-down source stays out of later appends, however it was named
    assert "nothing new" in (lambda r: r.stdout + r.stderr)(run_repack("images", src, out, "--append"))
    assert run_repack("verify", out).returncode == 0
