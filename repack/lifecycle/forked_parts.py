"""A function over a few parts of some work, each part after the first in a forked child, the results
back as bytes over pipes (no pickle): the decode of version 1's record for `--append`
(``repack.lifecycle.first_record.plan_inputs``) split over cores while SOURCE is walked.

Only where a fork is safe (``can_fork``: no other thread runs); else, and
for a child that fails (its error is raised by doing its part here), every part runs in this process.
A child dies with its parent (PR_SET_PDEATHSIG) and leaves by ``os._exit``.
"""

from __future__ import annotations

import multiprocessing
import os
import threading
from typing import Callable, Sequence, TypeVar

T = TypeVar("T")
_FAILED = b"-"  # what a child that failed sends (a part's bytes are never this short: see the callers)


def can_fork() -> bool:
    """Whether this process may fork a child that runs Python: fork exists, and no other thread runs."""
    return "fork" in multiprocessing.get_all_start_methods() and threading.active_count() == 1


def forked_map(work: Callable[[T], bytes], parts: Sequence[T]) -> list[bytes]:
    """``[work(part) for part in parts]``, the parts after the first each computed in a forked child while
    this process computes the first (see the module docstring)."""
    if len(parts) < 2 or not can_fork():
        return [work(part) for part in parts]
    children: list[tuple[int, int]] = []
    try:
        children.extend(_start(work, part) for part in parts[1:])
        results = [work(parts[0])]
        for part in parts[1:]:
            pid, read_end = children[0]
            with os.fdopen(read_end, "rb") as pipe:
                raw = pipe.read()
            os.waitpid(pid, 0)
            children.pop(0)
            results.append(raw if raw != _FAILED else work(part))
        return results
    finally:
        for pid, read_end in children:  # this process failed first: stop the children still running
            stop_child(pid, read_end)


def _start(work: Callable[[T], bytes], part: T) -> tuple[int, int]:
    return start_child(lambda: [work(part)], _FAILED)


def start_child(produce: Callable[[], Sequence], failed: bytes) -> tuple[int, int]:
    """Fork a child that writes ``produce()``'s pieces (bytes-like buffers, written as they are: no copy
    joins them) to a pipe, or ``failed`` where ``produce`` raised, and leaves by ``os._exit``; it dies with
    this process. Returns (the child's pid, the pipe's read end)."""
    read_end, write_end = os.pipe()
    pid = os.fork()
    if pid == 0:  # the child: never returns
        os.close(read_end)
        status = 1
        try:
            from repack.exec.parent_death import die_with_parent

            die_with_parent()
            pieces = produce()
            status = 0
        except BaseException:
            pieces = [failed]
        try:
            with os.fdopen(write_end, "wb", buffering=0) as pipe:
                for piece in pieces:
                    view = memoryview(piece).cast("B")
                    while len(view):
                        view = view[pipe.write(view):]
        finally:
            os._exit(status)
    os.close(write_end)
    return pid, read_end


def stop_child(pid: int, read_end: int) -> None:
    """Stop a child of ``start_child`` not waited for, and reap it."""
    import signal

    try:
        os.close(read_end)
    except OSError:
        pass
    try:
        os.kill(pid, signal.SIGKILL)
    except ProcessLookupError:
        pass
    os.waitpid(pid, 0)
