"""Ray executor: one long-lived actor per node runs the node's share of the tasks (a whole output shard
or part, or a chunk of one) on a local process pool; a task lost with its node is re-run elsewhere.

Why actors per node and not a Ray task per task: Ray starts fresh worker processes for every job (a
worker serves one job), and each imports Ray and the job's modules before its first task, ~1.5 CPU-s
per worker, once per CPU of the cluster per job. A node's actor pays that once; its pool's workers
fork from a fork server that imported the job's modules once (``multiprocessing`` forkserver with
preload), as the local pool's workers fork from the driver. Each actor takes the CPUs its node has
free when the job starts (``num_cpus``, pinned to the node), and runs as many tasks at a time.

Only JSON strings cross to the workers; the workers write their outputs and task records into OUT
(storage every node can reach: a shared filesystem, or an object store, each node then packing into
its own local scratch and uploading), exactly as the local pool does, so the output is byte-identical
whichever executor ran the job. The driver alone claims tasks (job lock, one attempt per task at a
time, run id): workers need nothing of the driver's disk. The driver hands each actor one task per
free slot (never a queue of them), so a node lost mid-job holds only the tasks it was running: each
counts one attempt and goes to another node, up to ``retries`` times, then the job fails naming it.
A failed attempt (an exception, a pool worker killed: the actor then starts a new pool) counts one
too. Workers must be able to import ``repack`` (install it on every node, or pass a runtime_env
through RAY_* settings).

- Joining a running cluster, and starting the actors (their fork servers import the job's modules),
  happen on a thread from the executor's start, while the driver plans. A local instance for the
  job starts in ``run`` (Ray starts one from the main thread only).
- A chunk whose worker runs on the driver's host and sees OUT as the same folder (``host_token``)
  writes its samples straight into the shard's shared file, as pool workers do; on another host it
  writes a piece that the driver copies in. The record says which, so a job may mix both.
- A pool worker dies with its actor (``repack.exec.local``'s worker initializer: PR_SET_PDEATHSIG and
  a pidfd watch), and the actor with the driver that owns it (Ray ends a dead owner's actors). The
  driver ends its actors when the run ends.

A worker with a scratch folder of its own (OUT on an object store, another node) sweeps it of the
temp files of attempts lost on its node before each task, and drops its copies of a finished task's
outputs once they are in the store (``repack.jobs.scratch``).
"""

from __future__ import annotations

import atexit
import collections
import contextlib
import json
import os
import socket
import sys
import threading
import types
from typing import Iterator

from repack.errors import UsageError
from repack.exec.base import TaskFailure
from repack.exec.host import host_token, job_folder


def _import_ray():
    try:
        import ray
    except ImportError:
        raise UsageError("--executor ray needs Ray, which is not installed: pip install 'repack[ray]'") from None
    return ray


def _execute(job_name: str, spec_json: str, task_json: str, plan_digest: str, share_pieces: bool = False,
             driver_host: str = "", run: str = "") -> str:
    """One task, in a node pool's worker: ``execute_task`` on this node. ``driver_host``: the driver's
    ``host_token`` of the job's folder. A worker that shares that folder places chunk segments into the
    shard's shared file (OUT on local storage), as local pool workers do. One with a scratch of its own
    (object-store OUT, another node) first sweeps it of the temp files of attempts lost on this node,
    and once the task's outputs are in the store removes its local copies (``repack.jobs.scratch``)."""
    from repack.jobs.engine import execute_task, state_dir

    folder = job_folder(json.loads(spec_json)["out"])
    state_dir(folder).mkdir(parents=True, exist_ok=True)  # a node's own scratch, first task there: the workers lock's folder
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


def _job_modules(job_name: str | None) -> list[str]:
    """The modules a task of ``job_name`` runs: imported once by a node pool's fork server."""
    from repack.jobs import JOBS

    return ["repack.jobs.engine", __name__] + ([JOBS[job_name].partition(":")[0]] if job_name in JOBS else [])


def _start_worker(actor_pid: int) -> None:
    """A node pool's worker initializer: die with the actor (as a local pool's worker dies with its driver),
    and leave the fork server's imported modules out of this worker's garbage collections."""
    import gc

    from repack.exec.local import _die_with_parent

    _die_with_parent(actor_pid)
    gc.freeze()


@contextlib.contextmanager
def _main_module_hidden():
    """While a node pool's processes start: multiprocessing makes each child import its parent's
    ``__main__`` again, which in a Ray worker is Ray's own worker script (it imports Ray, the cost this
    pool exists to avoid). An empty ``__main__`` (no file, no spec) is imported by nobody."""
    main = sys.modules["__main__"]
    sys.modules["__main__"] = types.ModuleType("__main__")
    try:
        yield
    finally:
        sys.modules["__main__"] = main


