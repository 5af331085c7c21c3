"""Tasks smaller than shards: a shard cut into chunk tasks is assembled in plan order from their
tar segments, byte-identical to the shard one task writes whole, whatever the worker count,
the partitions or a kill -9 in between; LMDB imports chunk parts the same way."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from repack.jobs.base import read_plan
from repack.store import open_store
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


@pytest.mark.parametrize("workers,executor", [("1", "local"), ("2", "local"), ("8", "local"), ("2", "ray")])
def test_chunked_shards_equal_whole_shards(photo_tree, whole, tmp_path, workers, executor):
    if executor == "ray":
        pytest.importorskip("ray")
    out = tmp_path / "chunked"
    run_repack("images", photo_tree, out, *SHARDED, "--chunk-size", "7", "--workers", workers, "--executor", executor)
    plan = read_plan(open_store(str(out))).to_json()
    assert len(plan["tasks"]) == 8 + 8 + 3 and {t.get("group") for t in plan["tasks"]} == {
        "shard-000000", "shard-000001", "shard-000002"}
    assert outputs(out) == outputs(whole) and len(outputs(out)) == 9  # .tar, .idx, .crc each
    assert comparable_manifest(out) == comparable_manifest(whole)
    assert not list((out / ".repack" / "segments").iterdir())  # pieces removed once their shard is recorded
    assert run_repack("verify", out).returncode == 0


def test_kill_between_chunks_and_resume_is_byte_identical(photo_tree, whole, tmp_path):
    args = ["images", photo_tree, None, *SHARDED, "--chunk-size", "4", "--workers", "1"]
    for kill_after in (2, 14, 30):
        out = tmp_path / f"killed{kill_after}"
        args[2] = out
        kill_after_records(args, out, kill_after, pattern="*.lock")  # placed chunks save no record
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


def test_dispatch_takes_turns_over_a_few_groups():
    """8 workers: 2 lanes, so the chunks of two consecutive shards alternate (see dispatch_order);
    the outputs above stay those of whole shards."""
    from repack.jobs.base import Task
    from repack.jobs.engine import dispatch_order

    tasks = ([Task(f"a{i}", {}, "a") for i in range(3)] + [Task("x", {})] + [Task(f"b{i}", {}, "b") for i in range(2)]
             + [Task(f"c{i}", {}, "c") for i in range(3)] + [Task("d0", {}, "d")])
    assert [t.task_id for t in dispatch_order(tasks, 2)] == ["a0", "a1", "a2", "x", "b0", "c0", "b1", "c1", "c2", "d0"]
    assert dispatch_order(tasks, 1) == tasks


def test_group_tasks_must_be_adjacent():
    from repack.jobs.base import Plan, Task

    plan = Plan((Task("a-0", {}, "a"), Task("b", {}), Task("a-1", {}, "a")))
    with pytest.raises(ValueError, match="adjacent"):
        plan.units
    ok = Plan((Task("a-0", {}, "a"), Task("a-1", {}, "a"), Task("b", {})))
    assert [(uid, [t.task_id for t in tasks]) for uid, tasks in ok.units] == [("a", ["a-0", "a-1"]), ("b", ["b"])]


def _png(width: int, height: int, shade: int) -> bytes:
    import io

    from PIL import Image

    buffer = io.BytesIO()
    Image.new("L", (width, height), shade).save(buffer, "PNG")
    return buffer.getvalue()


@pytest.fixture(scope="module")
def misfit_tree(tmp_path_factory) -> Path:
    """Inputs that miss the slots the plan predicts: a non-image (quarantined: its chunk is short),
    and a 10000-pixel-wide PNG whose (non-ASCII) name makes the predicted metadata exactly 512 bytes (its real,
    5-digit width makes it 513: its chunk spills into a file of its own)."""
    from repack.jobs.images import sample_json

    root = tmp_path_factory.mktemp("misfits")
    wide = _png(10000, 1000, 7)
    stem = "04_"
    while (short_of := 512 - len(sample_json(f"a/{stem}.png", "a", 1000, 1000, len(wide), "jpg"))) > 0:
        stem += "\u00e9" if short_of >= 6 else "w"  # é: 2 bytes in the name, 6 in the JSON
    files = {"a/00.png": _png(20, 30, 1), "a/01.png": _png(31, 22, 2), "a/02.png": _png(40, 40, 3),
             "a/03.jpg": b"not an image at all", f"a/{stem}.png": wide, "a/05.png": _png(50, 9, 4),
             "a/06.png": _png(9, 50, 5), "a/07.png": _png(12, 12, 6),
             "b/00.png": _png(10, 10, 8), "b/01.png": _png(11, 10, 9), "b/02.png": _png(12, 10, 10),
             "b/03.jpg": b"\xff\xd8 not a jpeg either"}
    for rel, data in files.items():
        (root / rel).parent.mkdir(exist_ok=True)
        (root / rel).write_bytes(data)
    return root


MISFIT_OPTIONS = ("--shard-size", "8", "--verify", "none", "--quiet")


@pytest.fixture(scope="module")
def misfits_whole(misfit_tree, tmp_path_factory) -> Path:
    """misfit_tree's shards each written by one task (read only)."""
    whole = tmp_path_factory.mktemp("misfits-whole") / "whole"
    run_repack("images", misfit_tree, whole, *MISFIT_OPTIONS, "--chunk-size", "100", "--workers", "1", check=False)
    return whole


