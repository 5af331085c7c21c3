"""The Job protocol that every modality implements, and the Plan it produces."""

from __future__ import annotations

import gc
import gzip
import hashlib
import io
import json
import re
from dataclasses import dataclass, field
from functools import cached_property
from pathlib import Path
from typing import ClassVar, Iterable, Protocol

from repack.config import JobSpec
from repack.jobs.task_inputs import input_count, task_inputs
from repack.manifest import dumps_canonical
from repack.store import open_store


STATE_DIR = ".repack"  # OUT's job state: job.json, plan.json.gz, task records, locks, chunk pieces
PLAN_NAME = "plan.json.gz"  # the plan's canonical JSON, gzip'd (an older repack wrote plan.json)
PLAN_LEVEL = 1  # ~17 bytes per image input, 0.16 s per 100,000 (level 6: ~14 bytes, 16x the time)
PLAN_PIECE = 1 << 20  # canonical JSON bytes per gzip member of the saved plan (compressed in parallel)
PLAN_THREADS = 8
MEMBER_EXTRA = (8).to_bytes(2, "little") + b"RP" + (4).to_bytes(2, "little")  # a plan member's gzip extra field: XLEN, SI1 SI2, LEN
TASK_NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9_.-]*")  # a task id or group: one plain file-name stem, never a path


def is_piece(rel: str) -> bool:
    """An intermediate output under the job state folder (a chunk's tar segment, an LMDB or text part)."""
    return rel.startswith(f"{STATE_DIR}/")


@dataclass(frozen=True)
class Task:
    """One unit of work. ``payload`` is JSON-able.

    A task without ``group`` produces its outputs itself (one shard, one part). Tasks that share
    a ``group`` are chunks of one output: each writes a temporary piece, and once all of them
    have records the engine feeds them, in plan order, to ``Job.open_assembly(group)``, which builds it.
    """

    task_id: str
    payload: dict
    group: str = ""

    def to_json(self) -> dict:
        data = {"task_id": self.task_id, "payload": self.payload}
        if self.group:
            data["group"] = self.group
        return data

    @classmethod
    def from_json(cls, data: dict) -> "Task":
        """A task read back from a saved plan; ValueError when its id or group is no plain name (the names
        become file names in OUT: a forged plan must not name a file elsewhere)."""
        task = cls(data["task_id"], data["payload"], data.get("group", ""))
        for name in (task.task_id, task.group or task.task_id):
            if not isinstance(name, str) or not TASK_NAME.fullmatch(name):
                raise ValueError(f"task name {name!r} is no plain name")
        return task


def planned_entries(payload: dict) -> Iterable[dict]:
    """The per-input entries ({rel, fingerprint, ...}) of a task payload: its ``inputs`` (images, video; as
    entries or as columns), ``segments``, or the rows of its columnar ``table`` (text: ``rel`` and
    ``fingerprint`` columns)."""
    table = payload.get("table")
    if table:
        from repack.jobs.text_plan import table_fingerprints, table_rels

        return ({"rel": rel, "fingerprint": fp} for rel, fp in zip(table_rels(table), table_fingerprints(table)))
    return task_inputs(payload) or payload.get("segments", ())


