"""The job engine shared by every modality.

State lives under ``OUT/.repack/``::

  job.json           job name, spec, options fingerprint, plan digest (refuses changed options)
  plan.json.gz       the planned tasks, canonical JSON gzip'd (read by `repack merge`, --append)
  tasks/<id>.json    one record per finished task, written atomically after its outputs
                     (the plan and the records go with version 1: ``repack.lifecycle.gc.drop_first_job_state``)
  lock[-<part>]      flock held while a run (or partition) is alive

All of it, the outputs and the manifest go through the job's store (``repack.store``): a local
OUT is written in place; for ``s3://`` OUT the job writes into a local scratch folder, each task
uploads its outputs (checked) before its record, locks are objects created with a conditional
PUT, and the manifest is uploaded last.

A run plans, skips tasks whose record and outputs check out, runs the rest on an executor,
and writes ``manifest.json`` last and atomically. kill -9 at any point, re-run, and the
result equals an uninterrupted run.

Tasks, chunks and outputs: a plan's *units* are its outputs in plan order (``Plan.units``). An
ungrouped task is a unit by itself. Tasks that share a ``group`` are *chunks* of one unit: each
writes a temporary piece and its own record; the driver feeds the records, in plan order and
as soon as the next one is there, to the group's assembly (``Job.open_assembly``) on a small
thread pool overlapping the executor; once the last is in, it writes the group's record
``tasks/<group>.json`` and only then removes the pieces (the chunk outputs the group's record
does not list) and the chunk records. A chunk record that a resumed run could never trust
(``Job.record_kept``: a segment placed in the group's shared file) is not saved at all: it only
travels to the driver, which drops it once its assembly has taken it in. A resumed run trusts a
group record whose outputs are intact, else each chunk record whose piece is intact, and redoes
the rest. Static partitions split the units (never a
group), so each node assembles its own; `repack merge` assembles a group whose chunks all have
records but whose assembly never ran. With an object store the pieces are published like any
output (see ``_run_and_record``) and deleted from it once the group's record is saved.
"""

from __future__ import annotations

import contextlib
import dataclasses
import fcntl
import gc
import hashlib
import importlib
import json
import os
import re
import sys
import tempfile
import time
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path, PurePosixPath

from repack import __version__
from repack.config import EngineOptions
from repack.errors import (IncompleteJobError, Interrupted, JobLockedError, NothingPackedError, RepackError,
                           StrictModeError, UsageError, raise_if_interrupted)
from repack.exec import TaskFailure, available_cpus, get_executor
from repack.jobs import JOBS
from repack.jobs.base import (PLAN_NAME, STATE_DIR, Job, Plan, Task, build_plan, is_piece, planned_entries, read_plan,
                              save_plan)
from repack.jobs.progress import progress_reporter
from repack.jobs.run_guard import (check_run, claim_run, driver_lock_fds, hold_workers_lock, open_lock_file, run_part,
                                   wait_for_old_workers)
from repack.manifest import (MANIFEST_NAME, Manifest, ManifestError, PathEscapeError, dumps_canonical, safe_join,
                             write_manifest)
from repack.manifest.io import atomic_write_bytes, sweep_write_temps
from repack.manifest.schema import format_version
from repack.manifest.quarantine_records import compact as compact_quarantine, file_name as quarantine_file_name, \
    FILE_NAME as QUARANTINE_FILE, expand as expand_quarantine, listed_records
from repack.manifest.duplicate_groups import FILE_NAME as GROUPS_FILE
from repack.manifest.paths import check_relative
from repack.store import open_store
from repack.store.local import clear_state_folder

STRICT_MANIFEST = f"{STATE_DIR}/strict-manifest.json"  # what a --strict run that failed leaves instead (exit 6)
ASSEMBLY_THREADS = 4  # driver threads that assemble groups (hashlib and file I/O release the GIL)
WRITERS_PER_GROUP = 4  # about this many workers write into one group's output at once (see dispatch_order)


def dispatch_order(tasks: list[Task], lanes: int) -> list[Task]:
    """``tasks`` in plan order, except that the chunks of up to ``lanes`` consecutive groups take turns.

    Sixteen workers writing into one shard at once contend in the kernel: on 16 cores, 24,000 photos
    took 5.4-7.5 s of system time in one 512 MB shard at a time and 2.6 s with 4 shards at a time,
    for the same wall time. Taking turns over ``lanes`` groups keeps about workers / lanes writers per
    shard while at most ``lanes`` groups are unfinished (what a kill -9 makes a re-run redo)."""
    if lanes <= 1:
        return list(tasks)
    ordered: list[Task] = []
    block: list[list[Task]] = []  # the groups taking turns

    def flush() -> None:
        for turn in range(max((len(g) for g in block), default=0)):
            ordered.extend(g[turn] for g in block if turn < len(g))
        block.clear()

    for task in tasks:
        if task.group and block and block[-1][0].group == task.group:
            block[-1].append(task)
            continue
        if not task.group or len(block) == lanes:
            flush()
        if task.group:
            block.append([task])
        else:
            ordered.append(task)
    flush()
    return ordered


def release_memory() -> None:
    """Collect the garbage and hand the heap's free pages back to the system (glibc ``malloc_trim``): a
    pool worker forked afterwards starts from the smaller process."""
    gc.collect()
    try:
        import ctypes

        ctypes.CDLL("libc.so.6").malloc_trim(0)
    except (OSError, AttributeError):  # not glibc
        pass


def replaced_job_class(store) -> tuple[type, dict] | None:
    """The job class and spec (JSON form) of the job OUT's ``job.json`` names; None where there is no readable
    one."""
    old = read_json(store, f"{STATE_DIR}/job.json")
    if not isinstance(old, dict) or old.get("job") not in JOBS or not isinstance(old.get("spec"), dict):
        return None
    module_name, _, cls_name = JOBS[old["job"]].partition(":")
    return getattr(importlib.import_module(module_name), cls_name), old["spec"]


def load_job(name: str, spec_json: str) -> Job:
    """Instantiate the registered job ``name`` from its spec's JSON."""
    module_name, _, cls_name = JOBS[name].partition(":")
    cls = getattr(importlib.import_module(module_name), cls_name)
    return cls(cls.spec_type.from_json(spec_json))


def execute_task(job_name: str, spec_json: str, task_json: str | bytes, plan_digest: str, share_pieces: bool = False,
                 place_segments: bool = False, run: str = "") -> str:
    """Run one task anywhere (pool worker, Ray worker, static partition) and persist its record.
    ``share_pieces``: publish a chunk's pieces to the store too (Ray: the group is assembled by a
    driver that may not share this worker's scratch). ``place_segments``: the worker shares the
    driver's disk and page cache (the local pool): chunks may write into the group's shared file.
    ``run``: the run id of the driver (``run_guard.claim_run``), checked before publishing."""
    job = load_job(job_name, spec_json)
    job.place_segments = place_segments
    hold_workers_lock(state_dir(job.out), run_part(run))  # a pool worker: a later run waits until it is gone
    task = Task.from_json(json.loads(task_json))
    local_pieces = bool(task.group) and not share_pieces
    _, text = _run_and_record(job, task.task_id, lambda: job.run_task(task), plan_digest, local_pieces=local_pieces,
                              run=run)
    return text.decode("ascii")  # the record as saved: encoded once


