"""Work done in forked children, the results back as bytes over pipes (no pickle), with no thread in
this process: ``forked_map`` (a few parts, each after the first in a child: the decode of version 1's
record for `--append`, ``repack.lifecycle.first_record.plan_inputs``) and ``ForkedTasks`` (many tasks
handed out as each child is ready: the folder walk started ahead, ``repack.sources.walk.walk_ahead``).

Only where a fork is safe (``can_fork``: no other thread runs); else, and for a child that fails (its
error is raised by doing its work here), the work runs in this process. A child dies with its parent
(PR_SET_PDEATHSIG) and leaves by ``os._exit``. No thread: this process may fork again while the
children run (a pool, the record's child), which a ``ProcessPoolExecutor`` (a thread of its own here)
would turn into a forkserver's start.
"""

from __future__ import annotations

import fcntl
import gc
import multiprocessing
import os
import struct
from typing import Callable, Sequence, TypeVar

from repack.exec.reap import only_thread

T = TypeVar("T")
FAILED = b"-"  # what a child that failed sends (a part's bytes are never this short: see the callers)


def can_fork() -> bool:
    """Whether this process may fork a child that runs Python: fork exists, and no other thread runs (but
    reapers, ``repack.exec.reap.only_thread``)."""
    return "fork" in multiprocessing.get_all_start_methods() and only_thread()


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
            results.append(raw if raw != FAILED else work(part))
        return results
    finally:
        for pid, read_end in children:  # this process failed first: stop the children still running
            stop_child(pid, read_end)


def _start(work: Callable[[T], bytes], part: T) -> tuple[int, int]:
    return start_child(lambda: [work(part)], FAILED)


def start_child(produce: Callable[[], Sequence], failed: bytes) -> tuple[int, int]:
    """Fork a child that writes ``produce()``'s pieces (bytes-like buffers, written as they are: no copy
    joins them) to a pipe, or ``failed`` where ``produce`` raised, and leaves by ``os._exit``; it dies with
    this process. Returns (the child's pid, the pipe's read end)."""
    read_end, write_end = os.pipe()
    pid = os.fork()
    if pid == 0:  # the child: never returns
        gc.freeze()  # inherited objects are never collected here (a finalizer needing the parent's threads hangs)
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


_TASK = struct.Struct("<I")  # a queue entry: the first task of a batch
_FRAME = struct.Struct("<IQ")  # a result: its task, its length


class ForkedTasks:
    """``work(task)`` (bytes) for each of ``tasks`` in ``workers`` forked children, started now; each child
    takes the next batch of tasks as it finishes one: a pipe filled with the batches' numbers before the
    children fork, each read of 4 bytes one batch (a pipe's read is atomic), so the load balances without
    a lock or a thread here. A child sends its results when its walk of the queue ends. ``results`` waits
    for them; ``stop`` ends children not waited for. Requires ``can_fork()``."""

    def __init__(self, work: Callable[[T], bytes], tasks: Sequence[T], workers: int) -> None:
        self.tasks = tasks
        self._children: list[tuple[int, int]] = []
        queue_read, queue_write = os.pipe()
        try:
            capacity = _grow_pipe(queue_write, _TASK.size * len(tasks))
            self.batch = -(-len(tasks) * _TASK.size // capacity)  # tasks per queue entry: every entry fits
            entries = b"".join(_TASK.pack(first) for first in range(0, len(tasks), self.batch))
            while entries:
                entries = entries[os.write(queue_write, entries):]
            os.close(queue_write)
            queue_write = -1
            for _ in range(min(workers, -(-len(tasks) // self.batch))):
                self._children.append(start_child(lambda: self._take(work, queue_read), FAILED))
        except BaseException:
            self.stop()
            raise
        finally:
            os.close(queue_read)
            if queue_write >= 0:
                os.close(queue_write)

    def _take(self, work: Callable[[T], bytes], queue_read: int) -> list:
        """In a child: the batches it takes off the queue, worked, as frames (task, length, bytes)."""
        pieces = []
        while len(entry := os.read(queue_read, _TASK.size)) == _TASK.size:
            first = _TASK.unpack(entry)[0]
            for task in range(first, min(first + self.batch, len(self.tasks))):
                raw = work(self.tasks[task])
                pieces += [_FRAME.pack(task, len(raw)), raw]
        return pieces

    def results(self) -> list[memoryview] | None:
        """Every task's bytes in task order (views of what its child sent: not copied), once every child ended;
        None when a child failed or a task's result is missing (its work is then for this process to do again)."""
        found: list = [None] * len(self.tasks)
        whole = True
        while self._children:
            pid, read_end = self._children[0]
            with os.fdopen(read_end, "rb") as pipe:
                raw = memoryview(pipe.read())
            try:
                os.waitpid(pid, 0)
            except ChildProcessError:  # read in a child of the process that forked them (a plan made ahead,
                pass                   # ``repack.jobs.plan_ahead``): that process reaps them
            self._children.pop(0)
            if raw == FAILED:
                whole = False
            at = 0
            while whole and at + _FRAME.size <= len(raw):
                task, length = _FRAME.unpack_from(raw, at)
                end = at + _FRAME.size + length
                if task >= len(found) or end > len(raw):  # not a frame: the pipe was read from elsewhere
                    whole = False
                    break
                found[task] = raw[at + _FRAME.size:end]
                at = end
            whole = whole and at == len(raw)
        if not whole or any(result is None for result in found):
            return None
        return found

    def stop(self) -> None:
        """End the children not waited for, and reap them."""
        while self._children:
            stop_child(*self._children.pop())


def _grow_pipe(fd: int, wanted: int) -> int:
    """The pipe's capacity, grown toward ``wanted`` bytes where the system allows (``F_SETPIPE_SZ``)."""
    set_size, get_size = getattr(fcntl, "F_SETPIPE_SZ", None), getattr(fcntl, "F_GETPIPE_SZ", None)
    if get_size is None:
        return 4096  # POSIX guarantees no more (PIPE_BUF)
    if set_size is not None and wanted > fcntl.fcntl(fd, get_size):
        try:
            fcntl.fcntl(fd, set_size, wanted)
        except OSError:
            pass  # above /proc/sys/fs/pipe-max-size: batches of tasks then
    return fcntl.fcntl(fd, get_size)
