"""`--append` costs what changed: the staged job's record is handed over in memory (never written), derived
once while the folder walk runs on the pool; the scan's names are compared as one ``S`` array; a few new
rows are taken without splitting the whole names blob; the task records are found by one listing of the
tasks folder (no stat per chunk lock). Each mechanism gives what the plain way gives, on odd names."""

from __future__ import annotations

import dataclasses
import multiprocessing
import os
import threading
from pathlib import Path

import numpy as np
import pytest

from repack.errors import UsageError
from repack.lifecycle.input_columns import InputColumns, build_columns, decode_names, names_of_blob
from repack.lifecycle.input_record import (KnownInputs, dataset_record, file_sha256, held_known, load_known,
                                          select_new_rows)
from repack.sources.columns import InputTable
from repack.sources.folder import scan_folder
from repack.sources.walk import PARALLEL_MIN_FOLDERS
from repack.store import open_store
from tests.conftest import kill_after_records, read_manifest_json, run_repack
from tests.test_images_job import jpeg_bytes
from tests.test_takedowns import packed_sources

# names whose byte order differs from a naive sort: a folder beside a longer file name, non-ASCII, a space,
# a byte that is not UTF-8 (surrogate-escaped when decoded)
ODD = ["a", "a-b.jpg", "a.jpg", "Ä.jpg", "z y.jpg", "é/x.jpg", os.fsdecode(b"\xff.jpg")]


def odd_tree(root: Path, folders: int = PARALLEL_MIN_FOLDERS + 2) -> Path:
    """``folders`` class folders (enough for the parallel scan), each with a few odd names and a subfolder."""
    seed = 0
    for f in range(folders):
        folder = root / (f"c{f:02d}" if f % 3 else f"c{f:02d} é")
        for name in ("a.jpg", "a-b.jpg", "Ä.jpg", "z y.jpg", "sub/x.jpg", "a/inner.jpg"):
            path = folder / name
            path.parent.mkdir(parents=True, exist_ok=True)
            path.write_bytes(jpeg_bytes(seed=seed))
            seed += 1
        (folder / os.fsdecode(b"\xff.jpg")).write_bytes(jpeg_bytes(seed=seed))
        seed += 1
    return root


def test_the_parallel_scan_equals_the_serial_one_and_runs_the_driver_work_meanwhile(tmp_path):
    root = odd_tree(tmp_path / "src")
    seen: list[int] = []
    serial = scan_folder(str(root), workers=1, meanwhile=lambda: seen.append(len(multiprocessing.active_children())))
    forks: list[int] = []
    os.register_at_fork(after_in_parent=lambda: forks.append(1))
    parallel_possible = threading.active_count() == 1
    parallel = scan_folder(str(root), workers=2,
                           meanwhile=lambda: seen.append(len(multiprocessing.active_children())))
    assert len(seen) == 2  # once per scan
    if parallel_possible:  # the walks ran on the fork pool, and the driver's work while they ran
        assert forks and seen[1] > 0
    a, b = serial.items, parallel.items
    assert a.names == b.names and a.rels == sorted(a.rels, key=os.fsencode)
    for column in ("sizes", "mtimes", "inodes", "label_ids"):
        assert np.array_equal(getattr(a, column), getattr(b, column)), column
    assert a.label_names == b.label_names and serial.quarantine == parallel.quarantine
    assert len(a) == 7 * (PARALLEL_MIN_FOLDERS + 2)


