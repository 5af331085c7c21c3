"""A dataset's index files parsed in a short-lived helper process, into one shared memory file.

Why a process: the parse runs on threads (``manifest_access.parse_index_files``), and glibc keeps
each thread's malloc arena holding the top of its working memory (``malloc_trim`` trims no thread
arena's top); a DataLoader worker forked afterwards maps every resident page of the reader's process,
so each worker's RSS carried it (measured at 1M synthetic samples, 16 parse threads: +123 MB per
worker, 128 B per sample). The helper's arenas die with it; the reader maps the columns from a memfd
``MAP_SHARED``, read-only: its workers share those pages and map only the ones they touch
(``drop_resident`` unmaps them again).

The helper: a fork of the reader's process where that is safe (``can_fork``: it starts in ~10 ms and
imports nothing; measured at 1M samples on 2 cores, a fresh interpreter with numpy and ``pipelines``
took ~0.2 s of the open's wall time), else ``python -m pipelines.index_process`` with the job on stdin.
The job: ``{"paths": [...], "counts": [...], "fd": N}`` (N: the memfd, inherited). It joins the columns of ``IndexColumns``
(``COLUMNS``) straight into the memfd, each at a page-aligned offset, and prints one JSON line: per column
[dtype, offset, length], and ``exts``, ``suffixes`` ([keyed, tail]), ``key_width``. A failure is one
JSON line ``{"error": kind, "message": ..., "errno": ..., "filename": ...}`` and exit status 1; the
reader raises the same kind (``ManifestError``, ``FileNotFoundError``, ``OSError``).
"""

from __future__ import annotations

import ctypes
import json
import mmap
import os
import signal
import subprocess
import sys
import threading
import traceback
from pathlib import Path

import numpy as np

from repack.manifest import ManifestError
from repack.manifest.shard_index import IndexColumns

COLUMNS = ("shard_starts", "first_member", "key_ends", "keys", "ext", "suffix", "offset", "size")
PAGE = mmap.PAGESIZE


class HelperUnavailable(RuntimeError):
    """The helper process did not start or did not answer (the reader then parses in its own process)."""


def available() -> bool:
    """Whether this system can hand columns back in a memfd (Linux)."""
    return hasattr(os, "memfd_create")


def parse_in_helper(paths: list[str], counts: list[int]) -> tuple[IndexColumns, mmap.mmap]:
    """The index files ``paths`` (local; ``counts``: the samples the manifest declares for each) as one
    ``IndexColumns``, parsed by a helper process: (columns, the shared read-only mapping they view).
    The helper is this process forked when no other Python thread runs here (``can_fork``: no
    interpreter to start, nothing to import), else ``python -m pipelines.index_process``."""
    fd = os.memfd_create("repack-index", os.MFD_CLOEXEC)
    try:
        job = {"paths": [str(p) for p in paths], "counts": [int(c) for c in counts], "fd": fd}
        reply = _forked(job) if can_fork() else _executed(job)
        if "error" in reply:
            raise _error(reply)
        mapping = mmap.mmap(fd, os.fstat(fd).st_size, flags=mmap.MAP_SHARED, prot=mmap.PROT_READ)
    finally:
        os.close(fd)
    arrays = {name: np.frombuffer(mapping, dtype=dtype, count=length, offset=offset)
              for name, (dtype, offset, length) in reply["columns"].items()}
    suffixes = tuple((bool(keyed), tail.encode("ascii")) for keyed, tail in reply["suffixes"])
    return IndexColumns(**arrays, exts=tuple(reply["exts"]), suffixes=suffixes,
                        key_width=int(reply["key_width"])), mapping


def can_fork() -> bool:
    """Whether the helper may be a fork of this process: Linux, and no other Python thread runs here
    (one could hold a lock mid-operation that the child would then wait on forever; the rule of the
    producer's pool, ``repack.exec.local``)."""
    return hasattr(os, "fork") and sys.platform.startswith("linux") and threading.active_count() == 1


def _executed(job: dict) -> dict:
    """The helper's reply from a fresh interpreter (``python -m pipelines.index_process``)."""
    try:
        run = subprocess.run([sys.executable, "-m", "pipelines.index_process"], input=json.dumps(job).encode(),
                             capture_output=True, pass_fds=(job["fd"],), env=_helper_env(), check=False)
    except OSError as exc:
        raise HelperUnavailable(f"the index helper process did not start ({sys.executable}: {exc})") from None
    return _reply(run.stdout, run.returncode, run.stderr)


