"""The job engine shared by every modality.

State lives under ``OUT/.repack/``::

  job.json           job name, spec, options fingerprint, plan digest (refuses changed options)
  plan.json          the planned tasks (read by `repack merge`)
  tasks/<id>.json    one record per finished task, written atomically after its outputs
  lock[-<part>]      flock held while a run (or partition) is alive

A run plans, skips tasks whose record and outputs check out, runs the rest on an executor,
and writes ``manifest.json`` last and atomically. kill -9 at any point, re-run, and the
result equals an uninterrupted run.

Tasks, chunks and outputs: a plan's *units* are its outputs in plan order (``Plan.units``). An
ungrouped task is a unit by itself. Tasks that share a ``group`` are *chunks* of one unit: each
writes a temporary piece and its own record; the driver feeds the records, in plan order and
as soon as the next one is there, to the group's assembly (``Job.open_assembly``) on a small
thread pool overlapping the executor; once the last is in, it writes the group's record
``tasks/<group>.json`` and only then removes the pieces (the chunk outputs the group's record
does not list). A resumed run trusts a group record whose outputs are intact, else each chunk
record whose piece is intact, and redoes the rest. Static partitions split the units (never a
group), so each node assembles its own.
"""

from __future__ import annotations

import fcntl
import hashlib
import importlib
import json
import os
import shutil
import sys
import time
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

from repack import __version__
from repack.config import EngineOptions
from repack.errors import IncompleteJobError, JobLockedError, RepackError, StrictModeError, UsageError
from repack.exec import TaskFailure, available_cpus, get_executor
from repack.jobs import JOBS
from repack.jobs.base import Job, Plan, Task
from repack.manifest import MANIFEST_NAME, atomic_write_bytes, atomic_write_json, dumps_canonical, write_manifest

STATE_DIR = ".repack"
ASSEMBLY_THREADS = 4  # driver threads that assemble groups (hashlib and file I/O release the GIL)


def load_job(name: str, spec_json: str) -> Job:
    """Instantiate the registered job ``name`` from its spec's JSON."""
    module_name, _, cls_name = JOBS[name].partition(":")
    cls = getattr(importlib.import_module(module_name), cls_name)
    return cls(cls.spec_type.from_json(spec_json))


def execute_task(job_name: str, spec_json: str, task_json: str, plan_digest: str) -> str:
    """Run one task anywhere (pool worker, Ray worker, static partition) and persist its record."""
    job = load_job(job_name, spec_json)
    task = Task.from_json(json.loads(task_json))
    return json.dumps(_run_and_record(job, task.task_id, lambda: job.run_task(task), plan_digest))


def _run_and_record(job: Job, unit_id: str, work, plan_digest: str) -> dict:
    """Run ``work()`` under the unit's lock and save the record it returns as tasks/<unit_id>.json."""
    started = time.perf_counter()
    with TaskLock(job.out, unit_id):
        record = work()
        record.update(task_id=unit_id, plan_digest=plan_digest, seconds=round(time.perf_counter() - started, 4))
        # Not fsynced: the outputs it vouches for are (a record lost to a power cut = the task is redone).
        atomic_write_json(state_dir(job.out) / "tasks" / f"{unit_id}.json", record, durable=False)
    return record


def state_dir(out: Path) -> Path:
    return Path(out) / STATE_DIR


@dataclass(frozen=True)
class RunResult:
    """What a run did: the manifest (None for a partition), and counts for the summary."""

    manifest: dict | None
    ran: int
    skipped: int
    seconds: float
    nothing_to_do: bool = False


def _flock(path: Path, mode: int, what: str, out: Path) -> int:
    """Open ``path`` and flock it without blocking; JobLockedError (naming the holder) if taken."""
    fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o644)
    try:
        fcntl.flock(fd, mode | fcntl.LOCK_NB)
    except BlockingIOError:
        holder = os.pread(fd, 64, 0).decode(errors="replace").strip() or "?"
        os.close(fd)
        raise JobLockedError(f"another repack process (pid {holder}) is already running {what} on {out}; "
                             "wait for it or stop it first") from None
    if mode == fcntl.LOCK_EX:
        os.ftruncate(fd, 0)
        os.pwrite(fd, str(os.getpid()).encode(), 0)
    return fd


class JobLock:
    """Refuses a second live run on OUT. A full run, --overwrite and merge hold OUT/.repack/lock
    exclusively; a static partition holds it shared plus lock-<part> exclusively, so partitions
    run side by side but never beside a full run, nor twice. Tasks are locked one by one too
    (``TaskLock``), so even overlapping partition schemes never write the same task."""

    def __init__(self, out: Path, part: str = "") -> None:
        self.out = out
        self.part = part
        self.fds: list[int] = []

    def __enter__(self) -> "JobLock":
        main = state_dir(self.out) / "lock"
        try:
            self.fds.append(_flock(main, fcntl.LOCK_SH if self.part else fcntl.LOCK_EX, "a job", self.out))
            if self.part:
                self.fds.append(_flock(state_dir(self.out) / f"lock-{self.part}", fcntl.LOCK_EX,
                                       f"partition {self.part}", self.out))
        except BaseException:
            self.__exit__()
            raise
        return self

    def __exit__(self, *exc) -> None:
        while self.fds:
            os.close(self.fds.pop())


