"""A job's plan made in a forked child while the driver does something else: under ``--executor ray`` the
driver imports Ray (0.8 s on the device machine's 16 cores, all of it on the driver's one thread) while
the child scans SOURCE and cuts the plan (1.1 s for 1M tiny files), where the two followed each other.

The child sends the plan as its JSON (``Plan.to_json``, the form ``save_plan`` writes) over a pipe; the
driver builds the same ``Plan`` from it. Nothing else of the child's comes back: planning only reads
SOURCE and returns the plan (``build_plan``). Only where a fork is safe (``repack.exec.forked.can_fork``:
an object store's lock heartbeat is a thread); there, and for a child that fails, the driver plans
itself (and raises what the child met).
"""

from __future__ import annotations

import json
import os

from repack.exec.forked import FAILED, can_fork, start_child, stop_child
from repack.jobs.base import Plan, build_plan


class PlanAhead:
    """``build_plan(job)`` started in a forked child now; ``plan()`` waits for it. A context manager: the
    child is stopped on leaving when it was not waited for."""

    def __init__(self, job) -> None:
        self._job = job
        self._pid, self._read_end = 0, -1
        if can_fork():
            self._pid, self._read_end = start_child(lambda: [_plan_json(job)], FAILED)

    def plan(self) -> Plan:
        """The child's plan, or one made here when there is no child or it failed."""
        raw = b""
        if self._pid:
            with os.fdopen(self._read_end, "rb") as pipe:
                raw = pipe.read()
            os.waitpid(self._pid, 0)
            self._pid = 0
        if raw and raw != FAILED:
            try:
                return Plan.from_json(json.loads(raw))
            except (ValueError, KeyError, TypeError):
                pass
        return build_plan(self._job)

    def close(self) -> None:
        """Stop the child when it was not waited for."""
        if self._pid:
            stop_child(self._pid, self._read_end)
            self._pid = 0

    def __enter__(self) -> "PlanAhead":
        return self

    def __exit__(self, *exc) -> None:
        self.close()


def _plan_json(job) -> bytes:
    return json.dumps(build_plan(job).to_json(), separators=(",", ":")).encode()
