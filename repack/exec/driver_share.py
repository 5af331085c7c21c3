"""The driver's own node in a Ray job: its CPUs reserved from Ray and run by a local process pool.

A Ray worker costs ~0.9 CPU-s before its first task (``import ray``, its connection, the job's modules),
and Ray starts fresh ones for every job; a pool worker forked from the driver starts in milliseconds with
the job's modules already imported. So the CPUs Ray can give on the driver's node run the job's tasks in
a pool forked when the executor starts (before Ray's threads exist in the driver), held for the job as a
placement group on that node, so that Ray schedules nothing else there meanwhile; Ray workers run the
tasks on the other nodes. A head with no CPUs for tasks (``ray start --head --num-cpus 0``, as clusters are
often set up), a node whose CPUs other work holds, or ``--ray-driver-cpus 0`` leaves every task to Ray.
"""

from __future__ import annotations

from concurrent.futures import ProcessPoolExecutor

RESERVE_WAIT_S = 5  # how long the placement group may take to be granted before Ray runs every task


class DriverShare:
    """A process pool of up to ``cpus`` workers, forked now; ``reserve`` then sizes it to what Ray grants."""

    def __init__(self, cpus: int) -> None:
        from repack.exec.local import new_pool
        from repack.sources import scan_pool

        self.cpus = cpus
        self.size = cpus  # the pool's processes
        self.group = None  # the placement group holding those CPUs on the driver's node
        self.pool: ProcessPoolExecutor | None = new_pool(cpus)
        self.pool.submit(int)  # under fork every worker starts at the first submit: now, while one thread runs
        scan_pool.lend(self.pool)  # the driver's scan runs on it while Ray joins (no forkserver for it)

    def in_flight(self) -> int:
        """Calls the pool may hold at once: two per CPU (and two) when every worker may run, else one per CPU."""
        if not self.cpus or self.pool is None:
            return 0
        return 2 * self.cpus + 2 if self.cpus == self.size else self.cpus

    def settle(self) -> None:
        """Planning is over: the scan's loan ends; the pool closes if Ray granted no CPU (``reserve``)."""
        from repack.sources import scan_pool

        if not self.cpus:
            self.close()  # ends the loan too
        elif self.pool is not None:
            scan_pool.end_loan(self.pool)

    def reserve(self, ray) -> int:
        """Hold this node's free CPUs (at most the pool's) for the job: the CPUs the pool may use (0: none,
        the pool is closed)."""
        from ray.util.placement_group import placement_group, placement_group_table

        node = ray.get_runtime_context().get_node_id()
        wanted = min(self.size, int(_free_cpus(ray, node)))
        granted = 0  # the pool may be running calls meanwhile (``RayExecutor._run_shared``): ``cpus`` set once
        if wanted >= 1:
            self.group = placement_group([{"CPU": wanted}], strategy="STRICT_PACK", _soft_target_node_id=node)
            if self.group.wait(timeout_seconds=RESERVE_WAIT_S) and \
                    placement_group_table(self.group).get("bundles_to_node_id", {}).get(0) == node:
                granted = wanted
            else:
                self.release()  # granted elsewhere (or not at all): Ray runs every task
        self.cpus = granted
        return granted

    def restart(self) -> None:
        """A new pool after a worker died (the driver runs Ray's threads now: forkserver, ``_pool_context``)."""
        from repack.exec.local import new_pool

        self.close(failed=True)
        self.pool = new_pool(self.cpus)
        self.size = self.cpus

    def close(self, failed: bool = False) -> None:
        """Stop the pool (``failed``: kill its workers now, dropping what they run; else let them finish)."""
        from repack.sources import scan_pool

        pool, self.pool = self.pool, None
        if pool is None:
            return
        scan_pool.end_loan(pool)
        if failed:
            from repack.exec.local import kill_pool

            kill_pool(pool)
        else:
            pool.shutdown(wait=True)

    def release(self) -> None:
        """Give the CPUs back to Ray (~1 ms; a driver that leaves ends its job, which drops its groups too)."""
        group, self.group = self.group, None
        if group is not None:
            from ray.util.placement_group import remove_placement_group

            try:
                remove_placement_group(group)
            except Exception:  # noqa: BLE001 - Ray drops a job's groups when the driver leaves anyway
                pass


def _free_cpus(ray, node: str) -> float:
    """CPUs not in use on ``node`` (Ray's per-node view); its total where that view does not list it yet (a
    local instance just started: its first resource report may still be on the way)."""
    try:
        from ray._private.state import available_resources_per_node

        free = available_resources_per_node().get(node)
    except (ImportError, AttributeError):
        free = None
    if free is not None:
        return free.get("CPU", 0.0)
    for entry in ray.nodes():
        if entry.get("NodeID") == node:
            return entry.get("Resources", {}).get("CPU", 0.0)
    return 0.0
