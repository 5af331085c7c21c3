"""A worker node's own scratch folder (object-store OUT on a cluster): what a task leaves there.

A finished task's outputs are in the store before its record is: the worker's local copies then
serve nobody (the driver assembles from the store, a resume checks the store), so the worker
removes them (``drop_published``), and a node's disk holds only the tasks running on it.

A task attempt writes temp files (``.<name>.tmp-<pid or task id>``) into the scratch of the node it
runs on, and renames them when whole, then uploads them. An attempt killed on that node (its worker
process, an OOM kill) leaves its temps there, or its whole outputs not yet uploaded or not yet dropped;
the driver's own clean-up (``Engine._clean_temps``) reaches only the driver's scratch. So each attempt on
a node (never the driver's: ``ray_executor._execute``) first sweeps that node's scratch: a temp file or an
output is stale when every task whose id its name holds has its task lock free on this node
(``TaskLock``: an flock, released by the kernel when its holder dies, kill -9 included; a finished
task's outputs are in the store, a lost one's are written again). A file naming no task the node has
locked is left alone.
"""

from __future__ import annotations

import fcntl
import os
from pathlib import Path

from repack.jobs.base import STATE_DIR
from repack.manifest import PathEscapeError, safe_join

TEMP_MARK = ".tmp"


def _lock_free(path: Path) -> bool:
    """True when nobody holds the flock on ``path`` (taken and released at once)."""
    try:
        fd = os.open(path, os.O_RDWR | getattr(os, "O_CLOEXEC", 0))
    except OSError:
        return False
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        fcntl.flock(fd, fcntl.LOCK_UN)
        return True
    except BlockingIOError:
        return False
    finally:
        os.close(fd)


def _files(folder: Path) -> list[Path]:
    """The files of ``folder`` a task may have left: its temps and its outputs (not the folders)."""
    try:
        with os.scandir(folder) as entries:
            return [Path(e.path) for e in entries if e.is_file(follow_symlinks=False)
                    and (not e.name.startswith(".") or TEMP_MARK in e.name)]
    except OSError:
        return []


def sweep_stale_temps(scratch: Path) -> list[str]:
    """Remove the temp files and outputs in ``scratch`` (its top folder and the job state's folders) of
    tasks that no live process on this node writes; returns their names."""
    tasks = Path(scratch) / STATE_DIR / "tasks"
    temps = [p for folder in (Path(scratch), *_state_folders(Path(scratch))) for p in _files(folder)]
    if not temps:
        return []
    locks = {p.name[:-len(".lock")]: p for p in tasks.glob("*.lock")} if tasks.is_dir() else {}
    removed = []
    for temp in temps:
        owners = [lock for task_id, lock in locks.items() if task_id in temp.name]
        if owners and all(_lock_free(lock) for lock in owners):
            temp.unlink(missing_ok=True)
            removed.append(temp.name)
    return removed


def _state_folders(scratch: Path) -> list[Path]:
    state = scratch / STATE_DIR
    try:
        with os.scandir(state) as entries:
            return [Path(e.path) for e in entries if e.is_dir(follow_symlinks=False) and e.name != "tasks"]
    except OSError:
        return []


def drop_published(scratch: Path, record: dict) -> None:
    """Remove from ``scratch`` the local copies of the outputs ``record`` lists (published to the
    store before the record was saved); a path that would leave ``scratch`` is ignored."""
    for output in record.get("outputs", []):
        try:
            safe_join(Path(scratch), output["path"]).unlink(missing_ok=True)
        except (PathEscapeError, KeyError, TypeError, IsADirectoryError):
            continue
