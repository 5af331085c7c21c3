"""Reading samples out of a tar shard in large blocks, cut at the offsets its DALI index gives,
with every member's tar header checked on the way.

A *block* is a run of samples adjacent in one shard: from the first member's 512-byte header to the
end of the last member's padding. On s3:// it is one ranged GET and the members are cut out of it;
on a local file (``read_block``) each member of ``DIRECT_BYTES`` or more is one ``pread`` straight
into the bytes the sample gets (one copy from the page cache), and the headers and small members
between them one ``pread`` per run (``Pieces``). The index says where each member's data starts;
its header is the 512 bytes in front, read with the block, so checking it is nearly free. For each member the header must be intact (the ustar
checksum matches), name the member the index names, and give the size the index gives; and the
block must be as long as the index says (a truncated shard reads short). Any failure is a
``ShardIntegrityError`` naming the shard and the sample key. Nothing here skips: the reader decides.

Blocks are read ahead of the consumer by a few threads (``fetch_blocks``): at most ``depth``
blocks are in flight or waiting besides the one being consumed, so memory stays under
``(depth + 1) * block bytes``, and storage or network latency overlaps with consumption.
"""

from __future__ import annotations

import os
import threading
from bisect import bisect_right
from collections import OrderedDict
from dataclasses import dataclass
from typing import Iterable, Iterator

import numpy as np

from pipelines.file_limit import files_allowed
from pipelines.manifest_access import Sample
from repack.exec.ahead import read_ahead  # noqa: F401 - the readers' prefetch (pipelines.torch_webdataset)
from pipelines.object_store import is_remote, pread_into, read_file_ranges, read_range, read_range_into
from pipelines.sample_errors import ShardIntegrityError

OPEN_SHARDS = 128  # shard files a reader keeps open at most (per DataLoader worker)

TAR_BLOCK = 512
_NAME, _SIZE, _CHECKSUM = slice(0, 100), slice(124, 136), slice(148, 156)
DIRECT_BYTES = 16 << 10  # local members this large are read into their own bytes (a first guess: not tuned yet)


@dataclass(frozen=True)
class ReadBlock:
    """Bytes [start, end) of shard ``url``, holding ``samples`` (at epoch ``positions``), in byte order."""

    url: str
    start: int
    end: int
    samples: tuple
    positions: tuple


def sample_span(sample: Sample) -> tuple[int, int]:
    """[first header byte, end of the last member's padding) of a sample in its tar."""
    return sample.start - TAR_BLOCK, sample.end + (-sample.end % TAR_BLOCK)


def plan_blocks(url: str, samples: Iterable[tuple[int, Sample]], max_bytes: int) -> list[ReadBlock]:
    """Group (position, sample) pairs of shard ``url`` (in byte order) into blocks of adjacent samples
    of at most ``max_bytes`` each (a larger sample gets a block of its own)."""
    blocks: list[ReadBlock] = []
    group: list[tuple[int, Sample]] = []
    start = end = 0
    for position, sample in samples:
        lo, hi = sample_span(sample)
        if group and (lo != end or hi - start > max_bytes):
            blocks.append(ReadBlock(url, start, end, tuple(s for _, s in group), tuple(p for p, _ in group)))
            group = []
        if not group:
            start = lo
        group.append((position, sample))
        end = hi
    if group:
        blocks.append(ReadBlock(url, start, end, tuple(s for _, s in group), tuple(p for p, _ in group)))
    return blocks


def split_out(block: ReadBlock, position: int) -> list[ReadBlock]:
    """``block`` as up to three blocks: the sample at epoch ``position`` alone first, then the samples
    before it and those after it (a reader's first GET small, so its first sample comes at once)."""
    i = block.positions.index(position)
    parts = [(i, i + 1), (0, i), (i + 1, len(block.samples))]
    out = []
    for lo, hi in parts:
        if lo < hi:
            samples = block.samples[lo:hi]
            out.append(ReadBlock(block.url, sample_span(samples[0])[0], sample_span(samples[-1])[1], samples,
                                 block.positions[lo:hi]))
    return out


