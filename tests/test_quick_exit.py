"""A job command that ran on Ray ends without the interpreter's module teardown
(``repack.cli._end_after_exit_handlers``): nothing of its output may be lost to that. The threads
are joined and the atexit handlers run as in a normal exit; only ``__del__`` of live objects and
the freeing of modules are skipped, so every file must be closed by then (audited here)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from tests.conftest import ROOT
from tests.test_executors import assert_identical_outputs, output_files

# Registered before repack is imported, so it runs last among the atexit handlers (after Ray's
# shutdown): which writable files are still open, which non-daemon threads run, and which way the
# process is about to end.
AUDIT = """
import atexit, gc, io, json, sys, threading
def audit():
    from repack.commands.options import ProcessEnd
    std = {id(s) for s in (sys.stdout, sys.stderr, sys.__stdout__, sys.__stderr__)}
    std |= {id(getattr(s, "buffer", None)) for s in (sys.stdout, sys.stderr, sys.__stdout__, sys.__stderr__)}
    open_files = [repr(o) for o in gc.get_objects()
                  if isinstance(o, (io.BufferedWriter, io.BufferedRandom, io.TextIOWrapper))
                  and id(o) not in std and not o.closed and o.writable()]
    threads = [t.name for t in threading.enumerate() if t is not threading.main_thread() and not t.daemon]
    sys.stderr.write("AUDIT " + json.dumps({"open": open_files, "threads": threads,
                                            "quick": ProcessEnd.after_exit_handlers}) + "\\n")
atexit.register(audit)
sys.argv = ["repack"] + sys.argv[1:]
from repack.cli import main
main()
"""


def run_audited(*args, env: dict | None = None) -> tuple[subprocess.CompletedProcess, dict]:
    import os

    proc = subprocess.run([sys.executable, "-c", AUDIT, *map(str, args)], capture_output=True, text=True,
                          cwd=ROOT, env={**os.environ, **(env or {})}, timeout=300)
    lines = [line for line in proc.stderr.splitlines() if line.startswith("AUDIT ")]
    assert len(lines) == 1, proc.stderr
    return proc, json.loads(lines[0][len("AUDIT "):])


@pytest.mark.parametrize("executor", ["local", "ray"])
def test_job_ends_quickly_on_ray_only_and_loses_nothing(photo_tree, tmp_path, executor):
    """A job on Ray (only there) ends through the quick exit; its shards, indexes and manifest equal the
    local pool's, its --json summary on stdout (a pipe: block-buffered) is whole, exit 0, no file left
    open for a ``__del__`` to flush, no thread left, no temp file in OUT and nothing in its scratch."""
    if executor == "ray":
        pytest.importorskip("ray")
    args = ("--shard-size", "16", "--chunk-size", "8", "--workers", "2", "--json")
    outs = {"local": tmp_path / "local", executor: tmp_path / executor}
    if executor == "ray":
        subprocess.run([sys.executable, "-m", "repack", "images", photo_tree, outs["local"], *args], check=True,
                       capture_output=True, cwd=ROOT)
    scratch = tmp_path / "scratch"
    proc, audit = run_audited("images", photo_tree, outs[executor], *args, "--executor", executor,
                              env={"REPACK_SCRATCH": str(scratch)})
    assert proc.returncode == 0, proc.stderr
    assert audit == {"open": [], "threads": [], "quick": executor == "ray"}, audit
    summary = json.loads(proc.stdout)  # the one line, whole
    assert summary["totals"]["samples"] == 120 and summary["ran"] == 8, summary
    assert_identical_outputs(outs)
    out = outs[executor]
    names = {str(p.relative_to(out)) for p in out.rglob("*") if p.is_file()}
    assert not [n for n in names if "tmp" in Path(n).name or Path(n).name.startswith(".")], sorted(names)
    assert not scratch.exists() or not any(scratch.rglob("*"))
    verified = subprocess.run([sys.executable, "-m", "repack", "verify", out], capture_output=True, text=True,
                              cwd=ROOT)
    assert verified.returncode == 0, verified.stderr
    assert {Path(n).suffix for n in output_files(out)} == {".tar", ".idx", ".crc"} and len(output_files(out)) == 24


ENDING = """
import atexit, concurrent.futures, sys, threading, time, weakref
from pathlib import Path
out = Path(sys.argv[1])

def late_write():
    time.sleep(0.2)
    out.joinpath("thread").write_text("joined")

class Witness:
    def __del__(self):
        out.joinpath("teardown").write_text("ran")

class Finalized:
    pass

threading.Thread(target=late_write).start()  # non-daemon: the exit joins it
pool = concurrent.futures.ThreadPoolExecutor(1)
pool.submit(time.sleep, 0.2)
pool.submit(out.joinpath("queued").write_text, "done")  # queued work: finished at the threads' exit hooks
kept = Finalized()
weakref.finalize(kept, out.joinpath("finalize").write_text, "ran")  # weakref.finalize runs at atexit
atexit.register(out.joinpath("atexit").write_text, "ran")
witness = Witness()  # alive to the end: only a module teardown would run its __del__
sys.stdout.write("unflushed")  # a pipe: block-buffered
from repack.cli import _end_after_exit_handlers
_end_after_exit_handlers()
sys.exit(3)  # never reached
"""


def test_quick_exit_joins_threads_runs_exit_handlers_and_flushes(tmp_path):
    """What the quick exit runs (the non-daemon threads' join, concurrent.futures' queued work, atexit
    handlers, ``weakref.finalize``, the stdout buffer) and what it skips (``__del__`` of an object alive
    to the end), with exit status 0."""
    proc = subprocess.run([sys.executable, "-c", ENDING, str(tmp_path)], capture_output=True, text=True,
                          cwd=ROOT, timeout=60)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout == "unflushed"
    written = {p.name: p.read_text() for p in tmp_path.iterdir()}
    assert written == {"thread": "joined", "queued": "done", "finalize": "ran", "atexit": "ran"}, written
