"""Ray executor: every task (a whole output shard or part, or a chunk of one) is a Ray task, retried on failure.

Only JSON strings cross to the workers; the workers write their outputs and task records
into OUT (storage every node can reach: a shared filesystem, or an object store, each node then
packing into its own local scratch and uploading), exactly as the local pool does, so the output
is byte-identical whichever executor ran the job. The driver alone claims tasks (job lock, one
attempt per task at a time, run id): workers need nothing of the driver's disk. A task lost with
its worker or node is retried elsewhere up to ``retries`` times. Workers must be able to import
``repack`` (install it on every node, or pass a runtime_env through RAY_* settings).

What keeps Ray's cost near the local pool's (``tests/benchmarks/bench_executors.py``):

- The driver's own node runs tasks in a local process pool on the CPUs Ray has free there, held for the
  job as a placement group (``repack.exec.driver_share``; ``--ray-driver-cpus``): a fresh Ray worker costs
  ~0.9 CPU-s before its first task, a forked pool worker milliseconds. Ray's workers run the tasks on the
  other nodes; both take the calls in order as each has room (``_run_shared``). A head without CPUs for
  tasks, or ``--ray-driver-cpus 0``, leaves every task to Ray (``_run_on_ray``).
- Joining a running cluster (``import ray`` included: 0.25 s on 2 cores, 0.8-1.5 s on the device
  machine's 16) happens on a thread from the executor's start, while a forked child plans; so does a
  warm-up task per worker that imports the job's modules (a fresh Ray worker imports them at its first
  task otherwise, where a pool worker forks with them already imported). Where the cluster's raylet on
  the driver's host offers CPUs (``repack.exec.ray_node``: its command line, read before Ray answers),
  the driver's pool does not wait for it: it starts on the plan's first calls with as many CPUs, and
  once Ray answers it keeps the CPUs Ray grants on that node (none: it takes no more calls, those it
  runs finish) while Ray's workers take calls too. A head started with ``--num-cpus 0`` runs no task.
  A local instance for the job starts in ``run`` (Ray starts one from the main thread only), before
  any call.
- A chunk whose worker runs on the driver's host and sees OUT as the same folder (``host_token``)
  writes its samples straight into the shard's shared file, as pool workers do; on another host it
  writes a piece that the driver copies in. The record says which, so a job may mix both.

A worker with a scratch folder of its own (OUT on an object store, another node) sweeps it of the
temp files of attempts lost on its node before each task, and drops its copies of a finished task's
outputs once they are in the store (``repack.jobs.scratch``).
- Results are collected as they finish, every ready one per ``ray.wait``, over a list that only
  shrinks (no O(tasks) rebuild per result).
- Many small tasks go to Ray in batches (``batch_size``): a Ray task runs a few consecutive calls and
  returns their records as a list of strings. Ray costs a few milliseconds per task on the worker, the
  raylet and the driver, which at ~10 ms of work per task (a chunk of 128 tiny files; 1M files make
  ~7,800) was as much as the work. Every Ray task is still small enough that each worker gets several
  (the last ones balance the tail). A call that raises is reported by name and retried as a Ray task
  of its own (``retries`` - 1 more times there, anywhere in the cluster); a batch lost with its worker
  or node is retried whole by Ray (its calls' outputs are idempotent), and after ``retries`` every
  call in it fails by name, as the local pool counts an attempt for every task in flight when its
  pool breaks.
"""

from __future__ import annotations

import atexit
import collections
import json
import queue
import os
import threading
import time
from typing import Iterator

from repack.errors import UsageError
from repack.exec.base import TaskFailure
from repack.exec.cpus import available_cpus
from repack.exec.host import host_token, job_folder
from repack.exec.ray_check import INSTALL_HINT


def _import_ray():
    try:
        import ray
    except ImportError as exc:
        raise UsageError(f"{INSTALL_HINT} ({exc})") from None
    return ray