def _checksums(headers: list[bytes]) -> list[int]:
    """The ustar checksum of each 512-byte header, or -1 for one cut short (the shard ended first):
    all at once with numpy (the checksum field counts as eight spaces)."""
    sums = [-1] * len(headers)
    whole = [i for i, h in enumerate(headers) if len(h) == TAR_BLOCK]
    if whole:
        raw = np.frombuffer(b"".join(headers[i] for i in whole), dtype=np.uint8).reshape(len(whole), TAR_BLOCK)
        got = (raw.sum(axis=1, dtype=np.int64) - raw[:, _CHECKSUM].sum(axis=1, dtype=np.int64) + 8 * 32).tolist()
        for i, value in zip(whole, got):
            sums[i] = value
    return sums


def _octal(field: bytes) -> int | None:
    digits = field.strip(b"\x00 ")
    try:
        return int(digits, 8)
    except ValueError:
        return None


def _header_problem(header: bytes, name: str, size: int, checksum: int, at: int) -> str | None:
    if _octal(header[_CHECKSUM]) != checksum:
        return f"damaged tar header at byte {at} (checksum mismatch)"
    found = header[_NAME].rstrip(b"\x00")
    if found != name.encode():
        return f"the tar header at byte {at} names {found.decode(errors='replace')!r}, the index {name!r}"
    if _octal(header[_SIZE]) != size:
        return f"the tar header at byte {at} gives {_octal(header[_SIZE])} bytes for {name}, the index {size}"
    return None


def _header_ok(header: bytes, name: str, size: int, checksum: int) -> bool:
    """The fast test: name and size fields exactly as ustar writers (repack's included) write them, and
    the checksum right. False sends the header to ``_header_problem``, which parses leniently."""
    return (header[_NAME] == name.encode().ljust(100, b"\x00") and header[_SIZE] == b"%011o\x00" % size
            and _octal(header[_CHECKSUM]) == checksum)


class Pieces:
    """Bytes of one shard read as pieces: (first byte, bytes) pairs in byte order, not overlapping
    (a piece may be shorter than planned where the shard ends). ``take`` hands a whole piece out
    as it is (no copy) and cuts from the others."""

    def __init__(self, pieces: list[tuple[int, bytes]]) -> None:
        self.starts = [at for at, _ in pieces]
        self.datas = [data for _, data in pieces]
        self.nbytes = sum(len(d) for d in self.datas)

    def __len__(self) -> int:
        return self.nbytes

    def take(self, start: int, end: int) -> bytes | None:
        """Bytes [start, end), or None where the pieces do not hold all of them (a short read)."""
        i = bisect_right(self.starts, start) - 1
        if i < 0:
            return None
        data, at = self.datas[i], start - self.starts[i]
        if at + (end - start) > len(data):
            return None
        if at == 0 and end - start == len(data):
            return data
        return data[at:at + end - start]

    def ends_at(self) -> int:
        """The byte after the last one read (where a truncated shard ended)."""
        last = max((i for i, d in enumerate(self.datas) if d), default=None)
        return self.starts[last] + len(self.datas[last]) if last is not None else self.starts[0]


def piece_ranges(block: ReadBlock, direct_bytes: int) -> list[tuple[int, int]]:
    """The byte ranges that read ``block``: each member of at least ``direct_bytes`` on its own (it
    becomes the sample's bytes without a second copy), the headers and small members between them
    as runs."""
    ranges: list[tuple[int, int]] = []
    at = block.start
    for sample in block.samples:
        for _, offset, size in sorted(sample.members, key=lambda m: m[1]):
            if size >= direct_bytes and offset - TAR_BLOCK >= at:  # its header stays in the run before
                if offset > at:
                    ranges.append((at, offset))
                ranges.append((offset, offset + size))
                at = offset + size
    if block.end > at:
        ranges.append((at, block.end))
    return ranges


def cut_block(block: ReadBlock, data: bytes | Pieces) -> list[dict | ShardIntegrityError]:
    """Each sample of ``block`` (read as ``data``: the block's bytes, or ``Pieces``) as {ext: bytes}, or
    the ShardIntegrityError that says why it cannot be: a member past the end of what was read, or a
    header that is not the index's."""
    return cut_blocks([(block, data)])[0]


