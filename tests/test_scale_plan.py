"""Planning and job state at scale: the folder scan in parallel (same result as one process, same
confinement), the plan as columns, and job state of a few bytes per input."""

from __future__ import annotations

import gc
import io
import json
import os
import random
import shutil
import threading
import tracemalloc
from pathlib import Path

import numpy as np
import pytest
from PIL import Image

from repack.jobs.base import PLAN_NAME, STATE_DIR, read_plan
from repack.jobs.image_plan import ARCHIVE_TAIL_MAX, cut_runs
from repack.jobs.record_columns import state_digests
from repack.jobs.task_inputs import task_inputs
from repack.sources import Confinement, scan_source
from repack.sources.walk import PARALLEL_MIN_FOLDERS
from repack.sources.scan_pool import start_method
from repack.store import open_store
from tests.conftest import duplicate_groups, read_manifest_json, run_repack, thread_alive

CLASSES = 12  # over PARALLEL_MIN_FOLDERS: the scan runs on a pool


def _tiny_jpeg(seed: int) -> bytes:
    image = Image.new("RGB", (16, 16), (seed * 37 % 256, seed * 91 % 256, seed * 13 % 256))
    buf = io.BytesIO()
    image.save(buf, "JPEG", quality=80)
    raw = buf.getvalue()
    tag = str(seed).encode()
    return raw[:2] + b"\xff\xfe" + (len(tag) + 2).to_bytes(2, "big") + tag + raw[2:]  # a COM segment: unique bytes


@pytest.fixture(scope="module")
def tiny_tree(tmp_path_factory) -> Path:
    """2,400 tiny JPEGs in 12 class folders (two of them equal in content)."""
    root = tmp_path_factory.mktemp("tiny") / "src"
    for n in range(2400):
        folder = root / f"c{n % CLASSES:02d}"
        folder.mkdir(parents=True, exist_ok=True)
        (folder / f"img{n:05d}.jpg").write_bytes(_tiny_jpeg(n if n != 7 else 3))
    return root


@pytest.fixture()
def hostile_tree(tmp_path) -> Path:
    """Enough class folders for the parallel scan, with every kind of entry the confinement rules cover."""
    root = tmp_path / "src"
    outside = tmp_path / "outside.jpg"
    outside.write_bytes(b"x" * 10)
    for c in range(CLASSES):
        (root / f"c{c:02d}").mkdir(parents=True)
        for i in range(3):
            (root / f"c{c:02d}" / f"f{i}.jpg").write_bytes(b"y" * (100 + 10 * c + i))
    (root / "c01" / "sub").mkdir()
    (root / "c01" / "sub" / "deep.jpg").write_bytes(b"z" * 5)
    (root / "c01" / "a.b").write_bytes(b"sorts before the sub folder's files by name, after them by path")
    os.symlink(root / "c00" / "f0.jpg", root / "c02" / "alias.jpg")         # a second path to a file
    os.symlink(outside, root / "c03" / "leaves.jpg")                       # leaves the root
    os.symlink(root / "c05", root / "c04" / "linked")                      # a folder through a symlink
    os.link(root / "c06" / "f0.jpg", root / "c06" / "hard.jpg")            # a hard link
    os.mkfifo(root / "c07" / "pipe.jpg")                                    # never opened
    os.symlink(root / "c08", root / "c08" / "loop")                         # a loop
    (root / "c09" / "big.jpg").write_bytes(b"b" * 5000)                      # over the size cap below
    (root / "c10" / ".hidden").write_bytes(b"h")
    (root / "loose.jpg").write_bytes(b"l")                                   # outside the class folders
    return root


def _scan(root: Path, workers: int):
    return scan_source(str(root), list_file=False, confinement=Confinement(max_file_bytes=4000), workers=workers)


