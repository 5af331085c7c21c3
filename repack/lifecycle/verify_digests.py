"""The sha256 of a local dataset's tars, hashed from the start of `repack verify`: by processes forked
before the driver imports numpy and the sinks, so that the hashing (a quarter of verify's work at
1M tiny samples) runs while the driver starts up, not after.

``EarlyDigests.start(files, workers)`` forks up to ``workers`` processes (``os.fork``: the
driver runs no other thread yet, and the children import nothing) that take file numbers from one
pipe, biggest file first (a read of 4 bytes from a pipe is atomic: each number goes to one process,
whichever is free), hash the file with ``sha256_file`` and write the digest into the file's slot of
a shared anonymous memory map, then exit once the pipe is empty. ``collect()`` waits for them and
returns {number: digest, or None for a file that could not be read}; a number whose process died
before it answered maps to the message that says so. Numbers that did not fit into the pipe are not
``queued``: the caller hashes those itself (the pool's digest tasks). Only bytes cross from the
children (no pickle); each child dies with the driver (PR_SET_PDEATHSIG).
"""

from __future__ import annotations

import fcntl
import mmap
import os
import signal
import struct
from dataclasses import dataclass

from repack.sinks.checks import sha256_file

_NUMBER = struct.Struct("<I")
_SLOT = 1 + 32  # state byte + the raw digest
_DONE, _UNREADABLE = 1, 2


@dataclass(frozen=True)
class Died:
    """A file whose hashing process died before it answered (``reason``: how it ended)."""

    reason: str


@dataclass(frozen=True)
class EarlyDigests:
    """The hashing processes of one verify: ``queued`` (the file numbers they hash), their ``pids``,
    and the shared slots their digests land in."""

    queued: frozenset[int]
    pids: tuple[int, ...]
    slots: mmap.mmap

    @classmethod
    def start(cls, files: list[tuple[int, str, int]], workers: int) -> EarlyDigests:
        """Start hashing ``files`` ([(number, path, bytes)]) on at most ``workers`` processes forked now."""
        if not files or workers < 1:
            return cls(frozenset(), (), mmap.mmap(-1, 1))
        slots = mmap.mmap(-1, _SLOT * (max(number for number, _, _ in files) + 1))
        order = sorted(files, key=lambda file: -file[2])
        paths = {number: path for number, path, _ in files}
        take, give = os.pipe()
        os.set_blocking(give, False)
        queued = []
        for number, _, _ in order:  # what fits into the pipe; the rest is the caller's
            try:
                if os.write(give, _NUMBER.pack(number)) != _NUMBER.size:
                    break
            except BlockingIOError:
                break
            queued.append(number)
        os.close(give)
        import ctypes  # noqa: F401  (numpy's import brings it anyway): the children's die_with_parent needs it
        pids = []
        for _ in range(min(workers, len(queued))):
            pid = os.fork()
            if pid == 0:  # the child: hash until the pipe is empty, then leave without Python's exit work
                status = 1
                try:
                    _hash_queue(take, paths, slots)
                    status = 0
                finally:
                    os._exit(status)
            pids.append(pid)
        os.close(take)
        return cls(frozenset(queued), tuple(pids), slots)

    def collect(self) -> dict[int, str | None | Died]:
        """{file number: its sha256 (hex), None where it could not be read, or ``Died``}, once every
        hashing process has ended."""
        ended = []
        for pid in self.pids:
            _, status = os.waitpid(pid, 0)
            ended.append(status)
        signals = [os.WTERMSIG(s) for s in ended if os.WIFSIGNALED(s)]
        died = Died(f"killed by signal {signals[0]}" if signals else "exited without answering")
        found: dict[int, str | None | Died] = {}
        for number in self.queued:
            slot = self.slots[_SLOT * number:_SLOT * (number + 1)]
            found[number] = slot[1:].hex() if slot[0] == _DONE else None if slot[0] == _UNREADABLE else died
        return found


def _hash_queue(take: int, paths: dict[int, str], slots: mmap.mmap) -> None:
    """A child's loop: each number read from ``take``, its file hashed into its slot."""
    from repack.exec.parent_death import die_with_parent

    die_with_parent()
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C is the driver's to handle
    os.set_blocking(take, True)
    fcntl.fcntl(take, fcntl.F_SETFD, fcntl.FD_CLOEXEC)
    while len(raw := os.read(take, _NUMBER.size)) == _NUMBER.size:
        number, = _NUMBER.unpack(raw)
        try:
            digest = bytes.fromhex(sha256_file(paths[number]))
            slots[_SLOT * number + 1:_SLOT * (number + 1)] = digest
            slots[_SLOT * number] = _DONE
        except OSError:
            slots[_SLOT * number] = _UNREADABLE


def early_files(manifest) -> list[tuple[int, str, int]]:
    """[(shard number, the tar's path, bytes)] of the shards whose check verify splits into a digest and parts
    (webdataset tars with an index, ``TarShardParts.parts``), paths that stay under the dataset root only."""
    from repack.manifest.paths import PathEscapeError

    if manifest.format != "webdataset":
        return []
    files = []
    for number, shard in enumerate(manifest.data["shards"]):
        if not shard.get("index"):
            continue
        try:
            path = str(manifest.path(shard["path"]))
        except (PathEscapeError, TypeError):
            continue  # reported by the shard check
        files.append((number, path, int(shard.get("bytes", 0))))
    return files