@pytest.mark.parametrize("workers", ["1", "2"])
def test_chunks_that_miss_their_slots_give_the_same_shards(misfit_tree, misfits_whole, tmp_path, workers):
    """Placed, short (a quarantined input), spilled and after-spill chunks, and a short last chunk
    of a shard still written in place: the same bytes as shards written whole."""
    options, whole = MISFIT_OPTIONS, misfits_whole
    out = tmp_path / "chunked"
    run_repack("images", misfit_tree, out, *options, "--chunk-size", "2", "--workers", workers, check=False)
    assert outputs(out) == outputs(whole) and len(outputs(out)) == 6  # .tar, .idx, .crc each
    assert comparable_manifest(out) == comparable_manifest(whole)
    assert read_manifest_json(out)["totals"]["quarantined"] == 2
    assert not list((out / ".repack" / "tasks").glob("*-c*.json"))  # the shard's record replaced its chunks'
    pieces = {tid: piece for p in (out / ".repack" / "tasks").glob("shard-??????.json")
              for tid, piece in json.loads(p.read_text())["segments"].items()}
    assert len(pieces) == 6
    placed = {tid for tid, piece in pieces.items() if "at" in piece}
    assert placed == set(pieces) - {"shard-000000-c0002"}  # the wide PNG's chunk spilled
    short = {tid for tid in placed if pieces[tid]["bytes"] < pieces[tid]["slot"]}
    assert short == {"shard-000000-c0001", "shard-000001-c0001"}
    assert not [p for p in out.rglob("*") if p.is_file() and (".tmp" in p.name or p.suffix == ".seg")]
    assert run_repack("verify", out).returncode == 0


def test_chunk_tasks_sent_in_pairs_give_the_same_shards(photo_tree, whole, tmp_path):
    """With at least PAIR_FROM tasks per worker the local pool sends them two by two (one call, one JSON
    list back): the shards and the manifest are those one task per shard writes."""
    from repack.exec.local import PAIR_FROM

    out = tmp_path / "paired"
    run_repack("images", photo_tree, out, *SHARDED, "--chunk-size", "1", "--workers", "2")
    assert len(read_plan(open_store(str(out))).tasks) >= 2 * PAIR_FROM
    assert outputs(out) == outputs(whole) and len(outputs(out)) == 9
    assert comparable_manifest(out) == comparable_manifest(whole)
