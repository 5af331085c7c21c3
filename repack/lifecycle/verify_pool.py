"""The processes that run one round of `repack verify`'s shard checks on a local dataset, and end
without being waited for.

``run_tasks(tasks, work, workers)`` forks up to ``workers`` processes once the round's tasks are
known (they inherit the list: no task crosses a pipe). Each takes task numbers from one shared pipe
(a read of 4 bytes from a pipe is atomic: each number goes to one process, whichever is free),
writes "took N" and then N's answer (``work``'s JSON text and raw bytes) into a pipe of its own,
and leaves with ``os._exit`` as soon as the task pipe is empty, while the others finish their last
tasks. The driver reads answers as they arrive and returns once it holds them all: it never joins a
process (a 16-core profile put ~0.7 s of a 1.2 s verify in a ``ProcessPoolExecutor``'s shutdown after
the last result: sentinels, then a join of every worker); a daemon thread reaps those still exiting
(``reap_later``), so none is left a zombie. Each process dies with the driver (PR_SET_PDEATHSIG) and
ignores Ctrl-C (the driver's to handle); an interrupted driver kills them. The caller forks only
where it runs no other thread (``repack.exec.reap.only_thread``).

A process that dies holding a task leaves that task's answer a ``Died`` (how it ended), and so do
tasks no process was left to take; a task that raised makes ``run_tasks`` raise ``TaskError`` with
its traceback, as a pool's future would. No pickle: struct headers, JSON text and raw bytes.
"""

from __future__ import annotations

import os
import selectors
import signal
import struct
from typing import Callable

from repack.exec.parent_death import die_with_parent  # imported here: each process only calls it
from repack.exec.reap import how_it_ended, reap_later
from repack.lifecycle.verify_digests import Died

Answer = tuple[str, bytes]  # a task's JSON text and raw bytes
_NUMBER = struct.Struct("<I")
_HEADER = struct.Struct("<BIII")  # kind, task number, bytes of text, bytes of raw
_TOOK, _DONE, _RAISED = 1, 2, 3


class TaskError(RuntimeError):
    """A task raised in its process (the message holds that process's traceback)."""


def run_tasks(tasks: list[str], work: Callable[[str], Answer], workers: int) -> list[Answer | Died]:
    """``work(task)`` of each of ``tasks``, in their order (each a ``Died`` when its process died), on
    ``min(workers, len(tasks))`` forked processes that take them in list order; in this process for
    ``workers`` 1 (a single task still runs in a forked process: a check that maps a damaged file, LMDB's,
    can die of SIGBUS, which then names the shard instead of ending verify)."""
    if workers <= 1 or not tasks:
        return [work(task) for task in tasks]
    workers = min(workers, len(tasks))
    with _Round(tasks, work, workers) as round_:
        return round_.gather()


