"""A forked pool worker never collects what it inherited from the driver (``gc.freeze`` in the pool's
initializer): a finalizer of an inherited object (a DALI pipeline's) may need the driver's threads, which the
fork did not copy, and hung a worker (stop 50 saw it in the walk's workers; the rewrite pool forks the same way).
Run in a fresh process: the test runner's own threads would make the pool start through a fork server."""

from __future__ import annotations

import json
import subprocess
import sys

from tests.conftest import ROOT

SCRIPT = """
import gc, json
from repack.exec.local import _pool_context, process_pool

def frozen(_):
    return gc.get_freeze_count()

if __name__ == "__main__":
    with process_pool(2) as pool:
        print(json.dumps([_pool_context().get_start_method(), list(pool.map(frozen, range(4)))]))
"""


def test_forked_pool_workers_freeze_what_they_inherited(tmp_path):
    script = tmp_path / "pool.py"
    script.write_text(SCRIPT)
    proc = subprocess.run([sys.executable, str(script)], cwd=ROOT, capture_output=True, text=True, check=True,
                          env={"PYTHONPATH": str(ROOT), "PATH": "/usr/bin:/bin"})
    method, counts = json.loads(proc.stdout.strip().splitlines()[-1])
    assert method == "fork" and all(count > 0 for count in counts), (method, counts)


DEAF = """
import json, multiprocessing, signal, time
from repack.exec.local import kill_pool, new_pool


def running(process) -> bool:  # the process itself, not multiprocessing's bookkeeping: the pool's manager thread
    try:                       # may reap a killed worker first, and then Process.is_alive() stays True (ECHILD)
        with open(f"/proc/{process.pid}/stat") as stat:
            return stat.read().rsplit(")", 1)[1].split()[0] != "Z"  # a zombie is dead, not yet reaped
    except FileNotFoundError:
        return False

def deaf(_):  # as a worker forked before its initializer reset SIGTERM, whose handler's raise was lost
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    time.sleep(600)

if __name__ == "__main__":
    pool = new_pool(1)
    pool.submit(deaf, 0)
    time.sleep(1)
    started = time.monotonic()
    kill_pool(pool)
    print(json.dumps([round(time.monotonic() - started), sum(map(running, multiprocessing.active_children()))]))
"""


def test_a_worker_that_survives_sigterm_is_killed_not_joined_forever(tmp_path):
    """A worker that lived through SIGTERM was left for the interpreter's exit, which joined it forever: the driver
    hung after its one-line error (seen under `ulimit -n 20`)."""
    script = tmp_path / "deaf.py"
    script.write_text(DEAF)
    proc = subprocess.run([sys.executable, str(script)], cwd=ROOT, capture_output=True, text=True, timeout=60)
    seconds, alive = json.loads(proc.stdout.strip().splitlines()[-1])
    assert proc.returncode == 0 and seconds <= 11 and alive == 0, proc.stderr