def _run_and_record(job: Job, unit_id: str, work, plan_digest: str, published: frozenset = frozenset(),
                    local_pieces: bool = False, run: str = "") -> tuple[dict, bytes]:
    """Run ``work()`` under the unit's lock, publish the outputs its record lists (but ``published``,
    those already in the store), then save the record as tasks/<unit_id>.json in the store; the
    record and its saved (canonical JSON) text.

    With an object store, a chunk's pieces (under .repack/) stay in the local scratch when the
    driver that assembles its group shares that scratch (``local_pieces``: the local pool, and
    static partitions, which assemble their own groups): a shard is uploaded once. A resume from
    another machine finds the piece neither there nor in the store and redoes the chunk. On Ray the
    pieces are published (``Engine.assemble_step`` fetches what the scratch lacks) and deleted from
    the store once the group's record is saved; text parts (ungrouped) are always published, so
    `repack merge` works on a machine without the parts' scratch.

    ``run``: the driver's run id, checked (``run_guard.check_run``) before the first publish and
    before the record is saved: a writer whose run was superseded (its driver killed, a later run
    holding the lock) raises StaleRunError and publishes nothing more."""
    started = time.perf_counter()
    with TaskLock(job.out, unit_id):
        record = work()
        record.update(task_id=unit_id, plan_digest=plan_digest, seconds=round(time.perf_counter() - started, 4))
        digests = known_digests(record)
        check_run(job.store, run)
        for output in job.record_outputs(record):  # object store: upload (checked) before the record
            if output["path"] not in published and not (local_pieces and is_piece(output["path"])):
                job.store.publish(output["path"], job.out / output["path"], digests.get(output["path"]))
        # Not fsynced: the outputs it vouches for are (a record lost to a power cut = the task is redone).
        text = dumps_canonical(record)
        check_run(job.store, run)
        if job.record_kept(record):
            job.store.put_bytes(record_name(unit_id), text, durable=False)
    return record, text


def known_digests(record: dict) -> dict[str, str]:
    """{path: sha256} of the files a record already hashed while writing them (a shard, a video:
    the entries that carry both), so publishing does not read them again to hash them."""
    entries = [v for v in record.values() if isinstance(v, dict)]
    entries += [e for v in record.values() if isinstance(v, list) for e in v if isinstance(e, dict)]
    return {e["path"]: e["sha256"] for e in entries if isinstance(e.get("path"), str) and isinstance(e.get("sha256"), str)}


def state_dir(out: Path) -> Path:
    return Path(out) / STATE_DIR


def record_name(task_id: str) -> str:
    """A task record's path in the store."""
    return f"{STATE_DIR}/tasks/{task_id}.json"


def read_json(store, rel: str) -> dict | None:
    """A JSON object from the store; None when missing or unreadable."""
    raw = store.read_bytes(rel)
    try:
        data = json.loads(raw) if raw is not None else None
    except ValueError:
        return None
    return data if isinstance(data, dict) else None


class _ChunksSeen:
    """What a group's chunk records said that its own record needs once they are gone: each chunk's
    seconds, whether its record was saved (it is deleted with the pieces), and the outputs they listed."""

    def __init__(self) -> None:
        self.seconds: dict[str, float] = {}
        self.kept: dict[str, bool] = {}
        self.outputs: set[str] = set()

    def add(self, record: dict, kept: bool) -> None:
        self.seconds[record["task_id"]] = record.get("seconds", 0.0)
        self.kept[record["task_id"]] = kept
        self.outputs.update(o["path"] for o in record.get("outputs", []))


@dataclass(frozen=True)
class RunResult:
    """What a run did: the manifest (None for a partition), and counts for the summary."""

    manifest: dict | None
    ran: int
    skipped: int
    seconds: float
    nothing_to_do: bool = False


def _flock(path: Path, mode: int, what: str, out: Path) -> int:
    """Open ``path`` and flock it without blocking; JobLockedError (naming the holder) if taken; UsageError
    when it is a symbolic link (the pid written into it would land wherever the link points)."""
    fd = open_lock_file(path, cloexec=False)
    try:
        fcntl.flock(fd, mode | fcntl.LOCK_NB)
    except BlockingIOError:
        holder = os.pread(fd, 64, 0).decode(errors="replace").strip()
        os.close(fd)
        who = f"another repack process (pid {holder})" if holder else \
            f"{_partitions_running(path.parent) or 'a static partition'} of a job run as static partitions"
        raise JobLockedError(f"{who} is already running {what} on {out}; wait for it or stop it first") from None
    if mode == fcntl.LOCK_EX:
        try:
            os.ftruncate(fd, 0)
            os.pwrite(fd, str(os.getpid()).encode(), 0)
        except OSError:  # a full disk: the lock goes with the fd, or this process's retry finds it "held"
            os.close(fd)
            raise
    return fd


def _partitions_running(state: Path) -> str:
    """The static partitions that hold their locks in ``state`` now, with their pids ("partition 0-of-2 (pid
    123)"), in words; empty where none is seen (each holds OUT's main lock shared, which records no pid)."""
    running = []
    for lock in sorted(state.glob("lock-*")):
        try:
            fd = os.open(lock, os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC)
        except OSError:
            continue
        try:
            fcntl.flock(fd, fcntl.LOCK_SH | fcntl.LOCK_NB)
        except BlockingIOError:  # held exclusively: that partition runs
            pid = os.pread(fd, 64, 0).decode(errors="replace").strip() or "?"
            running.append(f"partition {lock.name.removeprefix('lock-')} (pid {pid})")
        finally:
            os.close(fd)
    return ", ".join(running)


class JobLock:
    """Refuses a second live run on OUT. A full run, --overwrite and merge hold OUT/.repack/lock
    exclusively; a static partition holds it shared plus lock-<part> exclusively, so partitions
    run side by side but never beside a full run, nor twice. Tasks are locked one by one too
    (``TaskLock``), so even overlapping partition schemes never write the same task.

    With an object store the flocks guard the local scratch, and a lock object in the store
    (``.repack/lock`` or ``.repack/lock-<part>``) refuses a second run from any host."""

    def __init__(self, out: Path, part: str = "", store=None) -> None:
        self.out = out
        self.part = part
        self.fds: list[int] = []
        self.store_lock = store.lock(f"lock-{part}" if part else "lock") if store is not None else None

    def __enter__(self) -> "JobLock":
        main = state_dir(self.out) / "lock"
        try:
            self.fds.append(_flock(main, fcntl.LOCK_SH if self.part else fcntl.LOCK_EX, "a job", self.out))
            if self.part:
                self.fds.append(_flock(state_dir(self.out) / f"lock-{self.part}", fcntl.LOCK_EX,
                                       f"partition {self.part}", self.out))
            driver_lock_fds.update(self.fds)  # a forked pool worker closes its copies (run_guard.mark_pool_worker)
            if self.store_lock is not None:
                self.store_lock.__enter__()
        except BaseException:
            self.store_lock = None
            self.__exit__()
            raise
        return self

    def __exit__(self, *exc) -> None:
        try:
            if self.store_lock is not None:
                self.store_lock.__exit__(*exc)
        finally:
            self.store_lock = None
            self._release_fds()

    def _release_fds(self) -> None:
        while self.fds:
            fd = self.fds.pop()
            driver_lock_fds.discard(fd)
            os.close(fd)


