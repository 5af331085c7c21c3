"""The Job protocol that every modality implements, and the Plan it produces."""

from __future__ import annotations

import hashlib
from dataclasses import dataclass, field
from functools import cached_property
from pathlib import Path
from typing import ClassVar

from repack.config import JobSpec
from repack.manifest import dumps_canonical
from repack.store import open_store


@dataclass(frozen=True)
class Task:
    """One unit of work = one output shard (or part). ``payload`` is JSON-able."""

    task_id: str
    payload: dict

    def to_json(self) -> dict:
        return {"task_id": self.task_id, "payload": self.payload}

    @classmethod
    def from_json(cls, data: dict) -> "Task":
        return cls(data["task_id"], data["payload"])


@dataclass(frozen=True)
class Plan:
    """The deterministic cut of a job into tasks, plus inputs set aside while planning."""

    tasks: tuple[Task, ...]
    quarantine: tuple[dict, ...] = ()
    info: dict = field(default_factory=dict)

    @cached_property
    def digest(self) -> str:
        """sha256 of the canonical plan: equal plans, equal outputs (computed once)."""
        return hashlib.sha256(dumps_canonical(self.to_json())).hexdigest()

    def to_json(self) -> dict:
        return {"tasks": [t.to_json() for t in self.tasks], "quarantine": list(self.quarantine), "info": self.info}

    @classmethod
    def from_json(cls, data: dict) -> "Plan":
        return cls(tuple(Task.from_json(t) for t in data["tasks"]), tuple(data["quarantine"]), data["info"])


class Job:
    """Base class of a modality's job. Subclasses set ``name``/``spec_type`` and implement
    check, plan, run_task and finalize."""

    name: ClassVar[str]
    spec_type: ClassVar[type[JobSpec]]
    progress_unit: ClassVar[str] = "it"

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
        return len(task.payload.get("inputs", ()))

    def progress_counts(self, record: dict) -> dict[str, int]:
        """Extra counters a finished task adds to the progress bar as rates (e.g. frames/s)."""
        return {}

    def record_outputs(self, record: dict) -> list[dict]:
        """[{path, bytes}] the task produced: a resumed run trusts a record only if these hold."""
        return [{"path": o["path"], "bytes": o["bytes"]} for o in record.get("outputs", [])]

    def outputs_intact(self, record: dict) -> bool:
        return all(self.store.size(o["path"]) == o["bytes"] for o in self.record_outputs(record))

    def finalize(self, plan: Plan, records: list[dict]) -> dict:
        """Build the manifest body (without created_by/run) from the plan and task records."""
        raise NotImplementedError

    def packed(self, manifest: dict) -> int:
        """How many usable outputs the job made (0 with inputs found: exit 7, nothing packed)."""
        return manifest["totals"].get("samples", 0)

    def summary_lines(self, manifest: dict) -> list[str]:
        """A few human lines for the end-of-job summary."""
        totals = manifest["totals"]
        return [f"{k}: {v}" for k, v in sorted(totals.items())]
