"""``repack.exec.forked.ForkedTasks``: tasks worked in forked children fed by a pipe of batch numbers, no thread
in the driver; results in task order, a failed child's work left for the driver, stopped children reaped."""

from __future__ import annotations

import multiprocessing
import os
import threading

import pytest

from repack.exec import forked
from repack.exec.forked import ForkedTasks

pytestmark = pytest.mark.skipif("fork" not in multiprocessing.get_all_start_methods(), reason="needs fork")


def _square(task: int) -> bytes:
    return b"%d:%d" % (task, task * task) + b"x" * (task % 7)  # lengths differ, one is empty-ish


def test_every_task_once_in_task_order_from_several_children_and_no_thread_here():
    tasks = list(range(500))
    threads = threading.active_count()  # (threads other tests left are theirs; the children only compute)
    work = ForkedTasks(_square, tasks, 4)
    pids = [pid for pid, _ in work._children]
    assert len(pids) == 4 and threading.active_count() == threads  # no thread of its own here
    assert work.results() == [_square(task) for task in tasks]
    assert work._children == []
    for pid in pids:  # reaped
        with pytest.raises(ChildProcessError):
            os.waitpid(pid, os.WNOHANG)


def test_more_tasks_than_the_queue_holds_go_in_batches(monkeypatch):
    monkeypatch.setattr(forked, "_grow_pipe", lambda fd, wanted: 64)  # 16 entries
    tasks = list(range(100))
    work = ForkedTasks(_square, tasks, 3)
    assert work.batch == 7  # ceil(100 * 4 / 64)
    assert work.results() == [_square(task) for task in tasks]
    few = ForkedTasks(_square, [1, 2], 8)
    assert len(few._children) == 2  # no child without a batch to take
    assert few.results() == [_square(1), _square(2)]


def test_a_failed_child_leaves_its_work_to_the_caller_and_stop_reaps_the_running():
    def fails_on_seven(task: int) -> bytes:
        if task == 7:
            raise OSError("unreadable")
        return _square(task)

    assert ForkedTasks(fails_on_seven, list(range(20)), 3).results() is None

    def sleeps(task: int) -> bytes:
        import time

        time.sleep(30)
        return b""

    slow = ForkedTasks(sleeps, list(range(4)), 2)
    pids = [pid for pid, _ in slow._children]
    slow.stop()
    assert slow._children == []
    for pid in pids:
        with pytest.raises(ChildProcessError):
            os.waitpid(pid, os.WNOHANG)