STRICT_ASKED = f"{STATE_DIR}/strict-asked"  # a partition ran with --strict: `repack merge` applies it to the dataset


@contextlib.contextmanager
def partition_state_lock(out: Path, store):
    """Static partitions started together (an indexed Job's pods) check and write the job state one at a time:
    the first writes job.json and the plan, each later one compares its own with them, so a partition with other
    options or of another SOURCE is refused instead of mixed in. A flock in OUT's folder (the local scratch of an
    object store); on an object store the lock object ``.repack/lock-state`` too, waited for (a dead holder's is
    taken over once stale, ``s3_lock``)."""
    fd = open_lock_file(state_dir(out) / "lock-state")
    try:
        fcntl.flock(fd, fcntl.LOCK_EX)
        if not store.remote:
            yield
            return
        from repack.store.s3_lock import stale_after

        deadline = time.monotonic() + stale_after() + 30
        while True:
            lock = store.lock("lock-state")
            try:
                lock.__enter__()
                break
            except JobLockedError:
                if time.monotonic() > deadline:
                    raise
                time.sleep(0.2)
        try:
            yield
        finally:
            lock.__exit__(None, None, None)
    finally:
        os.close(fd)


class TaskLock:
    """Exclusive flock on OUT/.repack/tasks/<id>.lock (OUT: the folder the writer writes into, an object
    store's local scratch) while one process writes that task there.

    It guards one filesystem: two processes sharing it (pool workers, overlapping partitions on a
    shared OUT) never write one task's files at once. Across hosts that share nothing (Ray workers,
    each with its own scratch, OUT on s3://) the claim is the driver's: it holds the job lock (an
    object in the store), hands each task to one worker at a time (Ray retries a task only once its
    attempt has ended: an error, a dead worker or node), and every writer checks the run id before
    it publishes (``run_guard.check_run``). A worker's host may never have seen the driver's scratch:
    the lock's folder is created where missing."""

    def __init__(self, out: Path, task_id: str) -> None:
        self.out = out
        self.path = state_dir(out) / "tasks" / f"{task_id}.lock"
        self.task_id = task_id
        self.fd: int | None = None

    def __enter__(self) -> "TaskLock":
        self.path.parent.mkdir(parents=True, exist_ok=True)  # a Ray worker's own scratch, first task on its host
        self.fd = _flock(self.path, fcntl.LOCK_EX, f"task {self.task_id}", self.out)
        return self

    def __exit__(self, *exc) -> None:
        if self.fd is not None:
            os.close(self.fd)


def prepare_out(out: Path, store=None) -> None:
    """Create OUT (or the scratch of an object store) and its state folder, failing fast when it
    is not writable (an object store: wrong credentials, no bucket, read-only prefix)."""
    if store is not None and store.remote:
        store.check_writable()
    if out.exists() and not out.is_dir():
        raise UsageError(f"output {str(out)!r} exists and is not a folder")
    link = state_dir(out) if state_dir(out).is_symlink() else first_link(state_dir(out))
    if link is not None:  # the job state stays inside OUT: nothing is ever written through a link found there
        raise UsageError(f"{str(link)!r} is a symbolic link: repack writes its job state only inside OUT; "
                         "remove the link")
    try:
        (state_dir(out) / "tasks").mkdir(parents=True, exist_ok=True)
        fd, probe = tempfile.mkstemp(prefix=".write-probe-", dir=state_dir(out))  # a new file (O_EXCL), never a link
        os.close(fd)
        os.unlink(probe)
    except OSError as exc:
        raise UsageError(f"output {str(out)!r} is not writable: {exc.strerror}") from None


def first_link(folder: Path) -> Path | None:
    """The first symbolic link found anywhere under ``folder`` (links are not followed), or None."""
    pending = [folder]
    while pending:
        try:
            with os.scandir(pending.pop()) as entries:
                for entry in entries:
                    if entry.is_symlink():
                        return Path(entry.path)
                    if entry.is_dir(follow_symlinks=False):
                        pending.append(Path(entry.path))
        except (FileNotFoundError, NotADirectoryError):
            continue
    return None


def repack_manifest(store) -> dict | None:
    """OUT's ``manifest.json`` when it is repack's (its schema), else None (none, or another tool's)."""
    try:
        data = json.loads(store.read_bytes(MANIFEST_NAME) or b"null")
    except ValueError:
        return None
    return data if isinstance(data, dict) and data.get("schema") == "repack.manifest" else None


def holds_repack_job(store) -> bool:
    """OUT holds repack's job state or a repack manifest (not a ``manifest.json`` of another tool)."""
    return store.size(f"{STATE_DIR}/job.json") is not None or repack_manifest(store) is not None


def refuse_foreign_out(out: Path, store) -> None:
    """A non-empty OUT that holds no repack job state is someone else's folder, or a repack dataset copied
    without its job (``repack pull``, an rsync of the data files): UsageError naming what it holds, before
    anything in it is written (``--overwrite`` skips this). A ``manifest.json`` alone proves nothing."""
    if store.size(f"{STATE_DIR}/job.json") is not None:
        return
    data = repack_manifest(store)
    if data is not None:
        totals = data.get("totals") if isinstance(data.get("totals"), dict) else {}
        raise UsageError(f"{store.url} holds a repack {data.get('modality', '?')} dataset ({totals.get('samples', '?')} "
                         "samples) without its job state (.repack/job.json: a copy or a pull); packing into it would "
                         "replace it: choose a new or empty OUT, or pass --overwrite to replace it")
    if store.remote:
        found = sorted(rel for rel in store.list_sizes("") if not rel.startswith(f"{STATE_DIR}/"))
    else:
        found = sorted(entry.name for entry in os.scandir(out) if entry.name != STATE_DIR) if out.is_dir() else []
    if found:
        shown = ", ".join(found[:3]) + (" ..." if len(found) > 3 else "")
        raise UsageError(f"{store.url} is not empty and holds no repack job ({shown}); choose a new or empty OUT, "
                         "or pass --overwrite to pack into it anyway (files of the same names are replaced)")


def remove_local(root: Path, rel: str) -> None:
    """Delete ``root/rel`` if it is a file confined to ``root``."""
    try:
        target = safe_join(root, rel)
    except PathEscapeError:
        return
    if target.is_file():
        target.unlink()


def refuse_out_inside_source(source: str, out: Path) -> None:
    """OUT inside a source folder would be scanned as input (a class, a document folder)."""
    src = Path(source)
    if src.is_dir():
        src_real, out_real = src.resolve(), out.resolve()
        if out_real == src_real or src_real in out_real.parents:
            raise UsageError(f"output {str(out)!r} is inside the source folder {source!r}: choose an OUT outside it")


def input_fingerprints(plan: Plan) -> dict[str, list]:
    """rel -> [size, mtime_ns, inode] of every planned input (images/video inputs, text segments)."""
    found: dict[str, list] = {}
    for task in plan.tasks:
        for entry in planned_entries(task.payload):
            found[entry["rel"]] = list(entry.get("fingerprint", ()))
    return found


