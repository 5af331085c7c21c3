"""Other loaders' files in a repack dataset (issue 18, item 6): after the real `energon prepare`
(megatron-energon) and with a wids shard index, `repack verify` passes on a folder and on s3://,
checks energon's counts and tar indexes and the wids index against the manifest, and still refuses
any other unlisted file. (docs/interop.md shows the three loaders reading; the README test runs it.)"""

from __future__ import annotations

import json
import shutil
import struct
import subprocess
import sys
from pathlib import Path

import pytest

from repack.manifest import read_manifest, wids_shard_index
from tests.conftest import run_repack
from tests.test_remote_checks import env_for, server, upload, verify_json  # noqa: F401 - the moto fixture

ENERGON = str(Path(sys.executable).parent / "energon")


@pytest.fixture(scope="module")
def prepared(packed_photos, tmp_path_factory) -> Path:
    """packed_photos after `energon prepare` and with OUT/shardindex.json (read-only for tests)."""
    out = tmp_path_factory.mktemp("energon") / "out"
    shutil.copytree(packed_photos, out)
    subprocess.run([ENERGON, "prepare", str(out), "--non-interactive", "--split-ratio", "1,0,0",
                    "--sample-type", "CrudeWebdataset", "--no-progress"], check=True, capture_output=True)
    (out / "shardindex.json").write_text(json.dumps(wids_shard_index(read_manifest(out))))
    assert (out / ".nv-meta" / ".info.json").is_file() and (out / "shard-000000.tar.idx").is_file()
    return out


def test_verify_passes_on_a_prepared_dataset_locally_and_on_s3(server, prepared, tmp_path):
    env = env_for(server, tmp_path)
    proc = run_repack("verify", prepared, "--json")
    report = json.loads(proc.stdout)
    assert report["ok"] and any(u.startswith(".nv-meta/index.sqlite") for u in report["unchecked"])
    assert not any("tar.idx" in u or ".info.json" in u or "shardindex" in u or "split.yaml" in u
                   for u in report["unchecked"])
    assert verify_json(upload(server, prepared, "interop", "prepared"), env) == (0, [])


def tamper_info(out: Path) -> None:
    info = json.loads((out / ".nv-meta" / ".info.json").read_text())
    info["shard_counts"]["shard-000000.tar"] -= 1
    (out / ".nv-meta" / ".info.json").write_text(json.dumps(info))


def tamper_tar_index(out: Path) -> None:
    raw = (out / "shard-000001.tar.idx").read_bytes()
    (out / "shard-000001.tar.idx").write_bytes(raw[:8] + struct.pack("Q", 1 + struct.unpack("Q", raw[8:16])[0]) + raw[16:])


def tamper_wids(out: Path) -> None:
    index = json.loads((out / "shardindex.json").read_text())
    index["shardlist"][0]["nsamples"] += 1
    (out / "shardindex.json").write_text(json.dumps(index))


def tamper_split(out: Path) -> None:
    """energon's split: one shard listed twice, the others dropped (energon then trains on one shard twice)."""
    (out / ".nv-meta" / "split.yaml").write_text("split_parts:\n  train:\n  - shard-000000.tar\n  - shard-000000.tar\n"
                                                "  val: []\n  test: []\nexclude: []\n")


def split_of_a_superseded_shard(out: Path) -> None:
    """A split naming a tar no version holds now (energon prepares every tar of the folder, a superseded one too)."""
    (out / ".nv-meta" / "split.yaml").write_text("split_parts:\n  train:\n  - shard-{000000..000004}.tar\n"
                                                "  - shard-000007.tar\nexclude: []\n")


def stray_in_nv_meta(out: Path) -> None:
    (out / ".nv-meta" / "run.sh").write_text("echo hi")


def stray_tar_idx(out: Path) -> None:
    (out / "shard-000099.tar.idx").write_bytes(bytes(16))


@pytest.mark.parametrize("tamper,said", [
    (tamper_info, ".nv-meta/.info.json: energon's shard counts differ"),
    (tamper_tar_index, "shard-000001.tar.idx: energon's tar index does not give the sample offsets"),
    (tamper_wids, "shardindex.json: not the wids shard index of this manifest"),
    (tamper_split, ".nv-meta/split.yaml: lists shard-000000.tar 2 times"),
    (split_of_a_superseded_shard, "does not hold (shard-000007.tar): run `repack gc OUT --keep 1`"),
    (stray_in_nv_meta, ".nv-meta/run.sh: a file the manifest does not name"),
    (stray_tar_idx, "shard-000099.tar.idx: a file the manifest does not name"),
], ids=lambda v: getattr(v, "__name__", ""))
def test_other_loaders_files_are_checked_and_nothing_else_is_let_through(server, prepared, tmp_path, tamper, said):
    out = tmp_path / "out"
    shutil.copytree(prepared, out)
    tamper(out)
    env = env_for(server, tmp_path)
    local = verify_json(out, env)
    assert local[0] == 5 and any(said in p for p in local[1]), local
    assert verify_json(upload(server, out, "interop", tamper.__name__), env) == local