class TaskLock:
    """Exclusive flock on OUT/.repack/tasks/<id>.lock while one process writes that task."""

    def __init__(self, out: Path, task_id: str) -> None:
        self.out = out
        self.path = state_dir(out) / "tasks" / f"{task_id}.lock"
        self.task_id = task_id
        self.fd: int | None = None

    def __enter__(self) -> "TaskLock":
        self.fd = _flock(self.path, fcntl.LOCK_EX, f"task {self.task_id}", self.out)
        return self

    def __exit__(self, *exc) -> None:
        if self.fd is not None:
            os.close(self.fd)


def prepare_out(out: Path) -> None:
    """Create OUT and its state folder, failing fast when it is not writable."""
    if out.exists() and not out.is_dir():
        raise UsageError(f"output {str(out)!r} exists and is not a folder")
    try:
        (state_dir(out) / "tasks").mkdir(parents=True, exist_ok=True)
        probe = state_dir(out) / f".write-probe-{os.getpid()}"
        probe.write_bytes(b"")
        probe.unlink()
    except OSError as exc:
        raise UsageError(f"output {str(out)!r} is not writable: {exc.strerror}") from None


def refuse_out_inside_source(source: str, out: Path) -> None:
    """OUT inside a source folder would be scanned as input (a class, a document folder)."""
    src = Path(source)
    if src.is_dir():
        src_real, out_real = src.resolve(), out.resolve()
        if out_real == src_real or src_real in out_real.parents:
            raise UsageError(f"output {str(out)!r} is inside the source folder {source!r}: choose an OUT outside it")


def options_fingerprint(job: Job) -> str:
    return hashlib.sha256(dumps_canonical({"job": job.name, "options": job.spec.options()})).hexdigest()


