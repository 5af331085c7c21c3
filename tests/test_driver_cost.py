"""What the driver of an image pack spends per task and per chunk: a task's JSON is encoded once (the plan's
digest, the saved plan and the executor's call share it), a shard's assembly folds each chunk record in
as it arrives, keeping nothing of it but its summary (so the last shard's finish is short and the driver
holds no chunk record's index text or columns), and finalize finds duplicate content on a uint64 column of
digest prefixes."""

from __future__ import annotations

import base64
import gc
import io
import json
import tracemalloc
from pathlib import Path

import numpy as np

from repack.config import EngineOptions, ImagesSpec
from repack.jobs.base import Plan, Task, build_plan, read_plan
from repack.jobs.engine import Engine, execute_task
from repack.jobs.images import ImagesJob, _packed_duplicates
from repack.jobs.record_columns import unpack_times
from repack.store import open_store


def _tree(root: Path, count: int, folders: int = 3) -> Path:
    from PIL import Image

    for n in range(count):
        folder = root / f"k{n % folders}"
        folder.mkdir(parents=True, exist_ok=True)
        buf = io.BytesIO()
        Image.new("RGB", (8 + n % 5, 6), (n * 37 % 256, n * 11 % 256, 90)).save(buf, "JPEG", quality=90)
        (folder / f"img_{n:05d}.jpg").write_bytes(buf.getvalue())
    return root


def test_a_task_is_encoded_once_per_run(tmp_path, monkeypatch):
    """Digest, saved plan and the executor's calls use one encoding of each task (three before)."""
    src = _tree(tmp_path / "src", 24)
    encoded: list[str] = []
    to_json = Task.to_json

    def counted(task: Task) -> dict:
        encoded.append(task.task_id)
        return to_json(task)

    monkeypatch.setattr(Task, "to_json", counted)
    job = ImagesJob(ImagesSpec(source=str(src), out=str(tmp_path / "out"), chunk_size=5, verify="none"))
    Engine(job, EngineOptions(workers=1, quiet=True)).run()
    plan = read_plan(open_store(str(tmp_path / "out")))
    assert len(plan.tasks) == 5 and sorted(encoded) == sorted(t.task_id for t in plan.tasks)
    assert json.loads((tmp_path / "out" / "manifest.json").read_bytes())["totals"]["samples"] == 24


def _chunk_records(tmp_path: Path, count: int, chunk: int) -> tuple[ImagesJob, str, list[Task], list[dict]]:
    src = _tree(tmp_path / "src", count)
    spec = ImagesSpec(source=str(src), out=str(tmp_path / "out"), chunk_size=chunk, verify="none")
    job = ImagesJob(spec)
    (job.out / ".repack" / "tasks").mkdir(parents=True)
    plan = build_plan(job)
    records = [json.loads(execute_task("images", spec.to_json(), json.dumps(t.to_json()), "d", False, True))
               for t in plan.tasks]
    return job, plan.tasks[0].group, list(plan.tasks), records


def test_assembled_record_joins_its_chunk_records(tmp_path):
    """The shard's record, folded chunk by chunk, holds every chunk's digests and times in plan order, their
    summed counts and the slowest of all."""
    job, group, tasks, records = _chunk_records(tmp_path, 40, 6)
    assembly = job.open_assembly(group)
    for record in records:
        assembly.add(record)
    combined = assembly.finish()
    assert combined["inputs"] == 40 and combined["chunks"] == len(tasks) == 7
    assert base64.b64decode(combined["sha256"]) == b"".join(base64.b64decode(r["sha256"]) for r in records)
    for column in range(2):
        joined = np.concatenate([unpack_times(r["timing"]["us"], 2)[column] for r in records])
        assert unpack_times(combined["timing"]["us"], 2)[column].tolist() == joined.tolist()
    assert combined["profile"]["classes"] == {"k0": 14, "k1": 13, "k2": 13}
    assert combined["formats"] == {"jpg": 40} and combined["shard"]["samples"] == 40
    every = sorted((e for r in records for e in r["timing"]["slowest"]), key=lambda e: (-e["us"], e["source"]))
    assert combined["timing"]["slowest"] == every[:10]
    assert list(combined["segments"]) == [t.task_id for t in tasks]


def test_the_assembly_keeps_no_chunk_record(tmp_path):
    """Once a chunk's segment is in, the driver holds its index lines (the shard's .idx to be), a checksum,
    a digest and two times per sample, and a summary per chunk: not the chunk record (its index text,
    base64 columns, profile and slowest list), which used to stay until the shard's finish."""
    job, group, _, records = _chunk_records(tmp_path, 320, 8)
    texts = [json.dumps(r) for r in records]
    index_bytes = sum(len(r["segment"]["index"]) + 1 for r in records)
    del records
    gc.collect()
    assembly = job.open_assembly(group)
    tracemalloc.start()
    try:
        base = tracemalloc.get_traced_memory()[0]
        for text in texts:
            assembly.add(json.loads(text))  # as the engine hands them over: the record is the assembly's alone
        gc.collect()
        held = tracemalloc.get_traced_memory()[0] - base
    finally:
        tracemalloc.stop()
    assembly.finish()
    budget = 100 * 320 + 1500 * len(texts)  # per sample: crc, digest, times; per chunk: its summary
    print(f"held beyond the index lines: {held - index_bytes} B, budget {budget} B")
    assert held - index_bytes < budget, f"the assembly holds {held - index_bytes} B beyond the index lines"


def _units(digest_rows: list[list[bytes]]) -> tuple[Plan, list[dict]]:
    tasks = [Task(f"shard-{u:06d}", {"inputs": [{"rel": f"u{u}/{i}.jpg"} for i in range(len(rows))]})
             for u, rows in enumerate(digest_rows)]
    records = [{"sha256": base64.b64encode(b"".join(rows)).decode(), "quarantine": []} for rows in digest_rows]
    return Plan(tuple(tasks)), records


def test_duplicates_are_found_by_digest_prefix_then_whole_digest():
    """Equal content across units is grouped in plan order; a digest that only shares its first 8 bytes with
    a repeated one is no duplicate."""
    rng = np.random.default_rng(5)
    same, other = rng.bytes(32), rng.bytes(32)
    lookalike = same[:8] + rng.bytes(24)
    plan, records = _units([[same, rng.bytes(32)], [lookalike, other], [rng.bytes(32), same, other]])
    assert _packed_duplicates(plan, records) == [
        {"sha256": same.hex(), "paths": ["u0/0.jpg", "u2/1.jpg"]},
        {"sha256": other.hex(), "paths": ["u1/1.jpg", "u2/2.jpg"]}]


def test_the_duplicate_search_of_finalize_holds_a_column_of_8_bytes_per_input():
    """finalize's search over every packed input's digest peaks at the decoded digests (32 B each) plus a
    uint64 column and its sort (~73 B per input), not a joined copy and a sorted copy of all the 32-byte
    digests."""
    rng = np.random.default_rng(9)
    count = 100_000
    plan, records = _units([[rng.bytes(32) for _ in range(1000)] for _ in range(count // 1000)])
    gc.collect()
    tracemalloc.start()
    try:
        assert _packed_duplicates(plan, records) == []
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert peak / count < 100, f"{peak / count:.0f} B per input at the peak"  # before: 145