def _execute(job_name: str, spec_json: str, task_json: str, plan_digest: str, share_pieces: bool = False,
             driver_host: str = "", run: str = "") -> str:
    """A Ray task: ``execute_task`` on this node. ``driver_host``: the driver's ``host_token`` of the job's
    folder. A worker that shares that folder places chunk segments into the shard's shared file (OUT
    on local storage), as pool workers do. One with a scratch of its own (object-store OUT, another
    node) first sweeps it of the temp files of attempts lost on this node, and once the task's
    outputs are in the store removes its local copies (``repack.jobs.scratch``)."""
    from repack.exec.cpus import set_worker_cpus
    from repack.jobs.engine import execute_task

    set_worker_cpus(1)  # a Ray task holds one CPU (num_cpus=1): a tokenizer runs one thread in it
    folder = job_folder(json.loads(spec_json)["out"])
    shares_folder = bool(driver_host) and driver_host == host_token(folder)
    own_scratch = share_pieces and not shares_folder
    if own_scratch:
        from repack.jobs.scratch import sweep_stale_temps

        sweep_stale_temps(folder)
    text = execute_task(job_name, spec_json, task_json, plan_digest, share_pieces,
                        shares_folder and not share_pieces, run)
    if own_scratch:  # its outputs are in the store: the node's disk keeps nothing of a finished task
        from repack.jobs.scratch import drop_published

        drop_published(folder, json.loads(text))
    return text


def _execute_batch(job_name: str, spec_json: str, task_jsons: list, plan_digest: str, share_pieces: bool,
                   driver_host: str, run: str) -> list[str]:
    """A Ray task: ``_execute`` for each of ``task_jsons`` in turn; per call, "R" + its record's text or "F" +
    its error (a failed call is a value: the driver retries it as a Ray task of its own)."""
    _warm_up(job_name)
    results = []
    for task_json in task_jsons:
        try:
            results.append("R" + _execute(job_name, spec_json, task_json, plan_digest, share_pieces, driver_host, run))
        except Exception as exc:  # noqa: BLE001 - reported by name, retried by the driver
            results.append(f"F{type(exc).__name__}: {exc}")
    return results


BATCH_MAX = 32  # calls per Ray task at most
BATCHES_PER_CPU = 8  # Ray tasks per CPU at least, where the calls allow: the last ones balance the tail