def _derived_changes(before: dict, now: dict) -> str | None:
    """What a plan drew from SOURCE beside its inputs that differs, in words (None: nothing): --dedup's groups (a
    copy added, changed or removed: the copy is in no task), the tokenizer file (changed in place)."""
    said = []
    if before.get("dedup") != now.get("dedup"):
        groups = {tuple(g["paths"]) for g in before.get("dedup") or ()} ^ {tuple(g["paths"]) for g in now.get("dedup") or ()}
        paths = sorted({p for group in groups for p in group})
        said.append(f"--dedup's groups of copies ({', '.join(paths[:5])}{' ...' if len(paths) > 5 else ''})")
    old_tok, new_tok = (before.get("tokenizer") or {}).get("sha256"), (now.get("tokenizer") or {}).get("sha256")
    if old_tok != new_tok:
        said.append(f"the tokenizer file (sha256 {str(old_tok)[:12]}... -> {str(new_tok)[:12]}...)")
    return "; ".join(said) or None


def _kind_phrase(job_name) -> str:
    """'an images' / 'a text' / 'a video': the dataset kind a recorded job name stands for."""
    name = str(job_name or "unknown")
    return f"{'an' if name[:1] in 'aeiou' else 'a'} {name}"


def _shown(value) -> str:
    """An option's value as a user reads it: unset, a number, a word or a list."""
    return "unset" if value is None else json.dumps(value)


def options_fingerprint(job: Job) -> str:
    return hashlib.sha256(dumps_canonical({"job": job.name, "options": job.spec.options()})).hexdigest()


# a shard and its side files as repack names them in OUT (an append's, a rewrite's too), and their temp files
OUTPUT_FILE = re.compile(r"\.?shard-(?:v[0-9]+-)?[0-9]{6}(?:-v[0-9]+)*\.(?:tar|idx|crc)(?:\.tmp-[0-9]+|\.[^/]+\.tmp)?")


class UnresumableJob(UsageError):
    """OUT holds a job this run cannot resume: planned from another SOURCE, or run with other options."""


class OtherToolVersion(UnresumableJob):
    """OUT holds an unfinished job another repack version started (its work is not resumed by this one)."""