def cut_blocks(reads: list[tuple[ReadBlock, bytes | Pieces]]) -> list[list[dict | ShardIntegrityError]]:
    """``cut_block`` for several blocks at once (their header checksums in one numpy pass)."""
    pieces = [data if isinstance(data, Pieces) else Pieces([(block.start, data)]) for block, data in reads]
    headers = [bytes(p.take(offset - TAR_BLOCK, offset) or b"")
               for (block, _), p in zip(reads, pieces) for sample in block.samples for _, offset, _ in sample.members]
    checksums = _checksums(headers)
    out: list[list[dict | ShardIntegrityError]] = []
    i = 0
    for (block, _), got in zip(reads, pieces):
        cut = []
        for sample in block.samples:
            n = len(sample.members)
            cut.append(_cut_sample(block.url, sample, got, headers[i:i + n], checksums[i:i + n]))
            i += n
        out.append(cut)
    return out


def _cut_sample(url: str, sample: Sample, pieces: Pieces, headers: list[bytes],
                checksums: list[int]) -> dict | ShardIntegrityError:
    members: dict = {}
    for (ext, offset, size), name, header, checksum in zip(sample.members, sample.names, headers, checksums):
        got = pieces.take(offset, offset + size) if checksum >= 0 else None
        if got is None:
            return ShardIntegrityError(url, sample.key, f"truncated shard: it ends at byte {pieces.ends_at()}, "
                                                        f"member {name} needs bytes up to {offset + size}")
        if not _header_ok(header, name, size, checksum):
            problem = _header_problem(header, name, size, checksum, offset - TAR_BLOCK)
            if problem is not None:
                return ShardIntegrityError(url, sample.key, problem)
        members[ext] = got
    return members


def read_block(block: ReadBlock, direct_bytes: int | None = None) -> bytes | Pieces:
    """The bytes of ``block``: one ranged GET of an object; for a local file, ``Pieces`` read with one
    pread per range of ``piece_ranges`` (each large member copied once, from the page cache into its
    own bytes)."""
    if is_remote(block.url):
        return read_range(block.url, block.start, block.end)
    ranges = piece_ranges(block, DIRECT_BYTES if direct_bytes is None else direct_bytes)
    return Pieces(list(zip((lo for lo, _ in ranges), read_file_ranges(block.url, ranges))))


class ShardFiles:
    """The shard files a reader reads, by path: local files kept open, at most ``limit`` at a time (default
    ``files_allowed(OPEN_SHARDS)``; the least recently read one closed first, once no thread is reading
    it: a shuffled epoch over 10,000 shards must not hold 10,000 descriptors, over ``ulimit -n``'s 1,024
    by default); ``close`` closes them all. s3:// objects are read with ranged GETs."""

    def __init__(self, limit: int | None = None) -> None:
        self._open: OrderedDict[str, list[int]] = OrderedDict()  # path -> [fd, readers now]
        self._lock = threading.Lock()
        self._limit = max(1, limit or files_allowed(OPEN_SHARDS))

    def read_into(self, path: str, start: int, buffer: memoryview) -> int:
        """Read the file's (or object's) bytes from ``start`` into ``buffer`` (straight in: one copy, from
        the page cache or the socket; on s3:// one ranged GET); how many were read, fewer only where the
        file ends first."""
        if is_remote(path):
            return read_range_into(path, start, buffer)
        entry = self._acquire(path)
        try:
            return pread_into(entry[0], buffer, start)
        finally:
            with self._lock:
                entry[1] -= 1
                if not entry[1] and len(self._open) > self._limit:  # opened over the limit while all were read
                    self._close_idle()

    def _acquire(self, path: str) -> list[int]:
        with self._lock:
            entry = self._open.get(path)
            if entry is not None:
                self._open.move_to_end(path)
                entry[1] += 1
                return entry
        opened = os.open(path, os.O_RDONLY)
        with self._lock:
            entry = self._open.get(path)
            if entry is None:
                entry = self._open[path] = [opened, 1]
                self._close_idle()
                return entry
            os.close(opened)  # another thread opened it meanwhile
            self._open.move_to_end(path)
            entry[1] += 1
            return entry

    def _close_idle(self) -> None:
        """Close the least recently read files no thread is reading, down to the limit (under the lock)."""
        surplus = len(self._open) - self._limit
        if surplus <= 0:
            return
        for path in [path for path, (_, readers) in self._open.items() if not readers][:surplus]:
            os.close(self._open.pop(path)[0])

    @property
    def open_files(self) -> int:
        """How many shard files are open now."""
        return len(self._open)

    def close(self, _close=os.close) -> None:  # bound now: a generator closed at interpreter exit finds os gone
        with self._lock:
            for fd, _ in self._open.values():
                _close(fd)
            self._open.clear()


