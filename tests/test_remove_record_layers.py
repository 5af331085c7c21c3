"""`repack remove` reads the published record of the inputs as layers (``repack.lifecycle.record_layers``):
the named sources' positions are those the merged record gives, found in each delta file and in version
1's plan without a merged row per input and without a task record read; the whole record is derived only
where it is written whole."""

from __future__ import annotations

import numpy as np

from repack.errors import UsageError
from repack.lifecycle.input_columns import encode_names
from repack.lifecycle.input_record import dataset_record
from repack.lifecycle.record_layers import record_layers
from repack.store import open_store
from tests.conftest import read_manifest_json, run_repack
from tests.test_dataset_versions import add_inputs, make_source
from tests.test_images_job import jpeg_bytes
from tests.test_takedowns import packed_sources


def _agree(out, monkeypatch=None) -> None:
    """The layers give every recorded name (and names never recorded) the merged record's position; with
    ``monkeypatch``, also when version 1's plan is looked up in forked parts of a few tasks each."""
    if monkeypatch is not None:
        with monkeypatch.context() as patched:
            from repack.exec import cpus

            patched.setattr(cpus, "available_cpus", lambda: 16)  # 8 parts
            _agree(out)
    store = open_store(str(out))
    current = read_manifest_json(out)
    whole = dataset_record(store, current)
    layers = record_layers(store, current)
    assert layers is not None and layers.next_position == whole.next_position
    names = np.unique(np.concatenate([whole.names, encode_names(["cat/none.jpg", "zzz/never.jpg"])]))
    positions, recorded = layers.positions_of(names)
    rows, held = whole.find(names)
    assert recorded.tolist() == held.tolist()
    assert positions[recorded].tolist() == whole.position[rows[held]].tolist()
    assert (positions[~recorded] == -1).all()


def test_the_layers_find_what_the_merged_record_holds_through_appends_and_removes(tmp_path, monkeypatch):
    src, out = make_source(tmp_path / "src"), tmp_path / "out"
    run_repack("images", src, out, "--shard-size", "4", "--quiet")
    from repack.jobs.base import read_plan
    from repack.lifecycle.first_record import task_runs

    assert len(task_runs(read_plan(open_store(str(out))).tasks, 8)) >= 2  # forked parts
    _agree(out, monkeypatch)  # version 1: the plan alone
    add_inputs(src)
    run_repack("images", src, out, "--shard-size", "4", "--append", "--quiet")
    _agree(out, monkeypatch)  # a delta on the plan
    (tmp_path / "gone.txt").write_text("cat/c1.jpg\ncat/new0.jpg\n")
    run_repack("remove", out, "--sources", tmp_path / "gone.txt", "--quiet")
    _agree(out)  # a delta on a delta
    (src / "dog" / "late.jpg").write_bytes(jpeg_bytes(seed=77))
    run_repack("images", src, out, "--shard-size", "4", "--append", "--quiet")
    _agree(out)
    run_repack("gc", out, "--keep", "1")
    _agree(out)  # a whole record


def test_remove_reads_no_task_record_and_merges_no_record(tmp_path, monkeypatch):
    """A remove after an append finds its samples from the layers: no ``.repack/tasks/`` file is read (the
    digests a merged record derives from them) and no record is merged; what it writes is the delta of the
    removed source, and the dataset verifies without the sample."""
    from repack.lifecycle import input_columns, publish
    from repack.lifecycle.remove import RemoveSpec, remove_samples
    from repack.store.local import LocalStore

    src, out = make_source(tmp_path / "src"), tmp_path / "out"
    run_repack("images", src, out, "--shard-size", "4", "--quiet")
    add_inputs(src)
    run_repack("images", src, out, "--shard-size", "4", "--append", "--quiet")
    read: list[str] = []
    original = LocalStore.read_bytes

    def reading(self, rel):
        read.append(rel)
        return original(self, rel)

    def merging(*args):
        raise AssertionError("a record merged for a remove")

    monkeypatch.setattr(LocalStore, "read_bytes", reading)
    monkeypatch.setattr(input_columns, "merged", merging)
    monkeypatch.setattr(publish, "merged", merging)
    done = remove_samples(RemoveSpec(str(out), ("cat/c2.jpg",), "sources"))
    monkeypatch.undo()
    assert done.published and done.removed == 1 and not done.not_found
    assert read and not [rel for rel in read if rel.startswith(".repack/tasks/")]
    assert "cat/c2.jpg" not in packed_sources(out) and len(packed_sources(out)) == 12
    assert run_repack("verify", out).returncode == 0
    (src / "cat" / "c2.jpg").touch()  # the removed source stays down on the next append
    run_repack("images", src, out, "--shard-size", "4", "--append", "--quiet")
    assert "cat/c2.jpg" not in packed_sources(out)


