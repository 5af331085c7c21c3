"""The sha256 of a local dataset's tars, hashed from the start of `repack verify`: by processes forked
before the driver imports numpy and the sinks, so that the hashing (a quarter of verify's work at
1M tiny samples) runs while the driver starts up, not after.

``EarlyDigests.start(files, workers)`` forks up to ``workers`` processes (``os.fork``: the
driver runs no other thread yet, and the children import nothing) that take file numbers from one
pipe, biggest file first (a read of 4 bytes from a pipe is atomic: each number goes to one process,
whichever is free), hash the file with ``sha256_file``, write the digest into the file's slot of
a shared anonymous memory map and the number into a pipe of answers, then exit once the pipe is
empty. ``collect()`` reads the answers until it has every queued number (the processes' exits are not
waited for: ``repack.exec.reap.reap_later``) or the answer pipe ends, and returns {number: digest,
or None for a file that could not be read}; a number whose process died before it answered maps to
the message that says so. Numbers that did not fit into the pipe are not ``queued``: the caller
hashes those itself (the pool's digest tasks). Only bytes cross from the children (no pickle); each
child dies with the driver (PR_SET_PDEATHSIG).
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
    answered: int = -1  # the read end of the pipe each process writes a file's number into once its slot is filled

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
        answered, answer = os.pipe()
        pids = []
        for _ in range(min(workers, len(queued))):
            pid = os.fork()
            if pid == 0:  # the child: hash until the pipe is empty, then leave without Python's exit work
                status = 1
                try:
                    os.close(answered)
                    _hash_queue(take, answer, paths, slots)
                    status = 0
                finally:
                    os._exit(status)
            pids.append(pid)
        os.close(take)
        os.close(answer)
        return cls(frozenset(queued), tuple(pids), slots, answered)

    def collect(self) -> dict[int, str | None | Died]:
        """{file number: its sha256 (hex), None where it could not be read, or ``Died``}, once every
        queued file is answered (or every hashing process has ended)."""
        from repack.exec.reap import how_it_ended, reap_later

        left = set(self.queued)
        if self.answered >= 0:
            try:
                while left and len(raw := _read_number(self.answered)) == _NUMBER.size:
                    left.discard(_NUMBER.unpack(raw)[0])
            finally:
                os.close(self.answered)
        if left:  # the pipe ended first: a process died holding a file
            ends = [how_it_ended(pid) for pid in self.pids]
            died = Died(next((end for end in ends if end.startswith("killed")), "exited without answering"))
        else:
            reap_later(list(self.pids))
        found: dict[int, str | None | Died] = {}
        for number in self.queued:
            slot = self.slots[_SLOT * number:_SLOT * (number + 1)]
            found[number] = died if number in left else slot[1:].hex() if slot[0] == _DONE else None
        return found


def _read_number(fd: int) -> bytes:
    """One number of the answer pipe (b"" at its end)."""
    raw = os.read(fd, _NUMBER.size)
    while raw and len(raw) < _NUMBER.size:  # one process writes 4 bytes at a time: whole numbers only
        more = os.read(fd, _NUMBER.size - len(raw))
        if not more:
            return b""
        raw += more
    return raw


def _hash_queue(take: int, answer: int, paths: dict[int, str], slots: mmap.mmap) -> None:
    """A child's loop: each number read from ``take``, its file hashed into its slot, the number written
    into ``answer`` once the slot is filled."""
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
        os.write(answer, _NUMBER.pack(number))  # 4 bytes: written whole


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