def test_parallel_scan_equals_one_process_and_keeps_the_confinement(hostile_tree):
    assert CLASSES >= PARALLEL_MIN_FOLDERS
    one, pool = _scan(hostile_tree, 1), _scan(hostile_tree, 2)
    as_rows = lambda scan: [(i.path, i.rel, i.label, i.fingerprint) for i in scan.items]  # noqa: E731
    assert as_rows(pool) == as_rows(one) and pool.quarantine == one.quarantine
    assert (pool.skipped, pool.labeled, pool.classes) == (one.skipped, one.labeled, one.classes) == (
        1, True, {f"c{c:02d}": c for c in range(CLASSES)})
    reasons = {q["source"]: q["reason"] for q in pool.quarantine}
    assert reasons["c03/leaves.jpg"] == "symlink leaves the source root"
    assert reasons["c07/pipe.jpg"] == "not a regular file (FIFO)"
    assert reasons["c08/loop"] == "symlink loop (folder already being scanned)"
    assert "over the size cap" in reasons["c09/big.jpg"]
    assert reasons["loose.jpg"] == "file outside the class folders of a labeled tree"
    assert reasons["c02/alias.jpg"].startswith("same file as c00/f0.jpg (symlink inside the source root)")
    assert reasons["c06/hard.jpg"].startswith("same file as c06/f0.jpg (hard link")
    rels = [i.rel for i in pool.items]
    assert rels == sorted(rels, key=os.fsencode)  # byte order of the whole path ("c01/a.b" after "c01/sub/...")
    assert reasons["c04/linked/f1.jpg"].startswith("same file as c05/f1.jpg (symlink inside the source root)")


def test_scan_with_a_thread_alive_fans_out_on_forkserver_workers_and_equals_one_process(hostile_tree):
    """A driver running a thread (Ray joining its cluster, an s3 lock's heartbeat) cannot fork safely: its scan
    runs on forkserver workers instead of on the driver alone, with the same result."""
    if threading.active_count() == 1:  # an earlier test of this process may have left a thread running
        assert start_method(2, CLASSES, PARALLEL_MIN_FOLDERS) == "fork"
    with thread_alive():
        assert start_method(2, CLASSES, PARALLEL_MIN_FOLDERS) == "forkserver"
        assert start_method(1, CLASSES, PARALLEL_MIN_FOLDERS) is None
        threaded = _scan(hostile_tree, 2)
    one = _scan(hostile_tree, 1)
    as_rows = lambda scan: [(i.path, i.rel, i.label, i.fingerprint) for i in scan.items]  # noqa: E731
    assert as_rows(threaded) == as_rows(one) and threaded.quarantine == one.quarantine
    assert (threaded.skipped, threaded.classes) == (one.skipped, one.classes)


def test_parallel_scan_keeps_real_paths_outside_the_root(hostile_tree, tmp_path):
    """--allow-outside-source: a class folder that is a symlink to a folder elsewhere is read at its real path."""
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    (elsewhere / "e.jpg").write_bytes(b"e" * 7)
    os.symlink(elsewhere, hostile_tree / "c99")
    conf = Confinement(allow_outside=True)
    one, pool = (scan_source(str(hostile_tree), list_file=False, confinement=conf, workers=w) for w in (1, 2))
    found = {i.rel: i.path for i in pool.items if i.rel.startswith("c99/")}
    assert found == {"c99/e.jpg": str(elsewhere.resolve() / "e.jpg")}
    assert [(i.path, i.rel) for i in one.items] == [(i.path, i.rel) for i in pool.items]


def test_cut_runs_is_the_greedy_budget_cut():
    """Every run fits the budget (or is one input), and no run could take the next input too."""
    rng = random.Random(5)
    bounds = np.array([rng.choice([1536, 2048, 4096, 70000]) for _ in range(500)], dtype=np.int64)
    for max_count, max_bytes in [(None, 100_000), (7, None), (13, 50_000), (None, 1000)]:
        runs = cut_runs(bounds, 20, 480, max_count, max_bytes)
        assert runs[0][0] == 20 and runs[-1][1] == 480 and all(a[1] == b[0] for a, b in zip(runs, runs[1:]))
        for s, e in runs:
            size = ARCHIVE_TAIL_MAX + int(bounds[s:e].sum())
            assert e - s == 1 or ((max_bytes is None or size <= max_bytes) and (max_count is None or e - s <= max_count))
            if e < 480:
                grown = size + int(bounds[e])
                assert (max_bytes is not None and grown > max_bytes) or (max_count is not None and e - s == max_count)


