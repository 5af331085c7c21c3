"""Executors: run a list of tasks somewhere (local process pool, Ray) and hand back records."""

from repack.exec.base import Executor, TaskFailure, get_executor
from repack.exec.cpus import available_cpus

__all__ = ["Executor", "TaskFailure", "available_cpus", "get_executor"]