class Engine:
    """Runs one job: plan, resume, execute, finalize."""

    def __init__(self, job: Job, options: EngineOptions) -> None:
        self.job = job
        self.options = options
        self.out = job.out

    # -- state ---------------------------------------------------------------------------
    def _check_state(self, plan: Plan) -> None:
        job_file = state_dir(self.out) / "job.json"
        state = {"job": self.job.name, "spec": json.loads(self.job.spec.to_json()), "tool_version": __version__,
                 "options_sha256": options_fingerprint(self.job), "plan_digest": plan.digest,
                 "num_tasks": len(plan.tasks)}
        if job_file.exists():
            old = json.loads(job_file.read_text())
            if old.get("options_sha256") != state["options_sha256"]:
                raise UsageError(f"{self.out} holds a job run with other options ({old.get('job')}: "
                                 f"{json.dumps(old.get('spec'), sort_keys=True)}); use --overwrite to replace it")
            if old.get("plan_digest") != state["plan_digest"]:
                raise UsageError(f"the source changed since {self.out} was started (the planned tasks differ); "
                                 "use --overwrite to start over")
        else:
            atomic_write_bytes(state_dir(self.out) / "plan.json", plan.canonical)
            atomic_write_json(job_file, state)

    def _wipe(self) -> None:
        """--overwrite: remove what an earlier job wrote (files its records and manifest name)."""
        tasks_dir = state_dir(self.out) / "tasks"
        names: set[str] = set()
        for record_file in tasks_dir.glob("*.json") if tasks_dir.exists() else ():
            try:
                names.update(o["path"] for o in json.loads(record_file.read_text()).get("outputs", []))
            except (ValueError, KeyError, TypeError):
                continue
        for rel in names | {MANIFEST_NAME}:
            target = self.out / rel
            if target.resolve().is_relative_to(self.out.resolve()) and target.is_file():
                target.unlink()
        shutil.rmtree(state_dir(self.out), ignore_errors=True)

    def _clean_temps(self, task_ids: set[str]) -> None:
        """Remove temp files left by a killed run of these tasks (we hold their lock)."""
        for path in self.out.rglob(".*.tmp*"):
            if any(tid in path.name for tid in task_ids) and path.is_file():
                path.unlink(missing_ok=True)

    def load_record(self, task: Task, plan_digest: str) -> dict | None:
        """A finished task's (or group's) record, if it belongs to this plan and its outputs are intact."""
        path = state_dir(self.out) / "tasks" / f"{task.task_id}.json"
        try:
            record = json.loads(path.read_text())
        except (OSError, ValueError):
            return None
        if record.get("plan_digest") != plan_digest or not self.job.outputs_intact(record):
            return None
        return record

    def resume_state(self, units, plan_digest: str) -> tuple[dict, dict]:
        """(unit id -> its record or None, task id -> record of a finished chunk of an unfinished group)."""
        unit_records: dict[str, dict | None] = {}
        chunk_records: dict[str, dict] = {}
        for uid, tasks in units:
            grouped = bool(tasks[0].group)
            unit_records[uid] = self.load_record(Task(uid, {}) if grouped else tasks[0], plan_digest)
            if grouped and unit_records[uid] is None:
                for task in tasks:
                    record = self.load_record(task, plan_digest)
                    if record is not None:
                        chunk_records[task.task_id] = record
        return unit_records, chunk_records

    def assemble_step(self, group: str, tasks, chunk_records: dict, assemblies: dict, prev: Future | None,
                      batch: list[dict], plan_digest: str) -> dict | None:
        """Feed ``batch`` (the next chunk records of ``group`` in plan order) to its assembly, after the
        previous step ``prev``; once the last chunk is in, save the group's record, then drop the pieces."""
        if prev is not None:
            prev.result()  # the group's earlier step (re-raises its error)
        assembly = assemblies.get(group)
        if assembly is None:
            assembly = assemblies[group] = self.job.open_assembly(group)
        try:
            for record in batch:
                assembly.add(record)
            if batch[-1]["task_id"] != tasks[-1].task_id:
                return None
            chunk_seconds = round(sum(chunk_records[t.task_id].get("seconds", 0.0) for t in tasks), 4)
            record = _run_and_record(self.job, group, lambda: {**assembly.finish(), "chunk_seconds": chunk_seconds},
                                     plan_digest)
        except BaseException:
            assembly.abort()
            raise
        kept = {output["path"] for output in record.get("outputs", [])}
        for task in tasks:
            for output in chunk_records[task.task_id].get("outputs", []):
                if output["path"] not in kept:
                    (self.out / output["path"]).unlink(missing_ok=True)
        return record

    # -- run -----------------------------------------------------------------------------
    def run(self) -> RunResult:
        started = time.time()
        self.job.check()
        refuse_out_inside_source(self.job.spec.source, self.out)
        opts = self.options
        executor = get_executor(opts.executor, workers=opts.workers or available_cpus(), retries=opts.retries,
                                address=opts.ray_address)  # fails fast, e.g. Ray not installed
        if opts.overwrite and opts.num_nodes > 1:
            raise UsageError("--overwrite cannot be combined with --num-nodes; clear OUT once, then start the nodes")
        prepare_out(self.out)
        part = f"{opts.node_rank}-of-{opts.num_nodes}" if opts.num_nodes > 1 else ""
        with JobLock(self.out, part):
            if opts.overwrite:
                self._wipe()
                prepare_out(self.out)
            plan = self.job.plan()
            if not plan.tasks and not plan.quarantine:
                raise UsageError(f"source {self.job.spec.source!r} holds no inputs")
            self._check_state(plan)
            digest = plan.digest
            mine = [u for i, u in enumerate(plan.units) if i % opts.num_nodes == opts.node_rank]
            records, chunk_records = self.resume_state(mine, digest)
            todo = [t for uid, tasks in mine if records[uid] is None for t in tasks if t.task_id not in chunk_records]
            unfinished = [uid for uid, _ in mine if records[uid] is None]
            manifest_path = self.out / MANIFEST_NAME
            if not unfinished and opts.num_nodes == 1 and manifest_path.exists():
                manifest = json.loads(manifest_path.read_text())
                result = RunResult(manifest, 0, len(mine), time.time() - started, nothing_to_do=True)
                self._check_strict(manifest, manifest_path)
                return result
            if unfinished:
                manifest_path.unlink(missing_ok=True)
            self._clean_temps({t.task_id for t in todo} | set(unfinished))
            failures = self._execute(executor, mine, todo, digest, records, chunk_records)
            if failures:
                lines = "\n".join(f"  {f.task_id}: {f.error.strip().splitlines()[-1] if f.error.strip() else '?'}"
                                  for f in failures)
                raise IncompleteJobError(f"{len(failures)} task(s) failed; finished shards are kept and a "
                                         f"re-run resumes:\n{lines}")
            ran, skipped = len(unfinished), len(mine) - len(unfinished)
            if opts.num_nodes > 1:
                return RunResult(None, ran, skipped, time.time() - started)
            manifest = self.finalize(plan, [records[uid] for uid, _ in plan.units], started)
            result = RunResult(manifest, ran, skipped, time.time() - started)
        self._check_strict(manifest, manifest_path)
        return result

    def _check_strict(self, manifest: dict, manifest_path: Path) -> None:
        if self.options.strict and manifest["totals"].get("quarantined"):
            raise StrictModeError(f"--strict: {manifest['totals']['quarantined']} input(s) were quarantined "
                                  f"(see {manifest_path})")

    def _execute(self, executor, units, todo: list[Task], digest: str, records: dict,
                 chunk_records: dict) -> list[TaskFailure]:
        """Run ``todo`` on the executor; assemble each group of ``units`` as soon as its chunks are done.

        Fills ``records`` (unit id -> record); returns the failures."""
        from tqdm import tqdm

        tqdm.monitor_interval = 0  # no monitor thread: the local pool forks after this point
        opts = self.options
        spec_json = self.job.spec.to_json()
        calls = [(self.job.name, spec_json, json.dumps(t.to_json()), digest) for t in todo]
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
            batch = []
            while fed[uid] < len(tasks) and tasks[fed[uid]].task_id in chunk_records:
                batch.append(chunk_records[tasks[fed[uid]].task_id])
                fed[uid] += 1
            if not batch:
                return
            if assembler is None:
                assembler = ThreadPoolExecutor(min(ASSEMBLY_THREADS, len(group_tasks)),
                                               thread_name_prefix="repack-assemble")
            # Steps of one group run in order: each waits for the previous one, which was queued first.
            step = assembler.submit(self.assemble_step, uid, tasks, chunk_records, assemblies, last_step.get(uid),
                                    batch, digest)
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
                return
            chunk_records[task_id] = record
            feed(uid)

        bar = tqdm(total=sum(units_of.values()), unit=self.job.progress_unit, unit_scale=True, file=sys.stderr,
                   disable=opts.quiet or None, desc=f"repack {self.job.name}", dynamic_ncols=True)
        counts: dict[str, int] = {}
        started = time.perf_counter()
        resumed = list(group_tasks)  # chunks finished before an interruption: fed once the pool has forked
        try:
            with bar:
                for item in executor.run(calls, [t.task_id for t in todo]) if calls else ():
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
                    bar.update(units_of[item["task_id"]])
            while resumed:
                feed(resumed.pop())
            collect(block=True)
        finally:
            if assembler is not None:
                assembler.shutdown(wait=True)
            for uid, assembly in assemblies.items():  # groups left unfinished by a failed chunk
                if records.get(uid) is None:
                    assembly.abort()
        return failures

    def finalize(self, plan: Plan, records: list[dict], started: float) -> dict:
        """Build and atomically write the manifest from all task records."""
        body = self.job.finalize(plan, records)
        body.update(schema="repack.manifest", version=1, modality=self.job.name)
        body["created_by"] = {"tool": "repack", "version": __version__, "options": self.job.spec.options()}
        body["run"] = {"command": self.options.command, "executor": self.options.executor,
                       "workers": self.options.workers or available_cpus(),
                       "finished_unix": int(time.time()), "seconds": round(time.time() - started, 3),
                       "task_seconds": round(sum(r.get("seconds", 0.0) + r.get("chunk_seconds", 0.0)
                                                 for r in records), 3),
                       **body.pop("run_stats", {})}
        write_manifest(self.out, body)
        return body