def test_select_new_rows_of_the_names_array_equals_the_str_rels(tmp_path):
    rels = sorted(ODD + ["b/new.jpg", "b/old.jpg", "b/touched.jpg"], key=os.fsencode)
    known = [r for r in rels if r != "b/new.jpg"]
    size = np.array([10] * len(rels), np.int64)
    mtime = np.arange(len(rels), dtype=np.int64)
    record = build_columns(known, [10] * len(known), [mtime[rels.index(r)] for r in known], range(len(known)),
                           {r: "0" * 64 for r in known}, len(known))
    touched = rels.index("b/touched.jpg")
    mtime[touched] += 1  # same size, another mtime: compared by content (the digest of row ``touched``)
    digest = {touched: "0" * 64}.get
    names = names_of_blob(("\0".join(rels) + "\0").encode("utf-8", "surrogateescape"))
    by_str = select_new_rows(rels, size, mtime, record, digest)
    by_names = select_new_rows(names, size, mtime, record, digest)
    assert by_str == by_names and by_names.new == [rels.index("b/new.jpg")]
    assert by_names.same_content == {"b/touched.jpg": [10, int(mtime[touched])]}
    size[rels.index(os.fsdecode(b"\xff.jpg"))] = 11  # changed: refused by its decoded name
    with pytest.raises(UsageError, match="1 source.s. changed.*\udcff.jpg"):
        select_new_rows(names, size, mtime, record, digest)


def test_taking_a_few_rows_equals_taking_many(tmp_path):
    rels = sorted([f"c{i % 7}/{name}" for i in range(40) for name in ODD if "/" not in name], key=os.fsencode)
    n = len(rels)
    table = InputTable.of_rels("/src", rels, np.zeros(n), ("c",), np.arange(n), np.arange(n), np.arange(n),
                               {5: "/elsewhere/x.jpg"})
    few = [3, 5, n - 1]  # the few-rows path (under an eighth of the table)
    many = list(range(0, n, 2)) + [5]
    for rows in (few, many, [], list(range(n))):
        taken = table.take(rows)
        assert taken.rels == [rels[r] for r in rows] and taken.sizes.tolist() == list(rows)
        assert taken.real_paths == {at: "/elsewhere/x.jpg" for at, r in enumerate(rows) if r == 5}


def test_the_record_is_read_once_when_first_asked_and_never_written(tmp_path):
    calls: list[int] = []
    record = build_columns(["a.jpg"], [1], [2], [0], {}, 1)
    known = KnownInputs(lambda: calls.append(1) or record, ["q.jpg"])
    key = str(tmp_path / "known-inputs.npz")
    with held_known(key, known):
        assert not calls  # nothing derived before the planner asks
        staged = load_known(key)
        assert decode_names(staged.quarantined) == ["q.jpg"] and decode_names(staged.names) == ["a.jpg"]
        assert load_known(key) is staged and known.record() is record and calls == [1]
    assert not Path(key).exists()
    with pytest.raises(UsageError, match="known-inputs.npz"):
        load_known(key)  # held only while the append runs


def test_an_append_finds_files_added_to_old_and_new_folders_and_resumes_without_a_record_file(tmp_path):
    src, out = odd_tree(tmp_path / "src", folders=PARALLEL_MIN_FOLDERS), tmp_path / "out"  # a 1-digit class index
    run_repack("images", src, out, "--shard-size", "16", "--chunk-size", "4", "--quiet")
    before = packed_sources(out)
    added = ["c01/b-new.jpg", "c01/sub/deeper/n.jpg", "c00 é/0.jpg", "new class/x.jpg", "c04/a/inner2.jpg"]
    assert all((src / rel.split("/")[0]).is_dir() for rel in added[:3] + added[4:])  # old folders
    for i, rel in enumerate(added):
        (src / rel).parent.mkdir(parents=True, exist_ok=True)
        (src / rel).write_bytes(jpeg_bytes(seed=500 + i))
    args = ["images", src, out, "--shard-size", "16", "--chunk-size", "1", "--workers", "1", "--append", "--quiet"]
    stage = out / ".repack" / "append-v2"
    kill_after_records(args, stage / "out", 2)
    if stage.exists():  # killed mid-append: the staged job's input was never a file
        assert not [p for p in stage.rglob("known-inputs*")]
    run_repack(*args)
    assert packed_sources(out) == sorted(before + added)
    manifest = read_manifest_json(out)
    assert manifest["dataset_version"]["number"] == 2 and manifest["totals"]["samples"] == len(before) + len(added)
    assert sorted(manifest["classes"]) == sorted(p.name for p in src.iterdir())  # one new class
    again = run_repack(*args)  # nothing new: nothing published
    assert read_manifest_json(out)["dataset_version"]["number"] == 2, again.stdout