def test_an_older_json_record_is_merged_as_before_and_remove_still_finds_its_samples(tmp_path):
    import json

    from repack.lifecycle.input_columns import decode_names
    from repack.lifecycle.publish import read_inputs_record

    src, out = make_source(tmp_path / "src"), tmp_path / "out"
    run_repack("images", src, out, "--shard-size", "4", "--quiet")
    add_inputs(src)
    run_repack("images", src, out, "--shard-size", "4", "--append", "--quiet")
    record = read_inputs_record(open_store(str(out)), 2)
    (out / ".repack" / "inputs-v2.npz").unlink()  # what an older repack left: the same record as JSON
    names = decode_names(record.names)
    (out / ".repack" / "inputs-v2.json").write_text(json.dumps(
        {"inputs": {n: [int(s), int(m)] for n, s, m in zip(names, record.size, record.mtime_ns)},
         "next_position": record.next_position, "removed": [],
         "sha256": {n: record.hex_digest(i) for i, n in enumerate(names)}}))
    assert record_layers(open_store(str(out)), read_manifest_json(out)) is None
    (tmp_path / "gone.txt").write_text("cat/new1.jpg\n")
    run_repack("remove", out, "--sources", tmp_path / "gone.txt", "--quiet")
    assert "cat/new1.jpg" not in packed_sources(out) and len(packed_sources(out)) == 12
    assert run_repack("verify", out).returncode == 0


def test_a_plan_whose_names_cannot_be_decoded_makes_remove_read_every_shard(tmp_path, monkeypatch):
    """Version 1's plan layer refuses a names column it cannot cut (an empty planned name): the positions
    cannot be had, so the remove finds its sample by reading every shard's .json members, as before the
    layers, and removes exactly it."""
    from repack.lifecycle import record_layers
    from repack.lifecycle.remove import RemoveSpec, remove_samples

    src, out = make_source(tmp_path / "src"), tmp_path / "out"
    run_repack("images", src, out, "--shard-size", "4", "--quiet")
    before = len(packed_sources(out))

    def undecodable(blob):
        raise UsageError("an empty input name; it cannot be recorded")

    monkeypatch.setattr(record_layers, "names_of_blob", undecodable)
    done = remove_samples(RemoveSpec(str(out), ("cat/c2.jpg",), "sources"))
    monkeypatch.undo()
    assert done.published and done.removed == 1 and not done.not_found
    assert "cat/c2.jpg" not in packed_sources(out) and len(packed_sources(out)) == before - 1
    assert run_repack("verify", out).returncode == 0


def test_names_looked_up_once_are_answered_again_without_the_layers():
    """A remove asks for its names twice (held as given? then where?): the second time, and for a subset or a
    mix with new names, the layers see only names never asked for, and the answers stay the merged record's."""
    from repack.lifecycle.record_layers import RecordLayers

    asked: list[list[bytes]] = []

    def layer(held: dict[bytes, int]):
        def find(names: np.ndarray):
            asked.append(names.tolist())
            found = [held.get(name, -1) for name in names.tolist()]
            return np.array(found, np.int64), np.array([name in held for name in names.tolist()], bool)
        return find

    newer, older = layer({b"a": 5, b"c": -1}), layer({b"a": 1, b"b": 2, b"c": 3})
    layers = RecordLayers((newer, older), 6, lambda: None)
    names = np.array([b"a", b"b", b"c", b"zz"])
    first = layers.positions_of(names)
    assert first[0].tolist() == [5, 2, 3, -1] and first[1].tolist() == [True, True, True, False]
    assert len(asked) == 2
    again = layers.positions_of(names)
    assert [column.tolist() for column in again] == [column.tolist() for column in first] and len(asked) == 2
    mixed = layers.positions_of(np.array([b"b", b"d", b"zz"]))
    assert mixed[0].tolist() == [2, -1, -1] and mixed[1].tolist() == [True, False, False]
    assert asked[2:] == [[b"d"], [b"d"]]  # only the new name, in each layer


def test_the_remove_timeline_tool_times_a_real_remove_step_by_step(tmp_path, capsys):
    """tests/tools/remove_timeline.py (the device's step-by-step figures) runs a real remove: the dog
    folder's samples are gone, and each step it names ends after it starts, inside the remove."""
    import json

    from tests.tools.remove_timeline import main

    src, out = make_source(tmp_path / "src"), tmp_path / "out"
    run_repack("images", src, out, "--quiet")
    names = tmp_path / "dogs.txt"
    names.write_text("".join(f"dog/d{i}.jpg\n" for i in range(4)))
    summary = main([str(out), str(names)])
    assert summary["removed"] == 4 and read_manifest_json(out)["totals"]["samples"] == 5
    steps = [json.loads(line) for line in capsys.readouterr().err.splitlines() if line.startswith("{")]
    named = {step["step"] for step in steps}
    assert {"published_record", "held_spellings", "copy_kept", "publish"} <= named
    assert all(0 <= step["start"] <= step["end"] for step in steps)
    import repack.lifecycle.remove as remove

    assert not any(hasattr(getattr(remove, name), "__wrapped__") for name in ("publish", "held_spellings"))  # unwrapped