@pytest.mark.parametrize("split", [
    "split_parts:\n  train:\n  - shard-{000000..000004}.tar\nexclude:\n- shard-000002.tar\n",  # a shard filtered out
    "split_parts:\n  train:\n  - shard-{000000..000004}.tar\nexclude:\n- shard-000001.tar/0\n",  # one sample
    "split_parts:\n  train:\n  - shard-{000000..000004}.tar\nexclude:\n- shard-000001.tar/00000031_chelsea_0007\n",
    "split_parts:\n  train:\n  - shard-{000000..000002}.tar\nexclude: []\n",  # shards held out (--split-parts)
])
def test_energon_splits_it_reads_itself_pass(prepared, tmp_path, split):
    """``exclude`` is energon's filter and a shard no part lists is energon's choice: only a name that is no shard
    of the manifest, or a shard listed twice, is a problem."""
    out = tmp_path / "out"
    shutil.copytree(prepared, out)
    (out / ".nv-meta" / "split.yaml").write_text(split)
    proc = run_repack("verify", out, check=False)
    assert proc.returncode == 0, proc.stdout + proc.stderr


def test_a_new_version_rewrites_the_wids_index_and_names_a_stale_energon_preparation(prepared, tmp_path):
    """After `repack remove` the wids shard index is the new version's (wids read the removed samples and missed
    none of them silently), energon's preparation is named as stale (energon still reads the removed samples);
    gc then takes energon's index of the deleted tar with it, and once prepared again the dataset verifies."""
    import wids

    out = tmp_path / "out"
    shutil.copytree(prepared, out)
    first = json.loads(next(data for name, data in tarfile_members(out / "shard-000000.tar") if name.endswith(".json")))
    (tmp_path / "takedown.txt").write_text(first["path"] + "\n")
    removed = run_repack("remove", out, "--sources", tmp_path / "takedown.txt")
    assert "(megatron-energon) was prepared for another version" in removed.stderr, removed.stderr
    manifest = read_manifest(out)
    assert json.loads((out / "shardindex.json").read_text()) == wids_shard_index(manifest)
    dataset = wids.ShardListDataset(str(out / "shardindex.json"), cache_dir=str(tmp_path / "wids"),
                                    transformations=[])
    paths = [json.loads(dataset[i][".json"].read())["path"] for i in range(len(dataset))]
    assert len(paths) == manifest.num_samples and first["path"] not in paths
    (out / "shardindex.json").write_text(json.dumps(wids_shard_index(read_manifest(out, 1))))  # killed before it
    run_repack("gc", out, "--keep", "2")  # was rewritten: the next command that takes the dataset's lock does it
    assert json.loads((out / "shardindex.json").read_text()) == wids_shard_index(manifest)
    run_repack("gc", out, "--keep", "1")
    assert not (out / "shard-000000.tar.idx").exists()
    subprocess.run([ENERGON, "prepare", str(out), "--non-interactive", "--split-ratio", "1,0,0", "--force-overwrite",
                    "--sample-type", "CrudeWebdataset", "--no-progress"], check=True, capture_output=True)
    assert run_repack("verify", out, check=False).returncode == 0


def tarfile_members(path: Path) -> list[tuple[str, bytes]]:
    import tarfile

    with tarfile.open(path) as tar:
        return [(m.name, tar.extractfile(m).read()) for m in tar.getmembers() if m.isfile()]


def test_other_loaders_files_that_cannot_be_rewritten_leave_the_published_version_standing(prepared, tmp_path):
    """An energon folder that is a link leaving the dataset: the version is published (exit 0, as before the views
    were kept), and the warning says why its files were not brought up to it."""
    out = tmp_path / "out"
    shutil.copytree(prepared, out)
    shutil.move(out / ".nv-meta", tmp_path / "nv-meta")
    (out / ".nv-meta").symlink_to(tmp_path / "nv-meta")
    first = json.loads(next(data for name, data in tarfile_members(out / "shard-000000.tar") if name.endswith(".json")))
    (tmp_path / "takedown.txt").write_text(first["path"] + "\n")
    removed = run_repack("remove", out, "--sources", tmp_path / "takedown.txt")
    assert "other loaders' files not brought up to version 2" in removed.stderr, removed.stderr
    assert json.loads((out / "manifest.json").read_text())["dataset_version"]["number"] == 2


def test_an_older_kept_version_verifies_beside_other_loaders_files_kept_at_the_latest(prepared, tmp_path):
    """repack keeps the wids index at the published version: `verify --version 1` checked it (and energon's
    preparation of the latest) against version 1 and exited 5 on a sound dataset. wids' own `widsindex create` adds a name and
    each shard's md5sum: an index with them passed nothing either; its counts are what is compared."""
    out = tmp_path / "out"
    shutil.copytree(prepared, out)
    first = json.loads(next(data for name, data in tarfile_members(out / "shard-000000.tar") if name.endswith(".json")))
    (tmp_path / "takedown.txt").write_text(first["path"] + "\n")
    shutil.rmtree(out / ".nv-meta")  # wids alone: energon prepares every tar of the folder, superseded ones too
    for index in out.glob("*.tar.idx"):
        index.unlink()
    run_repack("remove", out, "--sources", tmp_path / "takedown.txt")
    for args in ((), ("--version", "1"), ("--version", "2")):
        done = run_repack("verify", out, *args, check=False)
        assert done.returncode == 0, (args, done.stdout, done.stderr)
    index = json.loads((out / "shardindex.json").read_text())
    index["name"] = "shard"
    for shard in index["shardlist"]:
        shard["md5sum"] = "0" * 32
    (out / "shardindex.json").write_text(json.dumps(index))
    assert run_repack("verify", out, check=False).returncode == 0
    index["shardlist"][0]["nsamples"] += 1
    (out / "shardindex.json").write_text(json.dumps(index))
    done = run_repack("verify", out, check=False)
    assert done.returncode == 5 and "shardindex.json: not the wids shard index" in done.stdout + done.stderr