class Engine:
    """Runs one job: plan, resume, execute, finalize."""

    def __init__(self, job: Job, options: EngineOptions) -> None:
        self.job = job
        self.options = options
        self.out = job.out
        self.planned_quarantine = 0  # inputs the plan's scan refused (progress lines count them)
        self.run_id = ""  # this run's token once it holds the lock (run_guard.claim_run), checked by every writer
        self.tasks_ran: dict[str, int] = {}  # the executor's count of tasks by where they ran, if it keeps one
        self.rerun_unstrict = "re-run without --strict"  # how to publish what --strict refused (merge: --no-strict)

    # -- state ---------------------------------------------------------------------------
    def _check_state(self, plan: Plan) -> None:
        store = self.job.store
        state = {"job": self.job.name, "spec": json.loads(self.job.spec.to_json()), "tool_version": __version__,
                 "options_sha256": options_fingerprint(self.job), "plan_digest": plan.digest,
                 "num_tasks": len(plan.tasks)}
        if self.options.num_nodes > 1:  # the partition scheme: every partition's share is counted from it
            state["num_nodes"] = self.options.num_nodes
        old = read_json(store, f"{STATE_DIR}/job.json")
        if old is not None:
            scheme = old.get("num_nodes")
            if self.options.num_nodes > 1 and isinstance(scheme, int) and scheme != self.options.num_nodes:
                raise UsageError(f"{store.url} holds a job run as {scheme} static partitions (--num-nodes {scheme}); "
                                 f"this partition was started with --num-nodes {self.options.num_nodes}, which "
                                 f"would leave tasks of the others unrun: start it with --num-nodes {scheme}, or "
                                 "use --overwrite to start over")
            if old.get("tool_version") not in (None, __version__) and store.size(MANIFEST_NAME) is None:
                # an unfinished job: its shards and records so far are that repack's
                raise OtherToolVersion(f"{store.url} holds a job started by repack {old['tool_version']} and not "
                                       f"finished (this is repack {__version__}); finish it with repack "
                                       f"{old['tool_version']}, or use --overwrite to start over")
            if old.get("job") != self.job.name:
                raise UsageError(f"{store.url} holds {_kind_phrase(old.get('job'))} dataset; choose another OUT "
                                 f"(--overwrite deletes that dataset and packs this {self.job.name} job there)")
            if old.get("options_sha256") != state["options_sha256"]:
                old_spec, new_spec = old.get("spec") or {}, state["spec"]
                differ = [f"--{key.replace('_', '-')}: {_shown(old_spec.get(key))} -> {_shown(new_spec.get(key))}"
                          for key in sorted(set(old_spec) | set(new_spec))
                          if key != "out" and old_spec.get(key) != new_spec.get(key)]
                resume = ("re-run with the values it was started with (left of each ->) to resume it, or "
                          if differ else "")
                raise UnresumableJob(f"{store.url} holds a job run with other options ("
                                 f"{'; '.join(differ) or 'same values, older tool version'}); "
                                 f"{resume}use --overwrite to replace it")
            if old.get("plan_digest") != state["plan_digest"]:
                refuse_over_later_version(store)  # appended to since (and version 1's plan gone with gc, maybe)
                changes = self._changes(plan)
                if changes is None:  # e.g. a job left half-done by a repack that laid out its tasks otherwise
                    raise UnresumableJob(f"{store.url} holds a job planned differently from the same inputs (by "
                                         "another repack version); use --overwrite to start over")
                raise UnresumableJob(f"source changed since {store.url} was started: {changes}; "
                                     "use --overwrite to start over")
        else:
            save_plan(store, plan)
            store.put_bytes(f"{STATE_DIR}/job.json", dumps_canonical(state))

    def _changes(self, plan: Plan) -> str | None:
        """Which inputs differ from the recorded plan (size, mtime_ns, inode), in words; None when none does."""
        old = read_plan(self.job.store)
        if old is None:
            return "the planned tasks differ"
        before, now = input_fingerprints(old), input_fingerprints(plan)
        changed = sorted(rel for rel in before.keys() | now.keys() if before.get(rel) != now.get(rel))
        if not changed:
            return _derived_changes(old.info, plan.info)
        return (f"{len(changed)} input(s) differ in size, mtime or inode, or were added or removed "
                f"({', '.join(changed[:5])}{' ...' if len(changed) > 5 else ''})")

    def _wipe(self) -> None:
        """--overwrite: remove what an earlier job wrote: the files its records name, and every version of the
        dataset there (each ``manifest.vN.json``, published or pending, and the files it names), so that no
        version of the replaced dataset is ever published over the new one."""
        from repack.lifecycle.version_names import version_names
        from repack.manifest.versions import version_number

        store = self.job.store
        replaced = replaced_job_class(store)
        names: set[str] = set()
        for rel in store.list_sizes(f"{STATE_DIR}/tasks/"):
            if not rel.endswith(".json"):
                continue
            try:
                outputs = [o["path"] for o in (read_json(store, rel) or {}).get("outputs", [])]
            except (KeyError, TypeError):
                continue
            names.update(outputs)
            if replaced is not None:  # written beside them in the finish step (a --no-merge part's side file)
                names.update(name for output in outputs for name in replaced[0].written_beside(str(output)))
        names |= version_names(store)  # every version of the dataset there, pending ones too
        if replaced is not None:  # what the replaced job wrote in its finish step, before a manifest named it
            names |= replaced[0].fixed_outputs(replaced[1])
        spec = json.loads(self.job.spec.to_json())
        if holds_repack_job(store):  # shards a killed run left unrecorded; in a folder repack never wrote to, a
            names |= {rel for rel in store.list_names("") if OUTPUT_FILE.fullmatch(rel)  # shard-000005.tar is not ours
                      or QUARANTINE_FILE.fullmatch(rel) or GROUPS_FILE.fullmatch(rel)}  # a refused version's
            names |= self.job.fixed_outputs(spec)  # (nor is a tokenizer.json there: a user's own)
        # never a file this job reads (--tokenizer OUT/tokenizer.json, the copy an earlier text job left there)
        inputs = {os.path.realpath(value) for value in spec.values() if isinstance(value, str) and os.path.isabs(value)}
        names = {rel for rel in names if store.remote or os.path.realpath(self.out / rel) not in inputs}
        # the manifests first: a wipe killed mid-way never leaves one naming a file it deleted (data.lmdb sorts first)
        for rel in sorted(names | {MANIFEST_NAME}, key=lambda rel: (rel != MANIFEST_NAME, version_number(rel) is None,
                                                                    rel)):
            try:
                safe_join(self.out, rel)
            except PathEscapeError:
                continue
            store.delete(rel)
            if store.remote:
                remove_local(self.out, rel)
        store.clear_state(STATE_DIR)  # the lock files this run holds stay (a second run would lock new ones)
        if store.remote:
            clear_state_folder(state_dir(self.out))

    def _clean_temps(self, task_ids: set[str], every_node: bool = False, keep: set[Path] = frozenset()) -> None:
        """Remove temp files left by a killed run of these tasks (we hold their lock), and of a manifest write killed
        mid-way (one machine, or ``every_node``: the merge; the job lock is this run's, and partitions leave the
        merge's alone). ``keep``: temps this run has open (a task id can be part of any name: text's --name)."""
        for path in self.out.rglob(".*.tmp*"):
            if path in keep:
                continue
            if any(tid in path.name for tid in task_ids) and (path.is_symlink() or path.is_file()):  # a link too
                path.unlink(missing_ok=True)
        if self.options.num_nodes == 1 or every_node:  # a job's side files and manifests: a killed write leaves
            sweep_write_temps(self.out)                 # no stray

    def load_record(self, task: Task, plan_digest: str) -> dict | None:
        """A finished task's (or group's) record, if it belongs to this plan and its outputs are intact."""
        record = read_json(self.job.store, record_name(task.task_id))
        if record is None or record.get("plan_digest") != plan_digest or not self._paths_confined(record) \
                or not self.job.outputs_intact(record):
            return None
        return record

    def _paths_confined(self, record: dict) -> bool:
        """A record read back from the store names only paths inside OUT (else it is treated as damaged
        and its task redone: nothing is ever fetched, written or removed outside OUT on its word)."""
        try:
            for output in record.get("outputs", []):
                safe_join(self.out, output["path"])
            part = record.get("part") or {}  # a text part's .bin/.idx, an lmdb part: read, merged, then removed
            for key in ("bin", "idx", "path"):
                if key in part:
                    safe_join(self.out, part[key])
            segment = record.get("segment") or {}  # a chunk's piece: a file name in the job's segments folder
            if "name" in segment and PurePosixPath(check_relative(segment["name"])).name != segment["name"]:
                return False
        except (PathEscapeError, KeyError, TypeError, AttributeError):
            return False
        return True

    def resume_state(self, units, plan_digest: str) -> tuple[dict, dict]:
        """(unit id -> its record or None, task id -> record of a finished chunk of an unfinished group)."""
        if self.job.store.remote:
            self.job.store.cache_listing()  # one paged listing of the prefix serves every output check below
        unit_records = self.load_records([Task(uid, {}) if tasks[0].group else tasks[0] for uid, tasks in units],
                                         plan_digest)
        chunks = [t for uid, tasks in units if tasks[0].group and unit_records[uid] is None for t in tasks]
        chunk_records = {tid: r for tid, r in self.load_records(chunks, plan_digest).items() if r is not None}
        return unit_records, chunk_records

    def assemble_step(self, group: str, tasks, assemblies: dict, prev: Future | None,
                      batch: list[dict], plan_digest: str) -> dict | None:
        """Feed ``batch`` (the next chunk records of ``group`` in plan order) to its assembly, after the
        previous step ``prev``; once the last chunk is in, save the group's record, then drop the pieces.
        ``assemblies``: group -> (its assembly, what its chunk records said that the group's record needs)."""
        if prev is not None:
            prev.result()  # the group's earlier step (re-raises its error)
        if group not in assemblies:
            assemblies[group] = (self.job.open_assembly(group), _ChunksSeen())
        assembly, chunks = assemblies[group]
        store = self.job.store
        try:
            if store.remote:  # chunks run on another host (Ray) or before a move: their outputs from the store
                for output in (o for r in batch for o in self.job.record_outputs(r)):
                    local = self.out / output["path"]
                    if not (local.is_file() and local.stat().st_size == output["bytes"]):
                        store.fetch(output["path"], local)
            for record in batch:
                chunks.add(record, self.job.record_kept(record))
                assembly.add(record)
            if batch[-1]["task_id"] != tasks[-1].task_id:
                return None
            chunk_seconds = round(sum(chunks.seconds[t.task_id] for t in tasks), 4)
            chunk_outputs = frozenset(chunks.outputs)
            record, _ = _run_and_record(self.job, group, lambda: {**assembly.finish(), "chunk_seconds": chunk_seconds},
                                        plan_digest, published=chunk_outputs, run=self.run_id)
        except BaseException:
            assembly.abort()
            raise
        for rel in sorted(chunk_outputs - {output["path"] for output in record.get("outputs", [])}):  # the pieces
            (self.out / rel).unlink(missing_ok=True)
            if store.remote:
                store.delete(rel)
        for task in tasks:  # the group's record holds what theirs held: the chunk records go too
            if chunks.kept[task.task_id]:
                store.delete(record_name(task.task_id))
        return record

    # -- run -----------------------------------------------------------------------------
    def run(self) -> RunResult:
        started = time.time()
        self.job.check()
        listed_records()  # REPACK_QUARANTINE_LISTED refused now, not after the last task
        refuse_out_inside_source(self.job.spec.source, self.out)
        opts = self.options
        self._plan_ahead = None
        with contextlib.ExitStack() as ahead:
            if opts.executor == "ray":  # Ray's start (`import ray`, its driver pool, joining) runs while a forked
                from repack.exec.ray_check import check_ray  # child plans (``repack.jobs.plan_ahead``)
                from repack.jobs.plan_ahead import PlanAhead

                check_ray(opts.ray_address)  # fails fast: Ray not installed, an address that does not answer
                self._plan_ahead = ahead.enter_context(PlanAhead(self.job))
            executor = get_executor(opts.executor, workers=opts.workers or available_cpus(), retries=opts.retries,
                                    address=opts.ray_address, job=self.job.name, driver_cpus=opts.ray_driver_cpus)
            try:
                return self._run_on(executor, started)
            finally:
                executor.close()  # what it holds (Ray: the driver's pool, CPUs held from Ray)

    def _run_on(self, executor, started: float) -> RunResult:
        """``run`` on ``executor``: lock, plan (the one made ahead, if any), resume, execute, finalize."""
        opts = self.options
        if opts.overwrite and opts.num_nodes > 1:
            raise UsageError("--overwrite cannot be combined with --num-nodes; clear OUT once, then start the nodes")
        store = self.job.store
        if not opts.overwrite:
            refuse_foreign_out(self.out, store)
        prepare_out(self.out, store)
        part = f"{opts.node_rank}-of-{opts.num_nodes}" if opts.num_nodes > 1 else ""
        with JobLock(self.out, part, store if store.remote else None):
            wait_for_old_workers(state_dir(self.out), part)  # before --overwrite deletes the lock files they hold
            if opts.overwrite:
                self._wipe()
                prepare_out(self.out)
            self.run_id = claim_run(store, part)
            if store.remote:
                store.abort_uploads()  # left by a killed run: we hold the lock
            plan = self._plan_ahead.plan() if self._plan_ahead is not None else build_plan(self.job)
            self.planned_quarantine = len(plan.quarantine)
            if not plan.tasks and not plan.quarantine and not plan.info.get("dedup"):  # (an --append's copies: inputs)
                raise UsageError(f"source {self.job.spec.source!r} holds no inputs")
            if part:
                with partition_state_lock(self.out, store):
                    self._check_state(plan)
                if opts.strict and store.size(STRICT_ASKED) is None:
                    store.put_bytes(STRICT_ASKED, b"--strict\n")
            else:
                self._check_state(plan)
            digest = plan.digest
            mine = [u for i, u in enumerate(plan.units) if i % opts.num_nodes == opts.node_rank]
            records, chunk_records = self.resume_state(mine, digest)
            todo = [t for uid, tasks in mine if records[uid] is None for t in tasks if t.task_id not in chunk_records]
            unfinished = [uid for uid, _ in mine if records[uid] is None]
            release_memory()  # the planning's garbage, before the pool's workers fork from this process
            manifest_path = self.out / MANIFEST_NAME
            manifest = read_json(store, MANIFEST_NAME) if not unfinished and opts.num_nodes == 1 else None
            every_unit = {t.task_id for _, tasks in mine for t in tasks} | {uid for uid, _ in mine}
            if manifest is not None:
                self._clean_temps(every_unit)  # a worker killed and retried may have left one
                try:  # every quarantine record, as a run that finished it reports them
                    manifest = expand_quarantine(manifest, store.read_bytes, store.url)
                except ManifestError as exc:  # the summary lists what the manifest does; the damage is said
                    sys.stderr.write(f"repack: warning: {exc}; the summary names only the quarantine records "
                                     "the manifest lists (`repack verify OUT` checks the dataset)\n")
                result = RunResult(manifest, 0, len(mine), time.time() - started, nothing_to_do=True)
                self._check_outcome(manifest, f"{store.url}/{MANIFEST_NAME}")
                return result
            if unfinished:  # a later version's change (a remove, then gc) made a task of version 1 unfinished
                refuse_over_later_version(store)
                store.delete(MANIFEST_NAME)
                manifest_path.unlink(missing_ok=True)
            temps = {t.task_id for t in todo} | set(unfinished)  # chunks and unfinished assemblies
            self._clean_temps(temps)
            watcher = self.job.watch_tasks(plan, records) if opts.num_nodes == 1 and todo else None
            try:
                texts = dict(zip((t.task_id for t in plan.tasks), plan.task_texts))  # encoded once, for the digest
                failures = self._execute(executor, mine, todo, digest, records, chunk_records,
                                         [texts[t.task_id] for t in todo], watcher)
                self.tasks_ran = dict(getattr(executor, "tasks_ran", {}))  # where they ran (Ray: pool or Ray)
                del texts
            except BaseException as exc:
                if watcher is not None:
                    watcher.abort()
                if isinstance(exc, Interrupted):
                    self._clean_temps(temps)  # the workers and assemblies are stopped: their temps go
                raise
            if failures:
                if watcher is not None:
                    watcher.abort()
                lines = "\n".join(f"  {f.task_id}: {f.error.strip().splitlines()[-1] if f.error.strip() else '?'}"
                                  for f in failures)
                if all("SourceChanged" in f.error for f in failures):  # a re-run would be refused the same way
                    raise IncompleteJobError(f"{len(failures)} task(s) failed: the source changed while the job ran "
                                             f"(finished shards are kept; re-run with --overwrite to plan the "
                                             f"source as it is now):\n{lines}")
                raise IncompleteJobError(f"{len(failures)} task(s) failed; finished shards are kept and a "
                                         f"re-run resumes:\n{lines}")
            ran, skipped = len(unfinished), len(mine) - len(unfinished)
            self._clean_temps(every_unit, keep=watcher.owned_temps() if watcher is not None else set())
            # (temps of workers killed and retried, crash or OOM: never left beside the data; the watcher's are live)
            if opts.num_nodes > 1:
                return RunResult(None, ran, skipped, time.time() - started)
            try:
                raise_if_interrupted()  # nothing is published after a signal
                manifest = self.finalize(plan, [records[uid] for uid, _ in plan.units], started)
            finally:
                if watcher is not None:
                    watcher.abort()  # what finalize did not take
            result = RunResult(manifest, ran, skipped, time.time() - started)
        self._check_outcome(manifest, f"{store.url}/{MANIFEST_NAME}")
        return result

    def load_records(self, tasks: list[Task], digest: str) -> dict[str, dict | None]:
        """{task id: record or None} (an object store is read by a few threads: one GET per record; a local
        OUT's records folder is listed once, and only the records there are read)."""
        if not tasks:
            return {}
        if not self.job.store.remote:
            try:
                saved = set(os.listdir(state_dir(self.out) / "tasks"))
            except OSError:
                saved = set()
            return {t.task_id: self.load_record(t, digest) if f"{t.task_id}.json" in saved else None for t in tasks}
        with ThreadPoolExecutor(16) as pool:
            return dict(zip((t.task_id for t in tasks), pool.map(lambda t: self.load_record(t, digest), tasks)))

    def _strict_problem(self, manifest: dict) -> str | None:
        return self.job.strict_problem(manifest) if self.options.strict else None

    def _withhold(self, manifest: dict) -> str:
        """--strict refused the dataset: no manifest.json (an earlier one removed), the would-be manifest
        saved as .repack/strict-manifest.json for inspection; returns its location."""
        store = self.job.store
        store.put_bytes(STRICT_MANIFEST, dumps_canonical(manifest, indent=1))
        store.delete(MANIFEST_NAME)
        (self.out / MANIFEST_NAME).unlink(missing_ok=True)
        return f"{store.url}/{STRICT_MANIFEST}"

    def _check_outcome(self, manifest: dict, manifest_path: str) -> None:
        """Exit 7 when inputs were found and nothing was packed; exit 6 under --strict when the job's
        ``strict_problem`` finds one (a quarantine; video: also a needed transcode in a probe-only run).
        What --strict leaves: no manifest.json, so OUT is not a dataset (readers and verify refuse it);
        the shards and job state stay, and the would-be manifest is .repack/strict-manifest.json. A
        re-run without --strict publishes the manifest from the finished tasks (nothing is redone)."""
        problem = self._strict_problem(manifest)
        if problem:
            manifest_path = self._withhold(manifest)
        totals = manifest["totals"]
        if totals.get("inputs") and not self.job.packed(manifest):
            first = manifest["quarantine"][0] if manifest["quarantine"] else None
            example = f"; e.g. {first['source']}: {first['reason']}" if first else ""
            raise NothingPackedError(f"{totals['inputs']} input(s) found but nothing was packed: every one was "
                                     f"quarantined (see {manifest_path}{example})")
        if problem:
            raise StrictModeError(f"--strict: {problem}; no manifest.json was published, so {self.job.store.url} is "
                                  f"not a dataset (the would-be manifest: {manifest_path}; the shards stay for "
                                  f"inspection); {self.rerun_unstrict} to publish it (nothing is redone)")

    def _execute(self, executor, units, todo: list[Task], digest: str, records: dict,
                 chunk_records: dict, texts: list[bytes], watcher=None) -> list[TaskFailure]:
        """Run ``todo`` on the executor; assemble each group of ``units`` as soon as its chunks are done.
        ``texts``: each todo task's canonical JSON (``Plan.task_texts``), what a worker is sent; ``watcher``
        (``Job.watch_tasks``) is told of each ungrouped task's record as it lands.

        Fills ``records`` (unit id -> record); returns the failures."""
        opts = self.options
        spec_json = self.job.spec.to_json()
        share_pieces = self.job.store.remote and opts.executor == "ray"
        same_host = getattr(executor, "same_host", False)  # its workers share the driver's disk and page cache
        lanes = -(-(opts.workers or available_cpus()) // WRITERS_PER_GROUP)
        text_of = dict(zip((t.task_id for t in todo), texts))
        todo = dispatch_order(todo, lanes)
        calls = [(self.job.name, spec_json, text_of.pop(t.task_id), digest, share_pieces, same_host, self.run_id)
                 for t in todo]
        units_of = {t.task_id: self.job.task_units(t) for t in todo}
        group_tasks = {uid: tasks for uid, tasks in units if tasks[0].group and records[uid] is None}
        group_of = {t.task_id: uid for uid, tasks in group_tasks.items() for t in tasks}
        fed = dict.fromkeys(group_tasks, 0)  # chunks handed to each group's assembly so far
        last_step: dict[str, Future] = {}
        assemblies: dict = {}
        failures: list[TaskFailure] = []
        final_steps: dict[Future, str] = {}
        # Threads start only once a record arrived: the local pool has forked all its workers by then.
        assembler: ThreadPoolExecutor | None = None

        def feed(uid: str) -> None:
            """Hand the group's next chunk records in plan order (those finished) to its assembly."""
            nonlocal assembler
            tasks = group_tasks[uid]
            batch = []  # handed over: the driver keeps no chunk record beyond its group's assembly
            while fed[uid] < len(tasks) and tasks[fed[uid]].task_id in chunk_records:
                batch.append(chunk_records.pop(tasks[fed[uid]].task_id))
                fed[uid] += 1
            if not batch:
                return
            if assembler is None:
                assembler = ThreadPoolExecutor(min(ASSEMBLY_THREADS, len(group_tasks)),
                                               thread_name_prefix="repack-assemble")
            # Steps of one group run in order: each waits for the previous one, which was queued first.
            step = assembler.submit(self.assemble_step, uid, tasks, assemblies, last_step.get(uid), batch, digest)
            last_step[uid] = step
            if fed[uid] == len(tasks):
                final_steps[step] = uid

        def collect(block: bool) -> None:
            for step in [f for f in final_steps if block or f.done()]:
                uid = final_steps.pop(step)
                try:
                    record = step.result()
                except Exception as exc:  # noqa: BLE001 - a failed assembly is the group's failure
                    failures.append(TaskFailure(uid, f"{type(exc).__name__}: {exc}"))
                    continue
                records[uid] = record

        def finished(task_id: str, record: dict) -> None:
            uid = group_of.get(task_id)
            if uid is None:
                records[task_id] = record
                if watcher is not None:
                    watcher.finished(task_id, record)
                return
            chunk_records[task_id] = record
            feed(uid)

        every = sum(self.job.task_units(t) for _, tasks in units for t in tasks)  # resumed ones count as done
        bar = progress_reporter(every, self.job.progress_unit, self.job.name, opts, self.planned_quarantine,
                                done=every - sum(units_of.values()))
        counts: dict[str, int] = {}
        started = time.perf_counter()
        resumed = list(group_tasks)  # chunks finished before an interruption: fed once the pool has forked
        stopped = False
        gc.freeze()  # the plan and all else alive now: skipped by the run's collections, not copied by forked workers
        results = executor.run(calls, [t.task_id for t in todo])
        try:
            with bar, contextlib.closing(results):  # closed at once when interrupted: the executor stops its workers
                for item in results:
                    raise_if_interrupted()  # a signal whose raise was swallowed (repack.errors.note_interrupt)
                    while resumed:
                        feed(resumed.pop())
                    if isinstance(item, TaskFailure):
                        failures.append(item)
                        bar.update(units_of[item.task_id])
                        continue
                    finished(item["task_id"], item)
                    collect(block=False)
                    for name, value in self.job.progress_counts(item).items():
                        counts[name] = counts.get(name, 0) + value
                    if counts:
                        elapsed = max(time.perf_counter() - started, 1e-9)
                        bar.set_postfix({f"{name}/s": f"{value / elapsed:.0f}" for name, value in counts.items()},
                                        refresh=False)
                    bar.update(units_of[item["task_id"]], quarantined=len(item.get("quarantine", ())))
            while resumed:
                feed(resumed.pop())
            collect(block=True)
        except BaseException:
            stopped = True  # interrupted: queued assembly steps are cancelled, the running ones end
            raise
        finally:
            gc.unfreeze()  # collectable again once the run is over (a process may run several jobs)
            if assembler is not None:
                assembler.shutdown(wait=True, cancel_futures=stopped)
            for uid, (assembly, _) in assemblies.items():  # groups left unfinished by a failed chunk or a stop
                if records.get(uid) is None:
                    assembly.abort()
        return failures

    def finalize(self, plan: Plan, records: list[dict], started: float) -> dict:
        """Build and atomically write the manifest from all task records."""
        if self.job.store.remote:
            self._hydrate(records)
        body = self.job.finalize(plan, records)
        body.update(schema="repack.manifest", version=1, modality=self.job.name)
        body["created_by"] = {"tool": "repack", "version": __version__, "options": self.job.spec.options()}
        body["run"] = {"command": self.options.command, "executor": self.options.executor,
                       "workers": self.options.workers or available_cpus(),
                       "finished_unix": int(time.time()), "seconds": round(time.time() - started, 3),
                       "task_seconds": round(sum(r.get("seconds", 0.0) + r.get("chunk_seconds", 0.0)
                                                 for r in records), 3),
                       **({"tasks_ran": self.tasks_ran} if self.tasks_ran else {}),
                       **body.pop("run_stats", {})}
        if self._strict_problem(body):
            return body  # not published: _check_outcome withholds it (exit 6)
        published = self._compact_quarantine(body)
        write_manifest(self.out, published, f"{self.job.store.url}/{MANIFEST_NAME}" if self.job.store.remote else None)
        if self.job.store.remote:
            self._publish_dataset(published, records)
        return body  # every quarantine record: the summary counts their reasons

    def _compact_quarantine(self, body: dict) -> dict:
        """``body`` as published: beyond the records a manifest lists, every quarantine record in its side file
        (``repack.manifest.quarantine_records``), written beside the shards; a side file an earlier run left that
        this manifest does not name is deleted (a run killed before its manifest, re-run with a higher limit)."""
        name = quarantine_file_name(1)
        published, side = compact_quarantine(body, 1)
        published["version"] = body["version"] = format_version(published)
        if side is not None:
            atomic_write_bytes(self.out / side[0], side[1])
        else:
            (self.out / name).unlink(missing_ok=True)
            if self.job.store.remote and self.job.store.size(name) is not None:
                self.job.store.delete(name)
        return published

    def _hydrate(self, records: list[dict]) -> None:
        """Object store: download intermediate outputs (under .repack/, e.g. text parts) that the
        job's finalize reads and the local scratch lost (a re-run on another machine)."""
        store = self.job.store
        for record in records:
            for output in self.job.record_outputs(record):
                rel, local = output["path"], self.out / output["path"]
                if is_piece(rel) and not (local.is_file() and local.stat().st_size == output["bytes"]):
                    store.fetch(rel, local)  # not the cached listing: it may predate uploads by Ray workers

    def _publish_dataset(self, body: dict, records: list[dict]) -> None:
        """Object store: upload the files finalize wrote, then the manifest (last), then drop the
        intermediate outputs finalize consumed."""
        store = self.job.store
        published = {o["path"] for r in records for o in self.job.record_outputs(r)}
        for rel in Manifest(self.out, body).relative_paths():
            if rel not in published:
                store.publish(rel, self.out / rel)
        store.check_lock()  # the lock taken over by another run (a stalled heartbeat): publish nothing
        store.publish(MANIFEST_NAME, self.out / MANIFEST_NAME)
        for rel in sorted(published):
            if is_piece(rel) and not (self.out / rel).exists():
                store.delete(rel)


def refuse_over_later_version(store) -> None:
    """UsageError when OUT holds a version after 1: running the first job again would publish version 1 over it."""
    later = _later_version(store)
    if later is not None:
        raise UsageError(f"{store.url} holds version {later} of its dataset (an --append or remove after this job); "
                         "running the job again would publish version 1 over it (removed samples back): add inputs "
                         "with --append, or pass --overwrite to start over")


def _later_version(store) -> int | None:
    """The highest dataset version after 1 that OUT holds (published or pending), None when it holds none."""
    from repack.manifest.versions import load_number, version_number

    numbers = [n for n in (version_number(rel) for rel in store.list_sizes("manifest.v")) if n is not None]
    numbers.append(load_number(store.read_bytes(MANIFEST_NAME)))  # 1 when none or unreadable
    return max((n for n in numbers if n > 1), default=None)


def merge(out: str, options: EngineOptions, strict: bool | None = None) -> RunResult:
    """`repack merge`: check every planned task finished (all partitions) and write the manifest. ``strict``:
    --strict or --no-strict; None: --strict when a partition was run with it (``STRICT_ASKED``)."""
    started = time.time()
    store = open_store(str(out))
    state = read_json(store, f"{STATE_DIR}/job.json")
    if state is None:
        raise UsageError(f"{out} holds no repack job state (.repack/job.json)")
    if not isinstance(state, dict) or not isinstance(state.get("job"), str) or state["job"] not in JOBS \
            or not isinstance(state.get("spec"), dict) \
            or not isinstance(state.get("plan_digest"), str):
        raise UsageError(f"{out}/.repack/job.json is not a repack job state (a job name, spec and plan digest); "
                         "re-run the partitions")
    if state.get("tool_version") not in (None, __version__) and store.size(MANIFEST_NAME) is None:
        # unmerged partitions: their shards and records are that repack's
        raise OtherToolVersion(f"{out} holds partitions run by repack {state['tool_version']} (this is repack "
                               f"{__version__}); merge them with repack {state['tool_version']}")
    # the dataset is where merge was asked to write it: the job state's ``out`` is where the partitions ran (a
    # folder since moved or copied, or a forged one), never a place to write to
    job = load_job(state["job"], json.dumps({**state["spec"], "out": str(out)}))
    if strict is None:
        strict = store.size(STRICT_ASKED) is not None  # a partition was run with --strict: the merged dataset obeys it
    options = dataclasses.replace(options, strict=strict)
    engine = Engine(job, options)
    engine.rerun_unstrict = "run `repack merge --no-strict`"
    prepare_out(job.out, store)
    with JobLock(job.out, store=store if store.remote else None):
        later = _later_version(store)
        if later is not None:  # merged, then appended to or removed from: version 1 again would undo that
            raise UsageError(f"{store.url} holds version {later} of its dataset (an --append or remove after the "
                             "merge); merging again would publish version 1 over it (removed samples back): "
                             "nothing to merge")
        plan = read_plan(store)  # after that check: gc deletes the plan with version 1
        if plan is None:
            raise UsageError(f"{out}: .repack/{PLAN_NAME} is missing or damaged; re-run the partitions")
        if plan.digest != state["plan_digest"]:
            raise RepackError(f"{out}: {PLAN_NAME} does not match job.json (plan digest differs)")
        wait_for_old_workers(state_dir(job.out))
        engine.run_id = claim_run(store)
        digest = state["plan_digest"]
        records, chunk_records = engine.resume_state(plan.units, digest)
        for uid, tasks in plan.units:  # groups whose chunks all finished on their nodes but never assembled
            if records[uid] is None and tasks[0].group and all(t.task_id in chunk_records for t in tasks):
                records[uid] = engine.assemble_step(uid, tasks, {}, None, [chunk_records[t.task_id] for t in tasks],
                                                    digest)
        missing = [uid for uid, rec in records.items() if rec is None]
        if missing:
            shown = ", ".join(missing[:20]) + (" ..." if len(missing) > 20 else "")
            raise IncompleteJobError(f"{len(missing)} of {len(plan.units)} task(s) are missing or damaged: {shown}")
        # every partition has ended (their records are whole): a killed merge's or assembly's temps go, as a
        # one-machine run's re-run removes them
        engine._clean_temps({uid for uid, _ in plan.units} | {t.task_id for _, tasks in plan.units for t in tasks},
                            every_node=True)
        manifest = engine.finalize(plan, [records[uid] for uid, _ in plan.units], started)
    engine._check_outcome(manifest, f"{store.url}/{MANIFEST_NAME}")
    return RunResult(manifest, 0, len(plan.units), time.time() - started)
