"""`repack verify`'s rounds of shard checks on forked processes (``repack.lifecycle.verify_pool``): answers
in task order, a task that raises raised in the driver, a process killed mid-task leaves that task ``Died``
while the others are answered, and no process of a round, nor of `repack verify`, outlives it for long
(the driver does not wait for their exits; they are reaped in the background, none left a zombie)."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from repack.lifecycle.verify_digests import Died
from repack.lifecycle.verify_pool import TaskError, run_tasks

SETTLE_S = 30  # a generous bound for processes that were told to leave to be gone (a loaded machine)


def children(pid: int) -> dict[int, str]:
    """{pid: state letter} of the processes whose parent is ``pid``."""
    found = {}
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            stat = Path(f"/proc/{entry}/stat").read_text()
        except OSError:
            continue
        fields = stat.rsplit(")", 1)[1].split()
        if int(fields[1]) == pid:
            found[int(entry)] = fields[0]
    return found


def settled(before: set[int], parent: int) -> dict[int, str]:
    """The children of ``parent`` that were not in ``before`` once they are gone, or after SETTLE_S."""
    deadline = time.monotonic() + SETTLE_S
    while True:
        left = {pid: state for pid, state in children(parent).items() if pid not in before}
        if not left or time.monotonic() > deadline:
            return left
        time.sleep(0.05)


def echo(task: str) -> tuple[str, bytes]:
    if task == "raise":
        raise ValueError("a task that fails")
    if task.startswith("die"):
        os.kill(os.getpid(), signal.SIGKILL)
    return task.upper(), task.encode() * 3


def test_answers_come_back_in_task_order_and_no_process_is_left():
    before = set(children(os.getpid()))
    tasks = [f"task-{i}" for i in range(40)] + ["x" * 200_000]  # one answer larger than a pipe holds
    assert run_tasks(tasks, echo, 3) == [(t.upper(), t.encode() * 3) for t in tasks]
    assert settled(before, os.getpid()) == {}, "a process of the round is left (running or a zombie)"


def test_one_worker_runs_the_tasks_in_this_process():
    before = set(children(os.getpid()))
    assert run_tasks(["a", "b"], echo, 1) == [("A", b"aaa"), ("B", b"bbb")]
    assert set(children(os.getpid())) - before == set()  # no process started (an older one may have ended)


def test_a_task_that_raises_is_raised_in_the_driver_with_its_traceback():
    before = set(children(os.getpid()))
    with pytest.raises(TaskError, match="ValueError: a task that fails"):
        run_tasks(["a", "raise", "b", "c"], echo, 2)
    assert settled(before, os.getpid()) == {}


def test_a_process_killed_mid_task_leaves_that_task_died_and_the_others_answered():
    before = set(children(os.getpid()))
    tasks = ["a", "die", "b", "c", "d", "e"]
    found = run_tasks(tasks, echo, 2)
    assert found[1] == Died(f"killed by signal {int(signal.SIGKILL)}")
    assert [answer for i, answer in enumerate(found) if i != 1] == [(t.upper(), t.encode() * 3)
                                                                     for t in tasks if t != "die"]
    assert settled(before, os.getpid()) == {}


def test_tasks_no_process_was_left_to_take_are_died():
    found = run_tasks(["die-1", "die-2", "a", "b"], echo, 2)  # both processes die on their first task
    assert found[:2] == [Died(f"killed by signal {int(signal.SIGKILL)}")] * 2
    assert found[2:] == [Died("no process was left to run it")] * 2


def test_repack_verify_leaves_no_process_behind(packed_photos):
    """The CLI returns once every answer is in; within moments none of its processes is alive (nor a
    zombie of a live parent): they left on their own, reaped in the background or by the system."""
    from tests.conftest import ROOT

    proc = subprocess.Popen([sys.executable, "-m", "repack", "verify", str(packed_photos), "--workers", "3"],
                            cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            start_new_session=True)
    try:
        out, err = proc.communicate(timeout=300)
        assert proc.returncode == 0, err
        assert "OK, every file matches the manifest" in out
        deadline = time.monotonic() + SETTLE_S
        while session_processes(proc.pid) and time.monotonic() < deadline:
            time.sleep(0.05)
        assert session_processes(proc.pid) == []
    finally:
        try:
            os.killpg(proc.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass


def session_processes(sid: int) -> list[int]:
    """Processes of session ``sid`` that are alive (not zombies)."""
    found = []
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            fields = Path(f"/proc/{entry}/stat").read_text().rsplit(")", 1)[1].split()
        except OSError:
            continue
        if int(fields[4]) == sid and fields[0] != "Z":
            found.append(int(entry))
    return found


def test_with_another_thread_running_the_shards_are_checked_on_a_pool_that_does_not_fork_it(packed_photos):
    """A caller's thread alive (a fork would copy its locks mid-step): the checks run on the process pool
    (forkserver), with the same answers."""
    import threading

    from repack.lifecycle.verify_shards import _Pool, check_shards
    from repack.manifest import read_manifest
    from repack.store.files import open_files

    manifest = read_manifest(packed_photos)
    stop = threading.Event()
    other = threading.Thread(target=stop.wait, daemon=True)
    other.start()
    try:
        with _Pool(2) as pool:
            assert pool.executor is not None
        checked = check_shards(open_files(str(packed_photos)), manifest, 2)
    finally:
        stop.set()
        other.join()
    assert checked.problems == ((),) * len(manifest.data["shards"])
    from repack.exec.reap import only_thread

    if only_thread():  # an earlier test in this process may have left a thread of its own running
        with _Pool(2) as pool:
            assert pool.executor is None  # no other thread: rounds on forked processes


def _die_of_sigbus(task: str):
    if task == "mapped":
        os.kill(os.getpid(), signal.SIGBUS)  # what a mapped read past a damaged LMDB page does
    return str(os.getpid()), b""


def test_a_single_task_runs_in_a_forked_process_so_a_sigbus_names_its_shard():
    """One shard (an LMDB dataset's one database): its check still runs in a forked process, so a check that dies
    of SIGBUS is a ``Died`` for its shard, not the end of verify; one worker asked: in this process."""
    (answer,) = run_tasks(["plain"], _die_of_sigbus, 2)
    assert answer[0] != str(os.getpid())
    (died,) = run_tasks(["mapped"], _die_of_sigbus, 2)
    assert isinstance(died, Died) and "signal 7" in died.reason
    assert run_tasks(["plain"], _die_of_sigbus, 1)[0][0] == str(os.getpid())