def test_a_pack_takes_the_walk_started_ahead_and_an_append_forks_its_records_child_first(tmp_path, monkeypatch):
    """`repack images` starts SOURCE's walk before its imports (``walked_ahead``) in forked children that leave
    no thread here, and its scan takes it; `--append` does not (the child that reads the dataset's record is its
    critical path, and the walk would slow what comes before it): its record's child forks, its scan walks."""
    from repack.cli import cli
    from repack.exec.cpus import available_cpus
    from repack.exec.forked import can_fork
    from repack.lifecycle import record_child
    from repack.sources import folder

    if not can_fork() or available_cpus() < 2:
        pytest.skip("walks in forked children with two CPUs or more, where no other thread runs")
    src, out = odd_tree(tmp_path / "src", folders=PARALLEL_MIN_FOLDERS + 1), tmp_path / "out"
    taken, children = [], []
    take = folder.taken_ahead
    monkeypatch.setattr(folder, "taken_ahead", lambda conf, workers: taken.append(take(conf, workers)) or taken[-1])
    start = record_child.ChildRecord.__init__

    def spied(self, *args):
        start(self, *args)
        children.append(self._pid)

    monkeypatch.setattr(record_child.ChildRecord, "__init__", spied)
    cli.main(["images", str(src), str(out), "--quiet"], standalone_mode=False)
    assert len(taken) == 1 and taken[0] is not None and taken[0].children is not None
    before = packed_sources(out)
    (src / "c02" / "z-new.jpg").write_bytes(jpeg_bytes(seed=900))
    cli.main(["images", str(src), str(out), "--append", "--quiet"], standalone_mode=False)
    assert len(taken) == 2 and taken[1] is None
    assert len(children) == 1 and children[0]  # forked: no thread ran in the driver
    assert packed_sources(out) == sorted(before + ["c02/z-new.jpg"])


def test_the_first_record_lists_the_task_records_without_a_stat_per_lock(tmp_path, monkeypatch):
    from repack.store.local import LocalStore

    src, out = odd_tree(tmp_path / "src", folders=3), tmp_path / "out"
    run_repack("images", src, out, "--chunk-size", "2", "--quiet")
    tasks = out / ".repack" / "tasks"
    locks = list(tasks.glob("*.lock"))
    assert len(locks) >= 8  # a lock per chunk
    store = open_store(str(out))
    expected = dataset_record(store, read_manifest_json(out))
    assert store.list_names(".repack/tasks/") == sorted(store.list_sizes(".repack/tasks/"))
    assert store.list_names(".repack/ta") == sorted(store.list_sizes(".repack/ta"))
    assert store.list_names("nothing/here/") == []

    def refused(self, prefix=""):
        raise AssertionError(f"list_sizes({prefix!r}): a stat per file")

    stats: list[str] = []
    real_stat = os.stat

    def counted(path, *args, **kwargs):
        stats.append(str(path))
        return real_stat(path, *args, **kwargs)

    monkeypatch.setattr(LocalStore, "list_sizes", refused)
    monkeypatch.setattr(os, "stat", counted)
    record = dataset_record(open_store(str(out)), read_manifest_json(out))
    assert not [p for p in stats if p.endswith(".lock")]  # the locks are listed, never stat'ed
    assert decode_names(record.names) == decode_names(expected.names)
    assert np.array_equal(record.sha256, expected.sha256) and bool(record.has_sha256.all())