def _forked(job: dict) -> dict:
    """The helper's reply from a fork of this process (it parses, writes the columns into the memfd,
    answers on a pipe and exits without running this process's exit handlers)."""
    read_end, write_end = os.pipe()
    try:
        pid = os.fork()
    except OSError as exc:
        os.close(read_end)
        os.close(write_end)
        raise HelperUnavailable(f"the index helper process did not start (fork: {exc})") from None
    if pid == 0:  # the helper
        status = 1
        try:
            os.close(read_end)
            _die_with_parent()
            _tune_malloc()
            status, reply = run_job(job)
            with os.fdopen(write_end, "wb") as out:
                out.write(reply.encode())
        except BaseException:  # noqa: BLE001  (the reader falls back to its own parse, with this on stderr)
            traceback.print_exc()
        finally:
            os._exit(status)
    os.close(write_end)
    with os.fdopen(read_end, "rb") as answer:
        raw = answer.read()
    _, wait_status = os.waitpid(pid, 0)
    return _reply(raw, os.waitstatus_to_exitcode(wait_status), b"")


PR_SET_PDEATHSIG, M_TRIM_THRESHOLD, M_TOP_PAD, M_MMAP_THRESHOLD = 1, -1, -2, -3  # prctl and mallopt codes


def _die_with_parent() -> None:
    """A forked helper dies with the reader that waits for it (prctl PR_SET_PDEATHSIG, SIGKILL)."""
    try:
        ctypes.CDLL(None).prctl(PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0)
    except (OSError, AttributeError):
        pass


def _tune_malloc() -> None:
    """``HELPER_MALLOC`` in a forked helper (glibc ``mallopt``; the environment variables only act when
    a process starts)."""
    try:
        mallopt = ctypes.CDLL(None).mallopt
    except (OSError, AttributeError):
        return
    for option, name in ((M_MMAP_THRESHOLD, "MALLOC_MMAP_THRESHOLD_"), (M_TRIM_THRESHOLD, "MALLOC_TRIM_THRESHOLD_"),
                         (M_TOP_PAD, "MALLOC_TOP_PAD_")):
        mallopt(option, int(HELPER_MALLOC[name]))


def drop_resident(mapping: mmap.mmap | None) -> None:
    """Unmap this process's pages of ``mapping`` (a ``MAP_SHARED`` one: the data stays in the memfd or
    the shared anonymous memory, a later read maps the page again): what a worker touched no longer
    counts in its RSS."""
    if mapping is not None and not mapping.closed:
        mapping.madvise(mmap.MADV_DONTNEED)


def shared_maps(columns: IndexColumns, mapping: mmap.mmap | None) -> tuple[mmap.mmap, ...]:
    """The shared mappings that hold ``columns``, for ``drop_resident``: the helper's ``mapping``, else
    the maps of an index parsed in this process (``shard_index.concat``'s default: each column in an
    ``mmap.mmap(-1, n)``, which Python maps ``MAP_SHARED``), none for columns in ordinary arrays (e.g.
    unpickled in a spawned worker)."""
    if mapping is not None:
        return (mapping,)
    maps: dict[int, mmap.mmap] = {}
    for name in COLUMNS:
        base = getattr(columns, name).base
        owner = base.obj if isinstance(base, memoryview) else None
        if isinstance(owner, mmap.mmap):
            maps[id(owner)] = owner
    return tuple(maps.values())


# The helper's malloc keeps its heap between pieces (this process exits, so nothing it keeps outlives
# the parse): a thread parses its next piece in the pages of its last one instead of faulting in fresh
# ones (1M synthetic samples on 2 cores: 80,000 -> 46,000 minor faults, 0.24 -> 0.15 system CPU-s)
HELPER_MALLOC = {"MALLOC_MMAP_THRESHOLD_": str(32 << 20), "MALLOC_TRIM_THRESHOLD_": str(1 << 30),
                 "MALLOC_TOP_PAD_": str(16 << 20)}


