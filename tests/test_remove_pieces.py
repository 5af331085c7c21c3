"""`repack remove` cuts a large rewritten shard into pieces hashed side by side (issue 26 item 5): the pieces
hold exactly the samples a one-piece rewrite holds, in order, byte for byte; a later remove of a piece names
its pieces apart; verify and the readers accept them. ``REPACK_REWRITE_PIECE_BYTES`` makes the tests' small
shards big enough to cut."""

from __future__ import annotations

import hashlib
import shutil

import pytest

from pipelines.torch_webdataset import ImageShardDataset
from repack.exec.cpus import available_cpus
from repack.lifecycle.remove_tar import rewritten_stem
from tests.conftest import read_manifest_json, run_repack
from tests.test_images_job import write_jpegs

CUT = {"REPACK_REWRITE_PIECE_BYTES": "4096"}


def samples(out) -> list[tuple[str, int, str, str]]:
    """(key, label, source path, sha256 of the image bytes) of every sample, in reading order."""
    return [(s["key"], s["label"], s["meta"]["path"], hashlib.sha256(s["image"]).hexdigest())
            for s in ImageShardDataset(out, decode=False, output="dict")]


@pytest.fixture(scope="module")
def packed(tmp_path_factory):
    base = tmp_path_factory.mktemp("pieces")
    for c in range(3):
        write_jpegs(base / f"src/c{c}", 20, stem=f"c{c}_")
    run_repack("images", base / "src", base / "out", "--shard-size", "30", "--quiet")
    (base / "gone.txt").write_text("c0/c0_3.jpg\nc0/c0_4.jpg\n")
    return base


def removed(packed, tmp_path, env: dict | None, names: str = "gone.txt"):
    out = tmp_path / "out"
    shutil.copytree(packed / "out", out)
    run_repack("remove", out, "--sources", packed / names, "--quiet", env=env)
    return out


def test_pieces_hold_what_one_rewrite_holds(packed, tmp_path):
    whole = removed(packed, tmp_path / "whole", None)
    cut = removed(packed, tmp_path / "cut", CUT)
    change = read_manifest_json(cut)["dataset_version"]["change"]
    rewritten = change["rewritten"]["shard-000000.tar"]
    if available_cpus() > 1:
        assert isinstance(rewritten, list) and len(rewritten) >= 2, rewritten
        assert rewritten[:2] == ["shard-000000-v2_0.tar", "shard-000000-v2_1.tar"]
    assert samples(cut) == samples(whole)
    assert len(samples(cut)) == 58
    assert run_repack("verify", cut, check=False).returncode == 0
    again = cut.parent / "again.txt"
    again.write_text("c0/c0_9.jpg\n")
    run_repack("remove", cut, "--sources", again, "--quiet", env=CUT)
    data = read_manifest_json(cut)
    paths = [shard["path"] for shard in data["shards"]]
    assert len(paths) == len(set(paths))
    assert run_repack("verify", cut, check=False).returncode == 0
    assert samples(cut) == [s for s in samples(whole) if s[2] != "c0/c0_9.jpg"]
    assert len(samples(cut)) == 57


def test_rewritten_names_stay_apart():
    assert rewritten_stem("shard-000003.tar", 2) == "shard-000003-v2"
    assert rewritten_stem("shard-000003-v2.tar", 3) == "shard-000003-v3"
    assert rewritten_stem("shard-000003-v2_1.tar", 3) == "shard-000003_1-v3"
    assert rewritten_stem("shard-000003_1-v3_2.tar", 4) == "shard-000003_1_2-v4"
    assert rewritten_stem("shard-v3-000001.tar", 4) == "shard-v3-000001-v4"