def test_a_record_that_cannot_be_read_during_the_parallel_walk_fails_the_append_by_name(tmp_path):
    src, out = odd_tree(tmp_path / "src", folders=PARALLEL_MIN_FOLDERS), tmp_path / "out"
    run_repack("images", src, out, "--quiet")
    (src / "c01" / "late.jpg").write_bytes(jpeg_bytes(seed=700))
    run_repack("images", src, out, "--append", "--quiet")
    (out / ".repack" / "inputs-v2.npz").write_bytes(b"not a record")
    (src / "c02" / "later.jpg").write_bytes(jpeg_bytes(seed=701))
    refused = run_repack("images", src, out, "--append", check=False)
    assert refused.returncode == 2 and "inputs-v2.npz" in refused.stderr and "Traceback" not in refused.stderr
    assert read_manifest_json(out)["dataset_version"]["number"] == 2 and "c02/later.jpg" not in packed_sources(out)


def test_the_first_append_writes_only_its_rows_and_derives_version_ones_digests_only_to_compare(tmp_path,
                                                                                                 monkeypatch):
    """Version 2's record is a delta on version 1's, derived from the plan (no row per existing input
    written); the selection reads version 1's digests (every task record) only when a known input's mtime
    changed. A whole version 2 record (what an older repack wrote) still reads, and extends."""
    from repack.lifecycle import first_record
    from repack.lifecycle.input_columns import merged, parse_record, to_bytes
    from repack.lifecycle.publish import inputs_record, read_inputs_record

    src, out = odd_tree(tmp_path / "src", folders=3), tmp_path / "out"
    run_repack("images", src, out, "--chunk-size", "2", "--quiet")
    for i, rel in enumerate(["c01/new.jpg", "c02/a/new.jpg"]):
        (src / rel).write_bytes(jpeg_bytes(seed=900 + i))
    run_repack("images", src, out, "--append", "--quiet")
    stored = parse_record((out / inputs_record(2)).read_bytes(), "v2")
    assert (stored.base, stored.depth, decode_names(stored.columns.names)) == (1, 1, ["c01/new.jpg", "c02/a/new.jpg"])
    assert (out / inputs_record(2)).stat().st_size < 4096 and not (out / inputs_record(1)).exists()
    store = open_store(str(out))
    whole = read_inputs_record(store, 2)
    expected = merged(first_record.version_one_record(store), stored.columns)
    assert decode_names(whole.names) == sorted(packed_sources(out), key=os.fsencode)
    assert np.array_equal(whole.sha256, expected.sha256) and bool(whole.has_sha256.all())

    derived: list[int] = []
    real_plan_record = first_record.plan_record
    monkeypatch.setattr(first_record, "plan_record", lambda *a, **k: derived.append(1) or real_plan_record(*a, **k))
    planning = dataset_record(store, read_manifest_json(out), digests=False)
    assert planning.digests_from is not None and int(planning.has_sha256.sum()) == 2 and not derived  # the delta's
    scan = scan_folder(str(src)).items
    names = names_of_blob(scan.names)
    unchanged = select_new_rows(names, scan.sizes, scan.mtimes, planning, lambda row: None)
    assert unchanged.new == [] and not derived  # same fingerprints: no digest needed
    touched = src / "c00 é" / "a.jpg"
    os.utime(touched, ns=(touched.stat().st_atime_ns, touched.stat().st_mtime_ns + 10**9))
    scan = scan_folder(str(src)).items
    copy = select_new_rows(names, scan.sizes, scan.mtimes, planning, lambda row: file_sha256(f"{src}/{scan.rel(row)}"))
    assert copy.new == [] and list(copy.same_content) == ["c00 é/a.jpg"] and derived == [1]

    (out / inputs_record(2)).write_bytes(to_bytes(whole))  # the layout an older repack wrote: whole
    (src / "c01" / "newer.jpg").write_bytes(jpeg_bytes(seed=950))
    run_repack("images", src, out, "--append", "--quiet")
    third = parse_record((out / inputs_record(3)).read_bytes(), "v3")
    assert (third.base, third.depth) == (2, 1)
    assert "c01/newer.jpg" in packed_sources(out) and len(read_inputs_record(store, 3)) == len(whole) + 1


