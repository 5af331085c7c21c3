"""A FIFO in a dataset's place (a tar of a dataset can carry one) is refused by name, never waited on: with
manifest.json or a shard's .idx a FIFO, inspect, remove, gc and the readers waited forever. Nested JSON thousands
deep in a manifest is refused as not valid JSON (a RecursionError traceback before)."""

from __future__ import annotations

import os

import pytest

from tests.conftest import read_manifest_json, run_repack
from tests.test_images_job import write_jpegs


@pytest.fixture
def dataset(tmp_path):
    src, out = write_jpegs(tmp_path / "src" / "c", 4, "a").parent, tmp_path / "out"
    run_repack("images", src, out, "--quiet")
    (tmp_path / "names").write_text("c/a1.jpg\n")
    return out


def _fifo(path) -> None:
    path.unlink()
    os.mkfifo(path)


def test_a_fifo_manifest_is_refused_by_every_command(dataset, tmp_path):
    _fifo(dataset / "manifest.json")
    for args in (("inspect", dataset), ("remove", dataset, "--sources", tmp_path / "names"), ("gc", dataset),
                 ("verify", dataset)):
        done = run_repack(*args, check=False, timeout=60)
        assert done.returncode in (2, 5) and "manifest.json" in done.stderr + done.stdout, (args, done.stderr)
        assert "Traceback" not in done.stderr


def test_a_fifo_index_is_refused_by_the_reader_and_inspect(dataset):
    from pipelines.torch_webdataset import ImageShardDataset

    index = dataset / read_manifest_json(dataset)["shards"][0]["index"]
    _fifo(index)
    with pytest.raises(OSError, match="not a regular file"):
        list(ImageShardDataset(str(dataset)))
    done = run_repack("inspect", dataset, check=False, timeout=60)
    assert done.returncode in (2, 5) and "Traceback" not in done.stderr


def test_json_nested_thousands_deep_is_not_valid_json(dataset):
    manifest = (dataset / "manifest.json").read_text()
    (dataset / "manifest.json").write_text(manifest.rstrip().rstrip("}") + ', "extra": ' + "[" * 100000 + "]" * 100000
                                           + "}\n")
    for command in ("verify", "inspect", "gc"):
        done = run_repack(command, dataset, check=False, timeout=60)
        assert done.returncode in (2, 5) and "nested too deep" in done.stderr + done.stdout, done.stderr
        assert "Traceback" not in done.stderr


def test_an_over_cap_manifest_is_refused_unread_and_a_linked_folder_is_not_walked(dataset, tmp_path):
    """gc, remove and --append read a 1 GB manifest.json whole (1.09 GB resident) before the cap refused it; a link
    named manifest.v9.json to a folder made gc walk everything below it."""
    import subprocess
    import sys

    from tests.conftest import ROOT

    with open(dataset / "manifest.json", "r+b") as fh:
        fh.truncate(2**30)  # sparse: a gigabyte that costs no disk
    measure = ("import resource, subprocess, sys\n"
               "done = subprocess.run([sys.executable, '-m', 'repack'] + sys.argv[1:], capture_output=True, text=True)\n"
               "print(done.returncode, resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss // 1024)\n"
               "sys.stderr.write(done.stderr)\n")
    for args in (("gc", dataset), ("remove", dataset, "--sources", tmp_path / "names")):
        done = subprocess.run([sys.executable, "-c", measure, *map(str, args)], capture_output=True, text=True,
                              cwd=ROOT, timeout=120)
        code, peak_mb = map(int, done.stdout.split())
        assert code == 2 and "over the" in done.stderr and peak_mb < 400, (args, code, peak_mb, done.stderr)
    other = tmp_path / "other"
    run_repack("images", write_jpegs(tmp_path / "src2" / "c", 2, "b").parent, other, "--quiet")
    (other / "manifest.v9.json").symlink_to("/")  # walked, it hit /proc: exit 2 (Invalid argument)
    done = run_repack("gc", other, check=False, timeout=60)
    assert done.returncode == 0, done.stderr