@dataclass(frozen=True)
class Plan:
    """The deterministic cut of a job into tasks, plus inputs set aside while planning."""

    tasks: tuple[Task, ...]
    quarantine: tuple[dict, ...] = ()
    info: dict = field(default_factory=dict)

    @property
    def canonical(self) -> bytes:
        """The plan as canonical JSON (``dumps_canonical(self.to_json())``)."""
        return b"".join(self.canonical_parts())

    def canonical_parts(self):
        """The canonical JSON in pieces, one per task: hashed and saved without the whole text in memory
        (at 10M inputs that text is ~700 MB)."""
        yield b'{"info":' + dumps_canonical(self.info)[:-1] + b',"quarantine":' + \
            dumps_canonical(list(self.quarantine))[:-1] + b',"tasks":['
        for number, text in enumerate(self.task_texts):
            yield (b"," if number else b"") + text
        yield b"]}\n"

    @cached_property
    def task_texts(self) -> tuple[bytes, ...]:
        """Each task's canonical JSON (no newline), encoded once: the digest, the saved plan and the
        executor's calls all use these (a task's payload columns are its largest part)."""
        return tuple(dumps_canonical(task.to_json())[:-1] for task in self.tasks)

    @cached_property
    def digest(self) -> str:
        """sha256 of the canonical plan: equal plans, equal outputs (computed once)."""
        sha = hashlib.sha256()
        for part in self.canonical_parts():
            sha.update(part)
        return sha.hexdigest()

    @cached_property
    def units(self) -> tuple[tuple[str, tuple[Task, ...]], ...]:
        """The outputs in plan order: (id, tasks), one per ungrouped task (id = task id) and
        one per group (id = group; its tasks are adjacent in the plan)."""
        units: list[tuple[str, list[Task]]] = []
        for task in self.tasks:
            if task.group and units and units[-1][0] == task.group:
                units[-1][1].append(task)
            else:
                units.append((task.group or task.task_id, [task]))
        if len({uid for uid, _ in units}) != len(units):
            raise ValueError("a group's tasks must be adjacent in the plan, and ids unique")
        return tuple((uid, tuple(tasks)) for uid, tasks in units)

    def to_json(self) -> dict:
        return {"tasks": [t.to_json() for t in self.tasks], "quarantine": list(self.quarantine), "info": self.info}

    @classmethod
    def from_json(cls, data: dict) -> "Plan":
        return cls(tuple(Task.from_json(t) for t in data["tasks"]), tuple(data["quarantine"]), data["info"])


def save_plan(store, plan: Plan, state: str = STATE_DIR) -> None:
    """Write ``plan``: its canonical JSON gzip'd without a timestamp (the same plan, the same bytes), as gzip
    members of ~PLAN_PIECE bytes of JSON each, compressed on threads (zlib releases the GIL; a gzip reader
    reads the members as one stream). At most 2 members per thread wait, so the whole text is never held."""
    from collections import deque
    from concurrent.futures import ThreadPoolExecutor

    from repack.exec.cpus import available_cpus

    threads = max(1, min(PLAN_THREADS, available_cpus()))
    packed = io.BytesIO()
    with ThreadPoolExecutor(threads) as pool:  # joined before the job's pool forks
        waiting: deque = deque()
        piece: list[bytes] = []
        size = 0
        for part in plan.canonical_parts():
            piece.append(part)
            size += len(part)
            if size >= PLAN_PIECE:
                waiting.append(pool.submit(_gzip_member, b"".join(piece)))
                piece, size = [], 0
                while len(waiting) > 2 * threads:
                    packed.write(waiting.popleft().result())
        if piece:
            waiting.append(pool.submit(_gzip_member, b"".join(piece)))
        for member in waiting:
            packed.write(member.result())
    store.put_bytes(f"{state}/{PLAN_NAME}", packed.getvalue())


def _gzip_member(data: bytes) -> bytes:
    """One gzip member of ``data``: no timestamp, no name, the OS byte 255 ("unknown", as ``GzipFile`` writes;
    ``gzip.compress`` takes zlib's, which differs by platform), so the bytes are the same everywhere; its
    header's extra field holds the member's length (subfield ``RP``, uint32 LE, as BGZF's ``BC`` holds a
    block's), so a reader finds every member without inflating the ones before it (``plan_members``)."""
    body = gzip.compress(data, PLAN_LEVEL, mtime=0)[10:]
    size = 10 + len(MEMBER_EXTRA) + 4 + len(body)
    return bytes((0x1F, 0x8B, 8, 4, 0, 0, 0, 0, 0, 0xFF)) + MEMBER_EXTRA + size.to_bytes(4, "little") + body


