"""Tasks smaller than shards: a shard cut into chunk tasks is assembled in plan order from their
tar segments, byte-identical to the shard one task writes whole, whatever the worker count,
the partitions or a kill -9 in between; LMDB imports chunk parts the same way."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from tests.conftest import kill_after_records, read_manifest_json, run_repack

SHARDED = ("--shard-size", "50", "--quiet")


def outputs(out: Path) -> dict[str, bytes]:
    return {p.name: p.read_bytes() for p in sorted(Path(out).glob("shard-*"))}


def comparable_manifest(out: Path) -> dict:
    manifest = read_manifest_json(out)
    manifest.pop("run")
    manifest["created_by"]["options"].pop("chunk_size")
    return manifest


@pytest.fixture(scope="module")
def whole(photo_tree, tmp_path_factory) -> Path:
    """Every shard written by one task (chunks larger than shards)."""
    out = tmp_path_factory.mktemp("whole") / "out"
    run_repack("images", photo_tree, out, *SHARDED, "--chunk-size", "1000", "--workers", "1")
    return out


@pytest.mark.parametrize("workers,executor", [("1", "local"), ("2", "local"), ("2", "ray")])
def test_chunked_shards_equal_whole_shards(photo_tree, whole, tmp_path, workers, executor):
    if executor == "ray":
        pytest.importorskip("ray")
    out = tmp_path / "chunked"
    run_repack("images", photo_tree, out, *SHARDED, "--chunk-size", "7", "--workers", workers, "--executor", executor)
    plan = json.loads((out / ".repack" / "plan.json").read_text())
    assert len(plan["tasks"]) == 8 + 8 + 3 and {t.get("group") for t in plan["tasks"]} == {
        "shard-000000", "shard-000001", "shard-000002"}
    assert outputs(out) == outputs(whole) and len(outputs(out)) == 6
    assert comparable_manifest(out) == comparable_manifest(whole)
    assert not list((out / ".repack" / "segments").iterdir())  # pieces removed once their shard is recorded
    assert run_repack("verify", out).returncode == 0


def test_kill_between_chunks_and_resume_is_byte_identical(photo_tree, whole, tmp_path):
    args = ["images", photo_tree, None, *SHARDED, "--chunk-size", "4", "--workers", "1"]
    for kill_after in (2, 14, 30):
        out = tmp_path / f"killed{kill_after}"
        args[2] = out
        kill_after_records(args, out, kill_after)
        resumed = run_repack(*args)
        assert "resumed" in resumed.stdout or "nothing to do" in resumed.stdout
        assert outputs(out) == outputs(whole)
        assert comparable_manifest(out) == comparable_manifest(whole)
        assert not [p for p in out.rglob(".*") if p.is_file() and ".tmp" in p.name]


def test_partitions_assemble_their_own_shards(photo_tree, whole, tmp_path):
    out = tmp_path / "parts"
    for rank in ("1", "0"):
        run_repack("images", photo_tree, out, *SHARDED, "--chunk-size", "9", "--num-nodes", "2", "--node-rank", rank)
    run_repack("merge", out, "--quiet")
    assert outputs(out) == outputs(whole)


def test_lmdb_chunk_parts_are_deterministic(photo_tree, tmp_path):
    dbs = []
    for workers in ("1", "2"):
        out = tmp_path / f"lmdb{workers}"
        run_repack("images", photo_tree, out, "--to", "lmdb", "--chunk-size", "8", "--workers", workers, "--quiet")
        assert read_manifest_json(out)["shards"][0]["samples"] == 120
        assert run_repack("verify", out).returncode == 0
        dbs.append((out / "data.lmdb").read_bytes())
    assert dbs[0] == dbs[1]


@pytest.mark.parametrize("rel,label", [("cat/a b.jpg", "cat"), ("flat/\udcff\u00e9\"\\\n.png", None),
                                       ("x/\u4e2d.jpg", "\u00fc")])
def test_sample_json_equals_json_dumps(rel, label):
    """The hot-path metadata member is byte-identical to json.dumps(sort_keys=True) of the same dict."""
    from repack.jobs.images import sample_json

    meta = {"path": rel, "class": label, "width": 640, "height": 480, "bytes": 123456, "format": "jpg"}
    assert sample_json(rel, label, 640, 480, 123456, "jpg") == json.dumps(meta, sort_keys=True).encode()


def test_group_tasks_must_be_adjacent():
    from repack.jobs.base import Plan, Task

    plan = Plan((Task("a-0", {}, "a"), Task("b", {}), Task("a-1", {}, "a")))
    with pytest.raises(ValueError, match="adjacent"):
        plan.units
    ok = Plan((Task("a-0", {}, "a"), Task("a-1", {}, "a"), Task("b", {})))
    assert [(uid, [t.task_id for t in tasks]) for uid, tasks in ok.units] == [("a", ["a-0", "a-1"]), ("b", ["b"])]
