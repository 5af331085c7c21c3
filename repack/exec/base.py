"""The executor protocol and registry."""

from __future__ import annotations

import importlib
from dataclasses import dataclass
from typing import Iterator, Protocol

from repack.errors import UsageError


@dataclass(frozen=True)
class TaskFailure:
    """A task that kept failing: its id and the last error."""

    task_id: str
    error: str


class Executor(Protocol):
    """Runs ``execute_task(*call)`` for each call; yields results as they finish.

    Each yielded item is either a record (dict, JSON-decoded) or a TaskFailure. ``same_host``: the
    workers share the driver's disk and page cache (chunks may then write into a shared file).
    """

    same_host: bool

    def run(self, calls: list[tuple[str, str, str, str, bool, bool]],
            task_ids: list[str]) -> Iterator[dict | TaskFailure]: ...

    def close(self) -> None:
        """Release what the executor still holds (the engine calls it last, whether ``run`` ran or not)."""


EXECUTORS: dict[str, str] = {
    "local": "repack.exec.local:LocalExecutor",
    "ray": "repack.exec.ray_executor:RayExecutor",
}


def get_executor(name: str, **kwargs) -> Executor:
    """Instantiate the executor registered under ``name``."""
    if name not in EXECUTORS:
        raise UsageError(f"unknown executor {name!r}; choose from {', '.join(sorted(EXECUTORS))}")
    module_name, _, cls_name = EXECUTORS[name].partition(":")
    return getattr(importlib.import_module(module_name), cls_name)(**kwargs)