def plan_members(raw: bytes) -> list[memoryview] | None:
    """The gzip members of a saved plan, found by the lengths their headers hold (``_gzip_member``); None
    when a member has none (an older repack's plan: read as one stream)."""
    members, at, view = [], 0, memoryview(raw)
    while at < len(raw):
        if raw[at:at + 4] != b"\x1f\x8b\x08\x04" or raw[at + 10:at + 16] != MEMBER_EXTRA:
            return None
        size = int.from_bytes(raw[at + 16:at + 20], "little")
        if size < 20 or at + size > len(raw):
            return None
        members.append(view[at:at + size])
        at += size
    return members


def _inflate(raw: bytes) -> bytes:
    """A saved plan's JSON: its members inflated on threads when their headers say where they are (zlib
    releases the GIL), else as one gzip stream."""
    members = plan_members(raw)
    if members is None or len(members) < 2:
        return gzip.decompress(raw)
    from concurrent.futures import ThreadPoolExecutor

    from repack.exec.cpus import available_cpus

    with ThreadPoolExecutor(max(1, min(PLAN_THREADS, available_cpus(), len(members)))) as pool:
        return b"".join(pool.map(gzip.decompress, members))


def read_plan(store, state: str = STATE_DIR) -> Plan | None:
    """The plan a job state holds (``save_plan``, or an older plan.json); None when missing or unreadable."""
    raw = store.read_bytes(f"{state}/{PLAN_NAME}")
    try:
        text = _inflate(raw) if raw is not None else store.read_bytes(f"{state}/plan.json")
        return Plan.from_json(json.loads(text)) if text is not None else None
    except (OSError, EOFError, ValueError, KeyError, TypeError, RecursionError):
        return None


class Assembly(Protocol):
    """Builds one group's output from its chunk records, fed in plan order (see ``Job.open_assembly``)."""

    def add(self, record: dict) -> None: ...

    def finish(self) -> dict: ...

    def abort(self) -> None: ...


class TaskWatcher(Protocol):
    """Told of each finished task while a run goes on (see ``Job.watch_tasks``)."""

    def finished(self, task_id: str, record: dict) -> None: ...

    def owned_temps(self) -> set[Path]:
        """The temp files it has open under OUT: the engine's sweeps of killed tasks' temps leave them."""
        ...

    def abort(self) -> None: ...