def test_job_state_is_a_few_bytes_per_input(tiny_tree, tmp_path):
    """Everything under OUT that is not a shard, an index or a manifest: at most 64 bytes per input; the
    plan holds columns, not a dict per input, and its entries and the records' digests still read back."""
    out = tmp_path / "out"
    run_repack("images", tiny_tree, out, "--chunk-size", "200", "--workers", "2", "--quiet")
    manifest = read_manifest_json(out)
    inputs = manifest["totals"]["inputs"]
    assert inputs == manifest["totals"]["samples"] == 2400
    dataset = {"manifest.json", *(v for s in manifest["shards"] for k, v in s.items() if k in ("path", "index",
                                                                                                "checksums"))}
    state = [p for p in out.rglob("*") if p.is_file() and p.relative_to(out).as_posix() not in dataset
             and not p.relative_to(out).as_posix().startswith("manifest.v")]
    state_bytes = sum(p.stat().st_size for p in state)
    assert state_bytes <= 64 * inputs, sorted((p.stat().st_size, str(p.relative_to(out))) for p in state)[-5:]
    assert not (out / STATE_DIR / "plan.json").exists() and (out / STATE_DIR / PLAN_NAME).is_file()
    plan = read_plan(open_store(str(out)))
    assert len(plan.tasks) == 12 and all(isinstance(t.payload["inputs"], dict) for t in plan.tasks)
    entries = [e for t in plan.tasks for e in task_inputs(t.payload)]
    assert [e["rel"] for e in entries] == sorted(str(p.relative_to(tiny_tree)) for p in tiny_tree.rglob("*.jpg"))
    first = entries[0]
    assert first["key"] == "00000000_img00000" and first["label"] == "c00" and first["cls"] == 0
    assert first["fingerprint"] == [os.stat(tiny_tree / first["rel"]).st_size,
                                    os.stat(tiny_tree / first["rel"]).st_mtime_ns, os.stat(tiny_tree / first["rel"]).st_ino]
    digests = state_digests(open_store(str(out)))
    assert len(digests) == 2400 and digests["c07/img00007.jpg"] == digests["c03/img00003.jpg"]
    assert duplicate_groups(out, manifest["stats"]["duplicates"]) == [{"sha256": digests["c03/img00003.jpg"],
                                                        "paths": ["c03/img00003.jpg", "c07/img00007.jpg"]}]
    assert manifest["run"]["timing"]["read_ms"]["count"] == 2400
    assert sum(b["count"] for b in manifest["run"]["timing"]["sample_us_histogram"]) == 2400
    assert not list((out / STATE_DIR / "tasks").glob("*-c*.json"))  # the shard's record replaced its chunks'
    assert json.loads((out / STATE_DIR / "tasks" / "shard-000000.json").read_text())["chunks"] == 12


