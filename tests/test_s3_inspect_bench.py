"""`repack inspect s3://...` and `repack bench s3://...` against a real S3 HTTP server on loopback
(moto's server mode) with boto3: the same summary as for the same dataset on disk, the HTML
report, and bench rows measured from the bucket."""

from __future__ import annotations

import json
import re

import pytest

from tests.conftest import run_repack
from tests.tools.photos import make_photo_tree
from tests.tools.s3server import MotoServer, client, s3_env

URL = "s3://datasets/photos-wds"


@pytest.fixture(scope="module")
def packed(tmp_path_factory):
    """The same 18 photos (one broken file among them) packed locally and to s3://; the environment."""
    root = tmp_path_factory.mktemp("s3report")
    make_photo_tree(root / "src", per_class=6, classes=3, seed=9, min_side=40, max_side=120)
    (root / "src" / "broken.jpg").write_bytes(b"\xff\xd8\xff\xe0 not a jpeg")
    server = MotoServer()
    try:
        client(server.endpoint).create_bucket(Bucket="datasets")
        env = {**s3_env(server.endpoint), "REPACK_SCRATCH": str(root / "scratch")}
        for out in (root / "local", URL):
            run_repack("images", root / "src", out, "--shard-size", "8", "--quiet", env=env)
        yield root, env
    finally:
        server.stop()


def without_run(summary: dict) -> dict:
    return {k: v for k, v in summary.items() if k not in ("root", "run", "timing")}


def test_inspect_reads_the_dataset_in_the_bucket(packed, tmp_path):
    root, env = packed
    remote = json.loads(run_repack("inspect", URL, "--json", env=env).stdout)
    local = json.loads(run_repack("inspect", root / "local", "--json", env=env).stdout)
    assert remote["root"] == URL and remote["samples"] == 18 and remote["quarantine"]["count"] == 1
    assert without_run(remote) == without_run(local)
    text = run_repack("inspect", URL, env=env).stdout
    assert text.startswith(f"{URL}: images / webdataset") and "quarantined: 1" in text
    pages = {}
    for name, where in (("remote", URL), ("local", root / "local")):
        run_repack("inspect", where, "--html", tmp_path / f"{name}.html", env=env)
        pages[name] = (tmp_path / f"{name}.html").read_text()
    assert f"repack report: {URL}" in pages["remote"]
    # the thumbnails come from the bucket through ranged GETs: the same pictures as from the disk
    thumbs = [re.findall(r'<img src="(data:[^"]+)"', page) for page in (pages["remote"], pages["local"])]
    assert len(thumbs[0]) == 18 and thumbs[0] == thumbs[1]


def test_inspect_of_a_prefix_without_a_dataset_is_one_clear_error(packed):
    _, env = packed
    proc = run_repack("inspect", "s3://datasets/nothing-here", env=env, check=False)
    assert proc.returncode == 5 and "s3://datasets/nothing-here/manifest.json: no manifest" in proc.stderr


def test_bench_measures_the_reader_on_the_bucket(packed):
    _, env = packed
    proc = run_repack("bench", URL, "--reader", "torch", "--loader-workers", "0", "--batch-size", "6", "--steps", "3",
                      "--warmup", "1", "--json", env=env)
    report = json.loads(proc.stdout)
    assert report["dataset"] == URL and report["format"] == "webdataset"
    (row,) = report["results"]
    assert "error" not in row, row
    assert row["samples_per_s"] > 0 and row["steps"] == 3
