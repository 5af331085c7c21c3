"""A dataset's index files parsed in a short-lived helper process, into one shared memory file, while
the reader goes on: ``PendingIndex`` starts the helper and returns at once; ``result()`` waits for the
columns, in the process that started it or in any process forked from it (a DataLoader worker).

Why a process: the parse runs on threads (``manifest_access.parse_index_files``), and glibc keeps
each thread's malloc arena holding the top of its working memory (``malloc_trim`` trims no thread
arena's top); a DataLoader worker forked afterwards maps every resident page of the reader's process,
so each worker's RSS carried it (measured at 1M synthetic samples, 16 parse threads: +123 MB per
worker, 128 B per sample). The helper's arenas die with it; the reader maps the columns from a memfd
``MAP_SHARED``, read-only: its workers share those pages and map only the ones they touch
(``drop_resident`` unmaps them again).

Why not waiting for it: opening then costs the fork of the helper, and the parse runs while the
training script goes on and the DataLoader starts its workers (at 1M samples both take a few tenths
of a second); a worker waits for the columns when it first needs them.

The helper: a fork of the reader's process where that is safe (``can_fork``: it starts in ~10 ms and
imports nothing; a fresh interpreter with numpy and ``pipelines`` takes ~0.2 s), else ``python -m
pipelines.index_process`` with the job on stdin. The job: ``{"paths": [...], "counts": [...], "fd": N,
"lock": L}`` (N: the memfd, L: a descriptor of it that holds an exclusive ``flock``, both inherited).
The helper joins the columns of ``IndexColumns`` (``COLUMNS``) straight into the memfd after its first
page, each at a page-aligned offset; writes its reply, one JSON object (per column [dtype, offset,
length], and ``exts``, ``suffixes`` ([keyed, tail]), ``key_width``; or on failure ``{"error": kind,
"message": ..., "errno": ..., "filename": ...}``) after the columns; then the header, the first page:
``REPLY_MAGIC``, the reply's offset and length (uint64 little-endian); then releases the lock and
exits. A waiter takes a shared ``flock`` on a descriptor of its own (it is granted once the helper
released the lock or ended, however it ended) and reads the header: no header, no reply (the helper
died: ``HelperUnavailable``). An error reply raises the same kind (``ManifestError``,
``FileNotFoundError``, ``OSError``).
"""

from __future__ import annotations

import ctypes
import fcntl
import json
import mmap
import os
import signal
import subprocess
import sys
import tempfile
import threading
import traceback
from pathlib import Path

import numpy as np

from repack.manifest import ManifestError
from repack.manifest.shard_index import IndexColumns

COLUMNS = ("shard_starts", "first_member", "key_ends", "keys", "ext", "suffix", "offset", "size")
PAGE = mmap.PAGESIZE
REPLY_MAGIC = b"RPKIDX1\n"  # the memfd's header: magic, reply offset, reply length (24 bytes)


class HelperUnavailable(RuntimeError):
    """The helper process did not start or did not answer (the reader then parses in its own process)."""


def available() -> bool:
    """Whether this system can hand columns back in a memfd (Linux)."""
    return hasattr(os, "memfd_create") and hasattr(fcntl, "flock")