def test_re_dated_inputs_read_only_the_task_records_of_their_rows_and_their_digests_are_the_whole_records(
        tmp_path, monkeypatch):
    """A known input with a new mtime is compared by content with version 1's digest of its row alone: the
    task records of units that plan none of the rows asked are not read, the plan's columns are not decoded
    again, and the digests placed are the whole derivation's on those rows. The append then recognizes the
    copies and refuses a same-size change by name."""
    from repack.jobs.base import read_plan
    from repack.lifecycle import first_record

    src, out = odd_tree(tmp_path / "src", folders=4), tmp_path / "out"
    run_repack("images", src, out, "--chunk-size", "2", "--shard-size", "4", "--quiet")
    store = open_store(str(out))
    plan = read_plan(store)
    whole = first_record.plan_record(store, plan)
    assert bool(whole.has_sha256.all())
    inputs = first_record.plan_inputs(plan, 0)
    read: list[str] = []
    real_read = type(store).read_bytes
    monkeypatch.setattr(type(store), "read_bytes", lambda self, rel: read.append(rel) or real_read(self, rel))
    monkeypatch.setattr(first_record, "plan_inputs", lambda *a, **k: pytest.fail("the plan's columns decoded again"))
    rng = np.random.default_rng(5)
    for count in (1, 3, len(whole)):
        rows = rng.choice(len(whole), count, replace=False)
        read.clear()
        part = first_record.plan_record(store, plan, inputs=inputs, wanted=rows)
        assert np.array_equal(part.sha256[rows], whole.sha256[rows]) and bool(part.has_sha256[rows].all())
        records = [rel for rel in read if rel.startswith(".repack/tasks/")]
        assert len(records) <= count and (count < len(whole) or len(records) == len(plan.units or plan.tasks))
    monkeypatch.undo()

    touched = [src / "c01" / "a.jpg", src / "c02" / "sub" / "x.jpg"]
    for path in touched:
        os.utime(path, ns=(path.stat().st_atime_ns, path.stat().st_mtime_ns + 10**9))
    (src / "c01" / "new.jpg").write_bytes(jpeg_bytes(seed=990))
    run_repack("images", src, out, "--append", "--quiet")
    assert "c01/new.jpg" in packed_sources(out) and len(packed_sources(out)) == len(whole) + 1
    changed = src / "c00 é" / "Ä.jpg"
    body = bytearray(changed.read_bytes())
    body[-3] ^= 0xFF
    changed.write_bytes(bytes(body))
    (src / "c02" / "newer.jpg").write_bytes(jpeg_bytes(seed=991))
    refused = run_repack("images", src, out, "--append", "--quiet", check=False)
    assert refused.returncode != 0 and "1 source(s) changed since the dataset packed them" in refused.stderr
    assert "c00 é/Ä.jpg" in refused.stderr and "newer.jpg" not in packed_sources(out)