class _Round:
    """The processes of one ``run_tasks``: the task pipe, each process's answer pipe, their pids."""

    def __init__(self, tasks: list[str], work: Callable[[str], Answer], workers: int) -> None:
        self.take, self.give = os.pipe()
        self.answers: dict[int, int] = {}  # each process's answer pipe (read end) -> its pid
        self.count = len(tasks)
        self.finished = False
        try:
            for _ in range(workers):
                read_end, write_end = os.pipe()
                pid = os.fork()
                if pid == 0:  # the child: serve until the task pipe is empty, then leave without Python's exit work
                    status = 1
                    try:
                        for fd in (self.give, read_end, *self.answers):
                            os.close(fd)
                        _serve(self.take, write_end, tasks, work)
                        status = 0
                    finally:
                        os._exit(status)
                os.close(write_end)
                self.answers[read_end] = pid
        except BaseException:
            self.__exit__()
            raise
        finally:
            os.close(self.take)

    def __enter__(self) -> _Round:
        return self

    def __exit__(self, *exc) -> None:
        if self.give >= 0:
            os.close(self.give)
        for fd in self.answers:
            os.close(fd)
        if not self.finished:  # interrupted or failed: nothing of the round is wanted any more
            for pid in self.answers.values():
                try:
                    os.kill(pid, signal.SIGKILL)
                except ProcessLookupError:
                    pass
        reap_later(list(self.answers.values()))

    def gather(self) -> list[Answer | Died]:
        """Hand out task numbers 0..count-1 (the task pipe closed once all are written: a process that
        finds it empty leaves) and read every answer as it arrives."""
        found: list[Answer | Died | None] = [None] * self.count
        held: dict[int, int] = {}  # answer pipe -> the task its process took and has not answered
        waiting = self.count
        unsent = list(range(self.count - 1, -1, -1))  # popped from the end: number 0 first
        os.set_blocking(self.give, False)
        with selectors.DefaultSelector() as selector:
            for fd in self.answers:
                selector.register(fd, selectors.EVENT_READ)
            selector.register(self.give, selectors.EVENT_WRITE)
            readers = len(self.answers)
            while waiting and readers:
                for key, _ in selector.select():
                    fd = key.fd
                    if fd == self.give:
                        if _hand_out(fd, unsent):
                            selector.unregister(fd)
                            os.close(fd)
                            self.give = -1
                        continue
                    message = _read_message(fd)
                    if message is None:  # the process ended (done, or died: then it may hold a task)
                        selector.unregister(fd)
                        readers -= 1
                        if fd in held:
                            found[held.pop(fd)] = Died(how_it_ended(self.answers[fd]))
                            waiting -= 1
                        continue
                    kind, number, text, raw = message
                    if kind == _TOOK:
                        held[fd] = number
                        continue
                    del held[fd]
                    if kind == _RAISED:
                        raise TaskError(f"a verify task failed in its process:\n{text}")
                    found[number] = (text, raw)
                    waiting -= 1
        self.finished = True
        left = Died("no process was left to run it")
        return [left if answer is None else answer for answer in found]


def _hand_out(give: int, unsent: list[int]) -> bool:
    """Write the next task numbers into the (non-blocking) task pipe while it has room; True once none
    is left to write (all written, or every process has ended)."""
    while unsent:
        try:
            os.write(give, _NUMBER.pack(unsent[-1]))  # 4 bytes: all or nothing
        except BlockingIOError:
            return False
        except BrokenPipeError:  # every process has ended: what is left is answered "no process left"
            unsent.clear()
            break
        unsent.pop()
    return True


def _read_message(fd: int) -> tuple[int, int, str, bytes] | None:
    """One message of a process's answer pipe; None at its end (or a message cut off by its death)."""
    head = _read_exactly(fd, _HEADER.size)
    if head is None:
        return None
    kind, number, text_bytes, raw_bytes = _HEADER.unpack(head)
    body = _read_exactly(fd, text_bytes + raw_bytes)
    if body is None:
        return None
    return kind, number, body[:text_bytes].decode(), body[text_bytes:]


def _read_exactly(fd: int, size: int) -> bytes | None:
    data = bytearray()
    while len(data) < size:
        chunk = os.read(fd, size - len(data))
        if not chunk:
            return None
        data += chunk
    return bytes(data)


def _serve(take: int, answer: int, tasks: list[str], work: Callable[[str], Answer]) -> None:
    """A process's loop: each task number read from ``take``, its answer written into ``answer``."""
    die_with_parent()
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C is the driver's to handle
    while len(raw := os.read(take, _NUMBER.size)) == _NUMBER.size:
        number, = _NUMBER.unpack(raw)
        _write(answer, _HEADER.pack(_TOOK, number, 0, 0))
        try:
            text, blob = work(tasks[number])
            kind = _DONE
        except Exception:  # noqa: BLE001 - the driver raises it
            import traceback

            text, blob, kind = traceback.format_exc(), b"", _RAISED
        data = text.encode()
        _write(answer, _HEADER.pack(kind, number, len(data), len(blob)) + data)
        _write(answer, blob)


def _write(fd: int, data: bytes) -> None:
    view = memoryview(data)
    while view:
        view = view[os.write(fd, view):]
