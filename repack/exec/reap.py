"""Children that are not waited for: a process forked for work whose end nobody needs to wait on is
reaped in the background, so the caller returns at once and no zombie is left behind. Apart from the
pools so that verify's hashers, forked before the heavy imports, pay for ``os`` and ``threading`` only."""

from __future__ import annotations

import os
import threading

REAPER = "repack-reap"  # the name of the threads that reap


def reap_later(pids: list[int]) -> None:
    """Reap ``pids`` (children of this process that have ended or are ending): those already gone now,
    the others on a daemon thread that waits for them (it does not hold up this process's exit)."""
    left = [pid for pid in pids if not _reaped(pid, os.WNOHANG)]
    if left:
        threading.Thread(target=lambda: [_reaped(pid, 0) for pid in left], daemon=True, name=REAPER).start()


def only_thread() -> bool:
    """True when this process runs no thread but the calling one and reapers (safe to ``os.fork``:
    a reaper holds no lock while it waits)."""
    return all(thread is threading.current_thread() or thread.name == REAPER
               for thread in threading.enumerate())


def how_it_ended(pid: int) -> str:
    """Wait for child ``pid`` and say how it ended ("killed by signal 9", "exited with status 1")."""
    try:
        _, status = os.waitpid(pid, 0)
    except ChildProcessError:
        return "ended, its status already taken"
    if os.WIFSIGNALED(status):
        return f"killed by signal {os.WTERMSIG(status)}"
    return f"exited with status {os.waitstatus_to_exitcode(status)}"


def _reaped(pid: int, flags: int) -> bool:
    try:
        done, _ = os.waitpid(pid, flags)
    except ChildProcessError:
        return True  # reaped already (or not ours)
    return done != 0