def _helper_env() -> dict:
    """The environment with the folders that hold ``pipelines`` and ``repack`` first on PYTHONPATH, and
    ``HELPER_MALLOC``."""
    import pipelines
    import repack

    roots = [str(Path(p.__file__).resolve().parent.parent) for p in (pipelines, repack)]
    env = {**os.environ, **HELPER_MALLOC}
    env["PYTHONPATH"] = os.pathsep.join(dict.fromkeys([*roots, *filter(None, env.get("PYTHONPATH", "").split(os.pathsep))]))
    return env


def _reply(stdout: bytes, returncode: int, stderr: bytes) -> dict:
    lines = stdout.decode(errors="replace").strip().splitlines()
    try:
        return json.loads(lines[-1])
    except (IndexError, ValueError):
        tail = stderr.decode(errors="replace").strip()[-2000:]
        raise HelperUnavailable(f"the index helper process failed (exit {returncode}): {tail}") from None


def _error(reply: dict) -> Exception:
    kind, message = reply["error"], reply["message"]
    if kind == "ManifestError":
        return ManifestError(message)
    if reply.get("errno") is not None:
        cls = FileNotFoundError if kind == "FileNotFoundError" else OSError
        return cls(reply["errno"], reply.get("strerror") or message, reply.get("filename"))
    return RuntimeError(f"the index helper process failed: {kind}: {message}")


class MemfdColumns:
    """An ``Allocate`` for ``shard_index.concat``: each joined column straight in the file ``fd``, at the
    next page-aligned offset (no second copy of the columns in the helper)."""

    def __init__(self, fd: int) -> None:
        self.fd, self.size, self.placed = fd, 0, {}

    def __call__(self, count: int, dtype: np.dtype) -> np.ndarray:
        span = -(-max(count * dtype.itemsize, 1) // PAGE) * PAGE
        at, self.size = self.size, self.size + span
        os.ftruncate(self.fd, self.size)
        mapping = mmap.mmap(self.fd, span, flags=mmap.MAP_SHARED, prot=mmap.PROT_READ | mmap.PROT_WRITE, offset=at)
        self.placed[id(mapping)] = (mapping, at)
        return np.frombuffer(mapping, dtype=dtype, count=count)

    def offset_of(self, array: np.ndarray) -> int | None:
        """Where ``array`` (one this allocator made) lies in the file; None for any other array."""
        base = array.base
        owner = base.obj if isinstance(base, memoryview) else None
        placed = self.placed.get(id(owner))
        return placed[1] if placed is not None and placed[0] is owner else None


def write_columns(columns: IndexColumns, fd: int, memfd: MemfdColumns | None = None) -> dict:
    """The reply for ``columns`` in the file ``fd`` (``COLUMNS``, each page-aligned): those ``memfd``
    placed there already, the others copied in after them."""
    memfd = memfd or MemfdColumns(fd)
    layout = {}
    for name in COLUMNS:
        array = getattr(columns, name)
        at = memfd.offset_of(array)
        if at is None:
            placed = memfd(len(array), array.dtype)
            placed[:] = array
            at = memfd.offset_of(placed)
        layout[name] = (array.dtype.str, at, len(array))
    return {"columns": layout, "exts": list(columns.exts), "key_width": columns.key_width,
            "suffixes": [[keyed, tail.decode("ascii")] for keyed, tail in columns.suffixes]}


def run_job(job: dict) -> tuple[int, str]:
    """Parse the job's index files into its memfd: (exit status, the reply line)."""
    from pipelines.manifest_access import parse_index_files

    try:
        memfd = MemfdColumns(int(job["fd"]))
        columns = parse_index_files(job["paths"], job["counts"], memfd)
        return 0, json.dumps(write_columns(columns, memfd.fd, memfd)) + "\n"
    except (ManifestError, OSError) as exc:
        reply = {"error": type(exc).__name__, "message": str(exc)}
        if isinstance(exc, OSError):
            reply.update(errno=exc.errno, strerror=exc.strerror, filename=exc.filename)
        return 1, json.dumps(reply, default=str) + "\n"


def main() -> int:
    status, reply = run_job(json.loads(sys.stdin.buffer.read()))
    sys.stdout.write(reply)
    sys.stdout.flush()
    return status


if __name__ == "__main__":
    sys.exit(main())