def fetch_blocks(blocks: Iterable, threads: int, depth: int | None = None) -> Iterator[tuple[object, ReadBlock, bytes | Pieces]]:
    """(tag, block, data) for each (tag, block) of ``blocks``, in order, read by ``threads`` threads
    up to ``depth`` blocks (default: ``threads``) ahead of the one consumed (``read_ahead``)."""
    return read_ahead(blocks, lambda tagged: (*tagged, read_block(tagged[1])), threads, depth)


def octal_fields(values: np.ndarray, digits: int) -> np.ndarray:
    """(n, digits + 1) uint8: each value as ``b"%0{digits}o\\0"`` (how ustar writers fill a number field)."""
    shifts = 3 * np.arange(digits - 1, -1, -1, dtype=np.int64)
    out = np.zeros((len(values), digits + 1), dtype=np.uint8)
    out[:, :digits] = ((values.astype(np.int64)[:, None] >> shifts) & 7) + 48
    return out


def headers_match(blocks: np.ndarray, which: np.ndarray, names: np.ndarray, sizes: np.ndarray) -> np.ndarray:
    """For the tar headers ``blocks[which]`` (``blocks``: a buffer of tar data as rows of 512 bytes),
    whether each passes ``_header_ok``: the name field equals ``names`` (rows of 100 bytes), the size
    field is ``sizes`` as ustar writers write it, and the checksum is right. Array operations over all
    headers at once; a False only sends that header to the exact, lenient check."""
    rows = np.take(blocks, which, axis=0)  # one copy of each 512-byte row
    field = rows[:, _CHECKSUM]
    want = _byte_sums(rows) - field.sum(axis=1, dtype=np.int64) + 8 * 32
    ok = (rows[:, _NAME] == names).all(axis=1) & (rows[:, _SIZE] == octal_fields(sizes, 11)).all(axis=1)
    # the checksum field: one run of octal digits, else only NULs and spaces (what _octal accepts, less
    # the rarer spellings it also takes, which the exact check handles)
    digit = (field >= 48) & (field <= 55)
    ok &= np.all(digit | (field == 0) | (field == 32), axis=1)
    run_starts = digit.copy()
    run_starts[:, 1:] &= ~digit[:, :-1]
    ok &= np.count_nonzero(run_starts, axis=1) == 1
    value = np.zeros(len(which), dtype=np.int64)
    for column in range(field.shape[1]):
        value = np.where(digit[:, column], value * 8 + field[:, column] - 48, value)
    return ok & (value == want)


_LOW_BYTES = np.uint64(0x00FF00FF00FF00FF)


def _byte_sums(rows: np.ndarray) -> np.ndarray:
    """The sum of each row's bytes (rows of 512: C-contiguous uint8), eight bytes at a time: bytes added
    pairwise into four 16-bit lanes of a uint64 (at most 64 * 510 each: no carry), then the lanes."""
    words = np.ascontiguousarray(rows).view(np.uint64)
    lanes = ((words & _LOW_BYTES) + ((words >> np.uint64(8)) & _LOW_BYTES)).sum(axis=1, dtype=np.uint64)
    mask = np.uint64(0xFFFF)
    total = (lanes & mask) + ((lanes >> np.uint64(16)) & mask) + ((lanes >> np.uint64(32)) & mask) + (lanes >> np.uint64(48))
    return total.astype(np.int64)