def test_the_record_derived_in_a_child_process_equals_the_drivers_and_a_failure_is_raised_by_name(tmp_path):
    """``ChildRecord``: the columns the child sends over the pipe are the driver's own derivation (odd
    names, removed sources), its digests are derived when asked; a child that fails leaves the error to the
    driver's own derivation; a child never waited for is stopped."""
    from repack.lifecycle.input_columns import with_quarantined
    from repack.lifecycle.record_child import ChildRecord, can_fork, pack_columns, unpack_columns

    names = sorted(ODD, key=os.fsencode)
    record = build_columns(names, range(len(names)), [10**18 + i for i in range(len(names))],
                           [7 * i for i in range(len(names))], {names[0]: "ab" * 32}, 99, removed=["gone/x.jpg", "é"])
    for columns in (record, build_columns([], [], [], [], {}, 3)):
        back = unpack_columns(pack_columns(columns))
        assert decode_names(back.names) == decode_names(columns.names) and back.next_position == columns.next_position
        assert decode_names(back.removed) == decode_names(columns.removed) and not back.has_sha256.any()
        for column in ("size", "mtime_ns", "position"):
            assert np.array_equal(getattr(back, column), getattr(columns, column))
    assert unpack_columns(pack_columns(record)[:-1]) is None and unpack_columns(b"-\n") is None
    forked = can_fork()  # no other thread here (e.g. no xdist worker): the child path runs
    without_digests = dataclasses.replace(record, has_sha256=np.zeros(len(record), bool), digests_from=lambda rows=None: record)
    child = ChildRecord(lambda: without_digests, lambda columns, rows: record)  # derive() as dataset_record(digests=False) does
    got = child()
    assert child() is got and got.digests_from is not None and not got.has_sha256.any()
    assert decode_names(got.names) == names and np.array_equal(got.position, record.position)
    staged = with_quarantined(got, ["a.jpg"])
    assert bool(staged.digested().has_sha256[0]) and decode_names(staged.digested().quarantined) == ["a.jpg"]
    child.close()

    def refused() -> InputColumns:
        raise UsageError(f"{tmp_path}/inputs-v3.npz extends version 2's record, which is missing")

    with pytest.raises(UsageError, match="inputs-v3.npz extends version 2"):
        ChildRecord(refused, lambda columns, rows: refused())()
    waiting = ChildRecord(lambda: record, lambda columns, rows: record)
    assert bool(waiting._pid) == forked
    waiting.close()  # the append failed before asking: the child is stopped and reaped
    assert not waiting._pid


def test_version_ones_plan_decoded_in_parts_equals_one_process_and_a_failed_part_is_done_here(tmp_path):
    """``plan_inputs(..., parts)``: the plan's tasks cut into runs of about equal inputs, decoded in forked
    children (``forked_map``), give the columns of one process (odd names, several tasks); a child that
    fails has its part done in this process; no child is left."""
    from repack.jobs.base import read_plan
    from repack.lifecycle.first_record import pack_part, plan_inputs, task_columns, task_runs, unpack_part
    from repack.exec.forked import forked_map
    from repack.lifecycle.record_child import MAX_PARTS, can_fork, record_parts

    src, out = odd_tree(tmp_path / "src", folders=3), tmp_path / "out"
    run_repack("images", src, out, "--chunk-size", "2", "--quiet")
    plan = read_plan(open_store(str(out)))
    assert len(plan.tasks) >= 8
    one = plan_inputs(plan, 0)
    assert decode_names(one.names) == sorted(packed_sources(out), key=os.fsencode)
    for parts in (2, 3, 4, 50):
        runs = task_runs(plan.tasks, parts)
        assert 2 <= len(runs) <= parts and runs[0].start == 0 and runs[-1].stop == len(plan.tasks)
        assert all(a.stop == b.start and a.stop > a.start for a, b in zip(runs, runs[1:]))
        forks: list[int] = []
        os.register_at_fork(after_in_parent=lambda: forks.append(1))
        split = plan_inputs(plan, 5, parts)
        if can_fork():
            assert len(forks) >= len(runs) - 1  # a child per run after the first
        assert split.names.dtype == one.names.dtype and split.next_position == one.next_position
        for column in ("names", "size", "mtime_ns", "position"):
            assert np.array_equal(getattr(split, column), getattr(one, column))
    assert task_runs(plan.tasks, 1) == [slice(0, len(plan.tasks))] and task_runs(plan.tasks[:1], 4) == [slice(0, 1)]
    empty = unpack_part(pack_part(task_columns(())))
    assert [len(column) for column in empty] == [0, 0, 0, 0]
    with pytest.raises(ValueError):
        unpack_part(pack_part(task_columns(plan.tasks[:2]))[:-1])
    assert [record_parts(cpus) for cpus in (1, 2, 4, 8, 16, 128)] == [1, 1, 1, 2, 4, MAX_PARTS]

    parent = os.getpid()

    def only_here(part: int) -> bytes:  # fails in any child: its part is done again in this process
        if os.getpid() != parent:
            raise RuntimeError("a child's failure")
        return b"part %d" % part

    assert forked_map(only_here, [0, 1, 2]) == [b"part 0", b"part 1", b"part 2"]
    assert forked_map(lambda part: b"x" * part, [3, 70000, 1]) == [b"xxx", b"x" * 70000, b"x"]
    assert not multiprocessing.active_children()