class PendingIndex:
    """The index files ``paths`` (local; ``counts``: the samples the manifest declares for each) being
    parsed by a helper process into shared memory. Raises ``HelperUnavailable`` when the helper does not
    start. ``result()``: (the columns, the shared read-only mapping they view), once, then cached."""

    def __init__(self, paths: list[str], counts: list[int]) -> None:
        self.fd = os.memfd_create("repack-index", os.MFD_CLOEXEC)
        self.owner = os.getpid()  # the process that reaps the helper
        self._pid: int | None = None  # a forked helper
        self._run: subprocess.Popen | None = None  # a python -m helper
        self._stderr = None
        self._done: tuple[IndexColumns, mmap.mmap] | None = None
        lock = _reopen(self.fd)
        try:
            fcntl.flock(lock, fcntl.LOCK_EX)  # held by the helper (its copy of this descriptor) until it answered
            job = {"paths": [str(p) for p in paths], "counts": [int(c) for c in counts], "fd": self.fd, "lock": lock}
            if can_fork():
                self._pid = _fork(job)
            else:
                self._run, self._stderr = _execute(job)
        except BaseException:
            os.close(self.fd)
            self.fd = -1
            raise
        finally:
            os.close(lock)

    def result(self) -> tuple[IndexColumns, mmap.mmap]:
        """The columns and their mapping, waiting for the helper if it is still parsing."""
        if self._done is None:
            self._done = self._wait()
        return self._done

    def _wait(self) -> tuple[IndexColumns, mmap.mmap]:
        lock = _reopen(self.fd)
        try:
            fcntl.flock(lock, fcntl.LOCK_SH)  # granted once the helper answered, or ended
        finally:
            os.close(lock)
        try:
            reply = _read_reply(self.fd)
            if reply is None:
                raise HelperUnavailable(f"the index helper process ended without a reply{self._reap(True)}")
            self._reap(False)
            if "error" in reply:
                raise _error(reply)
            mapping = mmap.mmap(self.fd, os.fstat(self.fd).st_size, flags=mmap.MAP_SHARED, prot=mmap.PROT_READ)
        finally:
            os.close(self.fd)
            self.fd = -1
        return _columns(reply, mapping), mapping

    def _reap(self, block: bool) -> str:
        """In the process that started the helper: reap it (``block``: wait for its exit; else only if it
        has exited: it ends right after answering); a note on how it ended (its stderr), for a message."""
        if os.getpid() != self.owner:
            return ""
        if self._pid is not None:
            try:
                pid, status = os.waitpid(self._pid, 0 if block else os.WNOHANG)
            except ChildProcessError:  # reaped by someone else (a SIGCHLD handler that waits for any child)
                self._pid = None
                return ""
            if pid == 0:
                return ""
            self._pid = None
            code = os.waitstatus_to_exitcode(status)
            return "" if code == 0 else f" (exit {code}; its traceback is on stderr)"
        if self._run is not None:
            code = self._run.wait() if block else self._run.poll()
            if code is None:
                return ""  # reaped by subprocess once it ends
            self._stderr.seek(0)
            tail = self._stderr.read().decode(errors="replace").strip()[-2000:]
            self._stderr.close()
            self._run = None
            return "" if code == 0 else f" (exit {code}): {tail}"
        return ""

    def __del__(self) -> None:
        try:
            if self.fd >= 0:
                os.close(self.fd)
                self.fd = -1
            if self._pid is not None and os.getpid() == self.owner:
                # a helper that answered is exiting: reaped (its CPU then counts as this process's child's);
                # one still parsing is reaped if it ended, else left to init once this process is gone
                os.waitpid(self._pid, 0 if self._done is not None else os.WNOHANG)
        except (OSError, TypeError, AttributeError):  # interpreter shutdown: os may be gone
            pass


def parse_in_helper(paths: list[str], counts: list[int]) -> tuple[IndexColumns, mmap.mmap]:
    """``PendingIndex(paths, counts).result()``: the columns parsed by a helper process, waited for."""
    return PendingIndex(paths, counts).result()


def can_fork() -> bool:
    """Whether the helper may be a fork of this process: Linux, and no other Python thread runs here
    (one could hold a lock mid-operation that the child would then wait on forever; the rule of the
    producer's pool, ``repack.exec.local``)."""
    return hasattr(os, "fork") and sys.platform.startswith("linux") and threading.active_count() == 1


def _reopen(fd: int) -> int:
    """A descriptor of the memfd ``fd`` with an open file description of its own (``flock`` locks
    belong to descriptions: a waiter must not share the helper's)."""
    return os.open(f"/proc/self/fd/{fd}", os.O_RDONLY | os.O_CLOEXEC)


