"""Reading samples out of a tar shard in large blocks, cut at the offsets its DALI index gives,
with every member's tar header checked on the way.

A *block* is a run of samples adjacent in one shard, read with one call (a ``pread`` or one ranged
GET): from the first member's 512-byte header to the end of the last member's padding. The index
says where each member's data starts; its header is the 512 bytes in front, inside the block
already, so checking it is nearly free. For each member the header must be intact (the ustar
checksum matches), name the member the index names, and give the size the index gives; and the
block must be as long as the index says (a truncated shard reads short). Any failure is a
``ShardIntegrityError`` naming the shard and the sample key. Nothing here skips: the reader decides.

Blocks are read ahead of the consumer by a few threads (``fetch_blocks``): at most ``depth``
blocks are in flight or waiting besides the one being consumed, so memory stays under
``(depth + 1) * block bytes``, and storage or network latency overlaps with consumption.
"""

from __future__ import annotations

from collections import deque
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Iterable, Iterator

import numpy as np

from pipelines.manifest_access import Sample
from pipelines.object_store import read_range

TAR_BLOCK = 512
_NAME, _SIZE, _CHECKSUM = slice(0, 100), slice(124, 136), slice(148, 156)
_HEADER_SPAN = np.arange(TAR_BLOCK)
_CHECKSUM_SPAN = np.arange(148, 156)


class ShardIntegrityError(ValueError):
    """A sample that its shard does not hold as its index says: ``url`` (the shard), ``key``, ``problem``.
    (Built from its message alone, as a DataLoader re-raises a worker's error, it keeps the message.)"""

    def __init__(self, url: str, key: str = "", problem: str = "") -> None:
        super().__init__(f"{url}: sample {key!r}: {problem}" if key else url)
        self.url, self.key, self.problem = url, key, problem


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


def _checksums(data: bytes, headers: list[int]) -> list[int]:
    """The ustar checksum of each 512-byte header at ``headers`` (offsets into ``data``), or -1 where
    ``data`` ends first: all at once with numpy (the checksum field counts as eight spaces)."""
    at = np.asarray(headers, dtype=np.int64)
    whole = at + TAR_BLOCK <= len(data)
    sums = np.full(len(at), -1, dtype=np.int64)
    if whole.any():
        raw = np.frombuffer(data, dtype=np.uint8)
        starts = at[whole][:, None]
        sums[whole] = (raw[starts + _HEADER_SPAN].sum(axis=1, dtype=np.int64)
                       - raw[starts + _CHECKSUM_SPAN].sum(axis=1, dtype=np.int64) + 8 * 32)
    return sums.tolist()


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


def cut_block(block: ReadBlock, data: bytes) -> list[dict | ShardIntegrityError]:
    """Each sample of ``block`` (read as ``data``) as {ext: bytes}, or the ShardIntegrityError that says
    why it cannot be: a member past the end of ``data``, or a header that is not the index's."""
    headers = [offset - TAR_BLOCK - block.start for sample in block.samples for _, offset, _ in sample.members]
    checksums = _checksums(data, headers)
    out: list[dict | ShardIntegrityError] = []
    i = 0
    for sample in block.samples:
        members: dict = {}
        problem = None
        for (ext, offset, size), name in zip(sample.members, sample.names):
            h, checksum = headers[i], checksums[i]
            i += 1
            if problem is not None:
                continue
            data_at = offset - block.start
            if checksum < 0 or data_at + size > len(data):
                problem = (f"truncated shard: it ends at byte {block.start + len(data)}, member {name} "
                           f"needs bytes up to {offset + size}")
                continue
            problem = _header_problem(data[h:h + TAR_BLOCK], name, size, checksum, block.start + h)
            if problem is None:
                members[ext] = data[data_at:data_at + size]
        out.append(ShardIntegrityError(block.url, sample.key, problem) if problem else members)
    return out


def fetch_blocks(blocks: Iterable, threads: int, depth: int | None = None) -> Iterator[tuple[object, ReadBlock, bytes]]:
    """(tag, block, data) for each (tag, block) of ``blocks``, in order, read by ``threads`` threads
    up to ``depth`` blocks (default: ``threads``) ahead of the one consumed (0 threads: read in the
    caller's thread, nothing ahead)."""
    if threads <= 0:
        for tag, block in blocks:
            yield tag, block, read_range(block.url, block.start, block.end)
        return
    prefetch = max(threads, depth or 0)
    pool = ThreadPoolExecutor(threads, thread_name_prefix="repack-prefetch")
    ahead: deque = deque()
    source = iter(blocks)
    try:
        for tag, block in source:
            ahead.append((tag, block, pool.submit(read_range, block.url, block.start, block.end)))
            if len(ahead) > prefetch:
                tag0, block0, future = ahead.popleft()
                yield tag0, block0, future.result()
        while ahead:
            tag0, block0, future = ahead.popleft()
            yield tag0, block0, future.result()
    finally:
        # Cancel what has not started and wait for the reads in flight (at most ``prefetch``):
        # no thread may outlive the iterator, or a DataLoader forking workers next could copy a
        # thread's held locks (seen: a forked worker's import failed with KeyError in importlib).
        for *_, future in ahead:
            future.cancel()
        pool.shutdown(wait=True, cancel_futures=True)