def test_sorted_rows_are_searchsorteds_rows_for_any_names():
    """``sorted_rows`` (most rows guessed from every 16th bisection) gives ``np.searchsorted``'s rows, and
    whether the table holds each name there: a sorted scan with new names between known ones, one with few known
    names, a shuffled one, other widths."""
    from repack.lifecycle.input_columns import ANCHOR_EVERY, sorted_rows

    rng = np.random.default_rng(7)
    table = np.unique(np.array([b"c%03d/img%07d.jpg" % (i % 37, i) for i in range(5000)], dtype="S22"))
    scans = [table, np.unique(np.concatenate([table, [b"c%03d/new%03d.jpg" % (i % 37, i) for i in range(300)]])),
             np.unique(np.concatenate([table[::7], [b"a", b"zzz/last.jpg", b"c000/img0000000.jpg-"]])),
             table[rng.permutation(len(table))], table[:ANCHOR_EVERY * 4 - 1], table[:1],
             np.array([b"c001/img0000001.jpg", b"c001/img0000001.jp"] * 100, dtype="S30")]
    for names in scans:
        expected = np.searchsorted(table, names).clip(0, len(table) - 1)
        got, got_found = sorted_rows(table, names)
        found = table[expected] == names
        assert np.array_equal(got_found, found) and np.array_equal(table[got] == names, found)
        assert np.array_equal(got, expected)


def test_the_childs_columns_are_read_into_one_buffer_and_a_partial_one_is_refused():
    """``read_columns``: the pieces a child writes (``column_pieces``, the columns' own buffers) read back as
    ``pack_columns``' record; a cut, overlong or failed child's bytes are no record (the driver derives)."""
    import threading as _threading

    from repack.lifecycle.record_child import column_pieces, pack_columns, read_columns, unpack_columns

    names = sorted(ODD, key=os.fsencode)
    record = build_columns(names, range(len(names)), [10**18 + i for i in range(len(names))],
                           [7 * i for i in range(len(names))], {}, 99, removed=["gone/x.jpg", "é"])
    whole = pack_columns(record)
    assert whole == b"".join(bytes(memoryview(piece).cast("B")) for piece in column_pieces(record))

    def through_a_pipe(raw: bytes):
        read_end, write_end = os.pipe()
        writer = _threading.Thread(target=lambda: (os.write(write_end, raw) if raw else 0, os.close(write_end)))
        writer.start()
        with os.fdopen(read_end, "rb") as pipe:
            got = read_columns(pipe)
        writer.join()
        return got

    back = through_a_pipe(whole)
    assert decode_names(back.names) == names and decode_names(back.removed) == decode_names(record.removed)
    for column in ("size", "mtime_ns", "position"):
        assert np.array_equal(getattr(back, column), getattr(record, column))
    assert back.next_position == 99 and unpack_columns(whole).next_position == 99
    for broken in (whole[:-1], whole + b"x", b"-\n", b""):
        assert through_a_pipe(broken) is None


def test_names_of_one_length_are_cut_from_the_blob_as_any_names():
    """``names_of_blob``: a blob of names all one length (numbered files: the blob reshaped) gives the ``S``
    array the general cut gives; an empty name is still refused."""
    same = [b"c%03d/img%07d.jpg" % (i % 7, i) for i in range(50)]
    mixed = same + [b"c1/x.jpg"]
    for names in (same, mixed, same[:1]):
        got = names_of_blob(b"".join(name + b"\0" for name in names))
        assert got.tolist() == names and got.dtype == np.dtype(f"S{max(map(len, names))}")
    with pytest.raises(UsageError, match="empty name"):
        names_of_blob(b"ab\0\0cd\0")