def batch_size(calls: int, cpus: int) -> int:
    """Calls per Ray task: one while there are fewer than ``BATCHES_PER_CPU`` calls per CPU (a task per call,
    as before), up to ``BATCH_MAX`` for many small ones."""
    return max(1, min(BATCH_MAX, calls // (max(1, cpus) * BATCHES_PER_CPU)))


def _warm_up(job_name: str) -> None:
    """Import what a task of ``job_name`` runs (a no-op once imported)."""
    import importlib

    from repack.jobs import JOBS
    import repack.jobs.engine  # noqa: F401

    importlib.import_module(JOBS[job_name].partition(":")[0])


JOINED = "joined"  # the joining thread's last word on the executor's queue of events


def _same_job(calls: list, task_ids: list) -> Iterator[tuple[tuple, list]]:
    """Runs of consecutive calls that differ in their task only: (job name, spec, digest, share_pieces, run) and
    [(task JSON, task id)] of each run (one run for every call of a job)."""
    key, group = None, []
    for (job_name, spec_json, task_json, digest, share_pieces, _same_host, run), task_id in zip(calls, task_ids):
        this = (job_name, spec_json, digest, share_pieces, run)
        if this != key and group:
            yield key, group
            group = []
        key = this
        group.append((task_json, task_id))
    if group:
        yield key, group


def _messages_to_stderr() -> None:
    """Ray's driver prints the cluster's messages ("(raylet) A worker died or was killed", a task's retries) on
    stdout, from a thread; they are diagnostics: on stderr, stdout holds only what repack prints (``--json``:
    one JSON document). Left as Ray has it where its printer is not where this Ray version keeps it."""
    import ray._private.worker as ray_worker

    printer = getattr(ray_worker, "print_to_stdstream", None)
    if printer is None or getattr(printer, "repack_stderr", False):
        return

    def to_stderr(data, *args, **kwargs):
        return printer({**data, "is_err": True}, *args, **kwargs)

    to_stderr.repack_stderr = True
    ray_worker.print_to_stdstream = to_stderr


CAPACITY_CHECK_S = 5.0  # how often the driver's pool+Ray run checks the cluster's CPUs (one call to its control store)


class RayExecutor:
    """Runs tasks on a Ray cluster (``address``) or on a local Ray instance started for the job."""

    same_host = False  # workers may be on other hosts: each decides per task (``host_token``)

    def __init__(self, workers: int | None = None, retries: int = 2, address: str | None = None,
                 job: str | None = None, driver_cpus: int | None = None, **_ignored) -> None:
        # Ray installed and the address answering: checked by the engine before it planned (``check_ray``)
        self.workers = workers
        self.retries = retries
        self.address = address
        self.job = job
        self._share = None  # the driver's node run by a local pool (``repack.exec.driver_share``)
        self._early = False  # the pool may start before Ray answers (``run``)
        if driver_cpus != 0:
            from repack.exec.driver_share import DriverShare
            from repack.exec.ray_node import local_node_cpus

            # forked first, while the driver runs one thread (Ray starts threads in it)
            self._share = DriverShare(min(workers or available_cpus(), available_cpus(), driver_cpus or 1 << 30))
            offered = local_node_cpus(address) if self._joins_a_cluster() else 0
            if offered:
                self._share.cpus = min(self._share.size, offered)  # until Ray grants them (``reserve``)
                self._early = True
        self._started_here = False
        self.tasks_ran = {"driver_pool": 0, "ray": 0}  # calls that ran to a record, by where they ran
        self.ray = None  # the module: imported below, or by the joining thread where the pool starts early
        self._init_error: BaseException | None = None
        self._local_started = False  # ``_joined`` started the local instance (once)
        self._warm: list = []
        self._batch = None  # the Ray remote function of a batch (its warm-up tasks included)
        self._joining: threading.Thread | None = None
        self._events: queue.SimpleQueue = queue.SimpleQueue()  # finished futures, and JOINED (``_run_shared``)
        if not self._early:
            try:  # on this thread, as the job waits for Ray anyway (a Ray that fails to import: before any work);
                # on the joining thread beside a planning driver, both took ~0.6 s longer on the device machine's
                # 16 cores (the GIL handed back and forth); the engine plans in a forked child where it can
                self.ray = _import_ray()
            except BaseException:
                self._end(failed=True)
                raise
        if self._joins_a_cluster():  # a local instance starts in run(): Ray starts one from the main thread only
            # (``import ray`` too where the pool starts without waiting for Ray: ``_run_shared``)
            self._joining = threading.Thread(target=self._join, daemon=True, name="repack-ray-init")
            self._joining.start()
            atexit.register(self._joining.join)  # a job that ends before run(): never exit mid-ray.init

    def _joins_a_cluster(self) -> bool:
        """A running cluster (an address, or RAY_ADDRESS), not a local instance started for the job ("local")."""
        return (self.address or os.environ.get("RAY_ADDRESS") or "local") != "local"

    def _join(self) -> None:
        try:
            self.ray = self.ray or _import_ray()
            self._started_here = self._init()
            # Ray retries a batch lost with its worker or node. Warm-ups are batches of no call: one remote
            # function (one scheduling class) for them and the batches, so a worker's lease and the function's
            # definition pass from its warm-up to its first batch
            self._batch = self.ray.remote(num_cpus=1, max_retries=self.retries)(_execute_batch)
            warm = self.workers or 1
            if self._share is not None:
                local = self._reserve()
                warm = min(warm, int(self.ray.cluster_resources().get("CPU", 0)) - local)
            if self.job:
                self._warm = [self._batch.remote(self.job, "", [], "", False, "", "") for _ in range(max(0, warm))]
        except BaseException as exc:  # noqa: BLE001 - raised by run(), in the driver's thread
            self._init_error = exc
        finally:
            self._events.put(JOINED)  # wakes a ``_run_shared`` already running on the driver's pool alone

    def _init(self) -> bool:
        ray = self.ray
        if ray.is_initialized():
            return False
        kwargs = dict(include_dashboard=False, log_to_driver=False, logging_level="ERROR",
                      configure_logging=True)
        try:
            if not self._joins_a_cluster():  # a new instance for the job, never another local cluster found here
                ray.init(address="local", num_cpus=self.workers, **kwargs)
            elif self.address:
                ray.init(address=self.address, **kwargs)
            else:
                ray.init(**kwargs)
        except (ConnectionError, RuntimeError, ValueError) as exc:
            where = self.address or os.environ.get("RAY_ADDRESS") or "a local instance"
            raise UsageError(f"cannot start or reach Ray ({where}): {exc}") from None
        _messages_to_stderr()
        return True

    def _joined(self) -> None:
        """Wait for the thread that joins the cluster (or start the local instance, once); re-raise its error here."""
        if self._joining is None:
            if not self._local_started:
                self._local_started = True
                self._join()
        else:
            self._joining.join()
        if self._init_error is not None:
            raise self._init_error

    def _joining_now(self) -> bool:
        """Whether the thread that joins the cluster is still at it."""
        return self._joining is not None and self._joining.is_alive()

    def _reserve(self) -> int:
        """The driver node's CPUs that its local pool runs tasks on (0: none, every task is a Ray task)."""
        try:
            return self._share.reserve(self.ray)
        except Exception:  # noqa: BLE001 - Ray cannot hold them (an older head): its workers run every task
            self._share.release()
            self._share.cpus = 0  # the pool takes no more calls
            return 0

    def run(self, calls: list[tuple[str, str, str, str, bool, bool, str]],
            task_ids: list[str]) -> Iterator[dict | TaskFailure]:
        ended = False
        try:
            if not self._early:
                self._joined()  # a local instance starts here, before any call; no pool: Ray runs every call
            if self._share is not None:
                self._share.settle()  # planning is over; a pool Ray granted no CPU closes
            if calls and self._share is not None and (self._share.cpus or self._joining_now()):
                yield from self._run_shared(calls, task_ids)  # joins the cluster on the way
            elif calls:
                self._joined()
                if self._share is not None:
                    self._share.settle()  # Ray granted no CPU since the first look
                yield from self._run_on_ray(calls, task_ids)
            ended = True
        finally:
            self._end(failed=not ended)

    def close(self) -> None:
        """Release what the executor holds if ``run`` never ran to its end (the engine calls it last)."""
        self._end(failed=False)

    def _end(self, failed: bool) -> None:
        """Stop the driver's pool (``failed``: its workers killed), give its CPUs back; stop a local instance
        started for the job. ``failed`` (interrupted, or an error): also leave a joined cluster now, which
        ends the job's Ray tasks before the engine removes their temp files (as before the driver's pool). A
        joined cluster that the job finished is left as the process exits (``run_job``: without
        ``ray.shutdown``, ~0.3 s), or by Ray's own exit hook; another job in this process reuses the
        connection. Idempotent."""
        if self._joining_now():  # the pool ran every call before Ray answered: Ray is left once it has (never
            self._joining.join()  # mid-import or mid-ray.init), as a job that waited for it would have
        try:
            if self._share is not None:
                self._share.close(failed=failed)
        finally:
            if self._share is not None:
                self._share.release()
            if self._started_here and (failed or not self._joins_a_cluster()):
                self._shutdown()

    def _run_shared(self, calls: list[tuple], task_ids: list[str]) -> Iterator[dict | TaskFailure]:
        """The driver's pool and Ray's workers take the calls in order as each has room (``2 x CPUs`` in flight:
        the pool's in pairs when there are many, Ray's in batches); results as they finish. A call that fails is
        charged an attempt and queued again for whichever side is free; past ``retries`` it fails by name. A
        Ray batch that Ray could not finish (its node lost ``retries`` times) fails every call in it by name;
        a pool whose worker died is replaced, the calls its workers may have run charged an attempt."""
        from concurrent.futures.process import BrokenProcessPool

        from repack.exec.local import FAILED, PAIR_FROM, call_outcomes, submit_calls

        share = self._share
        joining = self._early and self._joining_now()  # the pool starts alone; Ray's workers join once Ray answers

        def ray_cpus() -> int:  # the CPUs of the cluster's live nodes that Ray's workers may take
            return max(0, int(self.ray.cluster_resources().get("CPU", 0)) - share.cpus)

        def shapes() -> tuple[int, int]:  # calls per Ray batch, per pool submission
            return (batch_size(len(calls), share.cpus + others),
                    2 if len(calls) >= PAIR_FROM * (share.cpus + others) else 1)

        if joining:
            others = 0
        else:
            self._joined()
            others = ray_cpus()
        checked = time.monotonic()
        size, pair = shapes()
        host = host_token(job_folder(json.loads(calls[0][1])["out"]))
        todo = collections.deque(range(len(calls)))
        attempts = [0] * len(calls)
        finished = self._events
        in_pool: dict = {}  # future -> (submission number, indices)
        on_ray: dict = {}  # future of a Ray batch -> (its object ref, indices)
        submitted = 0

        def local_call(i: int) -> tuple:  # the pool shares the driver's folder: chunks write into the shard
            job_name, spec_json, task_json, digest, share_pieces, _, run = calls[i]
            return job_name, spec_json, task_json, digest, share_pieces, not share_pieces, run

        broken = False  # the pool broke (a worker died): nothing more goes to it until it is replaced

        def fill() -> None:
            nonlocal submitted, broken
            if broken and not in_pool and share.cpus:  # no future of the broken pool is left to report it: replace it
                share.restart()
                broken = False
            while todo and not broken and len(in_pool) < share.in_flight():
                indices = [todo.popleft() for _ in range(min(pair, len(todo)))]
                try:
                    future = submit_calls(share.pool, [local_call(i) for i in indices])
                except BrokenProcessPool:  # a worker died before its futures were failed: they will come
                    todo.extendleft(reversed(indices))
                    broken = True
                    if not in_pool:
                        share.restart()
                        broken = False
                    continue
                in_pool[future] = (submitted, indices)
                submitted += 1
                future.add_done_callback(finished.put)
            while todo and len(on_ray) < 2 * others:
                indices = [todo.popleft() for _ in range(min(size, len(todo)))]
                for (job_name, spec_json, digest, share_pieces, run), group in _same_job(
                        [calls[i] for i in indices], indices):
                    ref = self._batch.remote(job_name, spec_json, [calls[i][2] for _, i in group], digest,
                                             share_pieces, host, run)
                    future = ref.future()
                    on_ray[future] = (ref, [i for _, i in group])  # the ref kept: Ray keeps its result for it
                    future.add_done_callback(finished.put)

        def failed(i: int, error: str) -> TaskFailure | None:
            """One failed attempt of call ``i``: queued again, or its TaskFailure once past the retries."""
            attempts[i] += 1
            if attempts[i] <= self.retries:
                todo.appendleft(i)
                return None
            return TaskFailure(task_ids[i], error)

        fill()
        while todo or in_pool or on_ray:
            if not in_pool and not on_ray and not joining:  # never expected: fill() always has a side that takes
                raise RuntimeError(f"{len(todo)} task(s) left that neither the driver's pool nor Ray took")  # calls
            if not joining and time.monotonic() >= checked + CAPACITY_CHECK_S:  # nodes lost (or added): as many
                others, checked = ray_cpus(), time.monotonic()  # batches in flight as CPUs are left
                if not others and on_ray:  # no CPU left for a batch: none can be scheduled, ever (Ray keeps them
                    for future, (ref, indices) in list(on_ray.items()):  # queued); the driver's pool takes their
                        if not future.done():  # calls (a batch that finished meanwhile is taken as it came)
                            self.ray.cancel(ref)
                            todo.extendleft(reversed(indices))
                            del on_ray[future]  # its future still arrives (cancelled): ignored
                fill()
                if not in_pool and not on_ray:
                    continue
            try:
                future = finished.get(timeout=CAPACITY_CHECK_S)
            except queue.Empty:
                continue
            if future is JOINED:
                if joining:  # Ray answered (or failed: raised here): the pool keeps what Ray granted on this node
                    joining = False
                    self._joined()  # (a pool granted no CPU takes no more calls; it closes once its calls are in)
                    others, checked = ray_cpus(), time.monotonic()
                    size, pair = shapes()
            elif future in on_ray:
                _, indices = on_ray.pop(future)
                try:
                    outcomes = future.result()
                except Exception as exc:  # noqa: BLE001 - RayTaskError wraps the task's exception
                    cause = getattr(exc, "cause", None) or exc
                    for i in indices:
                        yield TaskFailure(task_ids[i], f"{type(cause).__name__}: {cause}")
                    outcomes = []
                for i, outcome in zip(indices, outcomes):
                    if outcome[0] == "R":
                        self.tasks_ran["ray"] += 1
                        yield json.loads(outcome[1:])
                    elif (failure := failed(i, outcome[1:])) is not None:
                        yield failure
            elif future in in_pool:
                seq, indices = in_pool.pop(future)
                try:
                    records = call_outcomes(future, len(indices))
                except BrokenProcessPool as exc:  # the oldest in flight may have run: charged; the rest not
                    lost = sorted([(seq, indices)] + list(in_pool.values()))
                    in_pool.clear()  # their futures still arrive (broken too): ignored
                    for rank, (_, lost_indices) in reversed(list(enumerate(lost))):
                        for i in reversed(lost_indices):
                            if rank > share.cpus:
                                todo.appendleft(i)
                            elif (failure := failed(i, f"{type(exc).__name__}: {exc}")) is not None:
                                yield failure
                    if share.cpus:
                        share.restart()
                    else:
                        share.close(failed=True)
                    broken = False
                    records = []
                for i, record in zip(indices, records):
                    if FAILED not in record:
                        self.tasks_ran["driver_pool"] += 1
                        yield record
                    elif (failure := failed(i, record[FAILED])) is not None:
                        yield failure
            if not share.cpus and not in_pool and share.pool is not None:
                share.close()  # Ray granted this node no CPU, and the calls the pool began before are in
            fill()

    def _run_on_ray(self, calls: list[tuple], task_ids: list[str]) -> Iterator[dict | TaskFailure]:
        """Every call a Ray task (in batches of consecutive calls); results as they finish."""
        ray = self.ray
        # a call that raised is retried as a Ray task of its own (anywhere in the cluster, as before batches),
        # its exceptions included
        remote = self._batch
        alone = ray.remote(num_cpus=1, max_retries=max(0, self.retries - 1), retry_exceptions=True)(_execute)
        hosts: dict[str, str] = {}  # spec JSON -> the driver's host token of its job folder (one spec per job)
        size = batch_size(len(calls), max(self.workers or 1, int(ray.cluster_resources().get("CPU", 0))))
        batch_ids: dict = {}  # Ray task -> the task ids of its calls, in order
        retried: set = set()  # Ray tasks of one call retried alone (they return the record's text)
        args_of: dict = {}  # Ray task -> (job name, spec, digest, share_pieces, driver host, run) of its calls
        for first in range(0, len(calls), size):
            for (job_name, spec_json, digest, share_pieces, run), group in _same_job(calls[first:first + size],
                                                                                    task_ids[first:first + size]):
                if spec_json not in hosts:
                    hosts[spec_json] = host_token(job_folder(json.loads(spec_json)["out"]))
                tasks = [task_json for task_json, _ in group]
                ref = remote.remote(job_name, spec_json, tasks, digest, share_pieces, hosts[spec_json], run)
                batch_ids[ref] = [task_id for _, task_id in group]
                args_of[ref] = (job_name, spec_json, tasks, digest, share_pieces, hosts[spec_json], run)
        pending = list(batch_ids)
        while pending:
            ready, pending = ray.wait(pending, num_returns=1)
            if pending:  # and whatever else finished meanwhile
                more, pending = ray.wait(pending, num_returns=len(pending), timeout=0)
                ready += more
            for ref in ready:
                ids = batch_ids.pop(ref)
                job_name, spec_json, tasks, digest, share_pieces, host, run = args_of.pop(ref)
                alone_call = ref in retried
                retried.discard(ref)
                try:
                    results = ray.get(ref)
                except Exception as exc:  # noqa: BLE001 - RayTaskError wraps the task's exception
                    cause = getattr(exc, "cause", None) or exc
                    for task_id in ids:
                        yield TaskFailure(task_id, f"{type(cause).__name__}: {cause}")
                    continue
                if alone_call:
                    self.tasks_ran["ray"] += 1
                    yield json.loads(results)
                    continue
                for task_id, task_json, result in zip(ids, tasks, results):
                    if result[0] == "R":
                        self.tasks_ran["ray"] += 1
                        yield json.loads(result[1:])
                    elif self.retries:
                        again = alone.remote(job_name, spec_json, task_json, digest, share_pieces, host, run)
                        batch_ids[again] = [task_id]
                        retried.add(again)
                        args_of[again] = (job_name, spec_json, [task_json], digest, share_pieces, host, run)
                        pending.append(again)
                    else:
                        yield TaskFailure(task_id, result[1:])

    def _shutdown(self) -> None:
        """Stop the local instance started for the job. In place, not on a thread: an object ref the driver
        frees while Ray's core worker shuts down ends the process (exit 1)."""
        if self._started_here:
            self.ray.shutdown()
            self._started_here = False