def merge(out: Path, options: EngineOptions) -> RunResult:
    """`repack merge`: check every planned task finished (all partitions) and write the manifest."""
    started = time.time()
    job_file = state_dir(out) / "job.json"
    if not job_file.exists():
        raise UsageError(f"{out} holds no repack job state (.repack/job.json)")
    state = json.loads(job_file.read_text())
    job = load_job(state["job"], json.dumps(state["spec"]))
    plan = Plan.from_json(json.loads((state_dir(out) / "plan.json").read_text()))
    if plan.digest != state["plan_digest"]:
        raise RepackError(f"{out}: plan.json does not match job.json (plan digest differs)")
    engine = Engine(job, options)
    with JobLock(out):
        digest = state["plan_digest"]
        records, chunk_records = engine.resume_state(plan.units, digest)
        for uid, tasks in plan.units:  # groups whose chunks all finished on their nodes but never assembled
            if records[uid] is None and tasks[0].group and all(t.task_id in chunk_records for t in tasks):
                records[uid] = engine.assemble_step(uid, tasks, chunk_records, {}, None,
                                                    [chunk_records[t.task_id] for t in tasks], digest)
        missing = [uid for uid, rec in records.items() if rec is None]
        if missing:
            shown = ", ".join(missing[:20]) + (" ..." if len(missing) > 20 else "")
            raise IncompleteJobError(f"{len(missing)} of {len(plan.units)} task(s) are missing or damaged: {shown}")
        manifest = engine.finalize(plan, [records[uid] for uid, _ in plan.units], started)
    return RunResult(manifest, 0, len(plan.units), time.time() - started)