class Job:
    """Base class of a modality's job. Subclasses set ``name``/``spec_type`` and implement
    check, plan, run_task and finalize."""

    name: ClassVar[str]
    spec_type: ClassVar[type[JobSpec]]
    progress_unit: ClassVar[str] = "it"

    place_segments: bool = False  # set for a task on the local pool: chunks may write into a shared file

    def __init__(self, spec: JobSpec) -> None:
        self.spec = spec
        self.store = open_store(spec.out)  # where outputs end up (a folder, or s3://)
        self.out = Path(self.store.scratch)  # where the job writes them (the folder itself, or a scratch)

    def check(self) -> None:
        """Fail fast (raise RepackError) on a bad job, before any work."""

    def plan(self) -> Plan:
        raise NotImplementedError

    def run_task(self, task: Task) -> dict:
        """Do one task: write its outputs atomically; return its record (JSON-able)."""
        raise NotImplementedError

    def task_units(self, task: Task) -> int:
        """Progress units (samples, files, documents) a task covers."""
        return input_count(task.payload)

    def progress_counts(self, record: dict) -> dict[str, int]:
        """Extra counters a finished task adds to the progress bar as rates (e.g. frames/s)."""
        return {}

    def record_outputs(self, record: dict) -> list[dict]:
        """[{path, bytes}] the task produced: a resumed run trusts a record only if these hold."""
        return [{"path": o["path"], "bytes": o["bytes"]} for o in record.get("outputs", [])]

    @classmethod
    def fixed_outputs(cls, spec: dict) -> set[str]:
        """Files a job of this kind with ``spec`` (its JSON form) writes under fixed names, beside what its task
        records list (an LMDB's ``data.lmdb``; a text job's merged prefix and tokenizer copy; a video job's
        ``probe.jsonl``): --overwrite deletes those of the job it replaces (its ``job.json``) and its own, even
        before a manifest names them (a run killed in its finish step), so that none is left or taken for its own.
        Every job: the quarantine side file (``repack.manifest.quarantine_records``)."""
        from repack.manifest.quarantine_records import file_name

        return {file_name(1)}

    @classmethod
    def written_beside(cls, output: str) -> set[str]:
        """Files a job of this kind writes in its finish step beside ``output``, a file a task record lists (a
        --no-merge text part's ``.sources``): --overwrite deletes them with it."""
        return set()

    def record_kept(self, record: dict) -> bool:
        """Whether a finished task's record is saved in the job state: False for one that a resumed run
        could never trust anyway (its outputs are redone unless its group finished), which then only
        travels to the driver."""
        return True

    def outputs_intact(self, record: dict) -> bool:
        """Every output the record lists is in the store with its size (a chunk's piece may instead be
        in the local scratch only: see ``engine._run_and_record``)."""
        return all(self.store.size(o["path"]) == o["bytes"]
                   or (is_piece(o["path"]) and _local_size(self.out / o["path"]) == o["bytes"])
                   for o in self.record_outputs(record))

    def open_assembly(self, group: str) -> "Assembly":
        """Start building the output of ``group``; the engine feeds it the chunk records in plan order.

        Runs in the driver, on a thread, as soon as the next chunk in plan order has a record (so
        a shard grows while later chunks still run). The record ``finish`` returns stands for the
        whole group in ``finalize`` and on resume; files the chunk records list under ``outputs``
        that it does not list are pieces, removed once it is saved."""
        raise NotImplementedError(f"{self.name} plans grouped tasks but cannot assemble them")

    def watch_tasks(self, plan: Plan, records: dict[str, dict | None]) -> "TaskWatcher | None":
        """Something the engine tells, in the driver, of each ungrouped task's record as it lands (``records``:
        those resumed, by unit id), before ``finalize``; None (the default): nothing. A text job merges its
        parts ahead (``repack.jobs.text_merge_ahead``)."""
        return None

    def finalize(self, plan: Plan, records: list[dict]) -> dict:
        """Build the manifest body (without created_by/run) from the plan and the records of its
        units in plan order: one per ungrouped task, one per group (what ``assemble`` returned)."""
        raise NotImplementedError

    def packed(self, manifest: dict) -> int:
        """How many usable outputs the job made (0 with inputs found: exit 7, nothing packed)."""
        return manifest["totals"].get("samples", 0)

    def strict_problem(self, manifest: dict) -> str | None:
        """Why ``--strict`` refuses to publish this manifest (exit 6), or None: any quarantined input."""
        quarantined = manifest["totals"].get("quarantined")
        return f"{quarantined} input(s) were quarantined" if quarantined else None

    def summary_lines(self, manifest: dict) -> list[str]:
        """A few human lines for the end-of-job summary."""
        totals = manifest["totals"]
        return [f"{k}: {v}" for k, v in sorted(totals.items())]


def build_plan(job: Job) -> Plan:
    """``job.plan()`` with the cyclic GC paused: a plan of a million inputs is millions of long-lived
    objects that every full collection would traverse again while it grows (a third of the planning
    time). The engine then freezes them for the run (``Engine._execute``)."""
    enabled = gc.isenabled()
    gc.disable()
    try:
        return job.plan()
    finally:
        if enabled:
            gc.enable()


def _local_size(path: Path) -> int | None:
    try:
        return path.stat().st_size
    except OSError:
        return None