def _fork(job: dict) -> int:
    """Start the helper as a fork of this process (it parses, answers in the memfd and exits without
    running this process's exit handlers); its pid."""
    try:
        pid = os.fork()
    except OSError as exc:
        raise HelperUnavailable(f"the index helper process did not start (fork: {exc})") from None
    if pid == 0:  # the helper
        status = 1
        try:
            signal.signal(signal.SIGINT, signal.SIG_IGN)  # a Ctrl-C is the reader's to handle (it dies with it)
            _die_with_parent()
            _tune_malloc()
            status = run_job(job)
        except BaseException:  # noqa: BLE001  (no reply: the reader parses itself, with this on stderr)
            traceback.print_exc()
        finally:
            os._exit(status)
    return pid


def _execute(job: dict) -> tuple[subprocess.Popen, object]:
    """Start the helper as ``python -m pipelines.index_process``: (the process, the file its stderr goes to)."""
    stdin, stderr = tempfile.TemporaryFile(), tempfile.TemporaryFile()
    try:
        stdin.write(json.dumps(job).encode())
        stdin.seek(0)
        run = subprocess.Popen([sys.executable, "-m", "pipelines.index_process"], stdin=stdin,
                               stdout=subprocess.DEVNULL, stderr=stderr, pass_fds=(job["fd"], job["lock"]),
                               env=_helper_env())
    except OSError as exc:
        stderr.close()
        raise HelperUnavailable(f"the index helper process did not start ({sys.executable}: {exc})") from None
    finally:
        stdin.close()
    return run, stderr


PR_SET_PDEATHSIG, M_TRIM_THRESHOLD, M_TOP_PAD, M_MMAP_THRESHOLD = 1, -1, -2, -3  # prctl and mallopt codes


def _die_with_parent() -> None:
    """A forked helper dies with the reader that started it (prctl PR_SET_PDEATHSIG, SIGKILL)."""
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


def _read_reply(fd: int) -> dict | None:
    """The helper's reply from the memfd's header, or None when it wrote none."""
    head = os.pread(fd, len(REPLY_MAGIC) + 16, 0)
    if len(head) < len(REPLY_MAGIC) + 16 or head[:len(REPLY_MAGIC)] != REPLY_MAGIC:
        return None
    at = int.from_bytes(head[8:16], "little")
    length = int.from_bytes(head[16:24], "little")
    return json.loads(os.pread(fd, length, at))


def _columns(reply: dict, mapping: mmap.mmap) -> IndexColumns:
    arrays = {name: np.frombuffer(mapping, dtype=dtype, count=length, offset=offset)
              for name, (dtype, offset, length) in reply["columns"].items()}
    suffixes = tuple((bool(keyed), tail.encode("ascii")) for keyed, tail in reply["suffixes"])
    return IndexColumns(**arrays, exts=tuple(reply["exts"]), suffixes=suffixes, key_width=int(reply["key_width"]))


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
    next page-aligned offset after the header page (no second copy of the columns in the helper)."""

    def __init__(self, fd: int) -> None:
        self.fd, self.size, self.placed = fd, PAGE, {}
        os.ftruncate(fd, self.size)

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


def run_job(job: dict) -> int:
    """Parse the job's index files into its memfd, answer there (the reply, then the header) and release
    the job's lock: the exit status (1: an error reply)."""
    from pipelines.manifest_access import parse_index_files

    fd, status = int(job["fd"]), 0
    try:
        memfd = MemfdColumns(fd)
        columns = parse_index_files(job["paths"], job["counts"], memfd)
        reply = write_columns(columns, fd, memfd)
    except (ManifestError, OSError) as exc:
        status, reply = 1, {"error": type(exc).__name__, "message": str(exc)}
        if isinstance(exc, OSError):
            reply.update(errno=exc.errno, strerror=exc.strerror, filename=exc.filename)
    raw = json.dumps(reply, default=str).encode()
    at = max(os.fstat(fd).st_size, PAGE)
    os.pwrite(fd, raw, at)
    os.pwrite(fd, REPLY_MAGIC + at.to_bytes(8, "little") + len(raw).to_bytes(8, "little"), 0)
    fcntl.flock(int(job["lock"]), fcntl.LOCK_UN)
    return status


def main() -> int:
    return run_job(json.loads(sys.stdin.buffer.read()))


if __name__ == "__main__":
    sys.exit(main())