def _planning_peak(n: int, out: Path) -> int:
    """tracemalloc's peak while ``n`` synthetic inputs (a scan's columns, built before) are planned, hashed
    and saved as the engine does."""
    from repack.config import ImagesSpec
    from repack.jobs.base import save_plan
    from repack.jobs.images import ImagesJob
    from repack.sources.base import Scan
    from tests.benchmarks.plan_scale import synthetic_table

    scan = Scan(synthetic_table(n), (), labeled=True)
    (out / STATE_DIR).mkdir(parents=True)
    gc.collect()
    tracemalloc.start()
    try:
        plan = ImagesJob(ImagesSpec(source="/synthetic/src", out=str(out), verify="none")).plan_scan(scan)
        assert len(plan.tasks) == -(-n // ImagesSpec.chunk_size) and plan.digest
        save_plan(open_store(str(out)), plan)
        return tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()


def test_planning_memory_per_input_is_bounded(tmp_path):
    """The driver's planning keeps columns, not objects, per input: between 20,000 and 40,000 inputs its
    traced peak grows by under 80 bytes per input (~33 measured; the task payloads' lists of str and int
    and the planner's full-length temporaries made it 105-200 before)."""
    small, large = _planning_peak(20_000, tmp_path / "small"), _planning_peak(40_000, tmp_path / "large")
    assert (large - small) / 20_000 < 80, (small, large)


def test_plan_payloads_round_trip_every_kind_of_rel(tmp_path):
    """Task payloads hold packed columns; what a worker unpacks is each input's rel (non-ASCII, quotes,
    undecodable bytes), fingerprint and class, and the planned slot equals the sample's JSON length."""
    from repack.jobs.image_plan import InputColumns, sample_expected
    from repack.jobs.images import sample_json
    from repack.sinks.tar_format import BLOCK
    from repack.sources.columns import InputTable

    rels = ['a/plain.jpg', 'a/quo"te\\.jpg', 'b/caf\u00e9 \u00fc.jpg', 'b/raw\udcff.jpg', 'b/tab\t.jpg']
    table = InputTable.of_rels("/r", rels, [0, 0, 1, 1, 1], ("a", "b\u00e9"), [5, 60, 700, 8000, 90000],
                               [1, 2, 3, 4, 5], [10, 11, 12, 13, 14])
    cols = InputColumns.of(table, "/r/")
    meta = [len(sample_json(rel, label, 1000, 1000, size, "jpg")) for rel, label, size in
            zip(rels, ["a", "a", "b\u00e9", "b\u00e9", "b\u00e9"], table.sizes.tolist())]
    blocks = [-(-m // BLOCK) * BLOCK for m in meta]
    image = [BLOCK + -(-s // BLOCK) * BLOCK + 2 * BLOCK for s in table.sizes.tolist()]
    assert sample_expected(cols).tolist() == [i + BLOCK + b for i, b in zip(image, blocks)]
    from repack.jobs.image_plan import PayloadWriter

    entries = task_inputs({"inputs": PayloadWriter(cols, {"a": 0, "b\u00e9": 7}).inputs(1, 5, 41)})
    assert [e["rel"] for e in entries] == rels[1:]
    assert [e["fingerprint"] for e in entries] == [[60, 2, 11], [700, 3, 12], [8000, 4, 13], [90000, 5, 14]]
    assert [(e["cls"], e["label"]) for e in entries] == [(0, "a")] + [(7, "b\u00e9")] * 3
    assert [e["key"][:8] for e in entries] == ["00000041", "00000042", "00000043", "00000044"]
    assert entries[2]["path"] == "/r/b/raw\udcff.jpg"


def test_scan_order_is_full_path_byte_order_without_a_sort(tmp_path):
    """Each folder is walked by name with a folder's "/" appended, so the rows come out in the byte order of
    the full paths: names sorting around "/" ("-", ".", " "), a folder named like a file's prefix, non-ASCII
    and undecodable names, in one process and on the pool."""
    root = tmp_path / "src"
    names = ["b", "b.c", "b-", "b c", "bz", "\u00e9", "e\u0301", "z"]
    for c in range(CLASSES):
        top = root / f"c{c:02d}"
        top.mkdir(parents=True)
        for name in names:
            (top / name).mkdir() if name in ("b", "\u00e9") else (top / name).write_bytes(b"x")
        for name in ("x", "b.c", "a"):
            (top / "b" / name).write_bytes(b"y")
        (top / "\u00e9" / "f").write_bytes(b"z")
        os.makedirs(os.fsencode(top) + b"/raw\xff", exist_ok=True)
        (Path(os.fsdecode(os.fsencode(top) + b"/raw\xff")) / "q").write_bytes(b"q")
    one, pool = _scan(root, 1), _scan(root, 2)
    rels = [i.rel for i in one.items]
    assert rels == sorted(rels, key=os.fsencode) and rels == [i.rel for i in pool.items]
    assert len(rels) == CLASSES * 11 and not one.quarantine


def test_a_plan_saved_in_parallel_gzip_members_reads_back_whole_and_the_same_bytes(tiny_tree, tmp_path,
                                                                                   monkeypatch):
    """A plan larger than PLAN_PIECE is saved as several gzip members compressed on threads: read back it
    is the same plan (same digest, same canonical JSON), saving it again gives the same bytes, and an
    --append derives the first version's record from it."""
    import gzip
    import zlib

    from repack.jobs import base

    src, out = tmp_path / "src", tmp_path / "out"
    shutil.copytree(tiny_tree, src)
    run_repack("images", src, out, "--verify", "none", "--shard-size", "50")
    store = open_store(str(out))
    plan = read_plan(store)
    whole = b"".join(plan.canonical_parts())
    monkeypatch.setattr(base, "PLAN_PIECE", max(1, len(whole) // 7))
    base.save_plan(store, plan)
    raw = (out / STATE_DIR / PLAN_NAME).read_bytes()
    members, rest = 0, raw
    while rest:
        assert rest[9] == 0xFF  # the OS byte "unknown": the same bytes on every platform
        member = zlib.decompressobj(31)  # one gzip member
        member.decompress(rest)
        rest, members = member.unused_data, members + 1
    assert members >= 7 and len(base.plan_members(raw)) == members  # each member's length in its header
    assert gzip.decompress(raw) == whole and read_plan(store).digest == plan.digest
    base.save_plan(store, plan)
    assert (out / STATE_DIR / PLAN_NAME).read_bytes() == raw
    (out / STATE_DIR / PLAN_NAME).write_bytes(gzip.compress(whole))  # an older repack's plan: one plain member
    assert base.plan_members(gzip.compress(whole)) is None and read_plan(store).digest == plan.digest
    (out / STATE_DIR / PLAN_NAME).write_bytes(raw)
    (src / "c00" / "new.jpg").write_bytes(_tiny_jpeg(9999))  # --append derives version 1's record from the plan
    run_repack("images", src, out, "--verify", "none", "--shard-size", "50", "--append")
    manifest = read_manifest_json(out)
    assert manifest["totals"]["samples"] == 2401  # only the new file added: the known 2,400 read from the plan
    assert (out / STATE_DIR / "inputs-v2.npz").is_file()


def test_default_shards_end_at_512_mb_and_shard_size_caps_the_inputs(tmp_path):
    """With neither --shard-size nor --shard-bytes a shard ends at DEFAULT_SHARD_BYTES (tiny samples: ~146,000 of
    them); --shard-size 16384 (the docs' advice for tiny samples that see removes) caps the inputs alone, and
    photos of 100 KB fill 512 MB first."""
    from repack.config import DEFAULT_SHARD_BYTES, ImagesSpec
    from repack.jobs.images import ImagesJob
    from repack.sources.base import Scan
    from tests.benchmarks.plan_scale import synthetic_table

    def shard_inputs(table, **options) -> list[int]:
        spec = ImagesSpec(source="/synthetic/src", out=str(tmp_path / "out"), verify="none", **options)
        plan = ImagesJob(spec).plan_scan(Scan(table, (), labeled=True))
        counts: dict[str, int] = {}
        for task in plan.tasks:
            stem = task.group or task.task_id
            counts[stem] = counts.get(stem, 0) + task.payload["inputs"]["count"]
        return list(counts.values())

    assert DEFAULT_SHARD_BYTES == 512 * 10**6
    tiny = synthetic_table(40_000)  # ~700 B inputs, ~3.5 KB each in the tar
    assert shard_inputs(tiny) == [40_000]
    assert shard_inputs(tiny, shard_size=16384) == [16384, 16384, 7232]
    assert shard_inputs(tiny, shard_bytes=64 * 10**6) == [17854, 17854, 4292]  # bytes alone
    photos = synthetic_table(12_000)
    photos.sizes[:] = 100_000  # 100 KB photos: 512 MB holds ~4,975 of them with their headers and json
    counts = shard_inputs(photos)
    assert len(counts) == 3 and sum(counts) == 12_000 and 4900 < counts[0] < 5100, counts
    assert shard_inputs(photos, shard_size=16384) == [12_000]


def test_a_walk_started_ahead_is_taken_by_the_scan_of_the_same_rules_else_stopped(hostile_tree):
    """``walk_ahead`` (what `repack images` starts before importing the job): the scan of the same root, rules and
    workers takes it and equals a scan from scratch; one with other rules walks on its own; a walk that no scan
    took is stopped when the block ends, its pool's processes gone."""
    from repack.exec.local import _pool_context
    from repack.sources import walk

    rows = lambda scan: [(i.path, i.rel, i.label, i.fingerprint) for i in scan.items]  # noqa: E731
    fresh = _scan(hostile_tree, 2)
    rules = Confinement(max_file_bytes=4000)
    with walk.walk_ahead(str(hostile_tree), rules, 2):
        assert len(walk._AHEAD) == 1 and walk._AHEAD[0].children is not None
        assert threading.active_count() == 1  # forked children, no pool thread: the next fork is still safe
        assert _pool_context().get_start_method() == "fork"  # (--executor ray's driver pool forks meanwhile)
        ahead = _scan(hostile_tree, 2)
        assert walk._AHEAD == []
    assert rows(ahead) == rows(fresh) and ahead.quarantine == fresh.quarantine and ahead.skipped == fresh.skipped
    with walk.walk_ahead(str(hostile_tree), Confinement(max_file_bytes=10), 2):
        other = _scan(hostile_tree, 2)  # other rules: not the walk started ahead
        assert len(walk._AHEAD) == 1
        started = [pid for pid, _ in walk._AHEAD[0].children._children]
        assert started
    assert walk._AHEAD == []
    for pid in started:  # stopped and reaped
        with pytest.raises(ChildProcessError):
            os.waitpid(pid, os.WNOHANG)
    assert rows(other) == rows(fresh)
    with walk.walk_ahead(str(hostile_tree / "missing"), rules, 2):
        assert walk._AHEAD == []  # no folder: nothing started, the scan says what is wrong
    with walk.walk_ahead(str(hostile_tree), rules, 1):  # no pool: the root listed now (a flat folder's files),
        assert len(walk._AHEAD) == 1 and walk._AHEAD[0].pool is None  # not twice: the scan takes it
        serial = _scan(hostile_tree, 1)
        assert walk._AHEAD == []
    assert rows(serial) == rows(fresh) and serial.quarantine == fresh.quarantine
    with pytest.raises(Exception, match="does not exist"):
        with walk.walk_ahead(str(hostile_tree / "missing"), rules, 2):
            _scan(hostile_tree / "missing", 2)


def test_lmdb_job_state_is_a_few_bytes_per_input_and_an_older_record_still_builds(tiny_tree, tmp_path):
    """--to lmdb: a task's record names its part and the part's index file (a line per sample, deleted with the
    part once the database is built), not a list per sample (136 B per input of job state and ~1 KB per input
    of driver memory at finalize); the database holds every sample. A record of an older repack (each sample's
    members listed in it) still reads the same samples from its part."""
    from repack.sinks.lmdb_sink import PARTS_DIR, PartWriter, _read_part

    out = tmp_path / "out"
    run_repack("images", tiny_tree, out, "--to", "lmdb", "--chunk-size", "200", "--workers", "2", "--quiet")
    manifest = read_manifest_json(out)
    inputs = manifest["totals"]["inputs"]
    assert inputs == manifest["totals"]["samples"] == 2400
    records = [json.loads(p.read_text()) for p in (out / STATE_DIR / "tasks").glob("*.json")]
    assert len(records) == 12 and all("samples" not in r["part"] and r["part"]["count"] == 200 for r in records)
    assert not (out / PARTS_DIR).exists()
    state = [p for p in out.rglob("*") if p.is_file() and p.name != "data.lmdb" and not p.name.startswith("manifest")]
    assert sum(p.stat().st_size for p in state) <= 64 * inputs
    from pipelines.torch_lmdb import LmdbImageDataset

    assert len(LmdbImageDataset(out, decode=False)) == 2400

    writer = PartWriter(tmp_path / "parts-test", "t0")  # parts under parts-test/.repack/parts
    for key in ("a", "b"):
        writer.add_sample(key, [("cls", b"1"), ("jpg", key.encode() * 700), ("json", b"{}")])
    part = writer.commit()
    root = tmp_path / "parts-test"
    lines = (root / part["idx"]).read_text().split("\n")[:-1]
    older = {"path": part["path"], "bytes": part["bytes"],
             "samples": [[f[3].split(".")[0], [[e, int(o), int(n)] for e, o, n in zip(f[::4], f[1::4], f[2::4])]]
                         for f in (line.split(" ") for line in lines)]}
    now, then = list(_read_part(root, part)), list(_read_part(root, older))
    assert now == then and [dict(s)["jpg"] for s in now] == [b"a" * 700, b"b" * 700]