class NodePool:
    """A Ray actor (threaded, one call per slot at a time): a process pool of ``slots`` workers forked
    from a fork server that imported the job's modules, each dying with this actor."""

    def __init__(self, slots: int, job_name: str | None) -> None:
        self.slots = slots
        self.job_name = job_name
        self._lock = threading.Lock()
        self._pool = self._start_pool()

    def _start_pool(self):
        import multiprocessing
        from concurrent.futures import ProcessPoolExecutor, wait

        context = multiprocessing.get_context("forkserver")  # this process runs Ray's threads: no plain fork
        context.set_forkserver_preload(_job_modules(self.job_name))
        pool = ProcessPoolExecutor(self.slots, mp_context=context, initializer=_start_worker, initargs=(os.getpid(),))
        with _main_module_hidden():  # a worker starts at a submit that finds none idle: all of them here
            wait([pool.submit(os.getpid) for _ in range(self.slots)])
        return pool

    def ready(self) -> int:
        """Its slots, once the pool is up."""
        return self.slots

    def run(self, *call) -> str:
        """``_execute(*call)`` on a worker of the pool; a pool broken by a killed worker is replaced
        (the calls it held fail: each counts one attempt on the driver)."""
        from concurrent.futures.process import BrokenProcessPool

        pool = self._pool
        try:
            return pool.submit(_execute, *call).result()
        except BrokenProcessPool:
            with self._lock:
                if self._pool is pool:
                    self._pool = self._start_pool()
            raise


