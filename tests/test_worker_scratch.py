"""A Ray worker node's own scratch (object-store OUT): the temp files an attempt killed on that node
left are swept by the next attempt there (``repack.jobs.scratch``), never those of a live writer,
nor a temp that names no task the node locked. Real processes hold the real task locks."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
from pathlib import Path

from repack.jobs.scratch import drop_published, sweep_stale_temps
from tests.conftest import ROOT

WRITER = """
import sys, time
from pathlib import Path
from repack.jobs.engine import TaskLock
scratch, task_id, temp = Path(sys.argv[1]), sys.argv[2], Path(sys.argv[3])
with TaskLock(scratch, task_id):
    temp.parent.mkdir(parents=True, exist_ok=True)
    temp.write_bytes(b"half a shard")
    print("writing", flush=True)
    time.sleep(60)
"""


def start_writer(scratch: Path, task_id: str, temp: Path) -> subprocess.Popen:
    """A process that holds ``task_id``'s task lock in ``scratch`` and has written ``temp``."""
    proc = subprocess.Popen([sys.executable, "-c", WRITER, str(scratch), task_id, str(temp)], cwd=ROOT,
                            env={**os.environ, "PYTHONPATH": str(ROOT)}, stdout=subprocess.PIPE, text=True)
    assert proc.stdout.readline().strip() == "writing"
    return proc


def test_temps_of_a_killed_attempt_are_swept_not_a_live_ones(tmp_path):
    scratch = tmp_path / "node1"
    lost = scratch / f".shard-000001.tar.tmp-{os.getpid() + 1}"
    piece = scratch / ".repack" / "segments" / ".shard-000002-c0001.seg.tmp-77"
    live = scratch / ".shard-000003.tar.tmp-99"
    foreign = scratch / ".notes.txt.tmp-1"  # names no task this node locked
    renamed = scratch / "shard-000004.tar"  # whole, not yet uploaded when its attempt was lost: it stayed for good
    writers = [start_writer(scratch, "shard-000001", lost), start_writer(scratch, "shard-000002-c0001", piece),
               start_writer(scratch, "shard-000004", renamed)]
    alive = start_writer(scratch, "shard-000003", live)
    foreign.write_bytes(b"not ours")
    try:
        assert sweep_stale_temps(scratch) == []  # every writer alive: nothing is stale
        for proc in writers:
            proc.send_signal(signal.SIGKILL)  # the attempts are lost (kill -9: no clean-up of their own)
            proc.wait()
        assert lost.exists() and piece.exists() and renamed.exists()
        assert sorted(sweep_stale_temps(scratch)) == sorted([lost.name, piece.name, renamed.name])
        assert not lost.exists() and not piece.exists() and not renamed.exists()
        assert live.exists() and foreign.exists()
    finally:
        alive.kill()
        alive.wait()
    assert sweep_stale_temps(scratch) == [live.name]


def test_a_finished_tasks_published_outputs_leave_the_node(tmp_path):
    scratch, outside = tmp_path / "node1", tmp_path / "elsewhere.tar"
    (scratch / ".repack" / "segments").mkdir(parents=True)
    for rel in ("shard-000004.tar", "shard-000004.idx", ".repack/segments/shard-000005-c0000.seg", "shard-000009.tar"):
        (scratch / rel).write_bytes(b"published")
    outside.write_bytes(b"not the node's scratch")
    record = {"outputs": [{"path": "shard-000004.tar", "bytes": 9}, {"path": "shard-000004.idx", "bytes": 9},
                          {"path": ".repack/segments/shard-000005-c0000.seg", "bytes": 9},
                          {"path": "../elsewhere.tar", "bytes": 22}]}
    drop_published(scratch, record)
    assert sorted(p.name for p in scratch.rglob("*") if p.is_file()) == ["shard-000009.tar"]  # another task's
    assert outside.read_bytes() == b"not the node's scratch"  # a path leaving the scratch is never followed


def test_a_task_lock_whose_pid_cannot_be_written_is_let_go(tmp_path):
    """Writing the holder's pid into a task lock fails on a full disk (here: a file size limit of 0 bytes, EFBIG):
    the task fails with that error and its lock goes with it, so the same process's retry of the task meets the
    disk's error again, not its own lock reported as another live repack process (pid ?)."""
    script = """
import resource, signal, sys
from pathlib import Path
from repack.jobs.engine import TaskLock
signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
resource.setrlimit(resource.RLIMIT_FSIZE, (0, resource.RLIM_INFINITY))
for attempt in range(2):
    try:
        with TaskLock(Path(sys.argv[1]), "part-000001"):
            pass
    except Exception as exc:
        print(type(exc).__name__)
"""
    (tmp_path / ".repack" / "tasks").mkdir(parents=True)
    done = subprocess.run([sys.executable, "-c", script, str(tmp_path)], cwd=ROOT, capture_output=True, text=True,
                          env={**os.environ, "PYTHONPATH": str(ROOT)}, check=True)
    assert done.stdout.split() == ["OSError", "OSError"], done.stdout + done.stderr


def test_a_state_folder_linked_elsewhere_is_not_swept_through(tmp_path):
    """A link in the node's job state (``.repack/segments -> elsewhere``) is no folder of the scratch: files
    elsewhere named after a task whose lock is free stay."""
    scratch, elsewhere = tmp_path / "node1", tmp_path / "elsewhere"
    (scratch / ".repack" / "tasks").mkdir(parents=True)
    (scratch / ".repack" / "tasks" / "shard-000000.lock").touch()  # no live holder
    elsewhere.mkdir()
    (elsewhere / "shard-000000-report.txt").write_text("keep me")
    (scratch / ".repack" / "segments").symlink_to(elsewhere)
    assert sweep_stale_temps(scratch) == []
    assert (elsewhere / "shard-000000-report.txt").read_text() == "keep me"
