"""Ray executor: every task (a whole output shard or part, or a chunk of one) is a Ray task, retried on failure.

Only JSON strings cross to the workers; the workers write their outputs and task records
into OUT (storage every node can reach: a shared filesystem, or an object store, each node then
packing into its own local scratch and uploading), exactly as the local pool does, so the output
is byte-identical whichever executor ran the job. The driver alone claims tasks (job lock, one
attempt per task at a time, run id): workers need nothing of the driver's disk. A task lost with
its worker or node is retried elsewhere up to ``retries`` times. Workers must be able to import
``repack`` (install it on every node, or pass a runtime_env through RAY_* settings).
"""

from __future__ import annotations

import json
import os
import socket
from typing import Iterator

from repack.errors import UsageError
from repack.exec.base import TaskFailure


def _import_ray():
    try:
        import ray
    except ImportError:
        raise UsageError("--executor ray needs Ray, which is not installed: pip install 'repack[ray]'") from None
    return ray


def _execute(job_name: str, spec_json: str, task_json: str, plan_digest: str, share_pieces: bool = False,
             place_segments: bool = False, run: str = "") -> str:
    from repack.jobs.engine import execute_task

    return execute_task(job_name, spec_json, task_json, plan_digest, share_pieces, place_segments, run)


class RayExecutor:
    """Runs tasks on a Ray cluster (``address``) or on a local Ray instance started for the job."""

    same_host = False  # workers may be on other hosts: chunks never share a file

    def __init__(self, workers: int | None = None, retries: int = 2, address: str | None = None, **_ignored) -> None:
        self.ray = _import_ray()
        self.workers = workers
        self.retries = retries
        self.address = address
        self._check_reachable()

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

    def run(self, calls: list[tuple[str, str, str, str, bool]], task_ids: list[str]) -> Iterator[dict | TaskFailure]:
        if not calls:
            return
        ray = self.ray
        started_here = self._init()
        try:
            remote = ray.remote(num_cpus=1, max_retries=self.retries, retry_exceptions=True)(_execute)
            pending = {remote.remote(*call): task_id for call, task_id in zip(calls, task_ids)}
            while pending:
                done, _ = ray.wait(list(pending), num_returns=1)
                for ref in done:
                    task_id = pending.pop(ref)
                    try:
                        yield json.loads(ray.get(ref))
                    except Exception as exc:  # noqa: BLE001 - RayTaskError wraps the task's exception
                        cause = getattr(exc, "cause", None) or exc
                        yield TaskFailure(task_id, f"{type(cause).__name__}: {cause}")
        finally:
            if started_here:
                ray.shutdown()