class RayExecutor:
    """Runs tasks on a Ray cluster (``address``) or on a local Ray instance started for the job."""

    same_host = False  # workers may be on other hosts: each decides per task (``host_token``)

    def __init__(self, workers: int | None = None, retries: int = 2, address: str | None = None,
                 job: str | None = None, **_ignored) -> None:
        self.ray = _import_ray()
        self.workers = workers
        self.retries = retries
        self.address = address
        self.job = job
        self._check_reachable()
        self._started_here = False
        self._init_error: BaseException | None = None
        self._pools: dict = {}  # actor handle -> its slots
        self._joining: threading.Thread | None = None
        if self._joins_a_cluster():  # a local instance starts in run(): Ray starts one from the main thread only
            self._joining = threading.Thread(target=self._join, daemon=True, name="repack-ray-init")
            self._joining.start()  # overlaps the driver's planning
            atexit.register(self._joining.join)  # a job that ends before run(): never exit mid-ray.init

    def _check_reachable(self) -> None:
        """Fail fast on a host:port that does not answer (ray.init would retry for minutes)."""
        address = self.address or ""
        host, sep, port = address.rpartition(":")
        if not sep or "://" in address or not port.isdigit():
            return
        try:
            socket.create_connection((host, int(port)), timeout=5).close()
        except OSError as exc:
            raise UsageError(f"cannot reach the Ray cluster at {address}: {exc.strerror or exc}") from None

    def _joins_a_cluster(self) -> bool:
        return bool(self.address or os.environ.get("RAY_ADDRESS"))

    def _join(self) -> None:
        try:
            self._started_here = self._init()
            self._pools = self._start_pools()
        except BaseException as exc:  # noqa: BLE001 - raised by run(), in the driver's thread
            self._init_error = exc

    def _init(self) -> bool:
        ray = self.ray
        if ray.is_initialized():
            return False
        kwargs = dict(include_dashboard=False, log_to_driver=False, logging_level="ERROR",
                      configure_logging=True)
        try:
            if self.address:
                ray.init(address=self.address, **kwargs)
            elif os.environ.get("RAY_ADDRESS"):
                ray.init(**kwargs)
            else:  # "local": a new instance for the job, never another local cluster found on this machine
                ray.init(address="local", num_cpus=self.workers, **kwargs)
        except (ConnectionError, RuntimeError, ValueError) as exc:
            where = self.address or os.environ.get("RAY_ADDRESS") or "a local instance"
            raise UsageError(f"cannot start or reach Ray ({where}): {exc}") from None
        return True

    def _free_cpus(self) -> dict[str, int]:
        """{node id: whole CPUs free now} of the alive nodes with at least one (a node not yet in the view
        of free resources: its total)."""
        ray = self.ray
        alive = {n["NodeID"]: n.get("Resources", {}).get("CPU", 0) for n in ray.nodes() if n.get("Alive")}
        try:
            from ray._private.state import available_resources_per_node

            free = {node: res.get("CPU", 0) for node, res in available_resources_per_node().items()}
        except (ImportError, AttributeError):  # an older or newer Ray without it: the nodes' totals
            free = alive
        cpus = {node: int(free.get(node, total)) for node, total in alive.items()}
        return {node: n for node, n in cpus.items() if n >= 1}

    def _start_pools(self, exclude: frozenset = frozenset()) -> dict:
        """One NodePool actor per alive node with free CPUs (but ``exclude``), pinned to it, taking them all."""
        from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

        actor = self.ray.remote(NodePool)
        pools = {}
        for node, cpus in sorted(self._free_cpus().items()):
            if node in exclude:
                continue
            handle = actor.options(num_cpus=cpus, max_concurrency=cpus, max_restarts=0,
                                   scheduling_strategy=NodeAffinitySchedulingStrategy(node, soft=False)
                                   ).remote(cpus, self.job)
            pools[handle] = (node, cpus)
        return pools

    def _joined(self) -> None:
        """Wait for the thread that joins the cluster (or start the local instance); re-raise its error here."""
        if self._joining is None:
            self._join()
        else:
            self._joining.join()
        if self._init_error is not None:
            raise self._init_error

    def run(self, calls: list[tuple[str, str, str, str, bool, bool, str]],
            task_ids: list[str]) -> Iterator[dict | TaskFailure]:
        self._joined()
        if not calls:
            self._shutdown()
            return
        try:
            hosts: dict[str, str] = {}  # spec JSON -> the driver's host token of its job folder (one spec per job)
            payloads = []
            for job_name, spec_json, task_json, digest, share_pieces, _same_host, run in calls:
                if spec_json not in hosts:
                    hosts[spec_json] = host_token(job_folder(json.loads(spec_json)["out"]))
                payloads.append((job_name, spec_json, task_json, digest, share_pieces, hosts[spec_json], run))
            yield from self._dispatch(payloads, task_ids)
        finally:
            self._shutdown()

    def _dispatch(self, payloads: list[tuple], task_ids: list[str]) -> Iterator[dict | TaskFailure]:
        """Hand each pool, once it is up, one task per free slot, in plan order; collect results as they
        finish. A failed attempt (an error, a lost actor) goes back to the queue's front until it used up
        its retries; a lost actor gets no more tasks. Nothing waits in a queue at an actor, so one that
        cannot start (its node busy or gone) holds no task."""
        ray = self.ray
        from ray.exceptions import RayActorError

        queue = collections.deque(range(len(payloads)))
        attempts = [0] * len(payloads)
        free: dict = {}  # actor handle -> free slots, once it is up
        starting = {handle.ready.remote(): handle for handle in self._pools}
        lost_nodes: set[str] = set()
        last_loss = ""
        running: dict = {}  # object ref -> (task index, actor handle)
        while queue or running:
            for handle in free:
                while free[handle] and queue:
                    i = queue.popleft()
                    running[handle.run.remote(*payloads[i])] = (i, handle)
                    free[handle] -= 1
            if not running and not starting:  # every pool is gone: start new ones on the nodes left
                more = self._start_pools(frozenset(lost_nodes))
                if not more:
                    for i in queue:
                        yield TaskFailure(task_ids[i], f"no Ray node with a free CPU is left to run it{last_loss}")
                    return
                self._pools.update(more)
                starting.update({handle.ready.remote(): handle for handle in more})
                continue
            waiting = [*running, *starting]
            ready, rest = ray.wait(waiting, num_returns=1)
            if rest:  # and whatever else finished meanwhile
                ready += ray.wait(rest, num_returns=len(rest), timeout=0)[0]
            for ref in ready:
                if ref in starting:
                    handle = starting.pop(ref)
                    try:
                        free[handle] = ray.get(ref)
                    except Exception as exc:  # noqa: BLE001 - it could not start there
                        lost_nodes.add(self._pools[handle][0])
                        last_loss = f" (a node's pool did not start: {type(exc).__name__}: {exc})"
                    continue
                i, handle = running.pop(ref)
                try:
                    text = ray.get(ref)
                except Exception as exc:  # noqa: BLE001 - RayTaskError wraps the task's exception
                    if isinstance(exc, RayActorError):  # the actor (its node) is lost: no more tasks for it
                        lost_nodes.add(self._pools[handle][0])
                        free.pop(handle, None)
                    elif handle in free:
                        free[handle] += 1
                    attempts[i] += 1
                    if attempts[i] > self.retries:
                        cause = getattr(exc, "cause", None) or exc
                        yield TaskFailure(task_ids[i], f"{type(cause).__name__}: {cause}")
                    else:
                        queue.appendleft(i)
                    continue
                free[handle] += 1
                yield json.loads(text)

    def _shutdown(self) -> None:
        for handle in self._pools:  # their pool workers die with them
            try:
                self.ray.kill(handle)
            except Exception:  # noqa: BLE001 - already gone with its node
                pass
        self._pools = {}
        if self._started_here:
            self.ray.shutdown()
            self._started_here = False
